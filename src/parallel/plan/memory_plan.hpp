// The bytes each rank allocates for a layout, computed from shapes alone (nothing is
// allocated): what `train --dry-run` prints for any world size (--world) and any model,
// GPT-2 1.5B included. DataParallel, TiedEmbedding and the ZeRO classes then allocate exactly
// this for real; test_memory_plan holds the two equal for every ZeRO stage, dtype, optimizer
// and pipeline cut it tries. The arithmetic is theirs (Ownership, ParameterStore::layout,
// ring_elements, Optimizer::state_tensors, TiedEmbedding::planned_bytes), not a copy.
#pragma once

#include <algorithm>
#include <cstdint>
#include <functional>
#include <vector>

#include "layers/model.hpp"
#include "layers/optimizer.hpp"
#include "parallel/pipeline/partition.hpp"
#include "parallel/pipeline/schedule.hpp"
#include "parallel/plan/layout.hpp"

namespace strata::parallel {

// A plan's tensor-parallel group: rank 0 of `size`, for the shapes of its shards. It moves
// nothing: meta tensors (plan_activations) have no values, and a real tensor is an Internal error.
class PlannedTensorParallel final : public layers::TensorParallelGroup {
 public:
  explicit PlannedTensorParallel(int size) : size_(size) {}
  int rank() const override { return 0; }
  int size() const override { return size_; }
  void all_reduce_sum(const Tensor& t) override { require_meta(t); }
  void all_gather(const Tensor& local, const Tensor&) override { require_meta(local); }
  void reduce_scatter_sum(const Tensor& in, const Tensor&) override { require_meta(in); }

 private:
  static void require_meta(const Tensor& t) {
    STRATA_CHECK(t.device().is_meta(), "a planned tensor-parallel group moves no values, got ", t.str());
  }
  int size_;
};

struct RankBytes {
  // Parameters in the compute dtype (ZeRO 3: the shard and two gather windows), f32 buffers,
  // a tied head's copy of wte.
  int64_t params = 0;
  // f32 gradients (ZeRO 2/3: the shard and the ring of the largest tile + one bucket), a tied
  // head's copy's gradient and the embedding stage's receive chunk.
  int64_t grads = 0;
  // Optimizer state and, below f32, the f32 master weights of the elements this rank steps.
  int64_t optimizer = 0;
  // The step's activation high-water mark (plan_activations(...).peak; plan_rank leaves it 0).
  int64_t activations = 0;
  // Micro-batches (interleaved: chunk micro-batches) whose activations the stage holds at once.
  int in_flight = 1;
  // What the runtime holds throughout besides the exact bytes above (RuntimeSpec): the
  // allocators' rounding of those buffers, shared-memory counters and pipeline mailboxes, the
  // loader's batches, --async-save's snapshot on rank 0.
  int64_t runtime = 0;
  // What a step boundary (or setup) allocates where the step's activations are gone: a checkpoint
  // save's or load's tensors in flight. Counted where it exceeds the activations.
  int64_t between_steps = 0;
  int64_t total() const { return params + grads + optimizer + runtime + std::max(activations, between_steps); }
};

// Whether the run reads or writes checkpoints (StateGather::planned_bytes), and what is held
// while training goes on under --async-save: rank 0 every full tensor (StateGather::snapshot_bytes),
// or, where every rank writes its own part (--checkpoint-io parallel), each rank its parts.
enum class Checkpoints { None, Synchronous, AsyncRank0, AsyncParallel };

// What a run holds around its model and step, so that the plan counts everything the cap
// counts (on the CPU device: the host allocator and this rank's shared-memory segments).
struct RuntimeSpec {
  // --shared-memory on a CPU: the planner assumes every group on one node, whose buffers are then
  // page-rounded segments, with a counters page per group and the pipeline's mailboxes.
  bool shared_memory = false;
  // The data's buffers (io::Loader::planned_bytes and the sources' read buffers) for a replica's
  // slice of `rows` samples and evaluation in micro-batches of `micro`; the first stage also
  // reads inputs. Empty: none (a GPU's are host memory).
  std::function<int64_t(int64_t rows, int64_t micro, bool first_stage)> data_bytes;
  Checkpoints checkpoints = Checkpoints::None;
};

// Activations of pipeline rank `stage` over a training step, measured by running it on meta
// tensors (nothing is allocated; core/allocator.hpp's MetaAllocator counts): the real
// PipelineExecutor runs two steps of the schedule over a communicator that moves nothing, with
// the stage's layers and, on the last stage, the loss. So what layers save for backward,
// recomputation, backward's temporaries, what the executor holds (received messages, outputs
// until sent) and the caching allocator's rounding come from the code that runs, not from a
// second model of it. `model` is built for planning: its layers are bound to meta parameters
// here (a tied head on another stage to a meta copy). The transports' buffers are counted
// apart (RankBytes::runtime); MPI's own are not the allocator's and not counted.
struct ActivationBytes {
  int64_t peak = 0;      // high-water mark above the parameters, over a whole step
  int64_t retained = 0;  // held from one step into the next (0: the executor lets go of everything)
  // The executor's mailbox request (PipelineExecutor::mailbox_bytes / mailbox_slots): 0 without a pipeline.
  int64_t message_bytes = 0;
  int message_slots = 0;
};
ActivationBytes plan_activations(layers::Model& model, const std::vector<StageRange>& stages, int stage,
                                 const Layout& layout);

// Parameter, gradient and optimizer bytes of rank (stage, replica) of the layout, whose (virtual) stages cut the model
// as `stages` does: pp x virtual_stages of them, chunk c of pipeline rank s being virtual stage c·pp + s; `runtime`
// holds their buffers' rounding (size classes).
RankBytes plan_rank(const layers::Model& model, const std::vector<StageRange>& stages, int stage, int replica,
                    const Layout& layout);

// plan_rank with its activations and what the runtime holds (RankBytes::runtime, between_steps):
// `activations` is plan_activations of the rank's stage, `message_bytes` the largest request of
// any stage (the pipeline group's mailboxes take the largest).
RankBytes plan_rank(const layers::Model& model, const std::vector<StageRange>& stages, int stage, int replica,
                    const Layout& layout, const ActivationBytes& activations, int64_t message_bytes,
                    const RuntimeSpec& runtime);

}  // namespace strata::parallel
