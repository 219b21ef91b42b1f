// PyTorch parity: every layer, the loss and the zoo models (mlp, cnn, resnet-8) against
// torch.nn in float32, from the file tests/layers/torch_reference.py writes (CTest fixture
// torch_ref). Outputs and all gradients must agree within 1e-5 norm-wise relative error and
// per element within 1e-5 * |ref| + 1e-5 * max|ref| (see compare.hpp for why the absolute part
// scales with the tensor).
#include <gtest/gtest.h>

#include <algorithm>
#include <memory>
#include <set>
#include <sstream>

#include "layers/basic.hpp"
#include "layers/compare.hpp"
#include "layers/composite.hpp"
#include "layers/h5_reader.hpp"
#include "layers/loss.hpp"
#include "layers/model.hpp"

namespace strata::layers {
namespace {

using testing::expect_close;
using testing::H5File;
using testing::H5Group;
using testing::Tolerance;

const Tolerance kTol{1e-5, 1e-5, 1e-5};

[[maybe_unused]] auto* const kReporter = ::testing::AddGlobalTestEnvironment(new testing::WorstErrorReporter);

const H5File& ref_file() {
  static const H5File file(testing::torch_ref_path());
  return file;
}

// The cases this test knows how to build; the file must hold exactly these.
const std::vector<std::string> kLayerCases = {
    "linear_bias",
    "linear_nobias",
    "conv_k3_s1_p0",
    "conv_k3_s1_p1",
    "conv_k3_s2_p1",
    "conv_k3_s2_p0_nobias",
    "conv_k1_s1_p0",
    "conv_k1_s2_p0_nobias",
    "maxpool_k2_s2",
    "maxpool_k3_s2_p1",
    "maxpool_k3_s1",
    "avgpool_k2_s2",
    "avgpool_k3_s2_p1",
    "avgpool_k3_s1_p1",
    "global_avg_pool",
    "relu",
    "gelu",
    "dropout",
    "flatten",
    "batchnorm_train",
    "batchnorm_eval",
    "layernorm_2d",
    "layernorm_3d",
    "residual_identity",
    "residual_projection",
    "softmax_xent",
};
const std::vector<std::string> kModelCases = {"mlp", "cnn", "resnet8"};

// A layer as described by a case group's attributes.
LayerPtr make_layer(const H5Group& c) {
  const std::string kind = c.str_attr("kind");
  if (kind == "linear")
    return std::make_unique<Linear>("linear", c.int_attr("in_features"), c.int_attr("out_features"),
                                    c.int_attr("bias") != 0);
  if (kind == "conv2d")
    return std::make_unique<Conv2d>("conv", c.int_attr("in_channels"), c.int_attr("out_channels"), c.int_attr("kernel"),
                                    c.int_attr("stride"), c.int_attr("padding"), c.int_attr("bias") != 0);
  if (kind == "pool2d")
    return std::make_unique<Pool2d>("pool", c.str_attr("pool") == "max" ? PoolKind::Max : PoolKind::Avg,
                                    c.int_attr("kernel"), c.int_attr("stride"), c.int_attr("padding"));
  if (kind == "global_avg_pool") return std::make_unique<GlobalAvgPool>("gap");
  if (kind == "relu") return std::make_unique<ActivationLayer>("relu", Activation::ReLU);
  if (kind == "gelu") return std::make_unique<ActivationLayer>("gelu", Activation::GELU);
  if (kind == "dropout") return std::make_unique<Dropout>("dropout", static_cast<float>(c.num_attr("p")));
  if (kind == "flatten") return std::make_unique<Flatten>("flatten");
  if (kind == "batchnorm2d")
    return std::make_unique<BatchNorm2d>("bn", c.int_attr("channels"), static_cast<float>(c.num_attr("momentum")),
                                         static_cast<float>(c.num_attr("eps")));
  if (kind == "layernorm")
    return std::make_unique<LayerNorm>("ln", c.int_attr("features"), static_cast<float>(c.num_attr("eps")));
  if (kind == "residual_basic")
    return ResidualBlock::basic("block", c.int_attr("in_channels"), c.int_attr("out_channels"), c.int_attr("stride"));
  throw std::runtime_error("unknown layer kind " + kind);
}

// Parameters read from the case's params/ group, bound to the layer; gradients zeroed.
struct Bound {
  std::vector<ParamSpec> specs;
  std::vector<Tensor> values, grads;
};

Bound bind_from_file(Layer& layer, const H5Group& c) {
  Bound b;
  b.specs = layer.param_specs();
  for (const ParamSpec& s : b.specs) {
    Tensor v = c.group("params").tensor(s.name);
    EXPECT_EQ(shape_str(v.shape()), shape_str(s.shape)) << "param " << s.name;
    b.values.push_back(v.reshape(s.shape));
    b.grads.push_back(s.trainable ? Tensor::zeros(s.shape) : Tensor());
  }
  // Every reference parameter is one of the layer's and the other way round.
  const size_t n_ref = c.has("params") ? c.group("params").dataset_paths().size() : 0;
  EXPECT_EQ(n_ref, b.specs.size()) << "parameters in the reference vs the layer's param_specs()";
  layer.bind(b.values, b.grads);
  return b;
}

class LayerParity : public ::testing::TestWithParam<std::string> {};

TEST_P(LayerParity, ForwardBackwardMatchTorch) {
  const std::string name = GetParam();
  const H5Group c = ref_file().root().group("layers").group(name);
  const Tensor x = c.tensor("input");

  if (name == "softmax_xent") {
    // Strata returns the sum and scales backward by 1/B; torch gives the mean.
    const Tensor labels = c.int_tensor("labels");
    const int64_t batch = x.dim(0);
    SoftmaxCrossEntropy loss;
    Context ctx;
    const double sum = loss.forward(x, labels, ctx);
    Tensor mean = Tensor::zeros({1});
    mean.data<float>()[0] = static_cast<float>(sum / static_cast<double>(batch));
    expect_close(name + "/loss", mean, c.tensor("output"), kTol);
    const Tensor dlogits = loss.backward(ctx, 1.0f / static_cast<float>(batch));
    expect_close(name + "/grad_input", dlogits, c.tensor("grad_input"), kTol);
    return;
  }

  LayerPtr layer = make_layer(c);
  StepInfo info;
  info.mode = c.str_attr("mode") == "train" ? Mode::Train : Mode::Eval;
  if (c.str_attr("kind") == "dropout") {
    layer->set_index(static_cast<int>(c.int_attr("index")));
    info.seed = static_cast<uint64_t>(c.int_attr("seed"));
    info.step = c.int_attr("step");
    info.first_sample = c.int_attr("first_sample");
  }
  Bound bound = bind_from_file(*layer, c);
  const Shape sample(x.shape().begin() + 1, x.shape().end());
  const Shape out_sample = layer->output_shape(sample);

  Context ctx;
  const Tensor y = layer->forward(x, ctx, info);
  EXPECT_EQ(shape_str(y.shape()), shape_str(batch_shape(x.dim(0), out_sample))) << "output_shape() vs forward";
  expect_close(name + "/output", y, c.tensor("output"), kTol);

  for (size_t k = 0; k < bound.specs.size(); ++k)
    if (!bound.specs[k].trainable) {
      const std::string n = bound.specs[k].name;
      expect_close(name + "/updated/" + n, bound.values[k], c.group("updated").tensor(n), kTol);
    }

  if (info.mode == Mode::Eval) {
    EXPECT_FALSE(c.has("grad_output"));
    return;
  }
  const Tensor dx = layer->backward(c.tensor("grad_output"), ctx);
  expect_close(name + "/grad_input", dx, c.tensor("grad_input"), kTol);
  for (size_t k = 0; k < bound.specs.size(); ++k)
    if (bound.specs[k].trainable) {
      const std::string n = bound.specs[k].name;
      expect_close(name + "/grad_" + n, bound.grads[k], c.group("grads").tensor(n).reshape(bound.specs[k].shape), kTol);
    }
}

INSTANTIATE_TEST_SUITE_P(Torch, LayerParity, ::testing::ValuesIn(kLayerCases),
                         [](const ::testing::TestParamInfo<std::string>& p) { return p.param; });

TEST(LayerParity, ReferenceHoldsExactlyTheKnownCases) {
  const std::vector<std::string> layers = ref_file().root().group("layers").children();
  EXPECT_EQ(std::set<std::string>(layers.begin(), layers.end()),
            std::set<std::string>(kLayerCases.begin(), kLayerCases.end()));
  const std::vector<std::string> models = ref_file().root().group("models").children();
  EXPECT_EQ(std::set<std::string>(models.begin(), models.end()),
            std::set<std::string>(kModelCases.begin(), kModelCases.end()));
}

// The dropout reference mask is Strata's documented one recomputed in python; the mask
// must drop a plausible fraction, or the case would test little.
TEST(LayerParity, DropoutReferenceMaskIsNotTrivial) {
  const H5Group c = ref_file().root().group("layers").group("dropout");
  const Tensor keep = c.tensor("keep");
  int64_t kept = 0;
  for (int64_t i = 0; i < keep.numel(); ++i) kept += keep.data<float>()[i] != 0.0f;
  const double p = c.num_attr("p");
  EXPECT_GT(kept, 0);
  EXPECT_LT(kept, keep.numel());
  EXPECT_NEAR(static_cast<double>(kept) / keep.numel(), 1.0 - p, 0.2);
}

// ---- whole models ----------------------------------------------------------------------------

std::vector<int64_t> parse_hidden(const std::string& s) {
  std::vector<int64_t> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) out.push_back(std::stoll(item));
  return out;
}

class ModelParity : public ::testing::TestWithParam<std::string> {};

TEST_P(ModelParity, LogitsLossAndEveryGradientMatchTorch) {
  const H5Group c = ref_file().root().group("models").group(GetParam());
  ModelSpec spec;
  spec.name = c.str_attr("model");
  if (c.has_attr("hidden")) spec.hidden = parse_hidden(c.str_attr("hidden"));
  if (c.has_attr("depth")) spec.depth = static_cast<int>(c.int_attr("depth"));
  if (c.has_attr("width")) spec.width = static_cast<int>(c.int_attr("width"));
  const Tensor x = c.tensor("input");
  const Tensor labels = c.int_tensor("labels");
  const int classes = static_cast<int>(c.int_attr("classes"));
  const Model model = build_model(spec, Shape(x.shape().begin() + 1, x.shape().end()), classes);
  const ParameterStore store(model, static_cast<uint64_t>(c.int_attr("seed")));

  // Strata's own initial values must be the ones the reference recomputed from (seed, name)
  // and loaded into torch by name; then they are copied in (a no-op when they agree).
  const H5Group params = c.group("params");
  EXPECT_EQ(params.dataset_paths().size(), store.entries().size()) << "parameter count, reference vs Strata";
  for (const ParamEntry& e : store.entries()) {
    ASSERT_TRUE(params.has(e.name)) << "no reference parameter " << e.name;
    const Tensor ref = params.tensor(e.name);
    ASSERT_EQ(ref.numel(), shape_numel(e.shape)) << e.name;
    const Tensor mine = store.value(e);
    int64_t differ = 0;
    for (int64_t i = 0; i < ref.numel(); ++i) differ += mine.data<float>()[i] != ref.data<float>()[i];
    EXPECT_EQ(differ, 0) << e.name << ": Strata's initial values differ from (seed, name) init";
    mine.copy_from(ref);
  }

  StepInfo info;
  info.mode = Mode::Train;
  std::vector<Context> ctx;
  const Tensor logits = model.forward(x, ctx, info);
  expect_close(GetParam() + "/logits", logits, c.tensor("logits"), kTol);

  const int64_t batch = x.dim(0);
  SoftmaxCrossEntropy loss;
  Context lctx;
  const double sum = loss.forward(logits, labels, lctx);
  Tensor mean = Tensor::zeros({1});
  mean.data<float>()[0] = static_cast<float>(sum / static_cast<double>(batch));
  expect_close(GetParam() + "/loss", mean, c.tensor("loss"), kTol);

  const Tensor dx = model.backward(loss.backward(lctx, 1.0f / static_cast<float>(batch)), ctx, 0, SIZE_MAX, {},
                                   /*input_grad=*/true);
  expect_close(GetParam() + "/grad_input", dx, c.tensor("grad_input"), kTol);
  for (const ParamEntry& e : store.entries()) {
    if (e.trainable)
      expect_close(GetParam() + "/grad_" + e.name, store.grad(e), c.group("grads").tensor(e.name).reshape(e.shape),
                   kTol);
    else
      expect_close(GetParam() + "/updated/" + e.name, store.value(e),
                   c.group("updated").tensor(e.name).reshape(e.shape), kTol);
  }
}

INSTANTIATE_TEST_SUITE_P(Torch, ModelParity, ::testing::ValuesIn(kModelCases),
                         [](const ::testing::TestParamInfo<std::string>& p) { return p.param; });

}  // namespace
}  // namespace strata::layers
