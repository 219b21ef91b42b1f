// The layers of a GPT-2-style language model (Radford et al. 2019; nanoGPT's layout and
// names): token + position embedding, pre-LayerNorm transformer blocks with causal
// self-attention and a GELU MLP, and the language-model head. Activations are (B, T, D);
// the model's input is i32 tokens (B, T). Parameter names mirror GPT-2's state dict without
// the "transformer." prefix: "wte/weight", "h3/attn/c_attn/weight", "ln_f/bias", "lm_head/weight".
//
// Init (GPT-2): Linear and embedding weights ~ N(0, 0.02^2), the residual projections
// (attn/c_proj, mlp/c_proj) ~ N(0, (0.02 / sqrt(2 * layers))^2), biases 0, LayerNorm 1 / 0.
// Parameter groups: biases, LayerNorm parameters and the embeddings take no weight decay.
//
// Tensor parallelism (Megatron-LM; a TensorParallelGroup of T ranks, null or T = 1: the whole
// model): the attention's c_attn is column-parallel with whole heads per rank (H/T) and c_proj
// row-parallel, likewise the MLP's c_fc and c_proj; the embedding and the head are
// vocabulary-parallel (V/T rows of wte each). LayerNorms, the residual dropouts and the biases
// after row-parallel layers are replicated: the same values and masks on every rank.
#pragma once

#include "core/ops.hpp"
#include "layers/basic.hpp"
#include "layers/composite.hpp"

namespace strata::layers {

constexpr double kGptInitStd = 0.02;

// tokens i32 (B, T) -> wte[token] + wpe[t] (B, T, D); per-sample shape {T} -> {T, D}, T <= Tmax.
// Parameters "wte/weight" (V, D) and "wpe/weight" (Tmax, D), named at model level
// (param_prefix() is empty). No input gradient (tokens are not differentiable).
// Vocabulary-parallel (tp): rank r holds wte rows [r P, (r+1) P), P = ceil(V / T), and wpe whole;
// it looks up the tokens it holds (zero for the others; wpe added on rank 0 only) and the
// ranks' outputs are all-reduced. Backward is local: dwte for its rows, dwpe on every rank (the
// same values). When T does not divide V the last ranks' rows past V are padding (Megatron's
// padded vocabulary): zero, never looked up, and not in the checkpoint (layers::row_split).
class Embedding final : public Layer {
 public:
  // vocab is the full vocabulary (any size: with tp, padded to whole pieces).
  // positions false: no wpe (a model with rotary positions, Llama); T is still at most max_positions.
  Embedding(std::string name, int64_t vocab, int64_t max_positions, int64_t embed, TensorParallelGroup* tp = nullptr,
            bool positions = true);
  std::string describe() const override;
  std::string param_prefix() const override { return ""; }
  Shape output_shape(const Shape& input) const override;
  std::vector<ParamSpec> param_specs() const override;
  void bind(std::span<const Tensor> params, std::span<const Tensor> grads) override;
  Tensor forward(const Tensor& x, Context& ctx, const StepInfo& info) override;
  Tensor backward(const Tensor& dy, Context& ctx) override;
  int64_t flops(const Shape& input) const override;
  bool takes_token_ids() const override { return true; }
  // wpe whole, then wte in blocks of whole rows from the last down (each block's backward picks
  // the tokens its rows hold); none when tied.
  std::vector<GradientPiece> gradient_pieces(int64_t max_elements) const override;
  // A tied LM head accumulates into wte's gradient too (directly, or TiedEmbedding adds its
  // copy's): the gradient is then written whole, never streamed.
  void set_tied_head() { tied_head_ = true; }

  int64_t vocab() const { return vocab_; }  // the full vocabulary
  int64_t embed() const { return embed_; }
  int64_t max_positions() const { return max_positions_; }
  bool has_position_table() const { return positions_; }  // wpe
  // The rows of wte this rank holds (V/T) and the token of the first; V and 0 without tp.
  int64_t local_vocab() const { return local_vocab_; }
  int64_t first_token() const { return first_token_; }
  TensorParallelGroup* tensor_parallel() const { return tp_; }
  // The token embedding's parameter name, model-level.
  static constexpr const char* kTokenWeight = "wte/weight";
  // The token embedding (this rank's rows) and its gradient as bound now (the tied LMHead
  // reads these).
  const Tensor& wte() const { return wte_; }
  const Tensor& dwte() const { return dwte_; }

