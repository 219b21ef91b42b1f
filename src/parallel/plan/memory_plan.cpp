#include "parallel/plan/memory_plan.hpp"

#include <algorithm>
#include <array>
#include <memory>

#include "core/allocator.hpp"
#include "layers/loss.hpp"
#include "layers/parameter_store.hpp"
#include "parallel/comm/shared_memory.hpp"
#include "parallel/data/bucket_reducer.hpp"
#include "parallel/data/gradient_ring.hpp"
#include "parallel/data/zero.hpp"
#include "parallel/pipeline/executor.hpp"
#include "parallel/stage/stage_map.hpp"
#include "parallel/stage/state_gather.hpp"
#include "parallel/stage/step.hpp"
#include "parallel/stage/tied_embedding.hpp"

namespace strata::parallel {

namespace {

// The bytes a buffer of `bytes` occupies beyond them: the allocators' size class or, for one
// the data-parallel group may share (`shared`: NodeSharedMemory::allocate's whole pages), the
// larger of the two (the plan assumes one node; a group across nodes takes size classes).
int64_t rounding(int64_t bytes, bool shared) {
  const auto size_class = static_cast<int64_t>(HostCachingAllocator::size_class(static_cast<size_t>(bytes)));
  return (shared ? std::max(size_class, NodeSharedMemory::buffer_bytes(bytes)) : size_class) - bytes;
}

// Parameter, gradient and optimizer bytes of one (virtual) stage's DataParallel; `runtime` gets
// the rounding of each of its buffers, `shared` telling whether the dp group may share them.
RankBytes plan_stage(const layers::Model& model, StageRange range, int replica, const Layout& layout, bool shared) {
  const std::vector<layers::ParamEntry> entries = layers::ParameterStore::layout(model, range.begin, range.end);
  const std::vector<layers::ParameterStore::LayerRange> ranges = layers::ParameterStore::layer_ranges(entries);
  const Ownership ownership(layout.zero, layout.dp, layers::ParameterStore::layout_numel(entries));
  const int64_t pad = ownership.pad_multiple();
  const int64_t flat = (ownership.used() + pad - 1) / pad * pad;
  const Shard shard = ownership.shard(replica);
  const auto dtype_bytes = static_cast<int64_t>(dtype_size(layout.dtype));
  constexpr auto f32 = static_cast<int64_t>(sizeof(float));

  RankBytes b;
  shared = shared && layout.dp > 1;
  // Each buffer as allocated: its bytes in `part`, its rounding in b.runtime.
  const auto add = [&](int64_t& part, int64_t bytes, bool in_group_memory = false) {
    part += bytes;
    b.runtime += rounding(bytes, shared && in_group_memory);
  };
  if (ownership.shards_params())
    add(b.params, shard.size * dtype_bytes);
  else
    add(b.params, flat * dtype_bytes, true);
  add(b.params, layers::ParameterStore::buffers_numel(entries) * f32);
  if (ownership.shards_params()) {  // ParameterGather's two windows
    const std::array<int64_t, 2> windows =
        ParameterGather::window_elements(ParameterGather::visits(model, range.begin, range.end, ranges));
    for (const int64_t w : windows) add(b.params, w * dtype_bytes);
  }
  if (ownership.shards_grads()) {  // GradientRing: the shard and the ring (largest tile + a bucket)
    // ZeRO 2 and 3 keep a tied embedding's gradient in the ring.
    const bool pinned = pins_tied_embedding(model, range.begin, range.end);
    const int64_t ring =
        ring_elements(gradient_tiles(model, entries, flat, layout.bucket_bytes), layout.bucket_bytes, pinned);
    add(b.grads, shard.size * f32);
    add(b.grads, ring * f32, true);
  } else {
    add(b.grads, flat * f32, true);
  }
  // ShardedOptimizer steps the whole padded buffer without ZeRO, its owned range with it.
  const int64_t stepped = ownership.shards_state() ? shard.numel() : flat;
  for (int k = 0; k < layers::Optimizer::state_tensors(layout.optimizer) + (layout.dtype != DType::F32); ++k)
    add(b.optimizer, stepped * f32);
  return b;
}

RankBytes plan_rank(const layers::Model& model, const std::vector<StageRange>& stages, int stage, int replica,
                    const Layout& layout, bool shared) {
  STRATA_CHECK(stages.size() == static_cast<size_t>(layout.pp * layout.virtual_stages), "plan: ", stages.size(),
               " stages for pp ", layout.pp, " x ", layout.virtual_stages, " virtual stages");
  RankBytes b;
  // Chunk c of the rank is virtual stage c·P + stage, each with its own DataParallel.
  for (int c = 0; c < layout.virtual_stages; ++c) {
    const RankBytes chunk =
        plan_stage(model, stages.at(static_cast<size_t>(c * layout.pp + stage)), replica, layout, shared);
    b.params += chunk.params;
    b.grads += chunk.grads;
    b.optimizer += chunk.optimizer;
    b.runtime += chunk.runtime;
  }
  const auto [tied_params, tied_grads] =
      TiedEmbedding::planned_bytes(model, stages, layout.pp, stage, layout.zero, layout.dtype);
  b.params += tied_params;
  b.grads += tied_grads;
  // Its weight and gradient (the head's stage) or its chunk (the embedding's) are separate buffers.
  for (const int64_t bytes : {tied_params, tied_grads})
    if (bytes > 0) b.runtime += rounding(bytes, false);
  b.in_flight = peak_in_flight(make_schedule(layout.schedule, layout.pp, layout.micro_batches, layout.virtual_stages)
                                   .at(static_cast<size_t>(stage)));
  return b;
}

// The copies a rank keeps of what it writes of a background parallel checkpoint
// (StateGather::write_parts, ParallelCheckpointFile's deferred write): replica 0 its stage's
// tensors (each tp rank its shard), every rank its ZeRO share of each optimizer state and, below
// f32, of the master weights; one f32 block per tensor.
int64_t part_bytes(const layers::Model& model, StageRange range, int replica, const Layout& layout) {
  const std::vector<layers::ParamEntry> entries = layers::ParameterStore::layout(model, range.begin, range.end);
  const Ownership ownership(layout.zero, layout.dp, layers::ParameterStore::layout_numel(entries));
  const Shard owned = replica < ownership.state_owners() ? ownership.state(replica) : Shard{};
  const int states = layers::Optimizer::state_tensors(layout.optimizer) + (layout.dtype != DType::F32);
  const auto held = [](int64_t elements) {
    return static_cast<int64_t>(HostCachingAllocator::size_class(static_cast<size_t>(elements) * sizeof(float)));
  };
  int64_t bytes = 0;
  for (const layers::ParamEntry& e : entries) {
    if (replica == 0) bytes += held(shape_numel(e.shape));
    if (const int64_t o = layers::overlap(e, owned.begin, owned.end).size; e.trainable && o > 0)
      bytes += states * held(o);
  }
  return bytes;
}

}  // namespace

RankBytes plan_rank(const layers::Model& model, const std::vector<StageRange>& stages, int stage, int replica,
                    const Layout& layout) {
  return plan_rank(model, stages, stage, replica, layout, false);
}

RankBytes plan_rank(const layers::Model& model, const std::vector<StageRange>& stages, int stage, int replica,
                    const Layout& layout, const ActivationBytes& activations, int64_t message_bytes,
                    const RuntimeSpec& runtime) {
  const bool shared = runtime.shared_memory && layout.cpu;
  RankBytes b = plan_rank(model, stages, stage, replica, layout, shared);
  b.activations = activations.peak;
  if (shared) {  // each group of two or more maps its counters; the pipeline's its mailboxes too
    for (const int size : {layout.dp, layout.pp})
      if (size > 1) b.runtime += NodeSharedMemory::counters_bytes();
    if (layout.pp > 1)
      b.runtime += NodeSharedMemory::mailbox_bytes(message_bytes, activations.message_slots, layout.pp);
  }
  if (runtime.data_bytes)
    b.runtime += runtime.data_bytes(layout.micro * layout.micro_batches, layout.micro, stage == 0);
  if (runtime.checkpoints != Checkpoints::None) {
    // Between steps only what the executor retains is left of the activations.
    b.between_steps = activations.retained + StateGather::planned_bytes(model);
    // Rank 0's snapshot (its tp peers are counted with it: more than they hold), or each rank's parts.
    if (runtime.checkpoints == Checkpoints::AsyncRank0 && stage == 0 && replica == 0)
      b.runtime += StateGather::snapshot_bytes(model, layout.optimizer, layout.dtype, true);
    if (runtime.checkpoints == Checkpoints::AsyncParallel)
      for (int c = 0; c < layout.virtual_stages; ++c)
        b.runtime += part_bytes(model, stages.at(static_cast<size_t>(c * layout.pp + stage)), replica, layout);
  }
  return b;
}

namespace {

// Binds the layers of `range` to meta parameters (compute dtype; buffers and gradients f32),
// which `held` keeps: they are counted before the activations, and a layer rebinding its views
// (a composite streaming its children's gradients) must not free them during the count.
// A tied head whose embedding is not on this rank gets a meta copy, as TiedEmbedding gives it.
void bind_meta(layers::Model& model, StageRange range, DType dtype, const std::vector<size_t>& rank_layers,
               std::vector<Tensor>& held) {
  for (size_t i = range.begin; i < range.end; ++i) {
    layers::Layer& layer = model.layer(i);
    std::vector<Tensor> params, grads;
    for (const layers::ParamSpec& s : layer.param_specs()) {
      params.push_back(Tensor::empty(s.shape, s.trainable ? dtype : DType::F32, Device::meta()));
      grads.push_back(s.trainable ? Tensor::empty(s.shape, DType::F32, Device::meta()) : Tensor());
    }
    layer.bind(params, grads);
    held.insert(held.end(), params.begin(), params.end());
    held.insert(held.end(), grads.begin(), grads.end());
    layers::TiedWeight* head = layer.tied_weight();
    if (head && layer.shares_parameters_with() != nullptr &&
        std::none_of(rank_layers.begin(), rank_layers.end(),
                     [&](size_t k) { return &model.layer(k) == layer.shares_parameters_with(); })) {
      const Shape w = head->weight_shape();
      head->use_copy(Tensor::empty(w, dtype, Device::meta()), Tensor::empty(w, DType::F32, Device::meta()));
    }
  }
}

// A pipeline communicator of a plan: rank `rank` of `size`, every operation done at once, no
// values moved (the tensors are meta).
class PlannedCommunicator final : public Communicator {
 public:
  PlannedCommunicator(int rank, int size) : rank_(rank), size_(size) {}
  const std::string& name() const override { return name_; }
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  WorkPtr all_reduce_async(const Tensor&, ReduceOp) override { return done(); }
  WorkPtr reduce_scatter_async(const Tensor&, const Tensor&, ReduceOp) override { return done(); }
  WorkPtr all_gather_async(const Tensor&, const Tensor&) override { return done(); }
  WorkPtr reduce_async(const Tensor&, int, ReduceOp) override { return done(); }
  WorkPtr broadcast_async(const Tensor&, int) override { return done(); }
  WorkPtr send_async(const Tensor&, int, int) override { return done(); }
  WorkPtr recv_async(const Tensor&, int, int) override { return done(); }
  WorkPtr barrier_async() override { return done(); }

