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
    STRATA_REQUIRE(vocab % tp_->size() == 0, "the vocabulary (", vocab, " tokens) must be divisible by --tp ",
                   tp_->size());
    local_vocab_ = vocab / tp_->size();
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
  return {input[0], embed_};
}

std::vector<ParamSpec> Embedding::param_specs() const {
  std::vector<ParamSpec> specs{normal(kTokenWeight, {local_vocab_, embed_}, kGptInitStd, true)};
  if (positions_) specs.push_back(normal("wpe/weight", {max_positions_, embed_}, kGptInitStd, true));
  if (tp_) specs[0].split = {tp_->size(), tp_->rank(), 0, 1};
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
                                         AttentionKind kind, double proj_std, TensorParallelGroup* tp,
                                         AttentionOptions options)
    : Layer(std::move(name)),
      embed_(embed),
      heads_(heads),
      kv_heads_(options.kv_heads > 0 ? options.kv_heads : heads),
      tp_(splitting(tp)),
      local_heads_(heads),
      first_head_(0),
      local_kv_heads_(kv_heads_),
      p_(dropout),
      kind_(kind),
      rope_(std::move(options.rope)),
      c_proj_(options.fused ? "c_proj" : "o_proj", embed, embed, options.fused),
      resid_drop_("resid_dropout", dropout) {
  STRATA_REQUIRE(heads > 0 && embed > 0 && embed % heads == 0, "--heads (", heads, ") must divide --embed (", embed,
                 ")");
  STRATA_REQUIRE(kv_heads_ >= 1 && heads % kv_heads_ == 0, "--kv-heads (", kv_heads_, ") must divide --heads (", heads,
                 "): each kv head serves a group of query heads");
  STRATA_CHECK(!options.fused || kv_heads_ == heads, "a fused c_attn has as many kv heads as query heads");
  const int64_t dh = embed / heads;
  STRATA_CHECK(rope_.empty() || static_cast<int64_t>(rope_.size()) * 2 == dh, "rotary frequencies: ", rope_.size(),
               " for heads of ", dh);
  if (options.fused) {
    in_proj_.push_back(std::make_unique<Linear>("c_attn", embed, 3 * embed));
  } else {
    in_proj_.push_back(std::make_unique<Linear>("q_proj", embed, heads * dh, false));
    in_proj_.push_back(std::make_unique<Linear>("k_proj", embed, kv_heads_ * dh, false));
    in_proj_.push_back(std::make_unique<Linear>("v_proj", embed, kv_heads_ * dh, false));
  }
  for (auto& l : in_proj_) l->set_gpt_init(kGptInitStd);
  c_proj_.set_gpt_init(proj_std);
  for (auto& l : in_proj_) gradients_.add(*l);
  gradients_.add(c_proj_);
  if (tp_) {
    const int t = tp_->size();
    STRATA_REQUIRE(heads % t == 0, "--heads (", heads, ") must be divisible by --tp (", t,
                   "): each rank computes whole heads");
    STRATA_REQUIRE(kv_heads_ % t == 0 || t % kv_heads_ == 0, "--kv-heads (", kv_heads_, ") must be divisible by --tp (",
                   t, ") or divide it (each kv head then replicated on tp / kv-heads ranks)");
    local_heads_ = heads / t;
    first_head_ = tp_->rank() * local_heads_;
    kv_replicas_ = kv_heads_ % t == 0 ? 1 : static_cast<int>(t / kv_heads_);
    local_kv_heads_ = kv_heads_ * kv_replicas_ / t;
    if (options.fused) {
      // q | k | v: three blocks of D, each split into whole heads.
      in_proj_[0]->set_tensor_parallel(TensorParallelMode::Column, tp_, 3);
    } else {
      // Rank r's query heads [r H/T, (r+1) H/T) read kv heads [r Hkv'/T, ...) of the replicated
      // layout (Hkv' = Hkv * replicas): the same groups as without tp.
      in_proj_[0]->set_tensor_parallel(TensorParallelMode::Column, tp_);
      for (size_t i = 1; i < 3; ++i) in_proj_[i]->set_tensor_parallel(TensorParallelMode::Column, tp_, 1, kv_replicas_);
      for (auto& l : in_proj_) l->set_local_input_grad();  // one all-reduce for the three
    }
    c_proj_.set_tensor_parallel(TensorParallelMode::Row, tp_);
  }
}

