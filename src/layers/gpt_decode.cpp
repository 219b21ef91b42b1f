// The GPT decoder with its key/value cache, token choice and the generation loop.
#include "layers/gpt_decode.hpp"

#include <algorithm>
#include <cmath>
#include <map>
#include <numeric>

#include "core/ops.hpp"
#include "core/rng.hpp"
#include "layers/basic.hpp"
#include "layers/gpt.hpp"

namespace strata::layers {

namespace {

// Attention of one query over the first n cached positions of one head: y = softmax(q k^T *
// scale) v, q and y of dh elements, k and v rows of dh with the same stride. `scores` holds n.
void attend_one(const float* q, const float* k, const float* v, int64_t n, int64_t dh, float scale, float* scores,
                float* y) {
  float max = -INFINITY;
  for (int64_t j = 0; j < n; ++j) {
    float s = 0.0f;
    for (int64_t d = 0; d < dh; ++d) s += q[d] * k[j * dh + d];
    scores[j] = s * scale;
    max = std::max(max, scores[j]);
  }
  double sum = 0.0;
  for (int64_t j = 0; j < n; ++j) {
    scores[j] = std::exp(scores[j] - max);
    sum += scores[j];
  }
  const float inv = static_cast<float>(1.0 / sum);
  std::fill(y, y + dh, 0.0f);
  for (int64_t j = 0; j < n; ++j) {
    const float p = scores[j] * inv;
    for (int64_t d = 0; d < dh; ++d) y[d] += p * v[j * dh + d];
  }
}

void linear(const Tensor& x, const Tensor& w, const Tensor& b, const Tensor& y) {
  ops::gemm(x, false, w, true, y);  // (1, in) @ W^T, W (out, in)
  ops::add_bias(y, b);
}

}  // namespace

GptDecoder::GptDecoder(const Model& model, const ParameterStore& store) {
  STRATA_CHECK(!store.sharded_params() && store.params().defined(), "the decoder needs a store of full parameters");
  STRATA_CHECK(store.params().dtype() == DType::F32 && store.params().device().is_cpu(),
               "the decoder runs on f32 parameters on the CPU, found ", store.params().str());
  std::map<std::string, const ParamEntry*> by_name;
  for (const ParamEntry& e : store.entries()) by_name[e.name] = &e;
  const auto param = [&](const std::string& name) {
    const auto it = by_name.find(name);
    STRATA_CHECK(it != by_name.end(), "the store holds no parameter ", name, " (a store over the whole gpt model?)");
    return store.value(*it->second);
  };

  const auto* embedding = model.size() > 0 ? dynamic_cast<const Embedding*>(&model.layer(0)) : nullptr;
  STRATA_CHECK(embedding != nullptr, "the decoder needs a gpt model (its first layer an embedding)");
  vocab_ = embedding->vocab();
  embed_ = embedding->embed();
  wte_ = param("wte/weight");
  wpe_ = param("wpe/weight");
  max_positions_ = wpe_.dim(0);
  const LMHead* head = nullptr;
  for (size_t i = 1; i < model.size(); ++i) {
    const Layer& layer = model.layer(i);
    const std::string p = layer.param_prefix();
    if (const auto* block = dynamic_cast<const TransformerBlock*>(&layer)) {
      STRATA_CHECK(heads_ == 0 || heads_ == block->heads(), "blocks with different head counts");
      heads_ = block->heads();
      eps_ = block->ln_eps();
      blocks_.push_back(Block{param(p + "ln_1/weight"), param(p + "ln_1/bias"), param(p + "attn/c_attn/weight"),
                              param(p + "attn/c_attn/bias"), param(p + "attn/c_proj/weight"),
                              param(p + "attn/c_proj/bias"), param(p + "ln_2/weight"), param(p + "ln_2/bias"),
                              param(p + "mlp/c_fc/weight"), param(p + "mlp/c_fc/bias"), param(p + "mlp/c_proj/weight"),
                              param(p + "mlp/c_proj/bias")});
    } else if (const auto* ln = dynamic_cast<const LayerNorm*>(&layer)) {
      STRATA_CHECK(!head && layer.name() == "ln_f", "unexpected layer norm ", layer.name());
      ln_f_w_ = param(p + "weight");
      ln_f_b_ = param(p + "bias");
      STRATA_CHECK(ln->eps() == eps_, "ln_f's eps differs from the blocks'");
    } else if ((head = dynamic_cast<const LMHead*>(&layer))) {
      head_w_ = head->tied() ? wte_ : param(p + "weight");
    } else {
      STRATA_CHECK(dynamic_cast<const Dropout*>(&layer) != nullptr, "the decoder does not know layer ", layer.name(),
                   " (", layer.describe(), ")");  // dropout: the identity at inference
    }
  }
  STRATA_CHECK(!blocks_.empty() && ln_f_w_.defined() && head != nullptr, "incomplete gpt model");
  layers_ = static_cast<int64_t>(blocks_.size());

  const int64_t d = embed_, dh = embed_ / heads_;
  k_cache_ = Tensor::zeros({layers_, heads_, max_positions_, dh});
  v_cache_ = Tensor::zeros({layers_, heads_, max_positions_, dh});
  token_ = Tensor::empty({1, 1}, DType::I32);
  x_ = Tensor::empty({1, d});
  h_ = Tensor::empty({1, d});
  qkv_ = Tensor::empty({1, 3 * d});
  att_ = Tensor::empty({1, d});
  proj_ = Tensor::empty({1, d});
  fc_ = Tensor::empty({1, 4 * d});
  act_ = Tensor::empty({1, 4 * d});
  mean_ = Tensor::empty({1});
  rstd_ = Tensor::empty({1});
  scores_ = Tensor::empty({max_positions_});
  logits_ = Tensor::empty({1, vocab_});
}

const Tensor& GptDecoder::step(int32_t token) {
  STRATA_REQUIRE(position_ < max_positions_, "the decoder's context is full (", max_positions_,
                 " positions, the model's seq_len)");
  STRATA_REQUIRE(token >= 0 && token < vocab_, "token ", token, " is outside the model's vocabulary [0, ", vocab_, ")");
  const int64_t d = embed_, dh = embed_ / heads_, t = position_, n = t + 1;
  const float scale = 1.0f / std::sqrt(static_cast<float>(dh));
  token_.data<int32_t>()[0] = token;
  ops::embedding_forward(token_, wte_, wpe_.slice(t, t + 1), x_.reshape({1, 1, d}));
  for (int64_t l = 0; l < layers_; ++l) {
    const Block& b = blocks_[static_cast<size_t>(l)];
    ops::layer_norm_forward(x_, b.ln_1_w, b.ln_1_b, h_, mean_, rstd_, eps_);
    linear(h_, b.c_attn_w, b.c_attn_b, qkv_);
    const float* qkv = qkv_.data<float>();  // q | k | v, each head-major
    float* kc = k_cache_.data<float>() + l * heads_ * max_positions_ * dh;
    float* vc = v_cache_.data<float>() + l * heads_ * max_positions_ * dh;
    for (int64_t h = 0; h < heads_; ++h) {
      float* k = kc + h * max_positions_ * dh;
      float* v = vc + h * max_positions_ * dh;
      std::copy_n(qkv + d + h * dh, dh, k + t * dh);
      std::copy_n(qkv + 2 * d + h * dh, dh, v + t * dh);
      attend_one(qkv + h * dh, k, v, n, dh, scale, scores_.data<float>(), att_.data<float>() + h * dh);
    }
    linear(att_, b.c_proj_w, b.c_proj_b, proj_);
    ops::axpy(1.0f, proj_, x_);  // the residual
    ops::layer_norm_forward(x_, b.ln_2_w, b.ln_2_b, h_, mean_, rstd_, eps_);
    linear(h_, b.c_fc_w, b.c_fc_b, fc_);
    ops::gelu_forward(fc_, act_);
    linear(act_, b.mlp_proj_w, b.mlp_proj_b, proj_);
    ops::axpy(1.0f, proj_, x_);
  }
  ops::layer_norm_forward(x_, ln_f_w_, ln_f_b_, h_, mean_, rstd_, eps_);
  ops::gemm(h_, false, head_w_, true, logits_);  // (1, D) @ W^T, W (V, D)
  ++position_;
  last_ = logits_.reshape({vocab_});
  return last_;
}

int32_t pick_token(const Tensor& logits, const SampleOptions& options, int64_t index) {
  STRATA_CHECK(logits.dtype() == DType::F32 && logits.device().is_cpu() && logits.numel() > 0,
               "pick_token takes f32 logits on the CPU, found ", logits.str());
  STRATA_REQUIRE(options.temperature >= 0.0f && std::isfinite(options.temperature),
                 "the temperature must be finite and not negative, found ", options.temperature);
  STRATA_REQUIRE(options.top_k >= 0, "top-k must not be negative, found ", options.top_k);
  const float* l = logits.data<float>();
  const int64_t v = options.vocab_limit > 0 ? std::min(options.vocab_limit, logits.numel()) : logits.numel();
  if (options.temperature == 0.0f) return static_cast<int32_t>(std::max_element(l, l + v) - l);  // first maximum

  std::vector<int32_t> ids(static_cast<size_t>(v));
  std::iota(ids.begin(), ids.end(), 0);
  if (options.top_k > 0 && options.top_k < v) {
    const auto before = [&](int32_t a, int32_t b) { return l[a] > l[b] || (l[a] == l[b] && a < b); };
    std::partial_sort(ids.begin(), ids.begin() + options.top_k, ids.end(), before);
    ids.resize(static_cast<size_t>(options.top_k));
  }
  float max = -INFINITY;
  for (const int32_t i : ids) max = std::max(max, l[i]);
  std::vector<double> weight(ids.size());
  double total = 0.0;
  for (size_t i = 0; i < ids.size(); ++i) {
    weight[i] = std::exp(static_cast<double>(l[ids[i]] - max) / options.temperature);
    total += weight[i];
  }
  const uint64_t key = rng::derive_key(options.seed, rng::kSample);
  const double u = static_cast<double>(rng::bits64(key, 0, static_cast<uint64_t>(index)) >> 11) * 0x1p-53 * total;
  double sum = 0.0;
  for (size_t i = 0; i < ids.size(); ++i) {
    sum += weight[i];
    if (u < sum) return ids[i];
  }
  return ids.back();  // rounding: u within the last ulp of the total
}

std::vector<int32_t> generate(GptDecoder& decoder, std::span<const int32_t> context, int64_t n,
                              const SampleOptions& options, const std::function<void(int32_t)>& on_token) {
  STRATA_REQUIRE(!context.empty(), "generation needs at least one token of context");
  const size_t window = static_cast<size_t>(decoder.max_positions());
  std::vector<int32_t> all(context.begin(), context.end()), out;
  out.reserve(static_cast<size_t>(std::max<int64_t>(n, 0)));
  decoder.reset();
  const Tensor* logits = nullptr;
  for (size_t i = all.size() > window ? all.size() - window : 0; i < all.size(); ++i) logits = &decoder.step(all[i]);
  for (int64_t i = 0; i < n; ++i) {
    const int32_t token = pick_token(*logits, options, i);
    out.push_back(token);
    all.push_back(token);
    if (on_token) on_token(token);
    if (i + 1 == n) break;
    if (decoder.position() == decoder.max_positions()) {
      // Slide: the cache over the last window - 1 tokens before this one, which then takes the
      // last position (nanoGPT's crop to the last seq_len tokens).
      decoder.reset();
      for (size_t j = all.size() - window; j + 1 < all.size(); ++j) decoder.step(all[j]);
    }
    logits = &decoder.step(token);
  }
  return out;
}

}  // namespace strata::layers
