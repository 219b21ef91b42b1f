// Optimizers over flat buffers (a stage's whole gradient buffer, or a ZeRO shard of it),
// learning-rate schedules, and global-norm gradient clipping.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "core/ops.hpp"

namespace strata::layers {

struct OptimizerConfig {
  std::string name = "sgd";  // sgd | adamw
  float momentum = 0.9f;     // sgd
  bool nesterov = false;     // sgd
  float weight_decay = 0.0f;
  double beta1 = 0.9, beta2 = 0.999;  // adamw
  float eps = 1e-8f;
};

// Parameter groups (the AdamW rule of nanoGPT/minGPT): weight decay applies only to the
// weights of Linear-like maps (2-D and up); parameters marked ParamSpec::no_weight_decay
// (biases, LayerNorm weight and bias, embeddings: the GPT model marks them) are stepped with
// weight_decay 0, for SGD and AdamW alike. The flat buffer is stepped in contiguous segments,
// each with weight_decay or 0; the optimizers are element-wise, so this is the same update as
// torch.optim with two param groups. Without such ranges (every model but gpt) step() is one
// update over the whole buffer.
class Optimizer {
 public:
  // f32 state tensors per parameter element: SGD 1 with momentum (else 0), AdamW 2.
  static int state_tensors(const OptimizerConfig& config);
  // State for `numel` elements on `device`, zero-initialised.
  Optimizer(const OptimizerConfig& config, int64_t numel, Device device = Device::cpu());
  // Elements [begin, end) of the buffers step() receives.
  struct Range {
    int64_t begin = 0, end = 0;
  };
  // The ranges stepped without weight decay: sorted, disjoint, within [0, numel).
  void set_no_decay(std::vector<Range> ranges);
  const std::vector<Range>& no_decay() const { return no_decay_; }
  // One update of params from grads (both `numel` elements) at learning rate lr.
  void step(const Tensor& params, const Tensor& grads, float lr);
  int64_t steps_taken() const { return steps_; }
  // Restores the step count from a checkpoint (AdamW's bias correction depends on it).
  void set_steps_taken(int64_t steps) { steps_ = steps; }
  // Named state tensors, for checkpoints: "momentum", or "exp_avg" and "exp_avg_sq".
  std::vector<std::pair<std::string, Tensor>> state() const;

 private:
  // Steps elements [begin, end) with the given weight decay.
  void update(const Tensor& params, const Tensor& grads, int64_t begin, int64_t end, float lr, float weight_decay);

  OptimizerConfig config_;
  int64_t steps_ = 0;
  int64_t numel_ = 0;
  Tensor state_a_, state_b_;
  std::vector<Range> no_decay_;
};

struct LrScheduleConfig {
  std::string kind = "constant";  // constant | step | cosine | linear | wsd
  float lr = 0.01f;
  int64_t warmup_steps = 0;  // linear warm-up from lr/warmup to lr, for every kind
  int64_t total_steps = 0;   // cosine, linear, wsd: decays to min_lr at this step
  int64_t step_size = 0;     // step: multiply by gamma every step_size steps
  float gamma = 0.1f;
  float min_lr = 0.0f;
  // wsd (warmup-stable-decay): the steps of the final decay (0: the last fifth of the run) and
  // its shape: linear | sqrt (1 - sqrt of the decay's progress) | cosine.
  int64_t decay_steps = 0;
  std::string decay_shape = "linear";
};

// The steps a wsd schedule decays over: decay_steps, or a fifth of the run (Hägele et al. 2024,
// "Scaling Laws and Compute-Optimal Training Beyond Fixed Training Durations", find 20% enough).
int64_t wsd_decay_steps(const LrScheduleConfig& c);

// The learning rate at optimizer step `step` (0-based).
float learning_rate(const LrScheduleConfig& c, int64_t step);

// Scales grads so that their global L2 norm is at most max_norm (torch's clip_grad_norm_,
// coefficient max_norm / (norm + 1e-6)). `sum_squares` is the (possibly all-reduced) sum of
// squares of all gradients. Returns the norm before clipping.
double clip_by_global_norm(const Tensor& grads, double sum_squares, float max_norm);

}  // namespace strata::layers
