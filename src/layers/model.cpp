// Model (shape inference, forward/backward over a range of layers), the model zoo and the
// flat parameter store.
#include "layers/model.hpp"

#include <algorithm>
#include <cmath>
#include <numbers>
#include <sstream>

#include "core/ops.hpp"
#include "core/rng.hpp"
#include "core/trace.hpp"
#include "layers/basic.hpp"
#include "layers/composite.hpp"
#include "layers/gpt.hpp"

namespace strata::layers {

Model::Model(std::vector<LayerPtr> layers, Shape input_shape, int num_classes, TensorParallelGroup* tp)
    : layers_(std::move(layers)), num_classes_(num_classes), tp_(tp != nullptr && tp->size() > 1 ? tp : nullptr) {
  shapes_.push_back(std::move(input_shape));
  for (size_t i = 0; i < layers_.size(); ++i) {
    layers_[i]->set_index(static_cast<int>(i));
    shapes_.push_back(layers_[i]->output_shape(shapes_.back()));
    const std::vector<ParamSpec> specs = layers_[i]->param_specs();
    trainable_.push_back(std::any_of(specs.begin(), specs.end(), [](const ParamSpec& s) { return s.trainable; }));
  }
  // A classifier's output is (K); a language model's (T, V), its classes the vocabulary; with
  // tp, this rank's slice (T, V / T).
  const Shape& out = shapes_.back();
  const bool sequence = !shapes_.front().empty() && out.size() == 2 && out[0] == shapes_.front()[0];
  if (tp_) {
    STRATA_REQUIRE(sequence && out[1] * tp_->size() == num_classes, "the tensor-parallel model's output shape is ",
                   shape_str(out), " but a vocabulary slice of ", num_classes, " tokens over --tp ", tp_->size(),
                   " needs [", shapes_.front().empty() ? 0 : shapes_.front()[0], ", ", num_classes / tp_->size(), "]");
    return;
  }
  STRATA_REQUIRE(out == Shape{num_classes} || (sequence && out[1] == num_classes), "the model's output shape is ",
                 shape_str(out), " but the dataset has ", num_classes, " classes");
}

std::string Model::summary() const {
  std::ostringstream os;
  int64_t total = 0;
  for (size_t i = 0; i < layers_.size(); ++i) {
    int64_t params = 0;
    for (const ParamSpec& s : layers_[i]->param_specs())
      if (s.trainable) params += shape_numel(s.shape);
    total += params;
    os << "  " << i << "  " << layers_[i]->name() << "  " << layers_[i]->describe() << "  " << shape_str(shapes_[i])
       << " -> " << shape_str(shapes_[i + 1]) << "  params " << params << "\n";
  }
  os << "  total trainable parameters: " << total;
  return os.str();
}

Tensor Model::forward(const Tensor& x, std::vector<Context>& ctx, const StepInfo& info, size_t begin,
                      size_t end) const {
  end = std::min(end, layers_.size());
  ctx.resize(layers_.size());
  Tensor h = x;
  for (size_t i = begin; i < end; ++i) {
    const trace::Span span(trace::Track::Compute, layers_[i]->name());
    h = layers_[i]->forward(h, ctx[i], info);
  }
  return h;
}

Tensor Model::backward(const Tensor& dy, std::vector<Context>& ctx, size_t begin, size_t end,
                       const std::function<void(size_t)>& after_layer, bool input_grad) const {
  end = std::min(end, layers_.size());
  // Without input_grad, nothing below the lowest layer with parameters needs a gradient.
  size_t stop = begin;
  if (!input_grad) {
    stop = end;
    for (size_t i = begin; i < end && stop == end; ++i)
      if (trainable_[i]) stop = i;
  }
  Tensor g = dy;
  for (size_t i = end; i-- > stop;) {
    ctx[i].input_grad = input_grad || i > stop;
    {
      const trace::Span span(trace::Track::Compute, layers_[i]->name());
      g = layers_[i]->backward(g, ctx[i]);
    }
    if (after_layer) after_layer(i);
  }
  for (size_t i = begin; i < stop; ++i) ctx[i].clear();
  return input_grad ? g : Tensor();
}

// ---- zoo -------------------------------------------------------------------------------------

namespace {

// Appends layers while tracking the per-sample shape, so sizes come from the data.
class Builder {
 public:
  explicit Builder(Shape input) : shape_(std::move(input)) {}
  template <class L, class... Args>
  void add(Args&&... args) {
    layers_.push_back(std::make_unique<L>(std::forward<Args>(args)...));
    shape_ = layers_.back()->output_shape(shape_);
  }
  void add(LayerPtr layer) {
    layers_.push_back(std::move(layer));
    shape_ = layers_.back()->output_shape(shape_);
  }
  const Shape& shape() const { return shape_; }
  int64_t features() const { return shape_numel(shape_); }
  std::vector<LayerPtr> take() { return std::move(layers_); }

