#include "parallel/memory_plan.hpp"

#include <algorithm>

#include "parallel/gradient_sync.hpp"
#include "parallel/tied_embedding.hpp"
#include "parallel/zero.hpp"

namespace strata::parallel {

namespace {

// Parameter, gradient and optimizer bytes of one (virtual) stage's DataParallel.
RankBytes plan_stage(const layers::Model& model, StageRange range, int replica, const MemoryLayout& layout) {
  const std::vector<layers::ParamEntry> entries = layers::ParameterStore::layout(model, range.begin, range.end);
  const std::vector<layers::ParameterStore::LayerRange> ranges = layers::ParameterStore::layer_ranges(entries);
  const Ownership ownership(layout.zero, layout.dp, layers::ParameterStore::layout_numel(entries));
  const int64_t pad = ownership.pad_multiple();
  const int64_t flat = (ownership.used() + pad - 1) / pad * pad;
  const Shard shard = ownership.shard(replica);
  const auto dtype_bytes = static_cast<int64_t>(dtype_size(layout.dtype));
  constexpr auto f32 = static_cast<int64_t>(sizeof(float));

  RankBytes b;
  b.params = (ownership.shards_params() ? shard.size : flat) * dtype_bytes +
             layers::ParameterStore::buffers_numel(entries) * f32;
  if (ownership.shards_params()) {  // ParameterGather's two windows of the largest layer
    int64_t largest = 0;
    for (const auto& r : ranges) largest = std::max(largest, r.end - r.begin);
    b.params += 2 * largest * dtype_bytes;
  }
  if (ownership.shards_grads()) {  // GradientSync: the shard and the ring (largest layer + a bucket)
    b.grads = (shard.size + ring_elements(ranges, flat, layout.bucket_bytes)) * f32;
  } else {
    b.grads = flat * f32;
  }
  // ShardedOptimizer steps the whole padded buffer without ZeRO, its owned range with it.
  const int64_t stepped = ownership.shards_state() ? shard.numel() : flat;
  b.optimizer = stepped * f32 * (layers::Optimizer::state_tensors(layout.optimizer) + (layout.dtype != DType::F32));
  int64_t outputs = 0;
  for (size_t i = range.begin; i < range.end; ++i) outputs += shape_numel(model.shape(i + 1));
  b.activations = outputs * layout.micro * dtype_bytes;
  return b;
}

}  // namespace

RankBytes plan_rank(const layers::Model& model, const std::vector<StageRange>& stages, int stage, int replica,
                    const MemoryLayout& layout) {
  STRATA_CHECK(stages.size() == static_cast<size_t>(layout.pp * layout.virtual_stages), "plan: ", stages.size(),
               " stages for pp ", layout.pp, " x ", layout.virtual_stages, " virtual stages");
  RankBytes b;
  // Chunk c of the rank is virtual stage c·P + stage, each with its own DataParallel; a
  // micro-batch in flight holds one chunk's activations (counted at the largest chunk's).
  for (int c = 0; c < layout.virtual_stages; ++c) {
    const RankBytes chunk = plan_stage(model, stages.at(static_cast<size_t>(c * layout.pp + stage)), replica, layout);
    b.params += chunk.params;
    b.grads += chunk.grads;
    b.optimizer += chunk.optimizer;
    b.activations = std::max(b.activations, chunk.activations);
  }
  const auto [tied_params, tied_grads] =
      TiedEmbedding::planned_bytes(model, stages, layout.pp, stage, layout.zero, layout.dtype);
  b.params += tied_params;
  b.grads += tied_grads;
  b.in_flight = peak_in_flight(make_schedule(layout.schedule, layout.pp, layout.micro_batches, layout.virtual_stages)
                                   .at(static_cast<size_t>(stage)));
  return b;
}

}  // namespace strata::parallel
