// Forward and backward of the basic layers; the math lives in the ops.
#include "layers/basic.hpp"

#include <cmath>

#include "core/rng.hpp"

namespace strata::layers {

Shape batch_shape(int64_t batch, const Shape& sample) {
  Shape s{batch};
  s.insert(s.end(), sample.begin(), sample.end());
  return s;
}

namespace {

void require_image(const Layer& layer, const Shape& input, int64_t channels) {
  STRATA_REQUIRE(input.size() == 3 && (channels < 0 || input[0] == channels), "layer ", layer.name(), " (",
                 layer.describe(), ") expects an image input [", channels < 0 ? "C" : std::to_string(channels),
                 ", H, W], found ", shape_str(input));
}

// Views for layers whose param_specs() are {weight, bias (optional)}.
void bind_weight_and_bias(std::span<const Tensor> params, std::span<const Tensor> grads, bool has_bias, Tensor& w,
                          Tensor& dw, Tensor& b, Tensor& db) {
  w = params[0];
  dw = grads[0];
  if (has_bias) {
    b = params[1];
    db = grads[1];
  }
}

}  // namespace

// ---- Linear ----------------------------------------------------------------------------------

Linear::Linear(std::string name, int64_t in_features, int64_t out_features, bool bias)
    : Layer(std::move(name)), in_(in_features), out_(out_features), has_bias_(bias) {}

std::string Linear::describe() const {
  if (mode_ == TensorParallelMode::None) return detail::cat("linear(", in_, "->", out_, ")");
  return detail::cat("linear(", in_, "->", out_, ", ", mode_ == TensorParallelMode::Column ? "column" : "row",
                     "-parallel ", tp_->rank(), "/", tp_->size(), ")");
}

void Linear::set_tensor_parallel(TensorParallelMode mode, TensorParallelGroup* tp, int segments, int replicas) {
  if (tp == nullptr || tp->size() == 1 || mode == TensorParallelMode::None) {
    mode_ = TensorParallelMode::None;
    tp_ = nullptr;
    segments_ = 1;
    replicas_ = 1;
    return;
  }
  const int64_t t = tp->size();
  STRATA_CHECK(segments >= 1 && replicas >= 1 && t % replicas == 0 &&
                   (mode == TensorParallelMode::Column || (segments == 1 && replicas == 1)),
               "layer ", name(), ": segments ", segments, " and replicas ", replicas,
               " apply to a column-parallel split over --tp ", t);
  if (mode == TensorParallelMode::Column)
    STRATA_REQUIRE(out_ % (segments * t / replicas) == 0, "layer ", name(), " (", describe(), "): ", out_,
                   " outputs in ", segments, " block(s) cannot be split over --tp ", t);
  else
    STRATA_REQUIRE(in_ % t == 0, "layer ", name(), " (", describe(), "): ", in_, " inputs cannot be split over --tp ",
                   t);
  mode_ = mode;
  tp_ = tp;
  segments_ = segments;
  replicas_ = replicas;
}

int64_t Linear::local_out() const {
  return mode_ == TensorParallelMode::Column ? out_ / (tp_->size() / replicas_) : out_;
}
int64_t Linear::local_in() const { return mode_ == TensorParallelMode::Row ? in_ / tp_->size() : in_; }

TensorSplit Linear::split(int dim) const {
  return {tp_->size(), tp_->rank(), dim, dim == 0 ? segments_ : 1, dim == 0 ? replicas_ : 1};
}

Shape Linear::output_shape(const Shape& input) const {
  const int64_t in = local_in();
  STRATA_REQUIRE(!input.empty() && input.back() == in, "layer ", name(), " (", describe(), ") expects input of shape [",
                 input.size() > 1 ? "..., " : "", in, "], found ", shape_str(input));
  Shape out = input;
  out.back() = local_out();
  if (gathers_input()) out.at(0) *= tp_->size();  // per sample (T/tp, in) -> (T, out/tp)
  if (scatters_output()) {
    STRATA_REQUIRE(input.size() == 2 && input[0] % tp_->size() == 0, "layer ", name(), " (", describe(),
                   ") cuts a sequence [T, ", in, "] into --tp ", tp_->size(), " parts, found ", shape_str(input));
    out.at(0) /= tp_->size();
  }
  return out;
}

// Per rank: its shard's multiply-adds; a piece held by several ranks (replicas) counts its share
// on each, so the group's sum (MFU's numerator) counts the model's work once. A map that gathers
// the sequence works on all of it.
int64_t Linear::flops(const Shape& input) const {
  const int64_t rows = shape_numel(input) / local_in() * (gathers_input() ? tp_->size() : 1);
  return rows * local_in() * local_out() / replicas_;
}

// Shapes are this rank's shards; fan_in stays the full layer's (the full tensor is drawn).
std::vector<ParamSpec> Linear::param_specs() const {
  std::vector<ParamSpec> specs{{"weight", {local_out(), local_in()}, init_, in_, true, std_}};
  if (mode_ != TensorParallelMode::None) specs.back().split = split(mode_ == TensorParallelMode::Column ? 0 : 1);
  if (has_bias_) {
    specs.push_back({"bias", {local_out()}, init_ == Init::Normal ? Init::Zeros : init_, in_});
    specs.back().no_weight_decay = init_ == Init::Normal;
    if (mode_ == TensorParallelMode::Column) specs.back().split = split(0);  // row-parallel: replicated
  }
  return specs;
}

void Linear::set_gpt_init(double std) {
  init_ = Init::Normal;
  std_ = std;
}

void Linear::bind(std::span<const Tensor> params, std::span<const Tensor> grads) {
  bind_weight_and_bias(params, grads, has_bias_, w_, dw_, b_, db_);
}

bool Linear::gathers_input() const {
  return mode_ == TensorParallelMode::Column && !local_input_grad_ && sequence_parallel_group(tp_) != nullptr;
}
bool Linear::scatters_output() const {
  return mode_ == TensorParallelMode::Row && sequence_parallel_group(tp_) != nullptr;
}

void Linear::restore_input(Context& ctx, const Tensor& x) {
  ctx.saved = {x.ndim() == 2 ? x : x.reshape({x.numel() / x.shape().back(), x.shape().back()})};
}

// Inputs (B, ..., in) are viewed as (B * ..., in): the map applies to the last dimension.
Tensor Linear::forward(const Tensor& x, Context& ctx, const StepInfo& info) {
  const int64_t in = local_in(), out = local_out();
  // Sequence parallelism: a column-parallel map takes the whole sequence, keeping only its part
  // for backward (which gathers it again), Megatron's trade of a second all-gather for T/tp of
  // the input kept.
  const Tensor whole = gathers_input() ? gather_sequence(*tp_, x) : x;
  const Tensor x2 = whole.ndim() == 2 ? whole : whole.reshape({whole.numel() / in, in});
  // x (N, in) @ W^T (in, out) -> y (N, out)
  Tensor y = Tensor::empty({x2.dim(0), out}, x.dtype(), x.device());
  ops::gemm(x2, false, w_, true, y);
  Shape shape = whole.shape();
  shape.back() = out;
  // Row-parallel: the ranks' partial products summed before the (replicated) bias, so the bias
  // is added once; sequence-parallel, each rank keeps the sum over its part of the sequence.
  if (scatters_output()) {
    STRATA_CHECK(x.ndim() == 3, "layer ", name(), ": a sequence-parallel map takes (B, T, in), found ", x.str());
    y = scatter_sequence(*tp_, y.reshape(shape));
    shape = y.shape();
    y = y.reshape({y.numel() / out, out});
  } else if (mode_ == TensorParallelMode::Row) {
    tp_->all_reduce_sum(y);
  }
  if (has_bias_) ops::add_bias(y, b_);
  if (info.mode == Mode::Train) restore_input(ctx, x);
  if (whole.ndim() == 2) return y;
  ctx.input_shape = x.shape();
  return y.reshape(shape);
}

Tensor Linear::backward(const Tensor& dy, Context& ctx) {
  Tensor x = ctx.saved.at(0);  // (N, in): this rank's part of the sequence when gathers_input()
  if (gathers_input()) {
    x = gather_sequence(*tp_, x.reshape(ctx.input_shape));
    x = x.reshape({x.numel() / local_in(), local_in()});
  }
  // Sequence-parallel row map: dy is this rank's part; the weight and the (replicated) bias take
  // the whole sequence's, the same on every rank.
  const Tensor dy_whole = scatters_output() ? gather_sequence(*tp_, dy) : dy;
  const Tensor dy2 = dy_whole.ndim() == 2 ? dy_whole : dy_whole.reshape({x.dim(0), local_out()});
  if (gradient_sink() != nullptr) {
    write_linear_gradient_pieces(*gradient_sink(), gradient_pieces(gradient_piece_limit()), dy2, x);
  } else {
    ops::gemm(dy2, true, x, false, dw_, 1.0f, 1.0f);  // dW (out, in) += dy^T x
    if (has_bias_) ops::bias_grad(dy2, db_);
  }
  Tensor dx;
  if (ctx.input_grad) {
    dx = Tensor::empty(x.shape(), x.dtype(), x.device());
    ops::gemm(dy2, false, w_, false, dx);  // dx (N, in) = dy W
    // Column-parallel: each rank's outputs contribute to every input feature; the sum is the
    // input's gradient (identical on every rank, as the replicated layers below need), or with
    // sequence parallelism each rank's part of it.
    Shape whole = ctx.input_shape;
    if (gathers_input()) {
      whole.at(1) *= tp_->size();
      dx = scatter_sequence(*tp_, dx.reshape(whole));
    } else if (mode_ == TensorParallelMode::Column && !local_input_grad_) {
      tp_->all_reduce_sum(dx);
    }
    if (dy.ndim() != 2) dx = dx.reshape(ctx.input_shape);
  }
  ctx.clear();
  return dx;
}

std::vector<GradientPiece> linear_gradient_pieces(int64_t rows, int64_t cols, bool bias, int64_t max_elements) {
  if (rows * cols + (bias ? rows : 0) <= max_elements) return {};
  const int64_t block = std::max<int64_t>(max_elements / cols, 1);
  std::vector<GradientPiece> pieces;
  if (bias) pieces.push_back({align_param(rows * cols), align_param(rows * cols) + rows});
  for (int64_t hi = rows; hi > 0; hi -= block) pieces.push_back({std::max<int64_t>(hi - block, 0) * cols, hi * cols});
  return pieces;
}

// Rows [r0, r1) of dW are dy's columns [r0, r1) times x: with dy transposed once, each block of
// rows is one GEMM of contiguous operands.
void write_linear_gradient_pieces(GradientSink& sink, const std::vector<GradientPiece>& pieces, const Tensor& dy,
                                  const Tensor& x) {
  const int64_t n = x.dim(0), rows = dy.dim(1), cols = x.dim(1);
  Tensor dy_t;  // (rows, N)
  for (const GradientPiece& p : pieces) {
    const Tensor g = sink.next_piece();
    STRATA_CHECK(g.numel() == p.end - p.begin, "a gradient piece of ", p.end - p.begin, " elements got ", g.numel());
    if (p.begin >= rows * cols) {  // the bias
      ops::bias_grad(dy, g);
    } else {
      if (!dy_t.defined()) {
        dy_t = Tensor::empty({rows, n}, dy.dtype(), dy.device());
        // (1, N, rows) -> (1, rows, N, 1): split_heads with one element per head is a transpose.
        ops::split_heads(dy.reshape({1, n, rows}), dy_t.reshape({1, rows, n, 1}));
      }
      const int64_t block = (p.end - p.begin) / cols;
      ops::gemm(dy_t.view(p.begin / cols * n, {block, n}), false, x, false, g.reshape({block, cols}), 1.0f, 1.0f);
    }
    sink.piece_written();
  }
}

std::vector<GradientPiece> Linear::gradient_pieces(int64_t max_elements) const {
  return linear_gradient_pieces(local_out(), local_in(), has_bias_, max_elements);
}

// ---- Conv2d ----------------------------------------------------------------------------------

Conv2d::Conv2d(std::string name, int64_t in_channels, int64_t out_channels, int64_t kernel, int64_t stride,
               int64_t padding, bool bias)
    : Layer(std::move(name)),
      in_(in_channels),
      out_(out_channels),
      kernel_(kernel),
      stride_(stride),
      padding_(padding),
      has_bias_(bias) {}

std::string Conv2d::describe() const {
  return detail::cat("conv2d(", in_, "->", out_, ", k", kernel_, " s", stride_, " p", padding_, ")");
}

ops::Conv2dGeometry Conv2d::geometry(const Shape& batch_input) const {
  ops::Conv2dGeometry g;
  g.in_channels = in_;
  g.out_channels = out_;
  g.kernel_h = g.kernel_w = kernel_;
  g.stride = stride_;
  g.padding = padding_;
  g.in_h = batch_input[2];
  g.in_w = batch_input[3];
  return g;
}

Shape Conv2d::output_shape(const Shape& input) const {
  require_image(*this, input, in_);
  const ops::Conv2dGeometry g = geometry({1, input[0], input[1], input[2]});
  // The window must fit the padded input: out_h() alone truncates a negative quotient to 0.
  const bool fits = input[1] + 2 * padding_ >= kernel_ && input[2] + 2 * padding_ >= kernel_;
  STRATA_REQUIRE(fits && g.out_h() > 0 && g.out_w() > 0, "layer ", name(), " (", describe(),
                 ") needs an input of at least ", kernel_, "x", kernel_, " after padding, found ", shape_str(input));
  return {out_, g.out_h(), g.out_w()};
}

std::vector<ParamSpec> Conv2d::param_specs() const {
  const int64_t fan_in = in_ * kernel_ * kernel_;
  std::vector<ParamSpec> specs{{"weight", {out_, in_, kernel_, kernel_}, Init::FanInUniform, fan_in}};
  if (has_bias_) specs.push_back({"bias", {out_}, Init::FanInUniform, fan_in});
  return specs;
}

void Conv2d::bind(std::span<const Tensor> params, std::span<const Tensor> grads) {
  bind_weight_and_bias(params, grads, has_bias_, w_, dw_, b_, db_);
}

int64_t Conv2d::flops(const Shape& input) const {
  const Shape out = output_shape(input);
  return out[0] * out[1] * out[2] * in_ * kernel_ * kernel_;
}

Tensor Conv2d::forward(const Tensor& x, Context& ctx, const StepInfo& info) {
  const ops::Conv2dGeometry g = geometry(x.shape());
  Tensor y = Tensor::empty({x.dim(0), out_, g.out_h(), g.out_w()}, x.dtype(), x.device());
  ops::conv2d_forward(x, w_, b_, y, g);
  if (info.mode == Mode::Train) ctx.saved = {x};
  return y;
}

Tensor Conv2d::backward(const Tensor& dy, Context& ctx) {
  const Tensor x = ctx.saved.at(0);
  const Tensor dx = ctx.input_grad ? Tensor::empty(x.shape(), x.dtype(), x.device()) : Tensor();
  ops::conv2d_backward(x, w_, dy, dx, dw_, db_, geometry(x.shape()));
  ctx.clear();
  return dx;
}

// ---- pooling ---------------------------------------------------------------------------------

Pool2d::Pool2d(std::string name, PoolKind kind, int64_t kernel, int64_t stride, int64_t padding)
    : Layer(std::move(name)), kind_(kind), kernel_(kernel), stride_(stride), padding_(padding) {}

std::string Pool2d::describe() const {
  return detail::cat(kind_ == PoolKind::Max ? "max_pool2d" : "avg_pool2d", "(k", kernel_, " s", stride_, " p", padding_,
                     ")");
}

ops::Pool2dGeometry Pool2d::geometry(const Shape& batch_input) const {
  ops::Pool2dGeometry g;
  g.kernel = kernel_;
  g.stride = stride_;
  g.padding = padding_;
  g.in_h = batch_input[2];
  g.in_w = batch_input[3];
  return g;
}

Shape Pool2d::output_shape(const Shape& input) const {
  require_image(*this, input, -1);
  const ops::Pool2dGeometry g = geometry({1, input[0], input[1], input[2]});
  // The window must fit the padded input: out_h() alone truncates a negative quotient to 0.
  const bool fits = input[1] + 2 * padding_ >= kernel_ && input[2] + 2 * padding_ >= kernel_;
  STRATA_REQUIRE(fits && g.out_h() > 0 && g.out_w() > 0, "layer ", name(), " (", describe(),
                 ") needs an input of at least ", kernel_, "x", kernel_, ", found ", shape_str(input));
  return {input[0], g.out_h(), g.out_w()};
}

Tensor Pool2d::forward(const Tensor& x, Context& ctx, const StepInfo& info) {
  const ops::Pool2dGeometry g = geometry(x.shape());
  Tensor y = Tensor::empty({x.dim(0), x.dim(1), g.out_h(), g.out_w()}, x.dtype(), x.device());
  ctx.input_shape = x.shape();
  if (kind_ == PoolKind::Max) {
    Tensor argmax = Tensor::empty(y.shape(), DType::I32, x.device());
    ops::max_pool2d_forward(x, y, argmax, g);
    if (info.mode == Mode::Train) ctx.saved = {argmax};
  } else {
    ops::avg_pool2d_forward(x, y, g);
  }
  return y;
}

Tensor Pool2d::backward(const Tensor& dy, Context& ctx) {
  const ops::Pool2dGeometry g = geometry(ctx.input_shape);
  Tensor dx = Tensor::empty(ctx.input_shape, dy.dtype(), dy.device());
  if (kind_ == PoolKind::Max)
    ops::max_pool2d_backward(dy, ctx.saved.at(0), dx, g);
  else
    ops::avg_pool2d_backward(dy, dx, g);
  ctx.clear();
  return dx;
}

Shape GlobalAvgPool::output_shape(const Shape& input) const {
  require_image(*this, input, -1);
  return {input[0]};
}

Tensor GlobalAvgPool::forward(const Tensor& x, Context& ctx, const StepInfo& info) {
  Tensor y = Tensor::empty({x.dim(0), x.dim(1)}, x.dtype(), x.device());
  ops::global_avg_pool_forward(x, y);
  ctx.input_shape = x.shape();
  return y;
}

Tensor GlobalAvgPool::backward(const Tensor& dy, Context& ctx) {
  Tensor dx = Tensor::empty(ctx.input_shape, dy.dtype(), dy.device());
  ops::global_avg_pool_backward(dy, dx);
  ctx.clear();
  return dx;
}

// ---- activations, dropout, flatten -----------------------------------------------------------

Tensor ActivationLayer::forward(const Tensor& x, Context& ctx, const StepInfo& info) {
  Tensor y = Tensor::empty(x.shape(), x.dtype(), x.device());
  if (kind_ == Activation::ReLU) {
    ops::relu_forward(x, y);
    if (info.mode == Mode::Train) ctx.saved = {y};  // relu's backward needs only the output
  } else {
    if (kind_ == Activation::GELU)
      ops::gelu_forward(x, y);
    else
      ops::gelu_tanh_forward(x, y);
    if (info.mode == Mode::Train) ctx.saved = {x};
  }
  return y;
}

Tensor ActivationLayer::backward(const Tensor& dy, Context& ctx) {
  const Tensor saved = ctx.saved.at(0);
  Tensor dx = Tensor::empty(dy.shape(), dy.dtype(), dy.device());
  if (kind_ == Activation::ReLU)
    ops::relu_backward(saved, dy, dx);
  else if (kind_ == Activation::GELU)
    ops::gelu_backward(saved, dy, dx);
  else
    ops::gelu_tanh_backward(saved, dy, dx);
  ctx.clear();
  return dx;
}

Dropout::Dropout(std::string name, float p) : Layer(std::move(name)), p_(p) {
  STRATA_REQUIRE(p >= 0.0f && p < 1.0f, "dropout probability must be in [0, 1), found ", p);
}

std::string Dropout::describe() const { return detail::cat("dropout(", p_, ")"); }

ops::DropoutKey Dropout::key(const StepInfo& info, const Tensor& x) const {
  ops::DropoutKey k;
  k.key = rng::derive_key(rng::derive_key(info.seed, rng::kDropout), static_cast<uint64_t>(index()));
  k.stream = static_cast<uint64_t>(info.step);
  k.first_sample = info.first_sample;
  if (sp_) set_sequence_part(*sp_, x, k.sample_numel, k.part_offset);
  return k;
}

Tensor Dropout::forward(const Tensor& x, Context& ctx, const StepInfo& info) {
  if (info.mode == Mode::Eval || p_ == 0.0f) return x;
  Tensor y = Tensor::empty(x.shape(), x.dtype(), x.device());
  ops::dropout_forward(x, y, p_, key(info, x));
  ctx.info = info;  // backward regenerates the same mask from the key
  return y;
}

Tensor Dropout::backward(const Tensor& dy, Context& ctx) {
  if (p_ == 0.0f) return dy;
  Tensor dx = Tensor::empty(dy.shape(), dy.dtype(), dy.device());
  ops::dropout_backward(dy, dx, p_, key(ctx.info, dy));
  ctx.clear();
  return dx;
}

Shape Flatten::output_shape(const Shape& input) const { return {shape_numel(input)}; }

Tensor Flatten::forward(const Tensor& x, Context& ctx, const StepInfo& info) {
  ctx.input_shape = x.shape();
  return x.reshape({x.dim(0), x.numel() / std::max<int64_t>(x.dim(0), 1)});
}

Tensor Flatten::backward(const Tensor& dy, Context& ctx) {
  Tensor dx = dy.reshape(ctx.input_shape);
  ctx.clear();
  return dx;
}

// ---- normalisation ---------------------------------------------------------------------------

BatchNorm2d::BatchNorm2d(std::string name, int64_t channels, float momentum, float eps)
    : Layer(std::move(name)), channels_(channels), momentum_(momentum), eps_(eps) {}

std::string BatchNorm2d::describe() const { return detail::cat("batch_norm2d(", channels_, ")"); }

Shape BatchNorm2d::output_shape(const Shape& input) const {
  require_image(*this, input, channels_);
  return input;
}

std::vector<ParamSpec> BatchNorm2d::param_specs() const {
  return {{"weight", {channels_}, Init::Ones},
          {"bias", {channels_}, Init::Zeros},
          {"running_mean", {channels_}, Init::Zeros, 0, false},
          {"running_var", {channels_}, Init::Ones, 0, false}};
}

void BatchNorm2d::bind(std::span<const Tensor> params, std::span<const Tensor> grads) {
  gamma_ = params[0];
  beta_ = params[1];
  running_mean_ = params[2];
  running_var_ = params[3];
  dgamma_ = grads[0];
  dbeta_ = grads[1];
}

Tensor BatchNorm2d::forward(const Tensor& x, Context& ctx, const StepInfo& info) {
  Tensor y = Tensor::empty(x.shape(), x.dtype(), x.device());
  if (info.mode == Mode::Eval) {
    ops::batch_norm_forward_eval(x, gamma_, beta_, running_mean_, running_var_, y, eps_);
    return y;
  }
  Tensor mean = Tensor::empty({channels_}, DType::F32, x.device());
  Tensor invstd = Tensor::empty({channels_}, DType::F32, x.device());
  ops::batch_norm_forward_train(x, gamma_, beta_, y, mean, invstd, running_mean_, running_var_, momentum_, eps_);
  ctx.saved = {x, mean, invstd};
  return y;
}

Tensor BatchNorm2d::backward(const Tensor& dy, Context& ctx) {
  const Tensor x = ctx.saved.at(0);
  Tensor dx = Tensor::empty(x.shape(), x.dtype(), x.device());
  ops::batch_norm_backward(x, dy, gamma_, ctx.saved.at(1), ctx.saved.at(2), dx, dgamma_, dbeta_);
  ctx.clear();
  return dx;
}

LayerNorm::LayerNorm(std::string name, int64_t features, float eps)
    : Layer(std::move(name)), features_(features), eps_(eps) {}

std::string LayerNorm::describe() const { return detail::cat("layer_norm(", features_, ")"); }

Shape LayerNorm::output_shape(const Shape& input) const {
  STRATA_REQUIRE(!input.empty() && input.back() == features_, "layer ", name(), " (", describe(),
                 ") expects the last dimension to be ", features_, ", found ", shape_str(input));
  return input;
}

std::vector<ParamSpec> LayerNorm::param_specs() const {
  std::vector<ParamSpec> specs{{"weight", {features_}, Init::Ones}, {"bias", {features_}, Init::Zeros}};
  for (ParamSpec& s : specs) s.no_weight_decay = no_weight_decay_;
  return specs;
}

void LayerNorm::bind(std::span<const Tensor> params, std::span<const Tensor> grads) {
  gamma_ = params[0];
  beta_ = params[1];
  dgamma_ = grads[0];
  dbeta_ = grads[1];
}

Tensor LayerNorm::forward(const Tensor& x, Context& ctx, const StepInfo& info) {
  const int64_t rows = x.numel() / features_;
  Tensor y = Tensor::empty(x.shape(), x.dtype(), x.device());
  Tensor mean = Tensor::empty({rows}, DType::F32, x.device());
  Tensor rstd = Tensor::empty({rows}, DType::F32, x.device());
  ops::layer_norm_forward(x, gamma_, beta_, y, mean, rstd, eps_);
  if (info.mode == Mode::Train) ctx.saved = {x, mean, rstd};
  return y;
}

Tensor LayerNorm::backward(const Tensor& dy, Context& ctx) {
  const Tensor x = ctx.saved.at(0);
  Tensor dx = Tensor::empty(x.shape(), x.dtype(), x.device());
  if (sp_) {
    sum_sequence_parallel_grads(*sp_, {dgamma_, dbeta_}, [&](const std::vector<Tensor>& g) {
      ops::layer_norm_backward(x, dy, gamma_, ctx.saved.at(1), ctx.saved.at(2), dx, g[0], g[1]);
    });
  } else {
    ops::layer_norm_backward(x, dy, gamma_, ctx.saved.at(1), ctx.saved.at(2), dx, dgamma_, dbeta_);
  }
  ctx.clear();
  return dx;
}

}  // namespace strata::layers