 private:
  int64_t vocab_, max_positions_, embed_;
  TensorParallelGroup* tp_;
  bool positions_;
  int64_t local_vocab_, first_token_;
  Tensor wte_, wpe_, dwte_, dwpe_;
  bool tied_head_ = false;
};

enum class AttentionKind { Flash, Plain };

// What distinguishes the Llama family's attention from GPT-2's (defaults: GPT-2's).
struct AttentionOptions {
  // Key/value heads (0: as many as query heads). Fewer: grouped-query attention, query head h
  // reading kv head h / (heads / kv_heads) as Hugging Face's repeat_interleave does; 1: multi-query.
  int64_t kv_heads = 0;
  // Rotary position embedding of q and k (ops::rope, rotate-half layout), Dh/2 frequencies
  // (rope_frequencies in llama.hpp); empty: none (GPT-2's learned positions).
  std::vector<float> rope;
  // true (GPT-2): one fused c_attn (q | k | v, with biases) and c_proj. false (Llama): q_proj,
  // k_proj, v_proj and o_proj without biases, as Hugging Face names them: with grouped-query
  // attention the q and kv blocks differ in size, so a fused weight could not be cut into
  // TensorSplit's equal segments; separate maps also make checkpoint interop a name map.
  bool fused = true;
};

// Causal multi-head self-attention on (B, T, D): c_attn (D -> 3D, bias), split into heads,
// scaled dot-product attention with a causal mask (memory-efficient by default, or the plain
// one materialising the probabilities), dropout p on the attention probabilities inside the
// op, heads merged, c_proj (D -> D, bias), dropout p (the residual dropout). Both dropouts
// are keyed as Dropout's (seed, step, layer index, global sample): the attention's by this
// layer's index, the residual one by its child's. With tp, c_attn is column-parallel (q, k and
// v each split: rank r computes heads [r H/T, (r+1) H/T)), c_proj row-parallel; the attention
// mask is keyed by the global head index, so it does not depend on T.
//
// Grouped-query attention with tp (AttentionOptions): q_proj, k_proj and v_proj are
// column-parallel with whole heads per rank, their input gradients joined by one all-reduce.
// When tp exceeds the kv heads, each kv head is held by tp / kv_heads consecutive ranks
// (replicated, as Megatron does): each replica's k and v gradients are partial (its query heads'
// share), so backward sums them over the replicas (one all-reduce of the kv heads' gradients,
// each rank contributing its own head) before k_proj and v_proj take their weight gradients.
class CausalSelfAttention final : public Layer {
 public:
  // heads must be divisible by tp->size() (an Input error otherwise), and by options.kv_heads;
  // with tp, kv_heads must be divisible by tp->size() or divide it.
  CausalSelfAttention(std::string name, int64_t embed, int64_t heads, float dropout = 0.0f,
                      AttentionKind kind = AttentionKind::Flash, double proj_std = kGptInitStd,
                      TensorParallelGroup* tp = nullptr, AttentionOptions options = {});
  std::string describe() const override;
  Shape output_shape(const Shape& input) const override;
  std::vector<ParamSpec> param_specs() const override;
  void bind(std::span<const Tensor> params, std::span<const Tensor> grads) override;
  Tensor forward(const Tensor& x, Context& ctx, const StepInfo& info) override;
  Tensor backward(const Tensor& dy, Context& ctx) override;
  int64_t flops(const Shape& input) const override;
  void set_index(int index) override;
  std::vector<GradientPiece> gradient_pieces(int64_t max_elements) const override;  // ChildGradients
  int64_t heads() const { return heads_; }                                          // all of the layer's heads
  int64_t kv_heads() const { return kv_heads_; }
  const std::vector<float>& rope() const { return rope_; }  // empty: no rotary positions
  // Backward's all-reduce of replicated kv heads' gradients, per sample of `input` (0 unless tp
  // exceeds the kv heads): k and v of every kv head over the sequence.
  int64_t kv_replica_elements(const Shape& input) const;
  bool tensor_parallel() const { return tp_ != nullptr; }
  // The parts each sequence is cut into (sequence parallelism), or 0.
  int sequence_parallel() const { return tp_ && tp_->sequence_parallel() ? tp_->size() : 0; }