 private:
  struct Done final : Work {
    void wait() override {}
    bool test() override { return true; }
  };
  static WorkPtr done() { return std::make_unique<Done>(); }
  std::string name_ = "planned pp";
  int rank_, size_;
};

// ZeRO 2/3: a layer that streams its gradients (GradientRing) gets its pieces from the ring,
// which RankBytes::grads counts, so here from one meta buffer allocated before the count starts;
// what the layer allocates to compute them (Linear: dy transposed) is counted as the real run's.
class PlannedGradientSink final : public layers::GradientSink {
 public:
  PlannedGradientSink(layers::Layer& layer, int64_t bucket_bytes) : layer_(layer) {
    int64_t largest = 0;
    for (const layers::GradientPiece& p : layer.gradient_pieces(bucket_elements(bucket_bytes))) {
      sizes_.push_back(p.end - p.begin);
      largest = std::max(largest, sizes_.back());
    }
    buffer_ = Tensor::empty({largest}, DType::F32, Device::meta());
    if (!sizes_.empty()) layer.set_gradient_sink(this, bucket_elements(bucket_bytes));
  }
  ~PlannedGradientSink() override {
    if (!sizes_.empty()) layer_.set_gradient_sink(nullptr, 0);
  }
  PlannedGradientSink(const PlannedGradientSink&) = delete;
  PlannedGradientSink& operator=(const PlannedGradientSink&) = delete;
  Tensor next_piece() override { return buffer_.view(0, {sizes_[next_++ % sizes_.size()]}); }
  void piece_written() override {}

