// The flat parameter store: the layout of a range of layers' parameters in one flat buffer, their
// gradients in another and their non-trained buffers in a third, and the binding of layers to views.
#include "layers/parameter_store.hpp"

#include <algorithm>
#include <cmath>
#include <numbers>

#include "core/ops.hpp"
#include "core/rng.hpp"
#include "layers/model.hpp"

namespace strata::layers {

namespace {

constexpr int64_t kAlign = kParamAlignment;  // elements: 64 bytes of f32
int64_t align_up(int64_t n, int64_t multiple = kAlign) { return (n + multiple - 1) / multiple * multiple; }

uint64_t fnv1a(const std::string& s) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : s) h = (h ^ c) * 1099511628211ull;
  return h;
}

void initialise(const Tensor& t, const ParamSpec& spec, const std::string& name, uint64_t seed) {
  float* p = t.data<float>();
  const int64_t n = t.numel();
  switch (spec.init) {
    case Init::Zeros:
      std::fill(p, p + n, 0.0f);
      break;
    case Init::Ones:
      std::fill(p, p + n, 1.0f);
      break;
    case Init::FanInUniform: {
      const float bound = 1.0f / std::sqrt(static_cast<float>(spec.fan_in));
      const uint64_t key = rng::derive_key(seed, rng::kInit);
      const uint64_t stream = fnv1a(name);
      for (int64_t i = 0; i < n; ++i) p[i] = (2.0f * rng::uniform(key, stream, i) - 1.0f) * bound;
      break;
    }
    case Init::Normal: {
      // Box-Muller on uniforms 2i and 2i+1 of the same (seed, name) stream, in double; 1 - u
      // lies in (0, 1], so the logarithm is finite (|z| <= 5.8 with 24-bit uniforms).
      const uint64_t key = rng::derive_key(seed, rng::kInit);
      const uint64_t stream = fnv1a(name);
      for (int64_t i = 0; i < n; ++i) {
        const double u1 = 1.0 - static_cast<double>(rng::uniform(key, stream, 2 * static_cast<uint64_t>(i)));
        const double u2 = rng::uniform(key, stream, 2 * static_cast<uint64_t>(i) + 1);
        const double z = std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * std::numbers::pi * u2);
        p[i] = static_cast<float>(spec.std * z);
      }
      break;
    }
  }
}

}  // namespace

std::vector<ParamEntry> ParameterStore::layout(const Model& model, size_t begin, size_t end) {
  end = std::min(end, model.size());
  std::vector<ParamEntry> entries;
  int64_t trainable = 0, buffers = 0;
  for (size_t i = begin; i < end; ++i)
    for (const ParamSpec& s : model.layer(i).param_specs()) {
      int64_t& cursor = s.trainable ? trainable : buffers;
      entries.push_back(
          {model.layer(i).param_prefix() + s.name, s.shape, cursor, s.trainable, i, s.no_weight_decay, s.split});
      cursor = align_up(cursor + shape_numel(s.shape));
    }
  return entries;
}

int64_t ParameterStore::layout_numel(const std::vector<ParamEntry>& entries) {
  int64_t trainable = 0;
  for (const ParamEntry& e : entries)
    if (e.trainable) trainable = align_up(e.offset + shape_numel(e.shape));
  return trainable;
}

int64_t ParameterStore::buffers_numel(const std::vector<ParamEntry>& entries) {
  int64_t buffers = 0;
  for (const ParamEntry& e : entries)
    if (!e.trainable) buffers = align_up(e.offset + shape_numel(e.shape));
  return buffers;
}

ParameterStore::ParameterStore(const Model& model, uint64_t seed, const StoreLayout& store_layout)
    : entries_(layout(model, store_layout.begin, store_layout.end)), first_layer_(store_layout.begin) {
  STRATA_CHECK(store_layout.pad_multiple > 0 && store_layout.pad_multiple % kAlign == 0, "pad_multiple ",
               store_layout.pad_multiple, " is not a positive multiple of ", kAlign);
  const int64_t buffers = buffers_numel(entries_);
  used_numel_ = layout_numel(entries_);
  flat_numel_ = align_up(used_numel_, store_layout.pad_multiple);
  params_begin_ = store_layout.allocate_params ? 0 : store_layout.shard_begin;
  sharded_params_ = !store_layout.allocate_params;
  const auto make = [&](int64_t numel, DType type) {
    return store_layout.allocate ? store_layout.allocate(numel, type)
                                 : Tensor::zeros({numel}, type, store_layout.device);
  };
  params_ = store_layout.allocate_params
                ? make(flat_numel_, store_layout.dtype)
                : Tensor::zeros({store_layout.shard_size}, store_layout.dtype, store_layout.device);
  if (store_layout.allocate_grads) grads_ = make(flat_numel_, DType::F32);
  buffers_ = Tensor::zeros({buffers}, DType::F32, store_layout.device);

  const size_t begin = store_layout.begin, end = std::min(store_layout.end, model.size());
  bindings_.resize(end - begin);
  size_t k = 0;  // entries_ follow the layers' param_specs() order
  for (size_t i = begin; i < end; ++i) {
    for (const ParamSpec& s : model.layer(i).param_specs()) {
      const ParamEntry& e = entries_[k++];
      // Each entry is drawn whole, so a shard holds exactly the unsharded values; a
      // tensor-parallel one is drawn at its full shape and this rank's part taken, so it
      // equals the same slice of the tp = 1 model's tensor.
      const Tensor full = Tensor::empty(e.full_shape());
      initialise(full, s, e.name, seed);
      if (e.split.split()) {
        const Tensor local = Tensor::empty(e.shape);
        take_shard(full, e.split, local);
        set_value(e, local);
      } else {
        set_value(e, full);
      }
    }
    bindings_[i - begin] = {store_layout.allocate_params ? params_ : Tensor(), grads_, 0, 0};
    bind(model, i);
  }
}

