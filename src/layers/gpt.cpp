// GPT layers: embedding, causal self-attention, transformer block, language-model head.
#include "layers/gpt.hpp"

#include "core/rng.hpp"

namespace strata::layers {

namespace {

ParamSpec normal(std::string name, Shape shape, double std, bool no_weight_decay) {
  ParamSpec s{std::move(name), std::move(shape), Init::Normal};
  s.std = std;
  s.no_weight_decay = no_weight_decay;
  return s;
}

// The specs of `child`, named "<prefix>/<name>".
void append_specs(std::vector<ParamSpec>& specs, const std::string& prefix, const Layer& child) {
  for (ParamSpec s : child.param_specs()) {
    s.name = prefix + "/" + s.name;
    specs.push_back(std::move(s));
  }
}

// The group if it splits anything (null or one rank: the whole layer, today's code path).
TensorParallelGroup* splitting(TensorParallelGroup* tp) { return tp != nullptr && tp->size() > 1 ? tp : nullptr; }

std::unique_ptr<Linear> gpt_linear(std::string name, int64_t in, int64_t out, double std,
                                   TensorParallelMode mode = TensorParallelMode::None,
                                   TensorParallelGroup* tp = nullptr) {
  auto l = std::make_unique<Linear>(std::move(name), in, out, true);
  l->set_gpt_init(std);
  l->set_tensor_parallel(mode, tp);
  return l;
}

// c_fc column-parallel, GELU on the local slice, c_proj row-parallel (Megatron's MLP: one
// all-reduce, after c_proj); the dropout after it sees replicated values.
std::vector<LayerPtr> mlp_layers(int64_t embed, float dropout, double proj_std, TensorParallelGroup* tp,
                                 Activation activation) {
  std::vector<LayerPtr> layers;
  layers.push_back(gpt_linear("c_fc", embed, 4 * embed, kGptInitStd, TensorParallelMode::Column, tp));
  layers.push_back(std::make_unique<ActivationLayer>("gelu", activation));
  layers.push_back(gpt_linear("c_proj", 4 * embed, embed, proj_std, TensorParallelMode::Row, tp));
  if (dropout > 0) layers.push_back(std::make_unique<Dropout>("dropout", dropout));
  return layers;
}

void require_sequence(const Layer& layer, const Shape& input, int64_t embed) {
  STRATA_REQUIRE(input.size() == 2 && input[1] == embed, "layer ", layer.name(), " (", layer.describe(),
                 ") expects a sequence [T, ", embed, "], found ", shape_str(input));
}

}  // namespace

// ---- Embedding -------------------------------------------------------------------------------

Embedding::Embedding(std::string name, int64_t vocab, int64_t max_positions, int64_t embed, TensorParallelGroup* tp)
    : Layer(std::move(name)),
      vocab_(vocab),
      max_positions_(max_positions),
      embed_(embed),
      tp_(splitting(tp)),
      local_vocab_(vocab),
      first_token_(0) {
  STRATA_REQUIRE(vocab > 0 && max_positions > 0 && embed > 0, "embedding sizes must be positive, found vocab ", vocab,
                 ", positions ", max_positions, ", width ", embed);
  if (tp_) {
    STRATA_REQUIRE(vocab % tp_->size() == 0, "the vocabulary (", vocab, " tokens) must be divisible by --tp ",
                   tp_->size());
    local_vocab_ = vocab / tp_->size();
    first_token_ = tp_->rank() * local_vocab_;
  }
}

std::string Embedding::describe() const {
  return detail::cat("embedding(vocab ", vocab_, ", positions ", max_positions_, ", ", embed_,
                     tp_ ? detail::cat(", vocabulary-parallel ", tp_->rank(), "/", tp_->size()) : "", ")");
}

Shape Embedding::output_shape(const Shape& input) const {
  STRATA_REQUIRE(input.size() == 1 && input[0] >= 1 && input[0] <= max_positions_, "layer ", name(), " (", describe(),
                 ") expects token sequences [T] with 1 <= T <= ", max_positions_, ", found ", shape_str(input));
  return {input[0], embed_};
}

std::vector<ParamSpec> Embedding::param_specs() const {
  std::vector<ParamSpec> specs{normal(kTokenWeight, {local_vocab_, embed_}, kGptInitStd, true),
                               normal("wpe/weight", {max_positions_, embed_}, kGptInitStd, true)};
  if (tp_) specs[0].split = {tp_->size(), tp_->rank(), 0, 1};
  return specs;
}

void Embedding::bind(std::span<const Tensor> params, std::span<const Tensor> grads) {
  wte_ = params[0];
  wpe_ = params[1];
  dwte_ = grads[0];
  dwpe_ = grads[1];
}

// The position add, once per element of the output; with tp each shard counts its share, so the
// group's sum (MFU's numerator) counts it once.
int64_t Embedding::flops(const Shape& input) const { return shape_numel(input) * embed_ / (tp_ ? tp_->size() : 1); }

Tensor Embedding::forward(const Tensor& x, Context& ctx, const StepInfo& info) {
  STRATA_REQUIRE(x.dtype() == DType::I32 && x.ndim() == 2, "layer ", name(), " expects i32 tokens (B, T), found ",
                 x.str());
  Tensor y = Tensor::empty({x.dim(0), x.dim(1), embed_}, wte_.dtype(), x.device());
  if (tp_) {
    // Each token's row is on one rank, the others add zeros, and wpe is added once (rank 0):
    // the sum is wte[token] + wpe[t] exactly, as without tp.
    ops::embedding_forward(x, wte_, tp_->rank() == 0 ? wpe_ : Tensor(), y, first_token_, vocab_);
    tp_->all_reduce_sum(y);
  } else {
    ops::embedding_forward(x, wte_, wpe_, y);
  }
  if (info.mode == Mode::Train) ctx.saved = {x};
  return y;
}

std::vector<GradientPiece> Embedding::gradient_pieces(int64_t max_elements) const {
  const int64_t wte = local_vocab_ * embed_, wpe_at = align_param(wte);
  if (tied_head_ || wte + max_positions_ * embed_ <= max_elements) return {};
  std::vector<GradientPiece> pieces{{wpe_at, wpe_at + max_positions_ * embed_}};
  const int64_t block = std::max<int64_t>(max_elements / embed_, 1);
  for (int64_t hi = local_vocab_; hi > 0; hi -= block)
    pieces.push_back({std::max<int64_t>(hi - block, 0) * embed_, hi * embed_});
  return pieces;
}

Tensor Embedding::backward(const Tensor& dy, Context& ctx) {
  // With tp, dy is replicated (the all-reduce's backward is the identity): dwte gets this
  // rank's rows, dwpe the same sum on every rank.
  const Tensor& tokens = ctx.saved.at(0);
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

// ---- CausalSelfAttention ---------------------------------------------------------------------

CausalSelfAttention::CausalSelfAttention(std::string name, int64_t embed, int64_t heads, float dropout,
                                         AttentionKind kind, double proj_std, TensorParallelGroup* tp)
    : Layer(std::move(name)),
      embed_(embed),
      heads_(heads),
      tp_(splitting(tp)),
      local_heads_(heads),
      first_head_(0),
      p_(dropout),
      kind_(kind),
      c_attn_("c_attn", embed, 3 * embed),
      c_proj_("c_proj", embed, embed),
      resid_drop_("resid_dropout", dropout) {
  STRATA_REQUIRE(heads > 0 && embed > 0 && embed % heads == 0, "--heads (", heads, ") must divide --embed (", embed,
                 ")");
  c_attn_.set_gpt_init(kGptInitStd);
  c_proj_.set_gpt_init(proj_std);
  gradients_.add(c_attn_);
  gradients_.add(c_proj_);
  if (tp_) {
    STRATA_REQUIRE(heads % tp_->size() == 0, "--heads (", heads, ") must be divisible by --tp (", tp_->size(),
                   "): each rank computes whole heads");
    local_heads_ = heads / tp_->size();
    first_head_ = tp_->rank() * local_heads_;
    // q | k | v: three blocks of D, each split into whole heads.
    c_attn_.set_tensor_parallel(TensorParallelMode::Column, tp_, 3);
    c_proj_.set_tensor_parallel(TensorParallelMode::Row, tp_);
  }
}

std::string CausalSelfAttention::describe() const {
  return detail::cat(
      "causal_self_attention(", embed_, ", heads ", heads_, ", ", kind_ == AttentionKind::Flash ? "flash" : "plain",
      p_ > 0 ? detail::cat(", dropout ", p_) : "",
      tp_ ? detail::cat(", heads ", first_head_, "..", first_head_ + local_heads_ - 1, " on this rank") : "", ")");
}

Shape CausalSelfAttention::output_shape(const Shape& input) const {
  require_sequence(*this, input, embed_);
  return input;
}

std::vector<ParamSpec> CausalSelfAttention::param_specs() const {
  std::vector<ParamSpec> specs;
  append_specs(specs, "c_attn", c_attn_);
  append_specs(specs, "c_proj", c_proj_);
  return specs;
}

void CausalSelfAttention::bind(std::span<const Tensor> params, std::span<const Tensor> grads) {
  gradients_.bind(params, grads);
}

std::vector<GradientPiece> CausalSelfAttention::gradient_pieces(int64_t max_elements) const {
  return gradients_.pieces(max_elements);
}

int64_t CausalSelfAttention::flops(const Shape& input) const {
  const int64_t t = input.at(0);
  // Projections, then q k^T and p v over the causal half of the T x T scores (this rank's heads).
  Shape merged = input;
  merged.back() = c_proj_.local_in();
  return c_attn_.flops(input) + c_proj_.flops(merged) + t * t * embed_ / heads_ * local_heads_;
}

void CausalSelfAttention::set_index(int index) {
  Layer::set_index(index);  // keys the attention dropout
  resid_drop_.set_index(index * 1024 + 1);
}

ops::DropoutKey CausalSelfAttention::key(const StepInfo& info) const {
  ops::DropoutKey k;
  k.key = rng::derive_key(rng::derive_key(info.seed, rng::kDropout), static_cast<uint64_t>(index()));
  k.stream = static_cast<uint64_t>(info.step);
  k.first_sample = info.first_sample;
  if (tp_) {  // the mask of global head first_head_ + h, whatever T is
    k.heads = heads_;
    k.first_head = first_head_;
  }
  return k;
}

Tensor CausalSelfAttention::forward(const Tensor& x, Context& ctx, const StepInfo& info) {
  const int64_t b = x.dim(0), t = x.dim(1), h = local_heads_, dh = embed_ / heads_;
  ctx.children.resize(3);
  const Tensor qkv = c_attn_.forward(x, ctx.children[0], info);  // (B, T, 3D)
  const Shape heads{b, h, t, dh};
  Tensor q = Tensor::empty(heads, x.dtype(), x.device());
  Tensor k = Tensor::empty(heads, x.dtype(), x.device());
  Tensor v = Tensor::empty(heads, x.dtype(), x.device());
  ops::split_qkv(qkv, q, k, v);
  const bool train = info.mode == Mode::Train;
  const float p = train ? p_ : 0.0f;
  Tensor y = Tensor::empty(heads, x.dtype(), x.device());
  Tensor stats;  // flash: the rows' log-sum-exp (B, H, T); plain: the probabilities (B, H, T, T)
  if (kind_ == AttentionKind::Flash) {
    stats = Tensor::empty({b, h, t}, DType::F32, x.device());
    ops::flash_attention_forward(q, k, v, y, stats, p, key(info));
  } else {
    stats = Tensor::empty({b, h, t, t}, DType::F32, x.device());
    ops::attention_forward(q, k, v, y, stats, p, key(info));
  }
  Tensor merged = Tensor::empty({b, t, h * dh}, x.dtype(), x.device());
  ops::merge_heads(y, merged);
  const Tensor out = c_proj_.forward(merged, ctx.children[1], info);
  if (train) {
    ctx.saved = {q, k, v, y, stats};
    ctx.info = info;
  }
  return resid_drop_.forward(out, ctx.children[2], info);
}

Tensor CausalSelfAttention::backward(const Tensor& dy, Context& ctx) {
  const Tensor q = ctx.saved.at(0), k = ctx.saved.at(1), v = ctx.saved.at(2), y = ctx.saved.at(3),
               stats = ctx.saved.at(4);
  const Tensor dout = resid_drop_.backward(dy, ctx.children[2]);
  ctx.children[1].input_grad = true;
  const Tensor dmerged =
      gradients_.backward(*this, c_proj_, [&] { return c_proj_.backward(dout, ctx.children[1]); });  // (B, T, D)
  Tensor dyh = Tensor::empty(y.shape(), dmerged.dtype(), dmerged.device());
  ops::split_heads(dmerged, dyh);
  Tensor dq = Tensor::empty(q.shape(), q.dtype(), q.device());
  Tensor dk = Tensor::empty(k.shape(), k.dtype(), k.device());
  Tensor dv = Tensor::empty(v.shape(), v.dtype(), v.device());
  if (kind_ == AttentionKind::Flash)
    ops::flash_attention_backward(q, k, v, y, stats, dyh, dq, dk, dv, p_, key(ctx.info));
  else
    ops::attention_backward(q, k, v, stats, dyh, dq, dk, dv, p_, key(ctx.info));
  Tensor dqkv = Tensor::empty({q.dim(0), q.dim(2), 3 * q.dim(1) * q.dim(3)}, q.dtype(), q.device());
  ops::merge_qkv(dq, dk, dv, dqkv);
  ctx.children[0].input_grad = ctx.input_grad;
  Tensor dx = gradients_.backward(*this, c_attn_, [&] { return c_attn_.backward(dqkv, ctx.children[0]); });
  ctx.clear();
  return dx;
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

TransformerBlock::TransformerBlock(std::string name, int64_t embed, int64_t heads, float dropout, AttentionKind kind,
                                   double proj_std, TensorParallelGroup* tp, Recompute recompute, Activation activation,
                                   float norm_eps)
    : Layer(std::move(name)),
      recompute_(recompute),
      activation_(activation),
      ln_1_("ln_1", embed, norm_eps),
      attn_("attn", embed, heads, dropout, kind, proj_std, tp),
      ln_2_("ln_2", embed, norm_eps),
      mlp_("mlp", mlp_layers(embed, dropout, proj_std, splitting(tp), activation)) {
  ln_1_.set_no_weight_decay();
  ln_2_.set_no_weight_decay();
  for (Layer* child : std::initializer_list<Layer*>{&ln_1_, &attn_, &ln_2_, &mlp_}) gradients_.add(*child);
}

std::string TransformerBlock::describe() const {
  const char* recompute = recompute_ == Recompute::Block  ? ", recompute block"
                          : recompute_ == Recompute::Full ? ", recompute full"
                                                          : "";
  return "transformer_block(" + attn_.describe() + ", mlp " + mlp_.describe() + recompute + ")";
}

Shape TransformerBlock::output_shape(const Shape& input) const {
  const Shape h = attn_.output_shape(ln_1_.output_shape(input));
  return mlp_.output_shape(ln_2_.output_shape(h));
}

std::vector<ParamSpec> TransformerBlock::param_specs() const {
  std::vector<ParamSpec> specs;
  append_specs(specs, "ln_1", ln_1_);
  append_specs(specs, "attn", attn_);
  append_specs(specs, "ln_2", ln_2_);
  append_specs(specs, "mlp", mlp_);
  return specs;
}

void TransformerBlock::bind(std::span<const Tensor> params, std::span<const Tensor> grads) {
  gradients_.bind(params, grads);
}

std::vector<GradientPiece> TransformerBlock::gradient_pieces(int64_t max_elements) const {
  return gradients_.pieces(max_elements);
}

int64_t TransformerBlock::flops(const Shape& input) const { return attn_.flops(input) + mlp_.flops(input); }

void TransformerBlock::set_index(int index) {
  Layer::set_index(index);
  ln_1_.set_index(index * 1024 + 1);
  attn_.set_index(index * 1024 + 2);
  ln_2_.set_index(index * 1024 + 3);
  mlp_.set_index(index * 1024 + 4);
}

Tensor TransformerBlock::run(const Tensor& x, Context& ctx, const StepInfo& info, bool rebuild) {
  ctx.children.resize(4);
  std::vector<Context>& c = ctx.children;
  const bool full = recompute_ == Recompute::Full && info.mode == Mode::Train;
  const Tensor n1 = ln_1_.forward(x, c[0], info);
  const Tensor a = full ? forward_keeping_input(attn_, n1, c[1], info) : attn_.forward(n1, c[1], info);
  Tensor h = Tensor::empty(x.shape(), x.dtype(), x.device());
  ops::add(x, a, h);
  const Tensor n2 = ln_2_.forward(h, c[2], info);
  if (rebuild && full) {  // the MLP's backward recomputes it from its input: no forward now
    c[3].saved = {n2};
    c[3].info = info;
    return Tensor();
  }
  const Tensor m = full ? forward_keeping_input(mlp_, n2, c[3], info) : mlp_.forward(n2, c[3], info);
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
  const Tensor dm = child(ln_2_, child(mlp_, dy, c[3], full), c[2], false);
  Tensor dh = Tensor::empty(dy.shape(), dy.dtype(), dy.device());
  ops::add(dy, dm, dh);
  Tensor dx = child(ln_1_, child(attn_, dh, c[1], full), c[0], false);
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
  if (tp_) {
    STRATA_REQUIRE(vocab % tp_->size() == 0, "the vocabulary (", vocab, " tokens) must be divisible by --tp ",
                   tp_->size());
    local_vocab_ = vocab / tp_->size();
  }
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
  return out;
}

std::vector<ParamSpec> LMHead::param_specs() const {
  if (tied_) return {};
  std::vector<ParamSpec> specs{normal("weight", {local_vocab_, embed_}, kGptInitStd, false)};
  if (tp_) specs[0].split = {tp_->size(), tp_->rank(), 0, 1};
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

int64_t LMHead::flops(const Shape& input) const { return shape_numel(input) * local_vocab_; }

Tensor LMHead::forward(const Tensor& x, Context& ctx, const StepInfo& info) {
  const Tensor& w = weight();
  STRATA_CHECK(w.defined(), "layer ", name(), ": the ", tied_ ? "tied embedding's " : "", "weight is not bound");
  const Tensor x2 = x.reshape({x.numel() / embed_, embed_});
  Tensor y = Tensor::empty({x2.dim(0), local_vocab_}, x.dtype(), x.device());
  ops::gemm(x2, false, w, true, y);  // (N, D) @ (V, D)^T: with tp, this rank's columns of the logits
  if (info.mode == Mode::Train) ctx.saved = {x2};
  ctx.input_shape = x.shape();
  Shape out = x.shape();
  out.back() = local_vocab_;
  return y.reshape(out);
}

Tensor LMHead::backward(const Tensor& dy, Context& ctx) {
  const Tensor x2 = ctx.saved.at(0);
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
    if (tp_) tp_->all_reduce_sum(dx);            // every vocabulary slice's share of dx
    dx = dx.reshape(ctx.input_shape);
  }
  ctx.clear();
  return dx;
}

}  // namespace strata::layers
