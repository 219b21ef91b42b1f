// The layers the Llama family adds to the GPT machinery (Touvron et al. 2023; Llama 3, Grattafiori
// et al. 2024; Hugging Face transformers' LlamaModel as the reference): RMSNorm, rotary position
// embeddings' frequencies (with Llama 3.1's scaling) and the SwiGLU MLP. The attention is
// gpt.hpp's CausalSelfAttention with AttentionOptions (grouped-query, rotary, q/k/v/o_proj
// without biases), the block gpt.hpp's TransformerBlock built from these parts (build_llama in
// zoo.cpp).
//
// Parameter names follow Hugging Face's state dict without "model.": "layers.3/self_attn/q_proj/
// weight", "layers.3/mlp/gate_proj/weight", "layers.3/input_layernorm/weight", "norm/weight",
// "lm_head/weight" ('/' for '.'; the token embedding is "wte/weight", HF's "embed_tokens").
//
// Rotary convention: rotate-half (transformers' rotate_half; Hugging Face's checkpoints have q_proj
// and k_proj rows permuted for it), so pair i of a head is (i, i + Dh/2), not (2i, 2i + 1) as in
// Meta's original code: importing an HF checkpoint is a name map, without permuting rows.
#pragma once

#include "layers/basic.hpp"
#include "layers/composite.hpp"

namespace strata::layers {

// Llama 3.1's scaling of the rotary frequencies for long contexts (transformers'
// rope_type "llama3"): wavelengths longer than original_context / low_freq_factor are divided by
// `factor`, shorter than original_context / high_freq_factor kept, and those between blended.
struct RopeScaling {
  double factor = 8.0, low_freq_factor = 1.0, high_freq_factor = 4.0;
  int64_t original_context = 8192;
};

// The Dh/2 rotary frequencies theta^(-2i/Dh) (computed in f32 as transformers does), scaled when
// `scaling` is given (Llama 3.1 and later).
std::vector<float> rope_frequencies(int64_t head_dim, double theta, const RopeScaling* scaling = nullptr);

// y = x / sqrt(mean(x^2) + eps) * weight over the last dimension; "weight" starts at 1 and takes
// no weight decay. Replicated under tensor parallelism (like GPT's LayerNorms).
class RMSNorm final : public Layer {
 public:
  RMSNorm(std::string name, int64_t features, float eps);
  std::string describe() const override;
  Shape output_shape(const Shape& input) const override;
  std::vector<ParamSpec> param_specs() const override;
  void bind(std::span<const Tensor> params, std::span<const Tensor> grads) override;
  Tensor forward(const Tensor& x, Context& ctx, const StepInfo& info) override;
  Tensor backward(const Tensor& dy, Context& ctx) override;
  float eps() const { return eps_; }
  // As LayerNorm's: on this rank's part of the sequence, the weight's gradient summed over `tp`.
  void set_sequence_parallel(TensorParallelGroup* tp) { sp_ = sequence_parallel_group(tp); }

 private:
  int64_t features_;
  float eps_;
  TensorParallelGroup* sp_ = nullptr;
  Tensor gamma_, dgamma_;
};

// Llama's MLP on (B, T, D): down_proj(silu(gate_proj(x)) * up_proj(x)), hidden F, no biases.
// With tp (Megatron's MLP): gate_proj and up_proj column-parallel (F/T each; their input
// gradients joined by one all-reduce), down_proj row-parallel (one all-reduce forward).
class SwiGLU final : public Layer {
 public:
  // hidden must be divisible by tp->size() (an Input error otherwise).
  SwiGLU(std::string name, int64_t embed, int64_t hidden, double proj_std, TensorParallelGroup* tp = nullptr);
  std::string describe() const override;
  Shape output_shape(const Shape& input) const override;
  std::vector<ParamSpec> param_specs() const override;
  void bind(std::span<const Tensor> params, std::span<const Tensor> grads) override;
  Tensor forward(const Tensor& x, Context& ctx, const StepInfo& info) override;
  Tensor backward(const Tensor& dy, Context& ctx) override;
  int64_t flops(const Shape& input) const override;
  std::vector<GradientPiece> gradient_pieces(int64_t max_elements) const override;  // ChildGradients

 private:
  int64_t embed_, hidden_;
  TensorParallelGroup* tp_;
  Linear gate_, up_, down_;
  ChildGradients gradients_;
};

}  // namespace strata::layers
