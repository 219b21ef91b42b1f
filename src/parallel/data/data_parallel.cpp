// DataParallel: the assembly of a stage's buffers, gradient sync, ZeRO-3 gather and sharded
// optimizer, chosen once from the ZeRO stage (Ownership).
#include "parallel/data/data_parallel.hpp"

#include <limits>

#include "core/ops.hpp"
#include "layers/parameter_store.hpp"

namespace strata::parallel {

namespace {

int64_t used_elements(const layers::Model& model, StageRange stage) {
  return layers::ParameterStore::layout_numel(layers::ParameterStore::layout(model, stage.begin, stage.end));
}

}  // namespace

DataParallel::DataParallel(Communicator& dp, const layers::Model& model, StageRange stage, const Layout& layout,
                           uint64_t seed, Device device)
    : dp_(dp), model_(model), stage_(stage), ownership_(layout.zero, dp.size(), used_elements(model, stage)) {
  // ZeRO 2 and 3 rebind layers' gradient and parameter views as buckets and windows pass. A tied
  // head on its embedding's stage reads the embedding's views: ZeRO 2 and 3's ring keeps the
  // embedding's gradient bound while the head writes it, and ZeRO 3 gathers the embedding's
  // parameters again, into the head's window, when the head runs (ParameterGather's visits).
  // ZeRO 2 and 3 never allocate the full gradient buffer: GradientRing holds the shard and
  // the ring. ZeRO 3 neither allocates the full parameter buffer: the store holds this replica's
  // S-element shard (elements replica*S onwards) and ParameterGather the windows. The full
  // buffers come from the communicator: on one node, shared memory that the bucket
  // all-reduces (and ZeRO's reduces and parameter all-gather) read in place.
  const Shard shard = ownership_.shard(dp.rank());
  store_ = std::make_unique<layers::ParameterStore>(
      model, seed,
      layers::StoreLayout{
          .begin = stage.begin,
          .end = stage.end,
          .pad_multiple = ownership_.pad_multiple(),
          .allocate_grads = !ownership_.shards_grads(),
          .allocate_params = !ownership_.shards_params(),
          .shard_begin = dp.rank() * shard.size,
          .shard_size = shard.size,
          .dtype = layout.dtype,
          .device = device,
          .allocate = [&dp, device](int64_t numel, DType dtype) { return dp.allocate(numel, dtype, device); }});
  optimizer_ = std::make_unique<ShardedOptimizer>(layout.optimizer, ownership_, dp, *store_);
  if (ownership_.shards_grads())
    ring_ = std::make_unique<GradientRing>(dp, model, *store_, layout.bucket_bytes, shard.size,
                                           pins_tied_embedding(model, stage.begin, stage.end));
  else
    reducer_ =
        std::make_unique<BucketReducer>(dp, *store_, layout.bucket_bytes, ownership_.shards_state() ? shard.size : 0);
  if (ownership_.shards_params())
    gather_ = std::make_unique<ParameterGather>(dp, model, *store_, shard.size, stage.begin, stage.end);
}

Ownership DataParallel::ownership_of(StageRange stage) const {
  return Ownership(ownership_.zero(), ownership_.dp(), used_elements(model_, stage));
}

const Tensor& DataParallel::grads() const { return ring_ ? ring_->shard_grads() : store_->grads(); }

void DataParallel::zero_grads() { grads().fill_zero(); }

Tensor DataParallel::forward(const Tensor& x, std::vector<layers::Context>& ctx, const layers::StepInfo& info) {
  if (!gather_) return model_.forward(x, ctx, info, stage_.begin, stage_.end);
  gather_->begin_pass(/*backward=*/false);
  Tensor h = x;
  for (size_t i = stage_.begin; i < stage_.end; ++i) {
    if (gather_->has_params(i)) gather_->next();
    h = model_.forward(h, ctx, info, i, i + 1);
  }
  return h;
}

Tensor DataParallel::backward(const Tensor& dy, std::vector<layers::Context>& ctx, bool last_of_step, bool input_grad) {
  // ZeRO 0/1 accumulate the micro-batches of a step locally and sync once, at the last; the
  // ring (ZeRO 2/3) has no full buffer to accumulate in and reduces every backward.
  if (!last_of_step && !ring_) return model_.backward(dy, ctx, stage_.begin, stage_.end, {}, input_grad);
  if (ring_)
    ring_->begin();
  else
    reducer_->begin();
  if (gather_) {  // ZeRO 3: the top layer's window now, each lower one as the layer above is done
    gather_->begin_pass(/*backward=*/true);
    gather_->next();
  }
  const Tensor dx = model_.backward(
      dy, ctx, stage_.begin, stage_.end,
      [this, last_of_step](size_t layer) {
        if (last_of_step && before_reduce_) before_reduce_(layer);
        if (ring_)
          ring_->layer_done(layer);
        else
          reducer_->layer_done(layer);
        if (gather_) gather_->layer_done(layer);
      },
      input_grad);
  // What backward did not hide: exposed communication.
  if (ring_)
    ring_->finish();
  else
    reducer_->finish();
  return dx;
}

bool DataParallel::step(float lr, layers::LossScaler& scaler, float clip, Communicator& world, Communicator& pipeline,
                        Communicator* tensor_parallel, bool inject_overflow) {
  DataParallel* self = this;
  return optimizer_step({&self, 1}, lr, scaler, clip, world, pipeline, tensor_parallel, inject_overflow);
}

bool optimizer_step(std::span<DataParallel* const> chunks, float lr, layers::LossScaler& scaler, float clip,
                    Communicator& world, Communicator& pipeline, Communicator* tensor_parallel, bool inject_overflow) {
  // Only the owned parts are stepped, and every element is owned by some rank: checking the
  // owned parts and agreeing over the world covers all gradients once.
  std::vector<Tensor> owned;
  for (DataParallel* c : chunks) owned.push_back(c->optimizer_->owned_grads(c->grads()));
  if (scaler.enabled()) {
    std::vector<double> overflow{0.0};
    for (const Tensor& o : owned) {
      if (inject_overflow && o.numel() > 0) {
        ops::fill(o.view(0, {1}), std::numeric_limits<float>::infinity());
        inject_overflow = false;
      }
      if (o.numel() > 0 && !ops::all_finite(o)) overflow[0] = 1.0;
    }
    all_reduce_sum(world, overflow);
    const double scale = scaler.scale();
    if (!scaler.update(overflow[0] > 0)) return false;
    for (const Tensor& o : owned)
      if (o.numel() > 0) ops::scale(o, static_cast<float>(1.0 / scale));
  }
  if (clip > 0) {
    // The global norm spans every chunk, stage and tp rank; within a chunk the optimizer sums its dp shards.
    const bool count_replicated = !tensor_parallel || tensor_parallel->rank() == 0;
    std::vector<double> squares{0.0};
    for (DataParallel* c : chunks) squares[0] += c->optimizer_->grad_sum_squares(c->grads(), count_replicated);
    all_reduce_sum(pipeline, squares);
    if (tensor_parallel) all_reduce_sum(*tensor_parallel, squares);
    for (const Tensor& o : owned) layers::clip_by_global_norm(o, squares[0], clip);  // only what is stepped
  }
  for (DataParallel* c : chunks) c->optimizer_->step(c->store_->params(), c->grads(), lr);
  return true;
}

void DataParallel::broadcast_parameters() {
  if (dp_.size() == 1) return;
  // ZeRO 3: each replica holds a different shard, initialised identically by construction.
  if (!store_->sharded_params() && store_->params().numel() > 0) dp_.broadcast(store_->params(), 0);
  broadcast_buffers();
}

void DataParallel::broadcast_buffers() {
  if (dp_.size() > 1 && store_->buffers().numel() > 0) dp_.broadcast(store_->buffers(), 0);
}

Tensor DataParallel::full_value(const layers::ParamEntry& e) {
  return gather_ && e.trainable ? gather_->gather(e) : store_->value(e);
}

void DataParallel::set_value(const layers::ParamEntry& e, const Tensor& full) {
  store_->set_value(e, full);
  optimizer_->set_master(e, full);
}

int64_t DataParallel::parameter_bytes() const {
  const int64_t window_bytes = gather_ ? gather_->allocated_bytes() : 0;  // ZeRO 3's two window slots
  return static_cast<int64_t>(store_->params().nbytes() + store_->buffers().nbytes()) + window_bytes;
}

int64_t DataParallel::gradient_bytes() const {
  return static_cast<int64_t>(store_->grads().nbytes()) + (ring_ ? ring_->allocated_bytes() : 0);
}

}  // namespace strata::parallel