 private:
  ops::DropoutKey key(const StepInfo& info) const;
  // Separate projections (!fused): k and v's gradients (B, local kv heads, T, Dh) summed over the
  // ranks holding the same kv head (kv_replicas_ > 1), in place.
  void sum_kv_replicas(const Tensor& dk, const Tensor& dv) const;
  // The whole sequence's length for a per-sample input (this rank's part when sequence-parallel).
  int64_t sequence_length(const Shape& input) const;
  int64_t embed_, heads_, kv_heads_;
  TensorParallelGroup* tp_;
  int64_t local_heads_, first_head_, local_kv_heads_;  // the heads this rank computes
  int kv_replicas_ = 1;                                // ranks holding each of its kv heads
  float p_;
  AttentionKind kind_;
  std::vector<float> rope_;
  // Fused: {c_attn}; else {q_proj, k_proj, v_proj}.
  std::vector<std::unique_ptr<Linear>> in_proj_;
  Linear c_proj_;  // "c_proj", or "o_proj"
  Dropout resid_drop_;
  ChildGradients gradients_;
};

// Activation recomputation (--recompute), per TransformerBlock, in Train mode:
// None:  every child keeps what its backward needs (the default).
// Block: the block keeps only its input x; backward re-runs the block's forward with the same
//        StepInfo (so the dropout masks, keyed by (seed, step, layer, sample), replay exactly)
//        to rebuild the children's contexts, then backpropagates as with None.
// Full:  Block, and inside the block the attention and the MLP each keep only their input
//        (the LayerNorms' outputs) and re-run their own forward just before their backward; the
//        rebuild skips the MLP's forward (its output is not needed to rebuild anything).
// Same ops on the same inputs in the same order: results are bit-identical to None.
enum class Recompute { None, Block, Full };
// "none" | "block" | "full"; anything else is an Input error.
Recompute parse_recompute(const std::string& name);

// Pre-LayerNorm block: h = x + attn(ln_1(x)), y = h + mlp(ln_2(h)), the MLP being c_fc
// (D -> 4D), GELU (exact, or its tanh approximation: `activation`), c_proj (4D -> D), dropout;
// both LayerNorms with epsilon `norm_eps`. Children "ln_1", "attn", "ln_2", "mlp", so
// parameters are "<block>/attn/c_attn/weight", "<block>/mlp/c_fc/bias", ... proj_std is the
// init std of the two residual projections (attn/c_proj, mlp/c_proj). With tp: the attention
// as above, c_fc column-parallel and c_proj row-parallel; LayerNorms and dropouts replicated.
// recompute: see Recompute (with tp, a recomputed forward re-issues its all-reduces, the same on
// every tp rank).
//
// The same block with other parts (Llama's: RMSNorms, rotary grouped-query attention and a
// SwiGLU MLP) is built from BlockParts; the children keep their own names.
struct BlockParts {
  LayerPtr norm_1;
  std::unique_ptr<CausalSelfAttention> attn;
  LayerPtr norm_2;
  LayerPtr mlp;
};
class TransformerBlock final : public Layer {
 public:
  TransformerBlock(std::string name, int64_t embed, int64_t heads, float dropout = 0.0f,
                   AttentionKind kind = AttentionKind::Flash, double proj_std = kGptInitStd,
                   TensorParallelGroup* tp = nullptr, Recompute recompute = Recompute::None,
                   Activation activation = Activation::GELU, float norm_eps = 1e-5f);
  TransformerBlock(std::string name, BlockParts parts, Recompute recompute = Recompute::None);
  std::string describe() const override;
  Shape output_shape(const Shape& input) const override;
  std::vector<ParamSpec> param_specs() const override;
  void bind(std::span<const Tensor> params, std::span<const Tensor> grads) override;
  Tensor forward(const Tensor& x, Context& ctx, const StepInfo& info) override;
  Tensor backward(const Tensor& dy, Context& ctx) override;
  int64_t flops(const Shape& input) const override;
  void set_index(int index) override;
  std::vector<GradientPiece> gradient_pieces(int64_t max_elements) const override;  // ChildGradients
  // With tp: the attention's and the MLP's outputs in forward and their inputs' gradients in
  // backward (4 all-reduces of the input's size, 6 when the forward runs again), and replicated kv
  // heads' gradients in backward. Sequence-parallel: all-gathers and reduce-scatters instead,
  // counted as the all-reduces of equal bytes (5 of the whole sequence's size, 7 with the
  // forward again: the backward gathers each region's input once more).
  int64_t tp_all_reduced_elements(const Shape& input, bool recomputed) const override;
  int64_t heads() const { return attn_->heads(); }
  float ln_eps() const;                                  // both LayerNorms' (GPT-2's block)
  Activation activation() const { return activation_; }  // the MLP's (GPT-2's block)
  Recompute recompute() const { return recompute_; }
  const Layer& norm_1() const { return *ln_1_; }  // the first normalisation (LayerNorm or RMSNorm)
  const CausalSelfAttention& attention() const { return *attn_; }