std::string CausalSelfAttention::describe() const {
  return detail::cat(
      "causal_self_attention(", embed_, ", heads ", heads_,
      kv_heads_ != heads_ ? detail::cat(", kv heads ", kv_heads_) : "", rope_.empty() ? "" : ", rotary", ", ",
      kind_ == AttentionKind::Flash ? "flash" : "plain", p_ > 0 ? detail::cat(", dropout ", p_) : "",
      tp_ ? detail::cat(", heads ", first_head_, "..", first_head_ + local_heads_ - 1, " on this rank") : "", ")");
}

Shape CausalSelfAttention::output_shape(const Shape& input) const {
  require_sequence(*this, input, embed_);
  return input;
}

std::vector<ParamSpec> CausalSelfAttention::param_specs() const {
  std::vector<ParamSpec> specs;
  for (const auto& l : in_proj_) append_specs(specs, l->name(), *l);
  append_specs(specs, c_proj_.name(), c_proj_);
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
  int64_t in_proj = 0;
  for (const auto& l : in_proj_) in_proj += l->flops(input);
  return in_proj + c_proj_.flops(merged) + t * t * embed_ / heads_ * local_heads_;
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
  const int64_t b = x.dim(0), t = x.dim(1), h = local_heads_, hkv = local_kv_heads_, dh = embed_ / heads_;
  const size_t n_in = in_proj_.size();
  ctx.children.resize(n_in + 2);  // the input projections, c_proj, the residual dropout
  Context& proj_ctx = ctx.children[n_in];
  Context& drop_ctx = ctx.children[n_in + 1];
  Tensor q = Tensor::empty({b, h, t, dh}, x.dtype(), x.device());
  Tensor k = Tensor::empty({b, hkv, t, dh}, x.dtype(), x.device());
  Tensor v = Tensor::empty({b, hkv, t, dh}, x.dtype(), x.device());
  if (n_in == 1) {
    ops::split_qkv(in_proj_[0]->forward(x, ctx.children[0], info), q, k, v);  // (B, T, 3D)
  } else {
    const Tensor* out[] = {&q, &k, &v};
    for (size_t i = 0; i < 3; ++i) ops::split_heads(in_proj_[i]->forward(x, ctx.children[i], info), *out[i]);
  }
  if (!rope_.empty()) {  // positions 0..T-1 of every sequence; in place
    ops::rope(q, q, rope_);
    ops::rope(k, k, rope_);
  }
  const bool train = info.mode == Mode::Train;
  const float p = train ? p_ : 0.0f;
  Tensor y = Tensor::empty(q.shape(), x.dtype(), x.device());
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
  const Tensor out = c_proj_.forward(merged, proj_ctx, info);
  if (train) {
    ctx.saved = {q, k, v, y, stats};
    ctx.info = info;
  }
  return resid_drop_.forward(out, drop_ctx, info);
}

void CausalSelfAttention::sum_kv_replicas(const Tensor& dk, const Tensor& dv) const {
  // Each rank holds one kv head (local_kv_heads_ == 1 when replicated): it writes its partial
  // gradients into that head's slot of a zeroed buffer of all kv heads, and one all-reduce over
  // the group sums each head's replicas (the other slots add zeros).
  const int64_t n = dk.numel(), head = tp_->rank() / kv_replicas_;
  const Tensor all = Tensor::empty({2 * kv_heads_, n}, dk.dtype(), dk.device());
  ops::fill(all, 0.0f);
  ops::copy(dk, all.view(head * n, {n}));
  ops::copy(dv, all.view((kv_heads_ + head) * n, {n}));
  tp_->all_reduce_sum(all);
  ops::copy(all.view(head * n, {n}), dk);
  ops::copy(all.view((kv_heads_ + head) * n, {n}), dv);
}

