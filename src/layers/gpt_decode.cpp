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
#include "layers/llama.hpp"
#include "layers/parameter_store.hpp"

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

  STRATA_CHECK(model.tensor_parallel() == nullptr, "the decoder needs the whole model (--tp 1)");
  const auto* embedding = model.size() > 0 ? dynamic_cast<const Embedding*>(&model.layer(0)) : nullptr;
  STRATA_CHECK(embedding != nullptr, "the decoder needs a gpt model (its first layer an embedding)");
  vocab_ = embedding->vocab();
  embed_ = embedding->embed();
  wte_ = param("wte/weight");
  if (embedding->has_position_table()) wpe_ = param("wpe/weight");
  max_positions_ = embedding->max_positions();
  const LMHead* head = nullptr;
  for (size_t i = 1; i < model.size(); ++i) {
    const Layer& layer = model.layer(i);
    const std::string p = layer.param_prefix();
    const auto* block = dynamic_cast<const TransformerBlock*>(&layer);
    const auto* rms = block ? dynamic_cast<const RMSNorm*>(&block->norm_1()) : nullptr;
    if (rms) {  // Llama
      STRATA_CHECK(heads_ == 0 || heads_ == block->heads(), "blocks with different head counts");
      llama_ = true;
      heads_ = block->heads();
      kv_heads_ = block->attention().kv_heads();
      rope_ = block->attention().rope();
      eps_ = rms->eps();
      const std::string a = p + "self_attn/", m = p + "mlp/";
      Block b;
      b.ln_1_w = param(p + "input_layernorm/weight");
      b.q_w = param(a + "q_proj/weight");
      b.k_w = param(a + "k_proj/weight");
      b.v_w = param(a + "v_proj/weight");
      b.c_proj_w = param(a + "o_proj/weight");
      b.ln_2_w = param(p + "post_attention_layernorm/weight");
      b.gate_w = param(m + "gate_proj/weight");
      b.up_w = param(m + "up_proj/weight");
      b.mlp_proj_w = param(m + "down_proj/weight");
      blocks_.push_back(std::move(b));
    } else if (const auto* rms_f = dynamic_cast<const RMSNorm*>(&layer)) {
      STRATA_CHECK(!head && llama_ && layer.name() == "norm", "unexpected RMSNorm ", layer.name());
      ln_f_w_ = param(p + "weight");
      STRATA_CHECK(rms_f->eps() == eps_, "norm's eps differs from the blocks'");
    } else if (block) {
      STRATA_CHECK(heads_ == 0 || heads_ == block->heads(), "blocks with different head counts");
      heads_ = block->heads();
      kv_heads_ = heads_;
      eps_ = block->ln_eps();
      tanh_gelu_ = block->activation() == Activation::GELUTanh;
      blocks_.push_back(Block{param(p + "ln_1/weight"), param(p + "ln_1/bias"), param(p + "attn/c_attn/weight"),
                              param(p + "attn/c_attn/bias"), param(p + "attn/c_proj/weight"),
                              param(p + "attn/c_proj/bias"), param(p + "ln_2/weight"), param(p + "ln_2/bias"),
                              param(p + "mlp/c_fc/weight"), param(p + "mlp/c_fc/bias"), param(p + "mlp/c_proj/weight"),
                              param(p + "mlp/c_proj/bias"), Tensor(), Tensor(), Tensor(), Tensor(), Tensor()});
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

  const int64_t dh = embed_ / heads_;
  k_cache_ = Tensor::zeros({layers_, kv_heads_, max_positions_, dh});
  v_cache_ = Tensor::zeros({layers_, kv_heads_, max_positions_, dh});
  scores_ = Tensor::empty({max_positions_});
  logits_ = Tensor::empty({1, vocab_});
}

const Tensor& GptDecoder::prefill(std::span<const int32_t> tokens) {
  const auto n = static_cast<int64_t>(tokens.size());
  STRATA_CHECK(n >= 1, "prefill needs at least one token");
  STRATA_REQUIRE(position_ + n <= max_positions_, "the decoder's context is full: ", position_, " + ", n,
                 " tokens do not fit in the model's ", max_positions_, " positions (seq_len)");
  const int64_t d = embed_, dh = embed_ / heads_, t0 = position_;
  const float scale = 1.0f / std::sqrt(static_cast<float>(dh));
  Tensor ids = Tensor::empty({1, n}, DType::I32);
  for (int64_t i = 0; i < n; ++i) {
    const int32_t token = tokens[static_cast<size_t>(i)];
    STRATA_REQUIRE(token >= 0 && token < vocab_, "token ", token, " is outside the model's vocabulary [0, ", vocab_,
                   ")");
    ids.data<int32_t>()[i] = token;
  }
  // Rows are the new positions: (n, D) activations, as the layers' (B * T, D) are.
  Tensor x = Tensor::empty({n, d}), h = Tensor::empty({n, d}), qkv = Tensor::empty({n, 3 * d});
  Tensor att = Tensor::empty({n, d}), proj = Tensor::empty({n, d});
  Tensor fc = Tensor::empty({n, 4 * d}), act = Tensor::empty({n, 4 * d});
  Tensor mean = Tensor::empty({n}), rstd = Tensor::empty({n});
  ops::embedding_forward(ids, wte_, wpe_.defined() ? wpe_.slice(t0, t0 + n) : Tensor(), x.reshape({1, n, d}));
  for (int64_t l = 0; l < layers_; ++l) {
    const Block& b = blocks_[static_cast<size_t>(l)];
    if (llama_) {
      llama_block(b, l, x, n);
      continue;
    }
    ops::layer_norm_forward(x, b.ln_1_w, b.ln_1_b, h, mean, rstd, eps_);
    linear(h, b.c_attn_w, b.c_attn_b, qkv);
    float* kc = k_cache_.data<float>() + l * heads_ * max_positions_ * dh;
    float* vc = v_cache_.data<float>() + l * heads_ * max_positions_ * dh;
    for (int64_t i = 0; i < n; ++i) {                    // the new keys and values first: row i attends to rows <= i
      const float* row = qkv.data<float>() + i * 3 * d;  // q | k | v, each head-major
      for (int64_t hd = 0; hd < heads_; ++hd) {
        std::copy_n(row + d + hd * dh, dh, kc + (hd * max_positions_ + t0 + i) * dh);
        std::copy_n(row + 2 * d + hd * dh, dh, vc + (hd * max_positions_ + t0 + i) * dh);
      }
    }
    for (int64_t i = 0; i < n; ++i)
      for (int64_t hd = 0; hd < heads_; ++hd)
        attend_one(qkv.data<float>() + i * 3 * d + hd * dh, kc + hd * max_positions_ * dh,
                   vc + hd * max_positions_ * dh, t0 + i + 1, dh, scale, scores_.data<float>(),
                   att.data<float>() + i * d + hd * dh);
    linear(att, b.c_proj_w, b.c_proj_b, proj);
    ops::axpy(1.0f, proj, x);  // the residual
    ops::layer_norm_forward(x, b.ln_2_w, b.ln_2_b, h, mean, rstd, eps_);
    linear(h, b.c_fc_w, b.c_fc_b, fc);
    if (tanh_gelu_)
      ops::gelu_tanh_forward(fc, act);
    else
      ops::gelu_forward(fc, act);
    linear(act, b.mlp_proj_w, b.mlp_proj_b, proj);
    ops::axpy(1.0f, proj, x);
  }
  // Logits of the last position only.
  const Tensor last = x.slice(n - 1, n), out = h.slice(n - 1, n);
  if (llama_)
    ops::rms_norm_forward(last, ln_f_w_, out, Tensor(), eps_);
  else
    ops::layer_norm_forward(last, ln_f_w_, ln_f_b_, out, mean.slice(0, 1), rstd.slice(0, 1), eps_);
  ops::gemm(out, false, head_w_, true, logits_);  // (1, D) @ W^T, W (V, D)
  position_ += n;
  logits_view_ = logits_.reshape({vocab_});
  return logits_view_;
}

void GptDecoder::llama_block(const Block& b, int64_t l, Tensor& x, int64_t n) {
  const int64_t d = embed_, dh = embed_ / heads_, g = kv_heads_, t0 = position_, ffn = b.up_w.dim(0);
  const float scale = 1.0f / std::sqrt(static_cast<float>(dh));
  Tensor h = Tensor::empty({n, d}), att = Tensor::empty({n, heads_ * dh}), proj = Tensor::empty({n, d});
  ops::rms_norm_forward(x, b.ln_1_w, h, Tensor(), eps_);
  // q, k, v head-major (1, heads, n, Dh), turned to their positions t0 .. t0 + n - 1.
  Tensor q = Tensor::empty({1, heads_, n, dh}), k = Tensor::empty({1, g, n, dh}), v = Tensor::empty({1, g, n, dh});
  for (const auto& [w, out] : {std::pair{&b.q_w, &q}, std::pair{&b.k_w, &k}, std::pair{&b.v_w, &v}}) {
    Tensor rows = Tensor::empty({n, w->dim(0)});
    ops::gemm(h, false, *w, true, rows);
    ops::split_heads(rows.reshape({1, n, w->dim(0)}), *out);
  }
  ops::rope(q, q, rope_, t0);
  ops::rope(k, k, rope_, t0);
  float* kc = k_cache_.data<float>() + l * g * max_positions_ * dh;
  float* vc = v_cache_.data<float>() + l * g * max_positions_ * dh;
  for (int64_t j = 0; j < g; ++j) {  // the new keys and values first: row i attends to rows <= i
    std::copy_n(k.data<float>() + j * n * dh, n * dh, kc + (j * max_positions_ + t0) * dh);
    std::copy_n(v.data<float>() + j * n * dh, n * dh, vc + (j * max_positions_ + t0) * dh);
  }
  for (int64_t i = 0; i < n; ++i)
    for (int64_t hd = 0; hd < heads_; ++hd) {
      const int64_t j = hd / (heads_ / g);  // the kv head of query head hd
      attend_one(q.data<float>() + (hd * n + i) * dh, kc + j * max_positions_ * dh, vc + j * max_positions_ * dh,
                 t0 + i + 1, dh, scale, scores_.data<float>(), att.data<float>() + i * heads_ * dh + hd * dh);
    }
  ops::gemm(att, false, b.c_proj_w, true, proj);
  ops::axpy(1.0f, proj, x);
  ops::rms_norm_forward(x, b.ln_2_w, h, Tensor(), eps_);
  Tensor gate = Tensor::empty({n, ffn}), up = Tensor::empty({n, ffn});
  ops::gemm(h, false, b.gate_w, true, gate);
  ops::gemm(h, false, b.up_w, true, up);
  ops::swiglu_forward(gate, up, gate);
  ops::gemm(gate, false, b.mlp_proj_w, true, proj);
  ops::axpy(1.0f, proj, x);
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
  // Grown as tokens come (no reservation: --tokens 1e10 must not ask for 40 GB up front); `all`
  // keeps only what a slide reads.
  std::vector<int32_t> all(context.begin(), context.end()), out;
  decoder.reset();
  const Tensor* logits = &decoder.prefill(all.size() > window ? std::span(all).last(window) : std::span(all));
  for (int64_t i = 0; i < n; ++i) {
    const int32_t token = pick_token(*logits, options, i);
    out.push_back(token);
    all.push_back(token);
    if (all.size() > 2 * window) all.erase(all.begin(), all.end() - static_cast<std::ptrdiff_t>(window));
    if (on_token) on_token(token);
    if (i + 1 == n) break;
    if (decoder.position() < decoder.max_positions()) {
      logits = &decoder.step(token);
    } else {  // slide: the cache over the last `window` tokens (nanoGPT's crop)
      decoder.reset();
      logits = &decoder.prefill(std::span(all).last(window));
    }
  }
  return out;
}

}  // namespace strata::layers