 private:
  // The block's forward into ctx.children. rebuild: backward's recomputation, which needs the
  // children's contexts but not y (returns an undefined tensor).
  Tensor run(const Tensor& x, Context& ctx, const StepInfo& info, bool rebuild);
  Recompute recompute_;
  Activation activation_ = Activation::GELU;
  LayerPtr ln_1_;
  std::unique_ptr<CausalSelfAttention> attn_;
  LayerPtr ln_2_;
  LayerPtr mlp_;
  ChildGradients gradients_;
};

// logits (B, T, V) = h (B, T, D) @ W^T, W (V, D), no bias. Untied: its own "weight" (the
// model names it "lm_head/weight"), N(0, 0.02^2), with weight decay. Tied (tie_to given): no
// parameters of its own; it uses the Embedding's wte as bound at the time it runs and
// accumulates into that Embedding's gradient view, so the two uses of wte add up in one
// buffer (no decay: an embedding). Where the two layers cannot share views (different pipeline
// stages; ZeRO 2/3, which rebind the Embedding's views bucket by bucket / layer by layer),
// parallel::TiedEmbedding gives the head a copy of wte and of its gradient (use_copy) and keeps
// the two in step.
// Vocabulary-parallel (tp): the weight is this rank's P = ceil(V / T) rows (its own, split along
// dim 0, or the tied embedding's rows: the same tokens), the output its slice of the logits
// (B, T, P), columns [r P, (r+1) P) (SoftmaxCrossEntropy with the same group takes them);
// backward all-reduces dx. A padding row's logit is -inf: softmax gives it probability 0, so
// its gradient is 0 and the loss, the argmax and sampling are those of the V real tokens.
class LMHead final : public Layer, public TiedWeight {
 public:
  // vocab is the full vocabulary; a tied head must have the embedding's group.
  LMHead(std::string name, int64_t embed, int64_t vocab, const Embedding* tie_to = nullptr,
         TensorParallelGroup* tp = nullptr);
  std::string describe() const override;
  Shape output_shape(const Shape& input) const override;
  std::vector<ParamSpec> param_specs() const override;
  void bind(std::span<const Tensor> params, std::span<const Tensor> grads) override;
  Tensor forward(const Tensor& x, Context& ctx, const StepInfo& info) override;
  Tensor backward(const Tensor& dy, Context& ctx) override;
  int64_t flops(const Shape& input) const override;
  // Untied: linear_gradient_pieces. Tied: none (it accumulates into the embedding's gradient).
  std::vector<GradientPiece> gradient_pieces(int64_t max_elements) const override;
  bool tied() const { return tied_ != nullptr; }
  const Embedding* tied_to() const { return tied_; }
  // Tied: itself, the Embedding's wte/weight (local_vocab() x D); untied: null.
  TiedWeight* tied_weight() override { return tied_ ? this : nullptr; }
  const Layer& weight_owner() const override;
  std::string weight_name() const override { return Embedding::kTokenWeight; }
  Shape weight_shape() const override;
  const Tensor& owner_weight_grad() const override;
  // A tied head from now on reads `w` and accumulates into `dw` (both local_vocab() x D)
  // instead of the Embedding's views; it then shares nothing.
  void use_copy(Tensor w, Tensor dw) override;
  bool uses_copy() const { return copy_; }
  const Layer* shares_parameters_with() const override;
  int64_t vocab() const { return vocab_; }              // the full vocabulary
  int64_t local_vocab() const { return local_vocab_; }  // the logits this rank outputs

 private:
  const Tensor& weight() const;
  const Tensor& weight_grad() const;
  int64_t real_columns() const;  // this rank's logits of real tokens (the rest are padding)
  int64_t embed_, vocab_;
  TensorParallelGroup* tp_;
  int64_t local_vocab_;
  const Embedding* tied_;
  bool copy_ = false;
  Tensor w_, dw_;
  Tensor padding_mask_;  // 0 per real token, -inf per padding row, in the logits' dtype and device
};

}  // namespace strata::layers
