// CausalSelfAttention: q, k, v projections (fused c_attn for GPT, q/k/v_proj with grouped kv
// heads and rotary positions for Llama), flash or plain attention, the output projection.
#include "core/rng.hpp"
#include "layers/gpt.hpp"
#include "layers/gpt_shared.hpp"

namespace strata::layers {

using gpt_shared::append_specs;
using gpt_shared::require_sequence;
using gpt_shared::splitting;

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
    resid_drop_.set_sequence_parallel(tp_);
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

int64_t CausalSelfAttention::sequence_length(const Shape& input) const {
  const TensorParallelGroup* sp = sequence_parallel_group(tp_);
  return input.at(0) * (sp ? sp->size() : 1);
}

int64_t CausalSelfAttention::flops(const Shape& input) const {
  const int64_t t = sequence_length(input);
  // Projections, then q k^T and p v over the causal half of the T x T scores (this rank's heads).
  const Shape whole{t, embed_};
  int64_t in_proj = 0;
  for (const auto& l : in_proj_) in_proj += l->flops(l->gathers_input() ? input : whole);
  return in_proj + c_proj_.flops({t, c_proj_.local_in()}) + t * t * embed_ / heads_ * local_heads_;
}

int64_t CausalSelfAttention::kv_replica_elements(const Shape& input) const {
  return kv_replicas_ > 1 ? 2 * kv_heads_ * sequence_length(input) * (embed_ / heads_) : 0;
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

Tensor CausalSelfAttention::forward(const Tensor& x_in, Context& ctx, const StepInfo& info) {
  const size_t n_in = in_proj_.size();
  // Sequence-parallel: x_in is this rank's part of the sequence. The fused c_attn gathers it
  // itself; the separate projections share one gather, and keep only the part for backward.
  TensorParallelGroup* gather = n_in > 1 ? sequence_parallel_group(tp_) : nullptr;
  const Tensor x = gather ? gather_sequence(*gather, x_in) : x_in;
  const int64_t b = x.dim(0), t = sequence_length({x_in.dim(1), embed_}), h = local_heads_, hkv = local_kv_heads_,
                dh = embed_ / heads_;
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
    if (gather && info.mode == Mode::Train)
      for (size_t i = 0; i < 3; ++i) Linear::release_input(ctx.children[i]);
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
    if (gather) ctx.saved.push_back(x_in);
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
    TensorParallelGroup* gather = sequence_parallel_group(tp_);
    if (gather) {  // the projections' input again (forward kept this rank's part)
      const Tensor x = gather_sequence(*gather, ctx.saved.at(5));
      for (size_t i = 0; i < 3; ++i) Linear::restore_input(ctx.children[i], x);
    }
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
    // Every rank's heads' share of dx (the maps left it local), summed; sequence-parallel, the
    // sum of this rank's positions.
    if (dx.defined() && gather)
      dx = scatter_sequence(*gather, dx);
    else if (dx.defined() && tp_)
      tp_->all_reduce_sum(dx);
  }
  ctx.clear();
  return dx;
}

}  // namespace strata::layers