Tensor CausalSelfAttention::backward(const Tensor& dy, Context& ctx) {
  const Tensor q = ctx.saved.at(0), k = ctx.saved.at(1), v = ctx.saved.at(2), y = ctx.saved.at(3),
               stats = ctx.saved.at(4);
  const size_t n_in = in_proj_.size();
  const Tensor dout = resid_drop_.backward(dy, ctx.children[n_in + 1]);
  ctx.children[n_in].input_grad = true;
  const Tensor dmerged = gradients_.backward(
      *this, c_proj_, [&] { return c_proj_.backward(dout, ctx.children[n_in]); });  // (B, T, local heads * Dh)
  Tensor dyh = Tensor::empty(y.shape(), dmerged.dtype(), dmerged.device());
  ops::split_heads(dmerged, dyh);
  Tensor dq = Tensor::empty(q.shape(), q.dtype(), q.device());
  Tensor dk = Tensor::empty(k.shape(), k.dtype(), k.device());
  Tensor dv = Tensor::empty(v.shape(), v.dtype(), v.device());
  if (kind_ == AttentionKind::Flash)
    ops::flash_attention_backward(q, k, v, y, stats, dyh, dq, dk, dv, p_, key(ctx.info));
  else
    ops::attention_backward(q, k, v, stats, dyh, dq, dk, dv, p_, key(ctx.info));
  if (!rope_.empty()) {  // the rotation's backward is the inverse rotation
    ops::rope(dq, dq, rope_, 0, true);
    ops::rope(dk, dk, rope_, 0, true);
  }
  Tensor dx;
  if (n_in == 1) {
    Tensor dqkv = Tensor::empty({q.dim(0), q.dim(2), 3 * q.dim(1) * q.dim(3)}, q.dtype(), q.device());
    ops::merge_qkv(dq, dk, dv, dqkv);
    ctx.children[0].input_grad = ctx.input_grad;
    dx = gradients_.backward(*this, *in_proj_[0], [&] { return in_proj_[0]->backward(dqkv, ctx.children[0]); });
  } else {
    if (kv_replicas_ > 1) sum_kv_replicas(dk, dv);
    const Tensor* grads[] = {&dq, &dk, &dv};
    for (size_t i = 3; i-- > 0;) {  // v_proj, k_proj, q_proj: the gradients' order down the layout
      const Tensor& d = *grads[i];
      Tensor dm = Tensor::empty({d.dim(0), d.dim(2), d.dim(1) * d.dim(3)}, d.dtype(), d.device());
      ops::merge_heads(d, dm);
      ctx.children[i].input_grad = ctx.input_grad;
      const Tensor dxi =
          gradients_.backward(*this, *in_proj_[i], [&] { return in_proj_[i]->backward(dm, ctx.children[i]); });
      if (!ctx.input_grad) continue;
      // A replicated kv head's summed gradient reaches x from each of its replicas: 1/replicas each.
      const float share = i > 0 && kv_replicas_ > 1 ? 1.0f / static_cast<float>(kv_replicas_) : 1.0f;
      if (!dx.defined()) {
        dx = dxi;
        if (share != 1.0f) ops::scale(dx, share);
      } else {
        ops::axpy(share, dxi, dx);
      }
    }
    if (dx.defined() && tp_) tp_->all_reduce_sum(dx);  // every rank's heads' share of dx (the maps left it local)
  }
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

namespace {
// GPT-2's parts: LayerNorms (no weight decay), fused attention, the GELU MLP (exact or tanh).
BlockParts gpt_parts(int64_t embed, int64_t heads, float dropout, AttentionKind kind, double proj_std,
                     TensorParallelGroup* tp, Activation activation, float norm_eps) {
  auto ln_1 = std::make_unique<LayerNorm>("ln_1", embed, norm_eps);
  auto ln_2 = std::make_unique<LayerNorm>("ln_2", embed, norm_eps);
  ln_1->set_no_weight_decay();
  ln_2->set_no_weight_decay();
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
