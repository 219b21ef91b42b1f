// The layers of a GPT-2-style language model (Radford et al. 2019; nanoGPT's layout and
// names): token + position embedding, pre-LayerNorm transformer blocks with causal
// self-attention and a GELU MLP, and the language-model head. Activations are (B, T, D);
// the model's input is i32 tokens (B, T). Parameter names mirror GPT-2's state dict without
// the "transformer." prefix: "wte/weight", "h3/attn/c_attn/weight", "ln_f/bias", "lm_head/weight".
//
// Init (GPT-2): Linear and embedding weights ~ N(0, 0.02^2), the residual projections
// (attn/c_proj, mlp/c_proj) ~ N(0, (0.02 / sqrt(2 * layers))^2), biases 0, LayerNorm 1 / 0.
// Parameter groups: biases, LayerNorm parameters and the embeddings take no weight decay.
#pragma once

#include "core/ops.hpp"
#include "layers/basic.hpp"
#include "layers/composite.hpp"

namespace strata::layers {

constexpr double kGptInitStd = 0.02;

// tokens i32 (B, T) -> wte[token] + wpe[t] (B, T, D); per-sample shape {T} -> {T, D}, T <= Tmax.
// Parameters "wte/weight" (V, D) and "wpe/weight" (Tmax, D), named at model level
// (param_prefix() is empty). No input gradient (tokens are not differentiable).
class Embedding final : public Layer {
 public:
  Embedding(std::string name, int64_t vocab, int64_t max_positions, int64_t embed);
  std::string describe() const override;
  std::string param_prefix() const override { return ""; }
  Shape output_shape(const Shape& input) const override;
  std::vector<ParamSpec> param_specs() const override;
  void bind(std::span<const Tensor> params, std::span<const Tensor> grads) override;
  Tensor forward(const Tensor& x, Context& ctx, const StepInfo& info) override;
  Tensor backward(const Tensor& dy, Context& ctx) override;
  int64_t flops(const Shape& input) const override;

  int64_t vocab() const { return vocab_; }
  int64_t embed() const { return embed_; }
  // The token embedding and its gradient as bound now (the tied LMHead reads these).
  const Tensor& wte() const { return wte_; }
  const Tensor& dwte() const { return dwte_; }

 private:
  int64_t vocab_, max_positions_, embed_;
  Tensor wte_, wpe_, dwte_, dwpe_;
};

enum class AttentionKind { Flash, Plain };

// Causal multi-head self-attention on (B, T, D): c_attn (D -> 3D, bias), split into heads,
// scaled dot-product attention with a causal mask (memory-efficient by default, or the plain
// one materialising the probabilities), dropout p on the attention probabilities inside the
// op, heads merged, c_proj (D -> D, bias), dropout p (the residual dropout). Both dropouts
// are keyed as Dropout's (seed, step, layer index, global sample): the attention's by this
// layer's index, the residual one by its child's.
class CausalSelfAttention final : public Layer {
 public:
  CausalSelfAttention(std::string name, int64_t embed, int64_t heads, float dropout = 0.0f,
                      AttentionKind kind = AttentionKind::Flash, double proj_std = kGptInitStd);
  std::string describe() const override;
  Shape output_shape(const Shape& input) const override;
  std::vector<ParamSpec> param_specs() const override;
  void bind(std::span<const Tensor> params, std::span<const Tensor> grads) override;
  Tensor forward(const Tensor& x, Context& ctx, const StepInfo& info) override;
  Tensor backward(const Tensor& dy, Context& ctx) override;
  int64_t flops(const Shape& input) const override;
  void set_index(int index) override;
  int64_t heads() const { return heads_; }

 private:
  ops::DropoutKey key(const StepInfo& info) const;
  int64_t embed_, heads_;
  float p_;
  AttentionKind kind_;
  Linear c_attn_, c_proj_;
  Dropout resid_drop_;
};

// Pre-LayerNorm block: h = x + attn(ln_1(x)), y = h + mlp(ln_2(h)), the MLP being c_fc
// (D -> 4D), exact GELU, c_proj (4D -> D), dropout. Children "ln_1", "attn", "ln_2", "mlp", so
// parameters are "<block>/attn/c_attn/weight", "<block>/mlp/c_fc/bias", ... proj_std is the
// init std of the two residual projections (attn/c_proj, mlp/c_proj).
class TransformerBlock final : public Layer {
 public:
  TransformerBlock(std::string name, int64_t embed, int64_t heads, float dropout = 0.0f,
                   AttentionKind kind = AttentionKind::Flash, double proj_std = kGptInitStd);
  std::string describe() const override;
  Shape output_shape(const Shape& input) const override;
  std::vector<ParamSpec> param_specs() const override;
  void bind(std::span<const Tensor> params, std::span<const Tensor> grads) override;
  Tensor forward(const Tensor& x, Context& ctx, const StepInfo& info) override;
  Tensor backward(const Tensor& dy, Context& ctx) override;
  int64_t flops(const Shape& input) const override;
  void set_index(int index) override;
  int64_t heads() const { return attn_.heads(); }
  float ln_eps() const { return ln_1_.eps(); }  // both LayerNorms'

 private:
  LayerNorm ln_1_;
  CausalSelfAttention attn_;
  LayerNorm ln_2_;
  Sequential mlp_;
};

// logits (B, T, V) = h (B, T, D) @ W^T, W (V, D), no bias. Untied: its own "weight" (the
// model names it "lm_head/weight"), N(0, 0.02^2), with weight decay. Tied (tie_to given): no
// parameters of its own; it uses the Embedding's wte as bound at the time it runs and
// accumulates into that Embedding's gradient view, so the two uses of wte add up in one
// buffer (no decay: an embedding). Where the two layers cannot share views (different pipeline
// stages; ZeRO 2/3, which rebind the Embedding's views bucket by bucket / layer by layer),
// parallel::TiedEmbedding gives the head a copy of wte and of its gradient (use_copy) and keeps
// the two in step.
class LMHead final : public Layer {
 public:
  LMHead(std::string name, int64_t embed, int64_t vocab, const Embedding* tie_to = nullptr);
  std::string describe() const override;
  Shape output_shape(const Shape& input) const override;
  std::vector<ParamSpec> param_specs() const override;
  void bind(std::span<const Tensor> params, std::span<const Tensor> grads) override;
  Tensor forward(const Tensor& x, Context& ctx, const StepInfo& info) override;
  Tensor backward(const Tensor& dy, Context& ctx) override;
  int64_t flops(const Shape& input) const override;
  bool tied() const { return tied_ != nullptr; }
  const Embedding* tied_to() const { return tied_; }
  // A tied head from now on reads `w` and accumulates into `dw` (both V x D) instead of the
  // Embedding's views; it then shares nothing.
  void use_copy(Tensor w, Tensor dw);
  bool uses_copy() const { return copy_; }
  const Layer* shares_parameters_with() const override;

 private:
  const Tensor& weight() const;
  const Tensor& weight_grad() const;
  int64_t embed_, vocab_;
  const Embedding* tied_;
  bool copy_ = false;
  Tensor w_, dw_;
};

}  // namespace strata::layers
