// Optimizers, learning-rate schedules and gradient clipping against torch.optim, from the
// reference file written by tests/layers/torch_reference.py (CTest fixture torch_ref).
// Tolerances: 1e-6 relative for one step, 1e-5 after 5 steps (errors compound through the
// optimizer state); per element the absolute part scales with the tensor (compare.hpp).
#include <gtest/gtest.h>

#include <cmath>
#include <memory>

#include "layers/compare.hpp"
#include "layers/h5_reader.hpp"
#include "layers/optimizer.hpp"

namespace strata::layers {
namespace {

using testing::expect_close;
using testing::H5File;
using testing::H5Group;
using testing::Tolerance;

const Tolerance kOneStep{1e-6, 1e-6, 1e-6};
const Tolerance kFiveSteps{1e-5, 1e-5, 1e-5};

[[maybe_unused]] auto* const kReporter = ::testing::AddGlobalTestEnvironment(new testing::WorstErrorReporter);

const H5File& ref_file() {
  static const H5File file(testing::torch_ref_path());
  return file;
}

// Runs the case's 5 steps; checks the parameters after each step when `check` is set.
std::unique_ptr<Optimizer> run_steps(const std::string& name, bool check) {
  const H5Group c = ref_file().root().group("optim").group(name);
  OptimizerConfig cfg;
  cfg.name = c.str_attr("name");
  cfg.weight_decay = static_cast<float>(c.num_attr("weight_decay"));
  if (cfg.name == "sgd") {
    cfg.momentum = static_cast<float>(c.num_attr("momentum"));
    cfg.nesterov = c.int_attr("nesterov") != 0;
  } else {
    cfg.beta1 = c.num_attr("beta1");
    cfg.beta2 = c.num_attr("beta2");
    cfg.eps = static_cast<float>(c.num_attr("eps"));
  }
  const float lr = static_cast<float>(c.num_attr("lr"));
  const Tensor params = c.tensor("params0");
  const Tensor grads = c.tensor("grads");      // (S, N)
  const Tensor expected = c.tensor("params");  // (S, N) after each step
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
  const H5Group state = ref_file().root().group("optim").group(GetParam()).group("state");
  const auto mine = opt->state();
  EXPECT_EQ(mine.size(), state.children().size());
  for (const auto& [name, tensor] : mine) {
    ASSERT_TRUE(state.has(name)) << "torch has no state " << name;
    expect_close(GetParam() + "/state/" + name, tensor, state.tensor(name), kFiveSteps);
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
  const H5Group c = ref_file().root().group("sched").group(GetParam());
  LrScheduleConfig cfg;
  cfg.kind = c.str_attr("kind");
  cfg.lr = static_cast<float>(c.num_attr("lr"));
  if (c.has_attr("warmup_steps")) cfg.warmup_steps = c.int_attr("warmup_steps");
  if (c.has_attr("total_steps")) cfg.total_steps = c.int_attr("total_steps");
  if (c.has_attr("step_size")) cfg.step_size = c.int_attr("step_size");
  if (c.has_attr("gamma")) cfg.gamma = static_cast<float>(c.num_attr("gamma"));
  if (c.has_attr("min_lr")) cfg.min_lr = static_cast<float>(c.num_attr("min_lr"));

  auto check = [&](const std::vector<double>& want, const char* which) {
    ASSERT_FALSE(want.empty());
    for (size_t s = 0; s < want.size(); ++s) {
      const double got = learning_rate(cfg, static_cast<int64_t>(s));
      EXPECT_LE(std::abs(got - want[s]), 1e-6 * std::abs(want[s]) + 1e-9)
          << GetParam() << " (" << which << ") step " << s << ": " << got << " vs " << want[s];
    }
  };
  check(c.doubles("lr"), c.str_attr("reference").c_str());
  // For warm-up + cosine the reference is the written-out formula; torch's own composition
  // (SequentialLR of LinearLR and CosineAnnealingLR) is recorded over the first period too.
  if (c.has("lr_torch_sequential")) check(c.doubles("lr_torch_sequential"), "torch SequentialLR");
}

INSTANTIATE_TEST_SUITE_P(Torch, ScheduleParity,
                         ::testing::Values("constant", "step", "constant_warmup", "step_warmup", "cosine",
                                           "cosine_warmup"),
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
  const H5Group c = ref_file().root().group("clip").group(GetParam());
  const Tensor grads = c.tensor("grads");
  const float max_norm = static_cast<float>(c.num_attr("max_norm"));
  const double norm = clip_by_global_norm(grads, ops::sum_squares(grads), max_norm);
  const double want = c.scalar("norm");
  EXPECT_LE(std::abs(norm - want), 1e-6 * want) << norm << " vs " << want;
  expect_close(GetParam() + "/clipped", grads, c.tensor("clipped"), kOneStep);
}

INSTANTIATE_TEST_SUITE_P(Torch, ClipParity, ::testing::Values("clip_active", "clip_inactive"),
                         [](const ::testing::TestParamInfo<std::string>& p) { return p.param; });

}  // namespace
}  // namespace strata::layers