void ParameterStore::bind_grads(const Model& model, size_t layer, const Tensor& grads, int64_t grads_begin) const {
  Binding& b = bindings_[layer - first_layer_];
  b.grads = grads;
  b.grads_begin = grads_begin;
  bind(model, layer);
}

void ParameterStore::bind_params(const Model& model, size_t layer, const Tensor& params, int64_t params_begin) const {
  Binding& b = bindings_[layer - first_layer_];
  b.params = params;
  b.params_begin = params_begin;
  bind(model, layer);
}

void ParameterStore::bind(const Model& model, size_t layer) const {
  const Binding& b = bindings_[layer - first_layer_];
  std::vector<Tensor> values, layer_grads;
  for (const ParamEntry& e : entries_) {
    if (e.layer != layer) continue;
    if (!e.trainable)
      values.push_back(buffers_.view(e.offset, e.shape));
    else
      values.push_back(b.params.defined() ? b.params.view(e.offset - b.params_begin, e.shape) : Tensor());
    layer_grads.push_back(e.trainable && b.grads.defined() ? b.grads.view(e.offset - b.grads_begin, e.shape)
                                                           : Tensor());
  }
  model.layer(layer).bind(values, layer_grads);
}

Tensor ParameterStore::value(const ParamEntry& e) const {
  STRATA_CHECK(!e.trainable || !sharded_params(), e.name, " is sharded: gather it (ZeRO 3)");
  return (e.trainable ? params_ : buffers_).view(e.offset, e.shape);
}

void ParameterStore::set_value(const ParamEntry& e, const Tensor& full) const {
  if (!e.trainable || !sharded_params()) {
    ops::copy(full, value(e));
    return;
  }
  const Overlap o = overlap(e, params_begin_, params_begin_ + params_.numel());
  if (o.size > 0) ops::copy(full.view(o.in_entry, {o.size}), params_.view(o.in_range, {o.size}));
}

Overlap overlap(const ParamEntry& e, int64_t begin, int64_t end) {
  const int64_t lo = std::max(e.offset, begin), hi = std::min(e.offset + shape_numel(e.shape), end);
  if (lo >= hi) return {};
  return {lo - e.offset, lo - begin, hi - lo};
}

std::vector<Optimizer::Range> no_decay_ranges(const std::vector<ParamEntry>& entries, int64_t begin, int64_t end) {
  std::vector<Optimizer::Range> ranges;
  for (const ParamEntry& e : entries) {
    if (!e.trainable || !e.no_weight_decay) continue;
    const int64_t lo = std::max(e.offset, begin), hi = std::min(align_up(e.offset + shape_numel(e.shape)), end);
    if (lo >= hi) continue;
    if (!ranges.empty() && ranges.back().end == lo - begin)
      ranges.back().end = hi - begin;
    else
      ranges.push_back({lo - begin, hi - begin});
  }
  return ranges;
}

Tensor ParameterStore::grad(const ParamEntry& e) const {
  STRATA_CHECK(e.trainable, e.name, " is a buffer and has no gradient");
  return grads_.view(e.offset, e.shape);
}

std::vector<ParameterStore::LayerRange> ParameterStore::layer_ranges(const std::vector<ParamEntry>& entries) {
  std::vector<LayerRange> ranges;
  for (const ParamEntry& e : entries) {
    if (!e.trainable) continue;
    const int64_t end = e.offset + shape_numel(e.shape);
    if (!ranges.empty() && ranges.back().layer == e.layer)
      ranges.back().end = end;
    else
      ranges.push_back({e.layer, e.offset, end});
  }
  return ranges;
}

int64_t ParameterStore::num_trainable() const {
  int64_t n = 0;
  for (const ParamEntry& e : entries_)
    if (e.trainable) n += shape_numel(e.shape);
  return n;
}

}  // namespace strata::layers
