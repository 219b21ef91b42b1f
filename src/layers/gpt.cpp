// GPT layers: embedding, transformer block, language-model head (causal self-attention:
// gpt_attention.cpp).
#include "layers/gpt.hpp"

#include <algorithm>
#include <cmath>

#include "core/rng.hpp"
#include "layers/gpt_shared.hpp"

namespace strata::layers {

using gpt_shared::append_specs;
using gpt_shared::require_sequence;
using gpt_shared::splitting;

namespace {

ParamSpec normal(std::string name, Shape shape, double std, bool no_weight_decay) {
  ParamSpec s{std::move(name), std::move(shape), Init::Normal};
  s.std = std;
  s.no_weight_decay = no_weight_decay;
  return s;
}

std::unique_ptr<Linear> gpt_linear(std::string name, int64_t in, int64_t out, double std,
                                   TensorParallelMode mode = TensorParallelMode::None,
                                   TensorParallelGroup* tp = nullptr) {
  auto l = std::make_unique<Linear>(std::move(name), in, out, true);
  l->set_gpt_init(std);
  l->set_tensor_parallel(mode, tp);
  return l;
}

// c_fc column-parallel, GELU on the local slice, c_proj row-parallel (Megatron's MLP: one
// all-reduce, after c_proj); the dropout after it sees replicated values (sequence-parallel:
// c_fc gathers the sequence, c_proj scatters it, the dropout sees this rank's part).
std::vector<LayerPtr> mlp_layers(int64_t embed, float dropout, double proj_std, TensorParallelGroup* tp,
                                 Activation activation) {
  std::vector<LayerPtr> layers;
  layers.push_back(gpt_linear("c_fc", embed, 4 * embed, kGptInitStd, TensorParallelMode::Column, tp));
  layers.push_back(std::make_unique<ActivationLayer>("gelu", activation));
  layers.push_back(gpt_linear("c_proj", 4 * embed, embed, proj_std, TensorParallelMode::Row, tp));
  if (dropout > 0) {
    auto drop = std::make_unique<Dropout>("dropout", dropout);
    drop->set_sequence_parallel(tp);
    layers.push_back(std::move(drop));
  }
  return layers;
}

}  // namespace

// ---- Embedding -------------------------------------------------------------------------------

Embedding::Embedding(std::string name, int64_t vocab, int64_t max_positions, int64_t embed, TensorParallelGroup* tp,
                     bool positions)
    : Layer(std::move(name)),
      vocab_(vocab),
      max_positions_(max_positions),
      embed_(embed),
      tp_(splitting(tp)),
      positions_(positions),
      local_vocab_(vocab),
      first_token_(0) {
  STRATA_REQUIRE(vocab > 0 && max_positions > 0 && embed > 0, "embedding sizes must be positive, found vocab ", vocab,
                 ", positions ", max_positions, ", width ", embed);
  if (tp_) {
    local_vocab_ = rows_per_piece(vocab, tp_->size());
    first_token_ = tp_->rank() * local_vocab_;
  }
}

std::string Embedding::describe() const {
  return detail::cat("embedding(vocab ", vocab_, positions_ ? ", positions " : ", rotary positions up to ",
                     max_positions_, ", ", embed_,
                     tp_ ? detail::cat(", vocabulary-parallel ", tp_->rank(), "/", tp_->size()) : "", ")");
}

Shape Embedding::output_shape(const Shape& input) const {
  STRATA_REQUIRE(input.size() == 1 && input[0] >= 1 && input[0] <= max_positions_, "layer ", name(), " (", describe(),
                 ") expects token sequences [T] with 1 <= T <= ", max_positions_, ", found ", shape_str(input));
  if (TensorParallelGroup* sp = sequence_parallel_group(tp_)) {
    STRATA_REQUIRE(input[0] % sp->size() == 0, "--sequence-parallel cuts each sequence into --tp ", sp->size(),
                   " parts: the sequences' ", input[0], " tokens must be divisible by it");
    return {input[0] / sp->size(), embed_};
  }
  return {input[0], embed_};
}

std::vector<ParamSpec> Embedding::param_specs() const {
  std::vector<ParamSpec> specs{normal(kTokenWeight, {local_vocab_, embed_}, kGptInitStd, true)};
  if (positions_) specs.push_back(normal("wpe/weight", {max_positions_, embed_}, kGptInitStd, true));
  if (tp_) specs[0].split = row_split(tp_->size(), tp_->rank(), vocab_);
  return specs;
}

void Embedding::bind(std::span<const Tensor> params, std::span<const Tensor> grads) {
  wte_ = params[0];
  dwte_ = grads[0];
  if (positions_) {
    wpe_ = params[1];
    dwpe_ = grads[1];
  }
}

// The position add, once per element of the output; with tp each shard counts its share, so the
// group's sum (MFU's numerator) counts it once.
int64_t Embedding::flops(const Shape& input) const {
  return positions_ ? shape_numel(input) * embed_ / (tp_ ? tp_->size() : 1) : 0;
}

Tensor Embedding::forward(const Tensor& x, Context& ctx, const StepInfo& info) {
  STRATA_REQUIRE(x.dtype() == DType::I32 && x.ndim() == 2, "layer ", name(), " expects i32 tokens (B, T), found ",
                 x.str());
  Tensor y = Tensor::empty({x.dim(0), x.dim(1), embed_}, wte_.dtype(), x.device());
  if (tp_) {
    // Each token's row is on one rank, the others add zeros, and wpe is added once (rank 0):
    // the sum is wte[token] + wpe[t] exactly, as without tp.
    ops::embedding_forward(x, wte_, tp_->rank() == 0 ? wpe_ : Tensor(), y, first_token_, vocab_);
    if (tp_->sequence_parallel())
      y = scatter_sequence(*tp_, y);  // each rank its positions' sums
    else
      tp_->all_reduce_sum(y);
  } else {
    ops::embedding_forward(x, wte_, wpe_, y);
  }
  if (info.mode == Mode::Train) ctx.saved = {x};
  return y;
}

std::vector<GradientPiece> Embedding::gradient_pieces(int64_t max_elements) const {
  const int64_t wte = local_vocab_ * embed_, wpe_at = align_param(wte), wpe = positions_ ? max_positions_ * embed_ : 0;
  if (tied_head_ || wte + wpe <= max_elements) return {};
  std::vector<GradientPiece> pieces;
  if (positions_) pieces.push_back({wpe_at, wpe_at + wpe});
  const int64_t block = std::max<int64_t>(max_elements / embed_, 1);
  for (int64_t hi = local_vocab_; hi > 0; hi -= block)
    pieces.push_back({std::max<int64_t>(hi - block, 0) * embed_, hi * embed_});
  return pieces;
}

Tensor Embedding::backward(const Tensor& dy_part, Context& ctx) {
  // With tp, dy is replicated (the all-reduce's backward is the identity): dwte gets this
  // rank's rows, dwpe the same sum on every rank.
  const Tensor& tokens = ctx.saved.at(0);
  // Sequence-parallel: every rank's rows take the gradients of all positions.
  const Tensor dy = tp_ && tp_->sequence_parallel() ? gather_sequence(*tp_, dy_part) : dy_part;
  if (gradient_sink() == nullptr) {
    ops::embedding_backward(tokens, dy, dwte_, dwpe_, first_token_);
  } else {
    for (const GradientPiece& p : gradient_pieces(gradient_piece_limit())) {
      const Tensor g = gradient_sink()->next_piece();
      const int64_t rows = (p.end - p.begin) / embed_;
      if (p.begin >= local_vocab_ * embed_)  // wpe
        ops::embedding_backward(tokens, dy, Tensor(), g.reshape({rows, embed_}), first_token_);
      else  // wte rows [r0, r0 + rows): the tokens from first_token_ + r0
        ops::embedding_backward(tokens, dy, g.reshape({rows, embed_}), Tensor(), first_token_ + p.begin / embed_);
      gradient_sink()->piece_written();
    }
  }
  ctx.clear();
  return Tensor();  // tokens have no gradient
}

// ---- TransformerBlock ------------------------------------------------------------------------

Recompute parse_recompute(const std::string& name) {
  if (name == "none") return Recompute::None;
  if (name == "block") return Recompute::Block;
  if (name == "full") return Recompute::Full;
  STRATA_THROW_INPUT("--recompute must be none, block or full, found '", name, "'");
}

namespace {

// Train mode: runs layer's forward, then keeps only its input (and the StepInfo that keys its
// dropout masks) in ctx; backward_recomputing rebuilds the rest. Eval: a plain forward.
Tensor forward_keeping_input(Layer& layer, const Tensor& x, Context& ctx, const StepInfo& info) {
  Tensor y = layer.forward(x, ctx, info);
  if (info.mode == Mode::Train) {
    ctx.clear();
    ctx.saved = {x};
    ctx.info = info;
  }
  return y;
}

// Re-runs the forward that forward_keeping_input ran (same input, same StepInfo: the same
// values and masks), then its backward. Consumes ctx.
Tensor backward_recomputing(Layer& layer, const Tensor& dy, Context& ctx) {
  const Tensor x = ctx.saved.at(0);
  const StepInfo info = ctx.info;
  Context rebuilt;
  layer.forward(x, rebuilt, info);  // the output is dropped: only the contexts are wanted
  rebuilt.input_grad = ctx.input_grad;
  ctx.clear();
  return layer.backward(dy, rebuilt);
}

}  // namespace

namespace {
// GPT-2's parts: LayerNorms (no weight decay), fused attention, the GELU MLP (exact or tanh).
BlockParts gpt_parts(int64_t embed, int64_t heads, float dropout, AttentionKind kind, double proj_std,
                     TensorParallelGroup* tp, Activation activation, float norm_eps) {
  auto ln_1 = std::make_unique<LayerNorm>("ln_1", embed, norm_eps);
  auto ln_2 = std::make_unique<LayerNorm>("ln_2", embed, norm_eps);
  for (LayerNorm* ln : {ln_1.get(), ln_2.get()}) {
    ln->set_no_weight_decay();
    ln->set_sequence_parallel(tp);
  }
  return {std::move(ln_1), std::make_unique<CausalSelfAttention>("attn", embed, heads, dropout, kind, proj_std, tp),
          std::move(ln_2),
          std::make_unique<Sequential>("mlp", mlp_layers(embed, dropout, proj_std, splitting(tp), activation))};
}
}  // namespace

TransformerBlock::TransformerBlock(std::string name, int64_t embed, int64_t heads, float dropout, AttentionKind kind,
                                   double proj_std, TensorParallelGroup* tp, Recompute recompute, Activation activation,
                                   float norm_eps)
    : TransformerBlock(std::move(name), gpt_parts(embed, heads, dropout, kind, proj_std, tp, activation, norm_eps),
                       recompute) {
  activation_ = activation;
}

TransformerBlock::TransformerBlock(std::string name, BlockParts parts, Recompute recompute)
    : Layer(std::move(name)),
      recompute_(recompute),
      ln_1_(std::move(parts.norm_1)),
      attn_(std::move(parts.attn)),
      ln_2_(std::move(parts.norm_2)),
      mlp_(std::move(parts.mlp)) {
  for (Layer* child : std::initializer_list<Layer*>{ln_1_.get(), attn_.get(), ln_2_.get(), mlp_.get()})
    gradients_.add(*child);
}

float TransformerBlock::ln_eps() const {
  const auto* ln = dynamic_cast<const LayerNorm*>(ln_1_.get());
  STRATA_CHECK(ln, "block ", name(), " has no LayerNorm (", ln_1_->describe(), ")");
  return ln->eps();
}

std::string TransformerBlock::describe() const {
  const char* recompute = recompute_ == Recompute::Block  ? ", recompute block"
                          : recompute_ == Recompute::Full ? ", recompute full"
                                                          : "";
  return "transformer_block(" + attn_->describe() + ", mlp " + mlp_->describe() + recompute + ")";
}

Shape TransformerBlock::output_shape(const Shape& input) const {
  const Shape h = attn_->output_shape(ln_1_->output_shape(input));
  return mlp_->output_shape(ln_2_->output_shape(h));
}

std::vector<ParamSpec> TransformerBlock::param_specs() const {
  std::vector<ParamSpec> specs;
  for (const Layer* child : std::initializer_list<const Layer*>{ln_1_.get(), attn_.get(), ln_2_.get(), mlp_.get()})
    append_specs(specs, child->name(), *child);
  return specs;
}

void TransformerBlock::bind(std::span<const Tensor> params, std::span<const Tensor> grads) {
  gradients_.bind(params, grads);
}

std::vector<GradientPiece> TransformerBlock::gradient_pieces(int64_t max_elements) const {
  return gradients_.pieces(max_elements);
}

int64_t TransformerBlock::flops(const Shape& input) const { return attn_->flops(input) + mlp_->flops(input); }

int64_t TransformerBlock::tp_all_reduced_elements(const Shape& input, bool recomputed) const {
  if (!attn_->tensor_parallel()) return 0;
  if (attn_->sequence_parallel() == 0)
    return (recomputed ? 6 : 4) * shape_numel(input) + attn_->kv_replica_elements(input);
  // Per region (attention, MLP) and whole sequence: forward an all-gather and a reduce-scatter,
  // backward two all-gathers (the input again, the output's gradient) and a reduce-scatter; each
  // moves half an all-reduce's bytes.
  const int64_t whole = shape_numel(input) * attn_->sequence_parallel();
  return (recomputed ? 7 : 5) * whole + attn_->kv_replica_elements(input);
}

void TransformerBlock::set_index(int index) {
  Layer::set_index(index);
  ln_1_->set_index(index * 1024 + 1);
  attn_->set_index(index * 1024 + 2);
  ln_2_->set_index(index * 1024 + 3);
  mlp_->set_index(index * 1024 + 4);
}

Tensor TransformerBlock::run(const Tensor& x, Context& ctx, const StepInfo& info, bool rebuild) {
  ctx.children.resize(4);
  std::vector<Context>& c = ctx.children;
  const bool full = recompute_ == Recompute::Full && info.mode == Mode::Train;
  const Tensor n1 = ln_1_->forward(x, c[0], info);
  const Tensor a = full ? forward_keeping_input(*attn_, n1, c[1], info) : attn_->forward(n1, c[1], info);
  Tensor h = Tensor::empty(x.shape(), x.dtype(), x.device());
  ops::add(x, a, h);
  const Tensor n2 = ln_2_->forward(h, c[2], info);
  if (rebuild && full) {  // the MLP's backward recomputes it from its input: no forward now
    c[3].saved = {n2};
    c[3].info = info;
    return Tensor();
  }
  const Tensor m = full ? forward_keeping_input(*mlp_, n2, c[3], info) : mlp_->forward(n2, c[3], info);
  if (rebuild) return Tensor();
  Tensor y = Tensor::empty(x.shape(), x.dtype(), x.device());
  ops::add(h, m, y);
  return y;
}

Tensor TransformerBlock::forward(const Tensor& x, Context& ctx, const StepInfo& info) {
  Tensor y = run(x, ctx, info, /*rebuild=*/false);
  if (recompute_ != Recompute::None && info.mode == Mode::Train) {  // backward rebuilds the rest from x
    ctx.clear();
    ctx.saved = {x};
    ctx.info = info;
  }
  return y;
}

Tensor TransformerBlock::backward(const Tensor& dy, Context& ctx) {
  if (recompute_ != Recompute::None) {
    // The same forward on the same input with the same StepInfo: bit-identical contexts.
    // ZeRO 3 binds this layer's parameters for all of its backward (ParameterGather).
    const Tensor x = ctx.saved.at(0);
    const StepInfo info = ctx.info;
    run(x, ctx, info, /*rebuild=*/true);
  }
  const bool full = recompute_ == Recompute::Full;
  std::vector<Context>& c = ctx.children;
  for (Context& child : c) child.input_grad = true;  // the residual paths need every branch's dx
  // Each child's backward through gradients_, which streams their gradients if this block does.
  const auto child = [&](Layer& layer, const Tensor& d, Context& cx, bool recompute) {
    return gradients_.backward(*this, layer,
                               [&] { return recompute ? backward_recomputing(layer, d, cx) : layer.backward(d, cx); });
  };
  const Tensor dm = child(*ln_2_, child(*mlp_, dy, c[3], full), c[2], false);
  Tensor dh = Tensor::empty(dy.shape(), dy.dtype(), dy.device());
  ops::add(dy, dm, dh);
  Tensor dx = child(*ln_1_, child(*attn_, dh, c[1], full), c[0], false);
  ops::axpy(1.0f, dh, dx);
  ctx.clear();
  return dx;
}

// ---- LMHead ----------------------------------------------------------------------------------

const Layer* LMHead::shares_parameters_with() const { return copy_ ? nullptr : tied_; }

const Layer& LMHead::weight_owner() const {
  STRATA_CHECK(tied_, "layer ", name(), " is not tied: it has its own weight");
  return *tied_;
}

Shape LMHead::weight_shape() const {
  STRATA_CHECK(tied_, "layer ", name(), " is not tied: it has its own weight");
  return {tied_->local_vocab(), tied_->embed()};
}

const Tensor& LMHead::owner_weight_grad() const {
  STRATA_CHECK(tied_, "layer ", name(), " is not tied: it has its own weight");
  return tied_->dwte();
}

void LMHead::use_copy(Tensor w, Tensor dw) {
  STRATA_CHECK(tied_, "layer ", name(), " is not tied: it has its own weight");
  STRATA_CHECK(w.shape() == Shape({local_vocab_, embed_}) && dw.shape() == w.shape(), "layer ", name(),
               ": a copy of shape ", shape_str(w.shape()), " does not fit ", describe());
  w_ = std::move(w);
  dw_ = std::move(dw);
  copy_ = true;
}

LMHead::LMHead(std::string name, int64_t embed, int64_t vocab, const Embedding* tie_to, TensorParallelGroup* tp)
    : Layer(std::move(name)), embed_(embed), vocab_(vocab), tp_(splitting(tp)), local_vocab_(vocab), tied_(tie_to) {
  if (tp_) local_vocab_ = rows_per_piece(vocab, tp_->size());
  if (tie_to)
    STRATA_CHECK(tie_to->embed() == embed && tie_to->vocab() == vocab && tie_to->tensor_parallel() == tp_,
                 "tied head (", embed, " -> ", vocab, tp_ ? ", tensor-parallel" : "", ") does not fit the embedding ",
                 tie_to->describe());
}

std::string LMHead::describe() const {
  return detail::cat("lm_head(", embed_, "->", vocab_, tied_ ? ", tied to wte" : "",
                     tp_ ? detail::cat(", vocabulary-parallel ", tp_->rank(), "/", tp_->size()) : "", ")");
}

Shape LMHead::output_shape(const Shape& input) const {
  STRATA_REQUIRE(!input.empty() && input.back() == embed_, "layer ", name(), " (", describe(),
                 ") expects input of shape [..., ", embed_, "], found ", shape_str(input));
  Shape out = input;
  out.back() = local_vocab_;
  if (const TensorParallelGroup* sp = sequence_parallel_group(tp_)) out.at(0) *= sp->size();  // the whole sequence
  return out;
}

std::vector<ParamSpec> LMHead::param_specs() const {
  if (tied_) return {};
  std::vector<ParamSpec> specs{normal("weight", {local_vocab_, embed_}, kGptInitStd, false)};
  if (tp_) specs[0].split = row_split(tp_->size(), tp_->rank(), vocab_);
  return specs;
}

void LMHead::bind(std::span<const Tensor> params, std::span<const Tensor> grads) {
  if (tied_) return;
  w_ = params[0];
  dw_ = grads[0];
}

std::vector<GradientPiece> LMHead::gradient_pieces(int64_t max_elements) const {
  return tied_ ? std::vector<GradientPiece>{} : linear_gradient_pieces(local_vocab_, embed_, false, max_elements);
}

const Tensor& LMHead::weight() const { return tied_ && !copy_ ? tied_->wte() : w_; }
const Tensor& LMHead::weight_grad() const { return tied_ && !copy_ ? tied_->dwte() : dw_; }

int64_t LMHead::real_columns() const { return tp_ ? real_rows(vocab_, tp_->size(), tp_->rank()) : local_vocab_; }

// The real tokens' logits only: the group's sum is the whole model's, padding or not.
// Sequence-parallel: of the whole sequence, which it gathers.
int64_t LMHead::flops(const Shape& input) const {
  const TensorParallelGroup* sp = sequence_parallel_group(tp_);
  return shape_numel(input) * (sp ? sp->size() : 1) * real_columns();
}

Tensor LMHead::forward(const Tensor& x_part, Context& ctx, const StepInfo& info) {
  const Tensor& w = weight();
  STRATA_CHECK(w.defined(), "layer ", name(), ": the ", tied_ ? "tied embedding's " : "", "weight is not bound");
  // Sequence-parallel: the logits of every position, from the gathered sequence; backward gathers
  // it again rather than keep it (as Linear's column-parallel maps do).
  TensorParallelGroup* sp = sequence_parallel_group(tp_);
  const Tensor x = sp ? gather_sequence(*sp, x_part) : x_part;
  const Tensor x2 = x.reshape({x.numel() / embed_, embed_});
  Tensor y = Tensor::empty({x2.dim(0), local_vocab_}, x.dtype(), x.device());
  ops::gemm(x2, false, w, true, y);  // (N, D) @ (V, D)^T: with tp, this rank's columns of the logits
  if (const int64_t real = real_columns(); real < local_vocab_) {
    if (!padding_mask_.defined() || padding_mask_.dtype() != y.dtype() || padding_mask_.device() != y.device()) {
      padding_mask_ = Tensor::empty({local_vocab_}, y.dtype(), y.device());
      if (!y.device().is_meta()) {
        const Tensor mask = Tensor::zeros({local_vocab_});
        std::fill(mask.data<float>() + real, mask.data<float>() + local_vocab_, -INFINITY);
        ops::copy(mask, padding_mask_);
      }
    }
    ops::add_bias(y, padding_mask_);
  }
  if (info.mode == Mode::Train) ctx.saved = {x_part};
  ctx.input_shape = x_part.shape();
  Shape out = x.shape();
  out.back() = local_vocab_;
  return y.reshape(out);
}

Tensor LMHead::backward(const Tensor& dy, Context& ctx) {
  TensorParallelGroup* sp = sequence_parallel_group(tp_);
  const Tensor x = sp ? gather_sequence(*sp, ctx.saved.at(0)) : ctx.saved.at(0);
  const Tensor x2 = x.reshape({x.numel() / embed_, embed_});
  const Tensor dy2 = dy.reshape({x2.dim(0), local_vocab_});
  if (gradient_sink() != nullptr) {
    write_linear_gradient_pieces(*gradient_sink(), gradient_pieces(gradient_piece_limit()), dy2, x2);
  } else {
    const Tensor& dw = weight_grad();
    STRATA_CHECK(dw.defined(), "layer ", name(), ": the ", tied_ ? "tied embedding's " : "", "gradient is not bound");
    ops::gemm(dy2, true, x2, false, dw, 1.0f, 1.0f);  // dW (V, D) += dy^T x
  }
  Tensor dx;
  if (ctx.input_grad) {
    dx = Tensor::empty(x2.shape(), x2.dtype(), x2.device());
    ops::gemm(dy2, false, weight(), false, dx);  // dx (N, D) = dy W
    // Every vocabulary slice's share of dx, summed (sequence-parallel: this rank's positions').
    if (sp)
      dx = scatter_sequence(*sp, dx.reshape(x.shape()));
    else if (tp_)
      tp_->all_reduce_sum(dx);
    dx = dx.reshape(ctx.input_shape);
  }
  ctx.clear();
  return dx;
}

}  // namespace strata::layers
