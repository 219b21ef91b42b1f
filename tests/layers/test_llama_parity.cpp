// PyTorch parity of the Llama model: Hugging Face's LlamaModel written out in plain torch
// (tests/layers/torch_reference.py, /llama/<case>: RMSNorm, rotate-half rotary embeddings,
// grouped-query attention by repeat_interleave of the kv heads, SwiGLU), 2 layers, width 32,
// T 12, vocabulary 64, batch 2: grouped-query (4 heads, 2 kv heads, untied), multi-query with
// Llama 3.1's frequency scaling and a tied head, and multi-head. Strata's initial values are
// checked against (seed, name), then random values (torch's) are loaded, so attention is far from
// uniform; logits, the loss and every parameter gradient within 1e-5 (compare.hpp's norm-wise
// and per-element tolerance).
#include <gtest/gtest.h>

#include <cmath>

#include "layers/compare.hpp"
#include "layers/loss.hpp"
#include "layers/model.hpp"
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
using testing::read_tensor;
using testing::Tolerance;

const Tolerance kTol{1e-5, 1e-5, 1e-5};

[[maybe_unused]] auto* const kReporter = ::testing::AddGlobalTestEnvironment(new testing::WorstErrorReporter);

const io::h5::File& ref_file() {
  static const io::h5::File file = testing::open_torch_ref();
  return file;
}

class LlamaParity : public ::testing::TestWithParam<std::string> {};

TEST_P(LlamaParity, LogitsLossAndEveryGradientMatchTorch) {
  const io::h5::Group group = open_group(ref_file(), "llama/" + GetParam());
  ModelSpec spec;
  spec.name = "llama";
  spec.layers = static_cast<int>(int_attr(group, "layers"));
  spec.heads = static_cast<int>(int_attr(group, "heads"));
  spec.kv_heads = static_cast<int>(int_attr(group, "kv_heads"));
  spec.embed = int_attr(group, "embed");
  spec.ffn_hidden = int_attr(group, "ffn_hidden");
  spec.norm_eps = num_attr(group, "norm_eps");
  spec.rope_theta = num_attr(group, "rope_theta");
  spec.rope_scaling = num_attr(group, "rope_scaling");
  spec.tie_embeddings = int_attr(group, "tied") != 0;
  const int vocab = static_cast<int>(int_attr(group, "vocab"));
  const Tensor x = read_tensor(group, "input", DType::I32), labels = read_tensor(group, "labels", DType::I32);
  Model model = build_model(spec, {x.dim(1)}, vocab);
  ParameterStore store(model, static_cast<uint64_t>(int_attr(group, "seed")));

  // Names are Hugging Face's ('/' for '.'); initial values Strata's (seed, name) draws, up to the
  // last bit of a Normal draw (libm vs numpy).
  const io::h5::Group init = open_group(group, "init"), params = open_group(group, "params");
  EXPECT_EQ(count_datasets(params), store.entries().size()) << "parameter count, reference vs Strata";
  for (const ParamEntry& e : store.entries()) {
    ASSERT_TRUE(io::h5::exists(params, e.name)) << "no reference parameter " << e.name;
    const Tensor want = read_tensor(init, e.name), mine = store.value(e);
    ASSERT_EQ(want.numel(), shape_numel(e.shape)) << e.name;
    int64_t differ = 0;
    for (int64_t i = 0; i < want.numel(); ++i) {
      const float a = mine.data<float>()[i], b = want.data<float>()[i];
      differ += a != b && std::nextafter(a, b) != b;
    }
    EXPECT_EQ(differ, 0) << e.name << ": Strata's initial values differ from (seed, name) init";
    mine.copy_from(read_tensor(params, e.name).reshape(e.shape));
  }

  store.grads().fill_zero();
  StepInfo info;
  std::vector<Context> ctx;
  const Tensor logits = model.forward(x, ctx, info);
  SoftmaxCrossEntropy loss;
  Context lctx;
  const double tokens = static_cast<double>(x.numel());
  Tensor mean = Tensor::zeros({1});
  mean.data<float>()[0] = static_cast<float>(loss.forward(logits, labels, lctx) / tokens);
  model.backward(loss.backward(lctx, static_cast<float>(1.0 / tokens)), ctx);

  expect_close(GetParam() + "/logits", logits, read_tensor(group, "logits"), kTol);
  expect_close(GetParam() + "/loss", mean, read_tensor(group, "loss"), kTol);
  for (const ParamEntry& e : store.entries())
    expect_close(GetParam() + "/grad_" + e.name, store.grad(e), read_tensor(group, "grads/" + e.name).reshape(e.shape),
                 kTol);
}

INSTANTIATE_TEST_SUITE_P(Torch, LlamaParity, ::testing::Values("gqa", "mqa_tied_scaled", "mha"),
                         [](const ::testing::TestParamInfo<std::string>& p) { return p.param; });

}  // namespace
}  // namespace strata::layers