 private:
  Shape shape_;
  std::vector<LayerPtr> layers_;
};

std::string numbered(const char* base, size_t i) { return base + std::to_string(i); }

Model build_mlp(const ModelSpec& spec, const Shape& input, int classes) {
  Builder b(input);
  b.add<Flatten>("flatten");
  for (size_t i = 0; i < spec.hidden.size(); ++i) {
    STRATA_REQUIRE(spec.hidden[i] > 0, "--hidden sizes must be positive, found ", spec.hidden[i]);
    b.add<Linear>(numbered("fc", i + 1), b.features(), spec.hidden[i]);
    b.add<ActivationLayer>(numbered("relu", i + 1), Activation::ReLU);
    if (spec.dropout > 0) b.add<Dropout>(numbered("dropout", i + 1), spec.dropout);
  }
  b.add<Linear>(numbered("fc", spec.hidden.size() + 1), b.features(), classes);
  return Model(b.take(), input, classes);
}

Model build_cnn(const ModelSpec& spec, const Shape& input, int classes) {
  STRATA_REQUIRE(input.size() == 3, "model cnn expects image samples [C, H, W], found ", shape_str(input));
  Builder b(input);
  b.add<Conv2d>("conv1", input[0], 32, 3, 1, 1);
  b.add<ActivationLayer>("relu1", Activation::ReLU);
  b.add<Pool2d>("pool1", PoolKind::Max, 2, 2);
  b.add<Conv2d>("conv2", 32, 64, 3, 1, 1);
  b.add<ActivationLayer>("relu2", Activation::ReLU);
  b.add<Pool2d>("pool2", PoolKind::Max, 2, 2);
  b.add<Flatten>("flatten");
  b.add<Linear>("fc1", b.features(), 128);
  b.add<ActivationLayer>("relu3", Activation::ReLU);
  if (spec.dropout > 0) b.add<Dropout>("dropout", spec.dropout);
  b.add<Linear>("fc2", 128, classes);
  return Model(b.take(), input, classes);
}

// CIFAR-style ResNet (He et al. 2016, section 4.2): 3 stages of n basic blocks, depth 6n+2.
Model build_resnet(const ModelSpec& spec, const Shape& input, int classes) {
  STRATA_REQUIRE(input.size() == 3, "model resnet expects image samples [C, H, W], found ", shape_str(input));
  STRATA_REQUIRE(spec.depth >= 8 && (spec.depth - 2) % 6 == 0,
                 "--depth for resnet must be 6n+2 (8, 14, 20, 32, 56, ...), found ", spec.depth);
  STRATA_REQUIRE(spec.width > 0, "--width must be positive, found ", spec.width);
  STRATA_REQUIRE(spec.dropout == 0, "--dropout applies to mlp and cnn; resnet has no dropout, found ", spec.dropout);
  const int blocks = (spec.depth - 2) / 6;
  Builder b(input);
  b.add<Conv2d>("conv1", input[0], spec.width, 3, 1, 1, false);
  b.add<BatchNorm2d>("bn1", spec.width);
  b.add<ActivationLayer>("relu1", Activation::ReLU);
  int64_t channels = spec.width;
  for (int stage = 0; stage < 3; ++stage) {
    const int64_t out = static_cast<int64_t>(spec.width) << stage;
    for (int i = 0; i < blocks; ++i) {
      const int64_t stride = (stage > 0 && i == 0) ? 2 : 1;
      b.add(ResidualBlock::basic(detail::cat("block", stage + 1, "_", i + 1), channels, out, stride));
      channels = out;
    }
  }
  b.add<GlobalAvgPool>("pool");
  b.add<Linear>("fc", channels, classes);
  return Model(b.take(), input, classes);
}

// GPT-2 (nanoGPT's layout): wte + wpe, [dropout], blocks h0..h{L-1}, ln_f, lm_head. Each is one
// top-level layer, so pipeline stages cut between blocks.
Model build_gpt(const ModelSpec& spec, const Shape& input, int classes, TensorParallelGroup* tp) {
  STRATA_REQUIRE(input.size() == 1 && input[0] >= 1, "model ", spec.name, " expects token sequences [T], found ",
                 shape_str(input));
  STRATA_REQUIRE(spec.layers >= 1, "--layers must be positive, found ", spec.layers);
  STRATA_REQUIRE(spec.embed >= 1, "--embed must be positive, found ", spec.embed);
  STRATA_REQUIRE(spec.heads >= 1 && spec.embed % spec.heads == 0, "--heads (", spec.heads, ") must divide --embed (",
                 spec.embed, ")");
  STRATA_REQUIRE(spec.dropout >= 0.0f && spec.dropout < 1.0f, "--dropout must be in [0, 1), found ", spec.dropout);
  STRATA_REQUIRE(spec.attention == "flash" || spec.attention == "plain", "--attention must be flash or plain, found '",
                 spec.attention, "'");
  const int64_t t = input[0];
  const int64_t positions = spec.seq_len > 0 ? spec.seq_len : t;
  STRATA_REQUIRE(t <= positions, "the data's sequences have ", t, " tokens but --seq-len is ", positions);
  const int64_t vocab = spec.vocab > 0 ? spec.vocab : classes;
  STRATA_REQUIRE(vocab >= classes, "--vocab ", vocab, " is smaller than the data's vocabulary of ", classes, " tokens");
  STRATA_REQUIRE(vocab <= INT32_MAX, "--vocab ", vocab, " is too large");
  if (tp != nullptr && tp->size() > 1) {
    const int64_t t_size = tp->size();
    STRATA_REQUIRE(spec.heads % t_size == 0, "--heads (", spec.heads, ") must be divisible by --tp (", t_size,
                   "): each rank computes whole heads");
    STRATA_REQUIRE(vocab % t_size == 0, "the vocabulary (", vocab, " tokens) must be divisible by --tp ", t_size,
                   " (each rank holds V / tp rows of wte); pass --vocab ", (vocab + t_size - 1) / t_size * t_size);
  } else {
    tp = nullptr;
  }
  const AttentionKind kind = spec.attention == "plain" ? AttentionKind::Plain : AttentionKind::Flash;
  const Recompute recompute = parse_recompute(spec.recompute);
  // GPT-2: the residual projections are scaled by 1/sqrt(2 * layers) at init.
  const double proj_std = kGptInitStd / std::sqrt(2.0 * spec.layers);

  Builder b(input);
  auto embedding = std::make_unique<Embedding>("embedding", vocab, positions, spec.embed, tp);
  const Embedding* wte = embedding.get();
  if (spec.tie_embeddings) embedding->set_tied_head();
  b.add(std::move(embedding));
  if (spec.dropout > 0) b.add<Dropout>("drop", spec.dropout);
  for (int i = 0; i < spec.layers; ++i)
    b.add<TransformerBlock>(numbered("h", static_cast<size_t>(i)), spec.embed, spec.heads, spec.dropout, kind, proj_std,
                            tp, recompute);
  auto ln_f = std::make_unique<LayerNorm>("ln_f", spec.embed);
  ln_f->set_no_weight_decay();
  b.add(std::move(ln_f));
  b.add<LMHead>("lm_head", spec.embed, vocab, spec.tie_embeddings ? wte : nullptr, tp);
  return Model(b.take(), input, static_cast<int>(vocab), tp);
}

struct GptPreset {
  const char* name;
  int layers, heads;
  int64_t embed;
};
constexpr GptPreset kGptPresets[] = {
    {"gpt2-124m", 12, 12, 768},
    {"gpt2-350m", 24, 16, 1024},
    {"gpt2-774m", 36, 20, 1280},
    {"gpt2-1.5b", 48, 25, 1600},
};
constexpr int64_t kGpt2SeqLen = 1024, kGpt2Vocab = 50257;

}  // namespace

const std::vector<std::string>& gpt_presets() {
  static const std::vector<std::string> names = [] {
    std::vector<std::string> n;
    for (const GptPreset& p : kGptPresets) n.emplace_back(p.name);
    return n;
  }();
  return names;
}

ModelSpec resolve_preset(const ModelSpec& spec) {
  ModelSpec out = spec;
  for (const GptPreset& p : kGptPresets)
    if (spec.name == p.name) {
      out.layers = p.layers;
      out.heads = p.heads;
      out.embed = p.embed;
      out.seq_len = kGpt2SeqLen;
      out.vocab = spec.vocab > 0 ? spec.vocab : kGpt2Vocab;  // --vocab pads it (nanoGPT's 50304)
    }
  return out;
}

bool is_language_model(const ModelSpec& spec) {
  const std::vector<std::string>& presets = gpt_presets();
  return spec.name == "gpt" || std::find(presets.begin(), presets.end(), spec.name) != presets.end();
}

Model build_model(const ModelSpec& spec, const Shape& input_shape, int num_classes, TensorParallelGroup* tp) {
  STRATA_REQUIRE(num_classes >= 2, "a classifier needs at least 2 classes, the dataset has ", num_classes);
  // Only the GPT has a tensor-parallel form (an alternating column/row MLP is left out).
  const bool split = tp != nullptr && tp->size() > 1;
  const bool classic = spec.name == "mlp" || spec.name == "cnn" || spec.name == "resnet";
  STRATA_REQUIRE(!split || !classic, "--tp applies to the gpt models; --model ", spec.name, " runs with --tp 1");
  STRATA_REQUIRE(!classic || spec.recompute == "none", "--recompute ", spec.recompute,
                 " applies to the gpt models' transformer blocks; --model ", spec.name, " runs with --recompute none");
  if (spec.name == "mlp") return build_mlp(spec, input_shape, num_classes);
  if (spec.name == "cnn") return build_cnn(spec, input_shape, num_classes);
  if (spec.name == "resnet") return build_resnet(spec, input_shape, num_classes);
  if (is_language_model(spec)) return build_gpt(resolve_preset(spec), input_shape, num_classes, tp);
  STRATA_THROW_INPUT(
      "--model must be one of mlp, cnn, resnet, gpt, gpt2-124m, gpt2-350m, gpt2-774m, gpt2-1.5b; found '", spec.name,
      "'");
}

// ---- parameters ------------------------------------------------------------------------------

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

ParameterStore::ParameterStore(const Model& model, uint64_t seed, size_t begin, size_t end, int64_t pad_multiple,
                               bool allocate_grads, bool allocate_params, int64_t shard_begin, int64_t shard_size,
                               DType dtype, Device device,
                               const std::function<Tensor(int64_t numel, DType dtype)>& allocate)
    : entries_(layout(model, begin, end)), first_layer_(begin) {
  STRATA_CHECK(pad_multiple > 0 && pad_multiple % kAlign == 0, "pad_multiple ", pad_multiple,
               " is not a positive multiple of ", kAlign);
  const int64_t buffers = buffers_numel(entries_);
  used_numel_ = layout_numel(entries_);
  flat_numel_ = align_up(used_numel_, pad_multiple);
  params_begin_ = allocate_params ? 0 : shard_begin;
  sharded_params_ = !allocate_params;
  const auto make = [&](int64_t numel, DType type) {
    return allocate ? allocate(numel, type) : Tensor::zeros({numel}, type, device);
  };
  params_ = allocate_params ? make(flat_numel_, dtype) : Tensor::zeros({shard_size}, dtype, device);
  if (allocate_grads) grads_ = make(flat_numel_, DType::F32);
  buffers_ = Tensor::zeros({buffers}, DType::F32, device);

  end = std::min(end, model.size());
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
    bindings_[i - begin] = {allocate_params ? params_ : Tensor(), grads_, 0, 0};
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
