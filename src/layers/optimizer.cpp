#include "layers/optimizer.hpp"

#include <cmath>
#include <numbers>

namespace strata::layers {

int Optimizer::state_tensors(const OptimizerConfig& config) {
  if (config.name == "sgd") return config.momentum != 0.0f ? 1 : 0;
  if (config.name == "adamw") return 2;
  STRATA_THROW_INPUT("--optimizer must be sgd or adamw, found '", config.name, "'");
}

Optimizer::Optimizer(const OptimizerConfig& config, int64_t numel, Device device) : config_(config), numel_(numel) {
  const int tensors = state_tensors(config);  // momentum, or exp_avg and exp_avg_sq
  if (tensors >= 1) state_a_ = Tensor::zeros({numel}, DType::F32, device);
  if (tensors >= 2) state_b_ = Tensor::zeros({numel}, DType::F32, device);
}

void Optimizer::set_no_decay(std::vector<Range> ranges) {
  int64_t cursor = 0;
  for (const Range& r : ranges) {
    STRATA_CHECK(r.begin >= cursor && r.begin < r.end && r.end <= numel_, "no-decay range [", r.begin, ", ", r.end,
                 ") is not sorted, disjoint and within ", numel_, " elements");
    cursor = r.end;
  }
  no_decay_ = std::move(ranges);
}

void Optimizer::step(const Tensor& params, const Tensor& grads, float lr) {
  ++steps_;
  if (no_decay_.empty()) {
    update(params, grads, 0, params.numel(), lr, config_.weight_decay);
    return;
  }
  int64_t cursor = 0;
  for (const Range& r : no_decay_) {
    if (r.begin > cursor) update(params, grads, cursor, r.begin, lr, config_.weight_decay);
    update(params, grads, r.begin, r.end, lr, 0.0f);
    cursor = r.end;
  }
  if (cursor < params.numel()) update(params, grads, cursor, params.numel(), lr, config_.weight_decay);
}

void Optimizer::update(const Tensor& params, const Tensor& grads, int64_t begin, int64_t end, float lr,
                       float weight_decay) {
  const bool whole = begin == 0 && end == params.numel();
  const auto part = [&](const Tensor& t) { return whole || !t.defined() ? t : t.view(begin, {end - begin}); };
  if (config_.name == "sgd") {
    ops::SgdParams p;
    p.lr = lr;
    p.momentum = config_.momentum;
    p.weight_decay = weight_decay;
    p.nesterov = config_.nesterov;
    ops::sgd_update(part(params), part(grads), part(state_a_), p);
  } else {
    ops::AdamWParams p;
    p.lr = lr;
    p.beta1 = config_.beta1;
    p.beta2 = config_.beta2;
    p.eps = config_.eps;
    p.weight_decay = weight_decay;
    p.step = steps_;
    ops::adamw_update(part(params), part(grads), part(state_a_), part(state_b_), p);
  }
}

std::vector<std::pair<std::string, Tensor>> Optimizer::state() const {
  if (config_.name == "adamw") return {{"exp_avg", state_a_}, {"exp_avg_sq", state_b_}};
  if (state_a_.defined()) return {{"momentum", state_a_}};
  return {};
}

int64_t wsd_decay_steps(const LrScheduleConfig& c) { return c.decay_steps > 0 ? c.decay_steps : c.total_steps / 5; }

namespace {

// A decay's factor at `progress` in [0, 1] of it: 1 at its start, 0 at its end.
double decay_factor(const std::string& shape, double progress) {
  if (shape == "linear") return 1.0 - progress;
  if (shape == "sqrt") return 1.0 - std::sqrt(progress);
  if (shape == "cosine") return 0.5 * (1.0 + std::cos(std::numbers::pi * progress));
  STRATA_THROW_INPUT("--lr-decay-shape must be linear, sqrt or cosine, found '", shape, "'");
}

}  // namespace

float learning_rate(const LrScheduleConfig& c, int64_t step) {
  if (step < c.warmup_steps) return c.lr * static_cast<float>(step + 1) / static_cast<float>(c.warmup_steps);
  if (c.kind == "constant") return c.lr;
  if (c.kind == "step") {
    if (c.step_size <= 0) return c.lr;
    return c.lr * std::pow(c.gamma, static_cast<float>((step - c.warmup_steps) / c.step_size));
  }
  // The decaying kinds: lr until the decay starts (right after warm-up but for wsd), then down to
  // min_lr at total_steps, held there after.
  int64_t decay_start = c.warmup_steps;
  std::string shape = c.kind;
  if (c.kind == "wsd") {
    decay_start = std::max(c.warmup_steps, c.total_steps - wsd_decay_steps(c));
    shape = c.decay_shape;
  } else if (c.kind != "cosine" && c.kind != "linear") {
    STRATA_THROW_INPUT("--lr-schedule must be constant, step, cosine, linear or wsd, found '", c.kind, "'");
  }
  if (step < decay_start) return c.lr;
  const int64_t span = std::max<int64_t>(c.total_steps - decay_start, 1);
  const double progress = std::min<double>(static_cast<double>(step - decay_start) / static_cast<double>(span), 1.0);
  return static_cast<float>(c.min_lr + (c.lr - c.min_lr) * decay_factor(shape, progress));
}

double clip_by_global_norm(const Tensor& grads, double sum_squares, float max_norm) {
  const double norm = std::sqrt(sum_squares);
  const double coef = max_norm / (norm + 1e-6);
  if (coef < 1.0) ops::scale(grads, static_cast<float>(coef));
  return norm;
}

}  // namespace strata::layers
