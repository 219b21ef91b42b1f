// The model zoo: mlp, cnn, resnet and gpt (with the GPT-2 presets), built from the data's shape.
#include "layers/zoo.hpp"

#include <algorithm>
#include <cmath>

#include "layers/basic.hpp"
#include "layers/composite.hpp"
#include "layers/gpt.hpp"
#include "layers/llama.hpp"

namespace strata::layers {

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
  STRATA_REQUIRE(spec.activation == "gelu" || spec.activation == "gelu_tanh",
                 "--activation must be gelu or gelu_tanh, found '", spec.activation, "'");
  STRATA_REQUIRE(spec.norm_eps > 0.0f && std::isfinite(spec.norm_eps), "--norm-eps must be positive, found ",
                 spec.norm_eps);
  const Activation activation = spec.activation == "gelu" ? Activation::GELU : Activation::GELUTanh;
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
  if (spec.dropout > 0) {
    auto drop = std::make_unique<Dropout>("drop", spec.dropout);
    drop->set_sequence_parallel(tp);
    b.add(std::move(drop));
  }
  for (int i = 0; i < spec.layers; ++i)
    b.add<TransformerBlock>(numbered("h", static_cast<size_t>(i)), spec.embed, spec.heads, spec.dropout, kind, proj_std,
                            tp, recompute, activation, spec.norm_eps);
  auto ln_f = std::make_unique<LayerNorm>("ln_f", spec.embed, spec.norm_eps);
  ln_f->set_no_weight_decay();
  ln_f->set_sequence_parallel(tp);
  b.add(std::move(ln_f));
  b.add<LMHead>("lm_head", spec.embed, vocab, spec.tie_embeddings ? wte : nullptr, tp);
  return Model(b.take(), input, static_cast<int>(vocab), tp);
}