 private:
  layers::Layer& layer_;
  std::vector<int64_t> sizes_;
  size_t next_ = 0;
  Tensor buffer_;
};

// A pipeline rank's chunks of a model, run directly: the planner's stand-in for the engine's
// data-parallel replicas (with meta tensors, the same layers allocate the same).
class ModelChunks final : public ChunkRunner {
 public:
  ModelChunks(layers::Model& model, const std::vector<StageRange>& stages, int stage, int pp)
      : model_(model), stages_(stages), stage_(stage), pp_(pp) {}
  Tensor forward(int chunk, const Tensor& x, std::vector<layers::Context>& ctx, const layers::StepInfo& info) override {
    return model_.forward(x, ctx, info, range(chunk).begin, range(chunk).end);
  }
  Tensor backward(int chunk, const Tensor& dy, std::vector<layers::Context>& ctx, bool, bool input_grad) override {
    return model_.backward(dy, ctx, range(chunk).begin, range(chunk).end, {}, input_grad);
  }

 private:
  StageRange range(int chunk) const { return StageMap(stages_, pp_).range(stage_, chunk); }
  layers::Model& model_;
  const std::vector<StageRange>& stages_;
  int stage_, pp_;
};

}  // namespace

ActivationBytes plan_activations(layers::Model& model, const std::vector<StageRange>& stages, int stage,
                                 const Layout& layout) {
  const int pp = layout.pp, v = layout.virtual_stages;
  const StageMap map(stages, pp);
  const auto chunk_range = [&](int c) { return map.range(stage, c); };
  std::vector<size_t> rank_layers;
  for (int c = 0; c < v; ++c)
    for (size_t i = chunk_range(c).begin; i < chunk_range(c).end; ++i) rank_layers.push_back(i);
  std::vector<Tensor> held;
  for (int c = 0; c < v; ++c) bind_meta(model, chunk_range(c), layout.dtype, rank_layers, held);

  std::vector<std::unique_ptr<PlannedGradientSink>> sinks;
  if (Ownership::shards_grads(layout.zero))
    for (size_t i : rank_layers)
      sinks.push_back(std::make_unique<PlannedGradientSink>(model.layer(i), layout.bucket_bytes));

  MetaAllocator& meta = meta_allocator();
  meta.set_host_staging(layout.cpu);
  const size_t base = meta.in_use();
  const auto batch = [&](const Shape& sample) { return layers::batch_shape(layout.micro, sample); };
  std::vector<Shape> inputs, outputs;
  for (int c = 0; c < v; ++c) {
    inputs.push_back(batch(model.shape(chunk_range(c).begin)));
    outputs.push_back(batch(model.shape(chunk_range(c).end)));
  }
  // The executor itself, over a communicator that moves nothing: what it keeps and when it lets
  // go is the real run's (messages received, outputs until sent, contexts until backward).
  PlannedCommunicator pp_comm(stage, pp);
  PipelineExecutor executor(pp_comm, layout.schedule, layout.micro_batches, v, inputs, outputs, layout.dtype,
                            Device::meta());
  const bool tokens = model.layer(0).takes_token_ids();
  const Shape logits = model.shape(model.size());  // (V) or (T, V)
  const Shape labels = batch(logits.size() > 1 ? Shape(logits.begin(), logits.end() - 1) : Shape{});
  // The step's own callbacks over the meta-bound model.
  ModelChunks chunks(model, stages, stage, pp);
  MicroBatches data;
  data.input = [&](int) {
    return Tensor::empty(batch(model.shape(0)), tokens ? DType::I32 : layout.dtype, Device::meta());
  };
  data.labels = [&](int) { return Tensor::empty(labels, DType::I32, Device::meta()); };
  data.size = layout.micro;
  PlannedTensorParallel tp(layout.tp);
  const layers::SoftmaxCrossEntropy loss(&tp);  // the vocabulary-parallel loss with tp, as the engine's
  double loss_sum = 0;
  const StageCallbacks work = step_callbacks(executor, chunks, loss, data, {}, 1.0f, loss_sum);
  ActivationBytes bytes;
  executor.run_step(work);  // the second step starts with whatever the first left behind
  bytes.retained = static_cast<int64_t>(meta.in_use() - base);
  meta.reset_peak();
  executor.run_step(work);
  bytes.peak = static_cast<int64_t>(meta.peak_in_use() - base);
  bytes.message_bytes = executor.mailbox_bytes();
  bytes.message_slots = executor.mailbox_slots();
  return bytes;
}

}  // namespace strata::parallel
