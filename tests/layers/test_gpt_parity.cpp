// PyTorch parity of the GPT model: a nanoGPT-style GPT written out in torch
// (tests/layers/torch_reference.py, /gpt/<case>), 2 layers, 2 heads, width 32, T 16, vocabulary
// 256, batch 2, with and without tied embeddings, starting from Strata's own initial values.
// Logits, the loss and every parameter gradient within 1e-5 (norm-wise relative; per element
// 1e-5 * |ref| + 1e-5 * max|ref|, compare.hpp); then 20 AdamW steps (weight decay 0.1 on the
// decay group only, torch.optim.AdamW with two param groups) give the same losses within 1e-4
// relative, and the same parameters within 1e-4 norm-wise.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "layers/compare.hpp"
#include "layers/loss.hpp"
#include "layers/model.hpp"
#include "layers/optimizer.hpp"
#include "layers/parameter_store.hpp"
#include "layers/torch_ref.hpp"
#include "layers/zoo.hpp"

namespace strata::layers {
namespace {

using testing::count_datasets;
using testing::expect_close;
using testing::int_attr;
using testing::num_attr;
using testing::open_group;
using testing::read_doubles;
using testing::read_tensor;
using testing::Tolerance;

const Tolerance kTol{1e-5, 1e-5, 1e-5};

[[maybe_unused]] auto* const kReporter = ::testing::AddGlobalTestEnvironment(new testing::WorstErrorReporter);

const io::h5::File& ref_file() {
  static const io::h5::File file = testing::open_torch_ref();
  return file;
}

struct Case {
  io::h5::Group group;
  ModelSpec spec;
  std::unique_ptr<Model> model;
  std::unique_ptr<ParameterStore> store;
  int64_t batch = 0, t = 0;
};

// Builds the case's model and checks that Strata's initial values are the reference's:
// bit-identical but for the last bit of Normal draws (Box-Muller's log and cos in libm vs numpy
// may round differently); then copies the reference values in.
Case load(const std::string& name) {
  Case c{open_group(ref_file(), "gpt/" + name), {}, nullptr, nullptr};
  c.spec.name = "gpt";
  c.spec.layers = static_cast<int>(int_attr(c.group, "layers"));
  c.spec.heads = static_cast<int>(int_attr(c.group, "heads"));
  c.spec.embed = int_attr(c.group, "embed");
  c.spec.seq_len = int_attr(c.group, "seq_len");
  c.spec.tie_embeddings = int_attr(c.group, "tied") != 0;
  const int vocab = static_cast<int>(int_attr(c.group, "vocab"));
  const Tensor x = read_tensor(c.group, "input", DType::I32);
  c.batch = x.dim(0);
  c.t = x.dim(1);
  c.model = std::make_unique<Model>(build_model(c.spec, {c.t}, vocab));
  c.store = std::make_unique<ParameterStore>(*c.model, static_cast<uint64_t>(int_attr(c.group, "seed")));
  const io::h5::Group params = open_group(c.group, "params");
  EXPECT_EQ(count_datasets(params), c.store->entries().size()) << "parameter count, reference vs Strata";
  for (const ParamEntry& e : c.store->entries()) {
    EXPECT_TRUE(io::h5::exists(params, e.name)) << "no reference parameter " << e.name;
    if (!io::h5::exists(params, e.name)) continue;
    const Tensor ref = read_tensor(params, e.name);
    EXPECT_EQ(ref.numel(), shape_numel(e.shape)) << e.name;
    const Tensor mine = c.store->value(e);
    int64_t differ = 0;
    for (int64_t i = 0; i < ref.numel(); ++i) {
      const float a = mine.data<float>()[i], b = ref.data<float>()[i];
      differ += a != b && std::nextafter(a, b) != b;
    }
    EXPECT_EQ(differ, 0) << e.name << ": Strata's initial values differ from (seed, name) init";
    mine.copy_from(ref);
  }
  return c;
}

// Forward, mean loss over the tokens, backward into the store's (zeroed) gradients.
double forward_backward(const Case& c, const Tensor& x, const Tensor& labels, Tensor* logits_out = nullptr) {
  c.store->grads().fill_zero();
  StepInfo info;
  info.mode = Mode::Train;
  std::vector<Context> ctx;
  const Tensor logits = c.model->forward(x, ctx, info);
  if (logits_out) *logits_out = logits;
  SoftmaxCrossEntropy loss;
  Context lctx;
  const double tokens = static_cast<double>(x.numel());
  const double mean = loss.forward(logits, labels, lctx) / tokens;
  c.model->backward(loss.backward(lctx, static_cast<float>(1.0 / tokens)), ctx);
  return mean;
}

class GptParity : public ::testing::TestWithParam<std::string> {};

TEST_P(GptParity, LogitsLossAndEveryGradientMatchTorch) {
  const Case c = load(GetParam());
  Tensor logits;
  const double mean = forward_backward(c, read_tensor(c.group, "input", DType::I32),
                                       read_tensor(c.group, "labels", DType::I32), &logits);
  expect_close(GetParam() + "/logits", logits, read_tensor(c.group, "logits"), kTol);
  Tensor loss = Tensor::zeros({1});
  loss.data<float>()[0] = static_cast<float>(mean);
  expect_close(GetParam() + "/loss", loss, read_tensor(c.group, "loss"), kTol);
  EXPECT_EQ(count_datasets(open_group(c.group, "grads")), c.store->entries().size());
  for (const ParamEntry& e : c.store->entries())
    expect_close(GetParam() + "/grad_" + e.name, c.store->grad(e),
                 read_tensor(c.group, "grads/" + e.name).reshape(e.shape), kTol);
}

TEST_P(GptParity, TwentyAdamWStepsWithParameterGroupsMatchTorch) {
  const Case c = load(GetParam());
  OptimizerConfig cfg;
  cfg.name = "adamw";
  cfg.weight_decay = static_cast<float>(num_attr(c.group, "weight_decay"));
  cfg.beta1 = num_attr(c.group, "beta1");
  cfg.beta2 = num_attr(c.group, "beta2");
  cfg.eps = static_cast<float>(num_attr(c.group, "eps"));
  const float lr = static_cast<float>(num_attr(c.group, "lr"));
  const Tensor& params = c.store->params();
  Optimizer opt(cfg, params.numel());
  opt.set_no_decay(no_decay_ranges(c.store->entries(), 0, params.numel()));
  EXPECT_FALSE(opt.no_decay().empty());

  const Tensor xs = read_tensor(c.group, "train_input", DType::I32);
  const Tensor ys = read_tensor(c.group, "train_labels", DType::I32);
  const std::vector<double> want = read_doubles(c.group, "train_loss");
  ASSERT_EQ(static_cast<int64_t>(want.size()), int_attr(c.group, "steps"));
  double worst = 0;
  for (int64_t s = 0; s < xs.dim(0); ++s) {
    const Tensor x = xs.slice(s, s + 1).reshape({c.batch, c.t});
    const Tensor y = ys.slice(s, s + 1).reshape({c.batch, c.t});
    const double loss = forward_backward(c, x, y);
    const double rel = std::abs(loss - want[static_cast<size_t>(s)]) / std::abs(want[static_cast<size_t>(s)]);
    worst = std::max(worst, rel);
    EXPECT_LE(rel, 1e-4) << "step " << s << ": loss " << loss << " vs torch " << want[static_cast<size_t>(s)];
    opt.step(params, c.store->grads(), lr);
  }
  std::printf("[ adamw   ] %s: worst relative loss error over %zu steps %.3e (loss %.4f -> %.4f)\n", GetParam().c_str(),
              want.size(), worst, want.front(), want.back());
  // The parameters after the last step; not the c_attn biases, whose key third has a zero
  // gradient in exact arithmetic (softmax is invariant to q.b_k), so that AdamW normalises
  // float noise there into full steps whose direction is arbitrary (and harmless to the loss).
  for (const ParamEntry& e : c.store->entries()) {
    if (e.name.ends_with("c_attn/bias")) continue;
    const Tensor mine = c.store->value(e), ref = read_tensor(c.group, "final/" + e.name).reshape(e.shape);
    double diff2 = 0, ref2 = 0;
    for (int64_t i = 0; i < ref.numel(); ++i) {
      const double d = static_cast<double>(mine.data<float>()[i]) - ref.data<float>()[i];
      diff2 += d * d;
      ref2 += static_cast<double>(ref.data<float>()[i]) * ref.data<float>()[i];
    }
    EXPECT_LE(std::sqrt(diff2 / std::max(ref2, 1e-30)), 1e-4) << e.name << " after the steps";
  }
}

INSTANTIATE_TEST_SUITE_P(Torch, GptParity, ::testing::Values("tied", "untied"),
                         [](const ::testing::TestParamInfo<std::string>& p) { return p.param; });

}  // namespace
}  // namespace strata::layers