// Llama (Hugging Face's LlamaForCausalLM): wte (embed_tokens), blocks layers.0 ..
// layers.{L-1} (input_layernorm, self_attn, post_attention_layernorm, mlp), norm, lm_head;
// no biases, no position table (rotary positions in the attention). Init: every weight
// N(0, 0.02^2) (transformers' initializer_range), RMSNorm weights 1.
Model build_llama(const ModelSpec& spec, const Shape& input, int classes, TensorParallelGroup* tp) {
  STRATA_REQUIRE(input.size() == 1 && input[0] >= 1, "model ", spec.name, " expects token sequences [T], found ",
                 shape_str(input));
  STRATA_REQUIRE(spec.layers >= 1, "--layers must be positive, found ", spec.layers);
  STRATA_REQUIRE(spec.heads >= 1 && spec.embed % spec.heads == 0 && spec.embed / spec.heads % 2 == 0, "--heads (",
                 spec.heads, ") must divide --embed (", spec.embed, ") into heads of an even size (rotary pairs)");
  const int kv_heads = spec.kv_heads > 0 ? spec.kv_heads : spec.heads;
  STRATA_REQUIRE(spec.heads % kv_heads == 0, "--kv-heads (", kv_heads, ") must divide --heads (", spec.heads,
                 "): each kv head serves a group of query heads");
  STRATA_REQUIRE(spec.dropout == 0, "--dropout: the llama models have none, found ", spec.dropout);
  STRATA_REQUIRE(spec.activation == "gelu", "--activation ", spec.activation,
                 " applies to the gpt models; the llama models' MLP is SwiGLU");
  STRATA_REQUIRE(spec.attention == "flash" || spec.attention == "plain", "--attention must be flash or plain, found '",
                 spec.attention, "'");
  STRATA_REQUIRE(spec.norm_eps > 0 && spec.norm_eps < 1, "--norm-eps must be in (0, 1), found ", spec.norm_eps);
  STRATA_REQUIRE(spec.rope_scaling == 0 || spec.rope_scaling >= 1,
                 "--rope-scaling must be 0 (none) or a factor >= 1, found ", spec.rope_scaling);
  const int64_t t = input[0];
  const int64_t positions = spec.seq_len > 0 ? spec.seq_len : t;
  STRATA_REQUIRE(t <= positions, "the data's sequences have ", t, " tokens but --seq-len is ", positions);
  const int64_t vocab = spec.vocab > 0 ? spec.vocab : classes;
  STRATA_REQUIRE(vocab >= classes, "--vocab ", vocab, " is smaller than the data's vocabulary of ", classes, " tokens");
  STRATA_REQUIRE(vocab <= INT32_MAX, "--vocab ", vocab, " is too large");
  const int64_t ffn = llama_ffn_hidden(spec);
  if (tp != nullptr && tp->size() > 1) {
    const int t_size = tp->size();
    STRATA_REQUIRE(spec.heads % t_size == 0, "--heads (", spec.heads, ") must be divisible by --tp (", t_size,
                   "): each rank computes whole heads");
    STRATA_REQUIRE(kv_heads % t_size == 0 || t_size % kv_heads == 0, "--kv-heads (", kv_heads,
                   ") must be divisible by --tp (", t_size,
                   ") or divide it (each kv head then on tp / kv-heads ranks)");
    STRATA_REQUIRE(ffn % t_size == 0, "--ffn-hidden (", ffn, ") must be divisible by --tp (", t_size, ")");
  } else {
    tp = nullptr;
  }
  const AttentionKind kind = spec.attention == "plain" ? AttentionKind::Plain : AttentionKind::Flash;
  const Recompute recompute = parse_recompute(spec.recompute);
  const RopeScaling scaling{spec.rope_scaling};
  const std::vector<float> rope =
      rope_frequencies(spec.embed / spec.heads, spec.rope_theta, spec.rope_scaling > 0 ? &scaling : nullptr);
  const auto eps = static_cast<float>(spec.norm_eps);

  Builder b(input);
  auto embedding = std::make_unique<Embedding>("embedding", vocab, positions, spec.embed, tp, /*positions=*/false);
  const Embedding* wte = embedding.get();
  if (spec.tie_embeddings) embedding->set_tied_head();
  b.add(std::move(embedding));
  const auto norm = [&](std::string name) {
    auto n = std::make_unique<RMSNorm>(std::move(name), spec.embed, eps);
    n->set_sequence_parallel(tp);
    return n;
  };
  for (int i = 0; i < spec.layers; ++i) {
    AttentionOptions options{kv_heads, rope, /*fused=*/false};
    BlockParts parts{norm("input_layernorm"),
                     std::make_unique<CausalSelfAttention>("self_attn", spec.embed, spec.heads, 0.0f, kind, kGptInitStd,
                                                           tp, std::move(options)),
                     norm("post_attention_layernorm"),
                     std::make_unique<SwiGLU>("mlp", spec.embed, ffn, kGptInitStd, tp)};
    b.add(std::make_unique<TransformerBlock>("layers." + std::to_string(i), std::move(parts), recompute));
  }
  b.add(norm("norm"));
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

// Meta's published configurations (Hugging Face's config.json of each).
struct LlamaPreset {
  const char* name;
  int layers, heads, kv_heads;
  int64_t embed, ffn_hidden;
  double rope_scaling;  // Llama 3.1's factor
  bool tied;
};
constexpr LlamaPreset kLlamaPresets[] = {
    {"llama3.2-1b", 16, 32, 8, 2048, 8192, 32, true},
    {"llama3.2-3b", 28, 24, 8, 3072, 8192, 32, true},
    {"llama3.1-8b", 32, 32, 8, 4096, 14336, 8, false},
    {"llama3.1-70b", 80, 64, 8, 8192, 28672, 8, false},
};
// The context a preset trains and plans with unless --seq-len says: Llama 3's pre-training one
// (the models accept 131072 with their rotary scaling; rotary positions need no table).
constexpr int64_t kLlama3SeqLen = 8192, kLlama3Vocab = 128256;
constexpr double kLlama3RopeTheta = 500000, kLlama3NormEps = 1e-5;

}  // namespace

const std::vector<std::string>& gpt_presets() {
  static const std::vector<std::string> names = [] {
    std::vector<std::string> n;
    for (const GptPreset& p : kGptPresets) n.emplace_back(p.name);
    return n;
  }();
  return names;
}

