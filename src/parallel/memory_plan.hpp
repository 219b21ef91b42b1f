// The bytes each rank allocates for a layout, computed from shapes alone (nothing is
// allocated): what `train --dry-run` prints for any world size (--world) and any model,
// GPT-2 1.5B included. DataParallel, TiedEmbedding and the ZeRO classes then allocate exactly
// this for real; test_memory_plan holds the two equal for every ZeRO stage, dtype, optimizer
// and pipeline cut it tries. The arithmetic is theirs (Ownership, ParameterStore::layout,
// ring_elements, Optimizer::state_tensors, TiedEmbedding::planned_bytes), not a copy.
#pragma once

#include <cstdint>
#include <vector>

#include "layers/model.hpp"
#include "layers/optimizer.hpp"
#include "parallel/partition.hpp"
#include "parallel/schedule.hpp"

namespace strata::parallel {

struct MemoryLayout {
  int pp = 1, dp = 1, zero = 0;
  DType dtype = DType::F32;  // parameters and activations
  layers::OptimizerConfig optimizer;
  int64_t bucket_bytes = 25 << 20;
  int64_t micro = 1;      // samples per micro-batch
  int micro_batches = 1;  // per replica and step
  ScheduleKind schedule = ScheduleKind::OneFOneB;
  int virtual_stages = 1;  // chunks per pipeline rank (interleaved)
};

struct RankBytes {
  // Parameters in the compute dtype (ZeRO 3: the shard and two gather windows), f32 buffers,
  // a tied head's copy of wte.
  int64_t params = 0;
  // f32 gradients (ZeRO 2/3: the shard and the ring of the largest layer + one bucket), a tied
  // head's copy's gradient and the embedding stage's receive chunk.
  int64_t grads = 0;
  // Optimizer state and, below f32, the f32 master weights of the elements this rank steps.
  int64_t optimizer = 0;
  // Outputs of the stage's layers for one micro-batch, in the compute dtype (interleaved: of
  // its largest chunk).
  int64_t activations = 0;
  // Micro-batches (interleaved: chunk micro-batches) whose activations the stage holds at once.
  int in_flight = 1;
  int64_t total() const { return params + grads + optimizer + activations * in_flight; }
};

// Rank (stage, replica) of the layout, whose (virtual) stages cut the model as `stages` does:
// pp x virtual_stages of them, chunk c of pipeline rank s being virtual stage c·pp + s.
RankBytes plan_rank(const layers::Model& model, const std::vector<StageRange>& stages, int stage, int replica,
                    const MemoryLayout& layout);

}  // namespace strata::parallel
