// Optimizers, learning-rate schedules and gradient clipping against torch.optim, from the
// reference file written by tests/layers/torch_reference.py (CTest fixture torch_ref).
// Tolerances: 1e-6 relative for one step, 1e-5 after 5 steps (errors compound through the
// optimizer state); per element the absolute part scales with the tensor (compare.hpp).
#include <gtest/gtest.h>

#include <cmath>
#include <memory>

#include "layers/compare.hpp"
#include "layers/optimizer.hpp"
#include "layers/torch_ref.hpp"

namespace strata::layers {
namespace {

using testing::children;
using testing::count_datasets;
using testing::expect_close;
using testing::int_attr;
using testing::num_attr;
using testing::open_group;
using testing::read_doubles;
using testing::read_tensor;
using testing::Tolerance;

const Tolerance kOneStep{1e-6, 1e-6, 1e-6};
const Tolerance kFiveSteps{1e-5, 1e-5, 1e-5};

[[maybe_unused]] auto* const kReporter = ::testing::AddGlobalTestEnvironment(new testing::WorstErrorReporter);

const io::h5::File& ref_file() {
  static const io::h5::File file = testing::open_torch_ref();
  return file;
}

// Runs the case's 5 steps; checks the parameters after each step when `check` is set.
std::unique_ptr<Optimizer> run_steps(const std::string& name, bool check) {
  const io::h5::Group c = open_group(ref_file(), "optim/" + name);
  OptimizerConfig cfg;
  cfg.name = io::h5::read_attr_string(c, "name");
  cfg.weight_decay = static_cast<float>(num_attr(c, "weight_decay"));
  if (cfg.name == "sgd") {
    cfg.momentum = static_cast<float>(num_attr(c, "momentum"));
    cfg.nesterov = int_attr(c, "nesterov") != 0;
  } else {
    cfg.beta1 = num_attr(c, "beta1");
    cfg.beta2 = num_attr(c, "beta2");
    cfg.eps = static_cast<float>(num_attr(c, "eps"));
  }
  const float lr = static_cast<float>(num_attr(c, "lr"));
  const Tensor params = read_tensor(c, "params0");
  const Tensor grads = read_tensor(c, "grads");      // (S, N)
  const Tensor expected = read_tensor(c, "params");  // (S, N) after each step
  const int64_t steps = grads.dim(0), n = grads.dim(1);
  EXPECT_EQ(params.numel(), n);

  auto opt = std::make_unique<Optimizer>(cfg, n);
  for (int64_t s = 0; s < steps; ++s) {
    // The optimizer may not modify the gradient it is given; give it a copy and check.
    const Tensor g = grads.slice(s, s + 1).reshape({n}).clone();
    opt->step(params, g, lr);
    if (!check) continue;
    EXPECT_EQ(opt->steps_taken(), s + 1);
    const Tensor want = expected.slice(s, s + 1).reshape({n});
    expect_close(name + "/step" + std::to_string(s + 1), params, want, s == 0 ? kOneStep : kFiveSteps);
    for (int64_t i = 0; i < n; ++i)
      EXPECT_EQ(g.data<float>()[i], grads.data<float>()[s * n + i]) << "gradient modified by the step";
  }
  return opt;
}

const auto kOptimCases = ::testing::Values("sgd_momentum", "sgd_nesterov", "sgd_plain", "adamw", "adamw_default_betas");
auto case_name = [](const ::testing::TestParamInfo<std::string>& p) { return p.param; };

class OptimizerParity : public ::testing::TestWithParam<std::string> {};

TEST_P(OptimizerParity, FiveStepsMatchTorchOptim) { run_steps(GetParam(), true); }

INSTANTIATE_TEST_SUITE_P(Torch, OptimizerParity, kOptimCases, case_name);

// The optimizer state (saved in checkpoints) after the 5 steps matches torch's too.
class OptimizerStateParity : public ::testing::TestWithParam<std::string> {};

TEST_P(OptimizerStateParity, StateAfterFiveStepsMatchesTorch) {
  const std::unique_ptr<Optimizer> opt = run_steps(GetParam(), false);
  const io::h5::Group state = open_group(ref_file(), "optim/" + GetParam() + "/state");
  const auto mine = opt->state();
  EXPECT_EQ(mine.size(), children(state).size());
  for (const auto& [name, tensor] : mine) {
    ASSERT_TRUE(io::h5::exists(state, name)) << "torch has no state " << name;
    expect_close(GetParam() + "/state/" + name, tensor, read_tensor(state, name), kFiveSteps);
  }
}

INSTANTIATE_TEST_SUITE_P(Torch, OptimizerStateParity, kOptimCases, case_name);

TEST(OptimizerParity, UnknownOptimizerIsAnInputError) {
  OptimizerConfig cfg;
  cfg.name = "adagrad";
  try {
    Optimizer opt(cfg, 4);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::Input);
    EXPECT_NE(e.message().find("adagrad"), std::string::npos) << e.message();
  }
}

// ---- learning-rate schedules -----------------------------------------------------------------

class ScheduleParity : public ::testing::TestWithParam<std::string> {};

TEST_P(ScheduleParity, MatchesTorchScheduler) {
  const io::h5::Group c = open_group(ref_file(), "sched/" + GetParam());
  LrScheduleConfig cfg;
  cfg.kind = io::h5::read_attr_string(c, "kind");
  cfg.lr = static_cast<float>(num_attr(c, "lr"));
  if (io::h5::has_attr(c, "warmup_steps")) cfg.warmup_steps = int_attr(c, "warmup_steps");
  if (io::h5::has_attr(c, "total_steps")) cfg.total_steps = int_attr(c, "total_steps");
  if (io::h5::has_attr(c, "step_size")) cfg.step_size = int_attr(c, "step_size");
  if (io::h5::has_attr(c, "gamma")) cfg.gamma = static_cast<float>(num_attr(c, "gamma"));
  if (io::h5::has_attr(c, "min_lr")) cfg.min_lr = static_cast<float>(num_attr(c, "min_lr"));
  if (io::h5::has_attr(c, "decay_steps")) cfg.decay_steps = int_attr(c, "decay_steps");
  if (io::h5::has_attr(c, "decay_shape")) cfg.decay_shape = io::h5::read_attr_string(c, "decay_shape");

  auto check = [&](const std::vector<double>& want, const char* which) {
    ASSERT_FALSE(want.empty());
    for (size_t s = 0; s < want.size(); ++s) {
      const double got = learning_rate(cfg, static_cast<int64_t>(s));
      EXPECT_LE(std::abs(got - want[s]), 1e-6 * std::abs(want[s]) + 1e-9)
          << GetParam() << " (" << which << ") step " << s << ": " << got << " vs " << want[s];
    }
  };
  check(read_doubles(c, "lr"), io::h5::read_attr_string(c, "reference").c_str());
  // For warm-up + cosine the reference is the written-out formula; torch's own composition
  // (SequentialLR of LinearLR and CosineAnnealingLR) is recorded over the first period too.
  if (io::h5::exists(c, "lr_torch_sequential")) check(read_doubles(c, "lr_torch_sequential"), "torch SequentialLR");
}

INSTANTIATE_TEST_SUITE_P(Torch, ScheduleParity,
                         ::testing::Values("constant", "step", "constant_warmup", "step_warmup", "cosine",
                                           "cosine_warmup", "linear", "linear_warmup", "wsd", "wsd_sqrt", "wsd_cosine"),
                         [](const ::testing::TestParamInfo<std::string>& p) { return p.param; });

TEST(ScheduleParity, UnknownKindIsAnInputError) {
  LrScheduleConfig cfg;
  cfg.kind = "exponential";
  try {
    learning_rate(cfg, 3);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::Input);
    EXPECT_NE(e.message().find("exponential"), std::string::npos) << e.message();
  }
}

// ---- clipping --------------------------------------------------------------------------------

class ClipParity : public ::testing::TestWithParam<std::string> {};

TEST_P(ClipParity, MatchesClipGradNorm) {
  const io::h5::Group c = open_group(ref_file(), "clip/" + GetParam());
  const Tensor grads = read_tensor(c, "grads");
  const float max_norm = static_cast<float>(num_attr(c, "max_norm"));
  const double norm = clip_by_global_norm(grads, ops::sum_squares(grads), max_norm);
  const double want = read_doubles(c, "norm").at(0);
  EXPECT_LE(std::abs(norm - want), 1e-6 * want) << norm << " vs " << want;
  expect_close(GetParam() + "/clipped", grads, read_tensor(c, "clipped"), kOneStep);
}

INSTANTIATE_TEST_SUITE_P(Torch, ClipParity, ::testing::Values("clip_active", "clip_inactive"),
                         [](const ::testing::TestParamInfo<std::string>& p) { return p.param; });

}  // namespace
}  // namespace strata::layers