const std::vector<std::string>& llama_presets() {
  static const std::vector<std::string> names = [] {
    std::vector<std::string> n;
    for (const LlamaPreset& p : kLlamaPresets) n.emplace_back(p.name);
    return n;
  }();
  return names;
}

bool is_llama(const ModelSpec& spec) {
  const std::vector<std::string>& presets = llama_presets();
  return spec.name == "llama" || std::find(presets.begin(), presets.end(), spec.name) != presets.end();
}

bool ties_embeddings_by_default(const std::string& model) {
  for (const LlamaPreset& p : kLlamaPresets)
    if (model == p.name) return p.tied;
  return model != "llama";
}

int64_t llama_ffn_hidden(const ModelSpec& spec) {
  return spec.ffn_hidden > 0 ? spec.ffn_hidden : (8 * spec.embed / 3 + 255) / 256 * 256;
}

ModelSpec resolve_preset(const ModelSpec& spec) {
  ModelSpec out = spec;
  for (const LlamaPreset& p : kLlamaPresets)
    if (spec.name == p.name) {
      out.layers = p.layers;
      out.heads = p.heads;
      out.kv_heads = p.kv_heads;
      out.embed = p.embed;
      out.ffn_hidden = p.ffn_hidden;
      out.rope_scaling = p.rope_scaling;
      out.rope_theta = kLlama3RopeTheta;
      out.norm_eps = kLlama3NormEps;
      out.seq_len = spec.seq_len > 0 ? spec.seq_len : kLlama3SeqLen;
      out.vocab = spec.vocab > 0 ? spec.vocab : kLlama3Vocab;
    }
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
  return spec.name == "gpt" || std::find(presets.begin(), presets.end(), spec.name) != presets.end() || is_llama(spec);
}

Model build_model(const ModelSpec& spec, const Shape& input_shape, int num_classes, TensorParallelGroup* tp) {
  STRATA_REQUIRE(num_classes >= 2, "a classifier needs at least 2 classes, the dataset has ", num_classes);
  // Only the GPT has a tensor-parallel form (an alternating column/row MLP is left out).
  const bool split = tp != nullptr && tp->size() > 1;
  const bool classic = spec.name == "mlp" || spec.name == "cnn" || spec.name == "resnet";
  STRATA_REQUIRE(!split || !classic, "--tp applies to the gpt models; --model ", spec.name, " runs with --tp 1");
  STRATA_REQUIRE(!classic || spec.recompute == "none", "--recompute ", spec.recompute,
                 " applies to the gpt models' transformer blocks; --model ", spec.name, " runs with --recompute none");
  STRATA_REQUIRE(!classic || (spec.activation == "gelu" && spec.norm_eps == 1e-5f), "--activation and --norm-eps",
                 " apply to the gpt models; --model ", spec.name, " takes neither");
  const ModelSpec defaults;
  STRATA_REQUIRE(
      is_llama(spec) || (spec.kv_heads == defaults.kv_heads && spec.ffn_hidden == defaults.ffn_hidden &&
                         spec.rope_theta == defaults.rope_theta && spec.rope_scaling == defaults.rope_scaling),
      "--kv-heads, --ffn-hidden, --rope-theta and --rope-scaling apply to the llama models; --model ", spec.name,
      " takes none of them");
  if (spec.name == "mlp") return build_mlp(spec, input_shape, num_classes);
  if (spec.name == "cnn") return build_cnn(spec, input_shape, num_classes);
  if (spec.name == "resnet") return build_resnet(spec, input_shape, num_classes);
  if (is_llama(spec)) return build_llama(resolve_preset(spec), input_shape, num_classes, tp);
  if (is_language_model(spec)) return build_gpt(resolve_preset(spec), input_shape, num_classes, tp);
  STRATA_THROW_INPUT(
      "--model must be one of mlp, cnn, resnet, gpt, gpt2-124m, gpt2-350m, gpt2-774m, gpt2-1.5b, llama, llama3.2-1b, "
      "llama3.2-3b, llama3.1-8b, llama3.1-70b; found '",
      spec.name, "'");
}

}  // namespace strata::layers
