// Incremental inference for the GPT and Llama models (zoo.hpp's "gpt", "llama" and their presets):
// a decoder that runs one new
// position at a time through the trained layers' parameters, keeping every block's keys and
// values in a cache, so a token costs O(context) attention work instead of a forward over the
// whole sequence. Training is untouched: the decoder reads the parameter views of a
// ParameterStore over the whole model (the memory the layers are bound to) and calls the same
// ops (gemm + add_bias for the Linear maps, layer_norm_forward, gelu_forward, embedding_forward
// for one position); attention of one query over the cached keys is a small CPU loop here.
// Its logits equal the full forward's (Mode::Eval) at every position, to rounding.
//
// Several positions at once (a prompt, a slid window) go through prefill(): the same path with
// n rows, so its matrix products are gemms of n rows rather than n products of one row.
//
// Llama's blocks: RMSNorm, q/k/v projections with rotary positions (ops::rope at the cache
// position), a cache of the kv heads only (grouped-query: query head h reads kv head h / (H/G)),
// SwiGLU (ops::swiglu_forward).
//
// Context longer than the model's positions (seq_len, wpe's rows): generate() slides the
// window like nanoGPT's crop, recomputing the cache over the last seq_len tokens (one prefill)
// for each new token, so the logits stay those of a full forward over the last seq_len tokens
// (such a token costs a forward over seq_len positions, not one).
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <vector>

#include "core/tensor.hpp"
#include "layers/model.hpp"
#include "layers/parameter_store.hpp"

namespace strata::layers {

class GptDecoder {
 public:
  // `model` built by build_model for a gpt (or a preset), `store` over all of its layers with
  // unsharded f32 parameters on the CPU (an internal error otherwise). Both must outlive the
  // decoder; the decoder reads the store's values as they are when prefill() runs.
  GptDecoder(const Model& model, const ParameterStore& store);

  int64_t layers() const { return layers_; }
  int64_t heads() const { return heads_; }
  int64_t embed() const { return embed_; }
  int64_t vocab() const { return vocab_; }
  int64_t max_positions() const { return max_positions_; }
  // Positions in the cache (where the next token goes).
  int64_t position() const { return position_; }
  // Empties the cache.
  void reset() { position_ = 0; }

  // Runs `tokens` (at least one) at positions position() .. position() + n - 1, appends their
  // keys and values to the cache and returns the logits (V, f32) of the last of them: a view
  // valid until the next call. Input error when they do not fit in the cache (position() + n >
  // max_positions()) or a token is outside [0, vocab).
  const Tensor& prefill(std::span<const int32_t> tokens);
  // prefill() of one token.
  const Tensor& step(int32_t token) { return prefill(std::span<const int32_t>(&token, 1)); }

 private:
  struct Block {
    Tensor ln_1_w, ln_1_b, c_attn_w, c_attn_b, c_proj_w, c_proj_b;
    Tensor ln_2_w, ln_2_b, c_fc_w, c_fc_b, mlp_proj_w, mlp_proj_b;
    Tensor q_w, k_w, v_w, gate_w, up_w;  // Llama: ln_*_w are the RMSNorms', c_proj_w o_proj, mlp_proj_w down_proj
  };
  // Llama's block: RMSNorm (no biases), rotary grouped-query attention, SwiGLU.
  void llama_block(const Block& b, int64_t l, Tensor& x, int64_t n);
  int64_t layers_ = 0, heads_ = 0, kv_heads_ = 0, embed_ = 0, vocab_ = 0, max_positions_ = 0, position_ = 0;
  bool llama_ = false;
  std::vector<float> rope_;
  float eps_ = 1e-5f;
  bool tanh_gelu_ = false;  // the blocks' MLP activation: GELU's tanh approximation, else exact
  Tensor wte_, wpe_, ln_f_w_, ln_f_b_, head_w_;
  std::vector<Block> blocks_;
  Tensor k_cache_, v_cache_;  // (layers, kv heads, max_positions, head dim)
  Tensor scores_, logits_, logits_view_;
};

// How the next token is chosen from a position's logits.
struct SampleOptions {
  float temperature = 1.0f;  // 0: greedy (argmax, the lowest id on ties)
  int64_t top_k = 0;         // only the k most likely tokens (ties: lower ids first); 0: all
  uint64_t seed = 0;
  int64_t vocab_limit = 0;  // only ids below this (a tokenizer's vocabulary in padded logits); 0: all
};

// The token for `logits` (V, f32): argmax when temperature is 0, else a draw from
// softmax(logits / temperature) over the top_k tokens, whose uniform number is the
// index-th of the Philox stream rng::derive_key(seed, rng::kSample): deterministic for a seed.
int32_t pick_token(const Tensor& logits, const SampleOptions& options, int64_t index);

// Continues `context` (at least one token) by n tokens, calling on_token (if given) for each as
// soon as it is chosen, and returns the n tokens. Context beyond the decoder's positions is
// cropped to the last max_positions() tokens; see the header comment for the sliding window.
std::vector<int32_t> generate(GptDecoder& decoder, std::span<const int32_t> context, int64_t n,
                              const SampleOptions& options, const std::function<void(int32_t)>& on_token = {});

}  // namespace strata::layers
