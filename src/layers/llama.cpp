// The Llama family's layers: RMSNorm, the rotary frequencies, the SwiGLU MLP.
#include "layers/llama.hpp"

#include <cmath>

namespace strata::layers {

std::vector<float> rope_frequencies(int64_t head_dim, double theta, const RopeScaling* scaling) {
  STRATA_REQUIRE(head_dim >= 2 && head_dim % 2 == 0, "rotary embeddings need an even head size, found ", head_dim);
  STRATA_REQUIRE(theta > 1.0, "--rope-theta must be above 1, found ", theta);
  std::vector<float> inv(static_cast<size_t>(head_dim / 2));
  // transformers: 1 / (theta ** (arange(0, Dh, 2).float() / Dh)), in f32.
  const float base = static_cast<float>(theta);
  for (size_t i = 0; i < inv.size(); ++i)
    inv[i] = 1.0f / std::pow(base, static_cast<float>(2 * i) / static_cast<float>(head_dim));
  if (scaling == nullptr) return inv;
  const RopeScaling& s = *scaling;
  STRATA_REQUIRE(s.factor >= 1 && s.high_freq_factor > s.low_freq_factor && s.original_context > 0,
                 "rope scaling: factor ", s.factor, ", frequency factors ", s.low_freq_factor, " < ",
                 s.high_freq_factor, ", original context ", s.original_context);
  // transformers' _compute_llama3_parameters, in f32 like its tensors.
  const float factor = static_cast<float>(s.factor), low = static_cast<float>(s.low_freq_factor),
              high = static_cast<float>(s.high_freq_factor), old = static_cast<float>(s.original_context);
  const float low_wavelen = old / low, high_wavelen = old / high;
  for (float& f : inv) {
    const float wavelen = 2.0f * static_cast<float>(M_PI) / f;
    const float scaled = wavelen > low_wavelen ? f / factor : f;
    if (wavelen < high_wavelen || wavelen > low_wavelen) {
      f = scaled;
    } else {  // medium frequencies: blended
      const float smooth = (old / wavelen - low) / (high - low);
      f = (1.0f - smooth) * scaled / factor + smooth * scaled;
    }
  }
  return inv;
}

// ---- RMSNorm ---------------------------------------------------------------------------------

RMSNorm::RMSNorm(std::string name, int64_t features, float eps)
    : Layer(std::move(name)), features_(features), eps_(eps) {
  STRATA_REQUIRE(eps > 0.0f, "--norm-eps must be positive, found ", eps);
}

std::string RMSNorm::describe() const { return detail::cat("rms_norm(", features_, ", eps ", eps_, ")"); }

Shape RMSNorm::output_shape(const Shape& input) const {
  STRATA_REQUIRE(!input.empty() && input.back() == features_, "layer ", name(), " (", describe(),
                 ") expects the last dimension to be ", features_, ", found ", shape_str(input));
  return input;
}

std::vector<ParamSpec> RMSNorm::param_specs() const {
  ParamSpec s{"weight", {features_}, Init::Ones};
  s.no_weight_decay = true;
  return {s};
}

void RMSNorm::bind(std::span<const Tensor> params, std::span<const Tensor> grads) {
  gamma_ = params[0];
  dgamma_ = grads[0];
}

Tensor RMSNorm::forward(const Tensor& x, Context& ctx, const StepInfo& info) {
  Tensor y = Tensor::empty(x.shape(), x.dtype(), x.device());
  Tensor rstd = Tensor::empty({x.numel() / features_}, DType::F32, x.device());
  ops::rms_norm_forward(x, gamma_, y, rstd, eps_);
  if (info.mode == Mode::Train) ctx.saved = {x, rstd};
  return y;
}

Tensor RMSNorm::backward(const Tensor& dy, Context& ctx) {
  const Tensor x = ctx.saved.at(0);
  Tensor dx = Tensor::empty(x.shape(), x.dtype(), x.device());
  if (sp_)
    sum_sequence_parallel_grads(*sp_, {dgamma_}, [&](const std::vector<Tensor>& g) {
      ops::rms_norm_backward(x, dy, gamma_, ctx.saved.at(1), dx, g[0]);
    });
  else
    ops::rms_norm_backward(x, dy, gamma_, ctx.saved.at(1), dx, dgamma_);
  ctx.clear();
  return dx;
}

// ---- SwiGLU ----------------------------------------------------------------------------------

SwiGLU::SwiGLU(std::string name, int64_t embed, int64_t hidden, double proj_std, TensorParallelGroup* tp)
    : Layer(std::move(name)),
      embed_(embed),
      hidden_(hidden),
      tp_(tp != nullptr && tp->size() > 1 ? tp : nullptr),
      gate_("gate_proj", embed, hidden, false),
      up_("up_proj", embed, hidden, false),
      down_("down_proj", hidden, embed, false) {
  STRATA_REQUIRE(hidden > 0, "--ffn-hidden must be positive, found ", hidden);
  gate_.set_gpt_init(0.02);
  up_.set_gpt_init(0.02);
  down_.set_gpt_init(proj_std);
  if (tp_) {
    STRATA_REQUIRE(hidden % tp_->size() == 0, "--ffn-hidden (", hidden, ") must be divisible by --tp (", tp_->size(),
                   ")");
    gate_.set_tensor_parallel(TensorParallelMode::Column, tp_);
    up_.set_tensor_parallel(TensorParallelMode::Column, tp_);
    gate_.set_local_input_grad();  // joined below: one all-reduce for the two
    up_.set_local_input_grad();
    down_.set_tensor_parallel(TensorParallelMode::Row, tp_);
  }
  for (Linear* l : {&gate_, &up_, &down_}) gradients_.add(*l);
}

std::string SwiGLU::describe() const { return detail::cat("swiglu(", embed_, "->", hidden_, "->", embed_, ")"); }

Shape SwiGLU::output_shape(const Shape& input) const {
  STRATA_REQUIRE(input.size() == 2 && input[1] == embed_, "layer ", name(), " (", describe(),
                 ") expects a sequence [T, ", embed_, "], found ", shape_str(input));
  return input;
}

std::vector<ParamSpec> SwiGLU::param_specs() const {
  std::vector<ParamSpec> specs;
  for (const Linear* l : {&gate_, &up_, &down_})
    for (ParamSpec s : l->param_specs()) {
      s.name = l->name() + "/" + s.name;
      specs.push_back(std::move(s));
    }
  return specs;
}

void SwiGLU::bind(std::span<const Tensor> params, std::span<const Tensor> grads) { gradients_.bind(params, grads); }

std::vector<GradientPiece> SwiGLU::gradient_pieces(int64_t max_elements) const {
  return gradients_.pieces(max_elements);
}

// The three maps, plus the gate's element-wise product (not counted: flops are multiply-adds of maps).
int64_t SwiGLU::flops(const Shape& input) const {
  const TensorParallelGroup* sp = sequence_parallel_group(tp_);
  const Shape whole{input.at(0) * (sp ? sp->size() : 1), embed_};  // the maps' rows: the whole sequence
  const Shape hidden{whole[0], gate_.local_out()};
  return gate_.flops(whole) + up_.flops(whole) + down_.flops(hidden);
}

Tensor SwiGLU::forward(const Tensor& x_in, Context& ctx, const StepInfo& info) {
  ctx.children.resize(3);
  // Sequence-parallel: one gather for gate and up, which keep only this rank's part for backward.
  TensorParallelGroup* sp = sequence_parallel_group(tp_);
  const Tensor x = sp ? gather_sequence(*sp, x_in) : x_in;
  const Tensor g = gate_.forward(x, ctx.children[0], info);  // (B, T, F/T)
  const Tensor u = up_.forward(x, ctx.children[1], info);
  Tensor a = Tensor::empty(g.shape(), g.dtype(), g.device());
  ops::swiglu_forward(g, u, a);
  if (info.mode == Mode::Train) {
    ctx.saved = {g, u};
    if (sp) {
      Linear::release_input(ctx.children[0]);
      Linear::release_input(ctx.children[1]);
      ctx.saved.push_back(x_in);
    }
  }
  return down_.forward(a, ctx.children[2], info);
}

Tensor SwiGLU::backward(const Tensor& dy, Context& ctx) {
  const Tensor g = ctx.saved.at(0), u = ctx.saved.at(1);
  ctx.children[2].input_grad = true;
  const Tensor da = gradients_.backward(*this, down_, [&] { return down_.backward(dy, ctx.children[2]); });
  Tensor dg = Tensor::empty(g.shape(), g.dtype(), g.device());
  Tensor du = Tensor::empty(u.shape(), u.dtype(), u.device());
  ops::swiglu_backward(g, u, da, dg, du);
  TensorParallelGroup* sp = sequence_parallel_group(tp_);
  if (sp) {
    const Tensor x = gather_sequence(*sp, ctx.saved.at(2));
    Linear::restore_input(ctx.children[0], x);
    Linear::restore_input(ctx.children[1], x);
  }
  ctx.children[1].input_grad = ctx.input_grad;
  ctx.children[0].input_grad = ctx.input_grad;
  Tensor dx = gradients_.backward(*this, up_, [&] { return up_.backward(du, ctx.children[1]); });
  const Tensor dxg = gradients_.backward(*this, gate_, [&] { return gate_.backward(dg, ctx.children[0]); });
  if (dx.defined()) {
    ops::axpy(1.0f, dxg, dx);
    // Every rank's hidden slice's share of dx, summed (sequence-parallel: its positions').
    if (sp)
      dx = scatter_sequence(*sp, dx);
    else if (tp_)
      tp_->all_reduce_sum(dx);
  }
  ctx.clear();
  return dx;
}

}  // namespace strata::layers
