#include "parallel/memory_plan.hpp"

#include <algorithm>

#include "core/allocator.hpp"
#include "layers/gpt.hpp"
#include "layers/loss.hpp"
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
  if (ownership.shards_grads()) {  // GradientSync: the shard and two slots of the largest bucket
    int64_t largest = 0;
    for (const Bucket& k : make_buckets(ranges, flat, layout.bucket_bytes))
      largest = std::max(largest, k.end - k.begin);
    b.grads = (shard.size + 2 * largest) * f32;
  } else {
    b.grads = flat * f32;
  }
  // ShardedOptimizer steps the whole padded buffer without ZeRO, its owned range with it.
  const int64_t stepped = ownership.shards_state() ? shard.numel() : flat;
  b.optimizer = stepped * f32 * (layers::Optimizer::state_tensors(layout.optimizer) + (layout.dtype != DType::F32));
  return b;
}

}  // namespace

RankBytes plan_rank(const layers::Model& model, const std::vector<StageRange>& stages, int stage, int replica,
                    const MemoryLayout& layout) {
  STRATA_CHECK(stages.size() == static_cast<size_t>(layout.pp * layout.virtual_stages), "plan: ", stages.size(),
               " stages for pp ", layout.pp, " x ", layout.virtual_stages, " virtual stages");
  RankBytes b;
  // Chunk c of the rank is virtual stage c·P + stage, each with its own DataParallel.
  for (int c = 0; c < layout.virtual_stages; ++c) {
    const RankBytes chunk = plan_stage(model, stages.at(static_cast<size_t>(c * layout.pp + stage)), replica, layout);
    b.params += chunk.params;
    b.grads += chunk.grads;
    b.optimizer += chunk.optimizer;
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

namespace strata::parallel {

namespace {

// Binds the layers of `range` to meta parameters (compute dtype; buffers and gradients f32).
// A tied head whose embedding is not on this rank gets a meta copy, as TiedEmbedding gives it.
void bind_meta(layers::Model& model, StageRange range, DType dtype, const std::vector<size_t>& rank_layers) {
  for (size_t i = range.begin; i < range.end; ++i) {
    layers::Layer& layer = model.layer(i);
    std::vector<Tensor> params, grads;
    for (const layers::ParamSpec& s : layer.param_specs()) {
      params.push_back(Tensor::empty(s.shape, s.trainable ? dtype : DType::F32, Device::meta()));
      grads.push_back(s.trainable ? Tensor::empty(s.shape, DType::F32, Device::meta()) : Tensor());
    }
    layer.bind(params, grads);
    auto* head = dynamic_cast<layers::LMHead*>(&layer);
    if (head && head->shares_parameters_with() != nullptr &&
        std::none_of(rank_layers.begin(), rank_layers.end(),
                     [&](size_t k) { return &model.layer(k) == head->shares_parameters_with(); })) {
      const Shape w{head->local_vocab(), head->tied_to()->embed()};
      head->use_copy(Tensor::empty(w, dtype, Device::meta()), Tensor::empty(w, DType::F32, Device::meta()));
    }
  }
}

}  // namespace

ActivationBytes plan_activations(layers::Model& model, const std::vector<StageRange>& stages, int stage,
                                 const MemoryLayout& layout) {
  const int pp = layout.pp, v = layout.virtual_stages, m = layout.micro_batches;
  const auto chunk_range = [&](int c) { return stages.at(static_cast<size_t>(c * pp + stage)); };
  std::vector<size_t> rank_layers;
  for (int c = 0; c < v; ++c)
    for (size_t i = chunk_range(c).begin; i < chunk_range(c).end; ++i) rank_layers.push_back(i);
  for (int c = 0; c < v; ++c) bind_meta(model, chunk_range(c), layout.dtype, rank_layers);

  MetaAllocator& meta = meta_allocator();
  meta.set_host_staging(layout.cpu);
  const size_t base = meta.in_use();
  const auto first = [&](int c) { return stage == 0 && c == 0; };
  const auto last = [&](int c) { return stage == pp - 1 && c == v - 1; };
  const auto batch = [&](const Shape& sample) { return layers::batch_shape(layout.micro, sample); };
  const bool tokens = dynamic_cast<const layers::Embedding*>(&model.layer(0)) != nullptr;
  const Shape output = model.shape(model.size());  // the logits: (V) or (T, V)
  const Shape labels = batch(output.size() > 1 ? Shape(output.begin(), output.end() - 1) : Shape{});

  const auto per_chunk = [&] { return std::vector<std::vector<Tensor>>(v, std::vector<Tensor>(m)); };
  // The executor's receive buffers, one per micro-batch and chunk, made once (more than one
  // stage; one stage hands a chunk's output to the next in memory).
  auto received_activations = per_chunk(), received_grads = per_chunk();
  for (int c = 0; c < v && pp > 1; ++c)
    for (int i = 0; i < m; ++i) {
      const StageRange r = chunk_range(c);
      if (!first(c))
        received_activations[c][i] = Tensor::empty(batch(model.shape(r.begin)), layout.dtype, Device::meta());
      if (!last(c)) received_grads[c][i] = Tensor::empty(batch(model.shape(r.end)), layout.dtype, Device::meta());
    }
  auto outputs = per_chunk(), input_grads = per_chunk();
  std::vector<std::vector<std::vector<layers::Context>>> contexts(
      static_cast<size_t>(v), std::vector<std::vector<layers::Context>>(static_cast<size_t>(m)));
  const layers::SoftmaxCrossEntropy loss;
  const StageProgram program = make_schedule(layout.schedule, pp, m, v).at(static_cast<size_t>(stage));
  const layers::StepInfo info{layers::Mode::Train, 0, 0, 0};

  ActivationBytes bytes;
  for (int step = 0; step < 2; ++step) {  // the second step starts with what the first retained
    if (step == 1) {
      bytes.retained = static_cast<int64_t>(meta.in_use() - base);
      meta.reset_peak();
    }
    auto x = per_chunk(), dy = per_chunk();
    for (const Action& a : program) {
      const auto c = static_cast<size_t>(a.chunk), i = static_cast<size_t>(a.micro_batch);
      const StageRange r = chunk_range(a.chunk);
      if (a.op == Op::RecvActivation) x[c][i] = pp > 1 ? received_activations[c][i] : outputs[c - 1][i];
      if (a.op == Op::RecvGrad) dy[c][i] = pp > 1 ? received_grads[c][i] : input_grads[c + 1][i];
      if (a.op == Op::Forward) {
        const Tensor in = first(a.chunk)
                              ? Tensor::empty(batch(model.shape(0)), tokens ? DType::I32 : layout.dtype, Device::meta())
                              : x[c][i];
        outputs[c][i] = model.forward(in, contexts[c][i], info, r.begin, r.end);
        if (last(a.chunk)) {  // the loss's gradient takes the output's place
          layers::Context loss_ctx;
          loss.forward(outputs[c][i], Tensor::empty(labels, DType::I32, Device::meta()), loss_ctx);
          outputs[c][i] = loss.backward(loss_ctx, 1.0f);
        }
      }
      if (a.op == Op::Backward)
        input_grads[c][i] = model.backward(last(a.chunk) ? outputs[c][i] : dy[c][i], contexts[c][i], r.begin, r.end, {},
                                           !first(a.chunk));
    }
  }
  bytes.peak = static_cast<int64_t>(meta.peak_in_use() - base);
  return bytes;
}

}  // namespace strata::parallel
