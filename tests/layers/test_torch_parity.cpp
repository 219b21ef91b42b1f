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
#include "layers/loss.hpp"
#include "layers/model.hpp"
#include "layers/parameter_store.hpp"
#include "layers/torch_ref.hpp"
#include "layers/zoo.hpp"

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

const Tolerance kTol{1e-5, 1e-5, 1e-5};

[[maybe_unused]] auto* const kReporter = ::testing::AddGlobalTestEnvironment(new testing::WorstErrorReporter);

const io::h5::File& ref_file() {
  static const io::h5::File file = testing::open_torch_ref();
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
LayerPtr make_layer(const io::h5::Group& c) {
  const std::string kind = io::h5::read_attr_string(c, "kind");
  if (kind == "linear")
    return std::make_unique<Linear>("linear", int_attr(c, "in_features"), int_attr(c, "out_features"),
                                    int_attr(c, "bias") != 0);
  if (kind == "conv2d")
    return std::make_unique<Conv2d>("conv", int_attr(c, "in_channels"), int_attr(c, "out_channels"),
                                    int_attr(c, "kernel"), int_attr(c, "stride"), int_attr(c, "padding"),
                                    int_attr(c, "bias") != 0);
  if (kind == "pool2d")
    return std::make_unique<Pool2d>("pool",
                                    io::h5::read_attr_string(c, "pool") == "max" ? PoolKind::Max : PoolKind::Avg,
                                    int_attr(c, "kernel"), int_attr(c, "stride"), int_attr(c, "padding"));
  if (kind == "global_avg_pool") return std::make_unique<GlobalAvgPool>("gap");
  if (kind == "relu") return std::make_unique<ActivationLayer>("relu", Activation::ReLU);
  if (kind == "gelu") return std::make_unique<ActivationLayer>("gelu", Activation::GELU);
  if (kind == "dropout") return std::make_unique<Dropout>("dropout", static_cast<float>(num_attr(c, "p")));
  if (kind == "flatten") return std::make_unique<Flatten>("flatten");
  if (kind == "batchnorm2d")
    return std::make_unique<BatchNorm2d>("bn", int_attr(c, "channels"), static_cast<float>(num_attr(c, "momentum")),
                                         static_cast<float>(num_attr(c, "eps")));
  if (kind == "layernorm")
    return std::make_unique<LayerNorm>("ln", int_attr(c, "features"), static_cast<float>(num_attr(c, "eps")));
  if (kind == "residual_basic")
    return ResidualBlock::basic("block", int_attr(c, "in_channels"), int_attr(c, "out_channels"),
                                int_attr(c, "stride"));
  throw std::runtime_error("unknown layer kind " + kind);
}

// Parameters read from the case's params/ group, bound to the layer; gradients zeroed.
struct Bound {
  std::vector<ParamSpec> specs;
  std::vector<Tensor> values, grads;
};

Bound bind_from_file(Layer& layer, const io::h5::Group& c) {
  Bound b;
  b.specs = layer.param_specs();
  for (const ParamSpec& s : b.specs) {
    Tensor v = read_tensor(c, "params/" + s.name);
    EXPECT_EQ(shape_str(v.shape()), shape_str(s.shape)) << "param " << s.name;
    b.values.push_back(v.reshape(s.shape));
    b.grads.push_back(s.trainable ? Tensor::zeros(s.shape) : Tensor());
  }
  // Every reference parameter is one of the layer's and the other way round.
  const size_t n_ref = io::h5::exists(c, "params") ? count_datasets(open_group(c, "params")) : 0;
  EXPECT_EQ(n_ref, b.specs.size()) << "parameters in the reference vs the layer's param_specs()";
  layer.bind(b.values, b.grads);
  return b;
}

class LayerParity : public ::testing::TestWithParam<std::string> {};

TEST_P(LayerParity, ForwardBackwardMatchTorch) {
  const std::string name = GetParam();
  const io::h5::Group c = open_group(ref_file(), "layers/" + name);
  const Tensor x = read_tensor(c, "input");

  if (name == "softmax_xent") {
    // Strata returns the sum and scales backward by 1/B; torch gives the mean.
    const Tensor labels = read_tensor(c, "labels", DType::I32);
    const int64_t batch = x.dim(0);
    SoftmaxCrossEntropy loss;
    Context ctx;
    const double sum = loss.forward(x, labels, ctx);
    Tensor mean = Tensor::zeros({1});
    mean.data<float>()[0] = static_cast<float>(sum / static_cast<double>(batch));
    expect_close(name + "/loss", mean, read_tensor(c, "output"), kTol);
    const Tensor dlogits = loss.backward(ctx, 1.0f / static_cast<float>(batch));
    expect_close(name + "/grad_input", dlogits, read_tensor(c, "grad_input"), kTol);
    return;
  }

  LayerPtr layer = make_layer(c);
  StepInfo info;
  info.mode = io::h5::read_attr_string(c, "mode") == "train" ? Mode::Train : Mode::Eval;
  if (io::h5::read_attr_string(c, "kind") == "dropout") {
    layer->set_index(static_cast<int>(int_attr(c, "index")));
    info.seed = static_cast<uint64_t>(int_attr(c, "seed"));
    info.step = int_attr(c, "step");
    info.first_sample = int_attr(c, "first_sample");
  }
  Bound bound = bind_from_file(*layer, c);
  const Shape sample(x.shape().begin() + 1, x.shape().end());
  const Shape out_sample = layer->output_shape(sample);

  Context ctx;
  const Tensor y = layer->forward(x, ctx, info);
  EXPECT_EQ(shape_str(y.shape()), shape_str(batch_shape(x.dim(0), out_sample))) << "output_shape() vs forward";
  expect_close(name + "/output", y, read_tensor(c, "output"), kTol);

  for (size_t k = 0; k < bound.specs.size(); ++k)
    if (!bound.specs[k].trainable) {
      const std::string n = bound.specs[k].name;
      expect_close(name + "/updated/" + n, bound.values[k], read_tensor(c, "updated/" + n), kTol);
    }

  if (info.mode == Mode::Eval) {
    EXPECT_FALSE(io::h5::exists(c, "grad_output"));
    return;
  }
  const Tensor dx = layer->backward(read_tensor(c, "grad_output"), ctx);
  expect_close(name + "/grad_input", dx, read_tensor(c, "grad_input"), kTol);
  for (size_t k = 0; k < bound.specs.size(); ++k)
    if (bound.specs[k].trainable) {
      const std::string n = bound.specs[k].name;
      expect_close(name + "/grad_" + n, bound.grads[k], read_tensor(c, "grads/" + n).reshape(bound.specs[k].shape),
                   kTol);
    }
}

INSTANTIATE_TEST_SUITE_P(Torch, LayerParity, ::testing::ValuesIn(kLayerCases),
                         [](const ::testing::TestParamInfo<std::string>& p) { return p.param; });

TEST(LayerParity, ReferenceHoldsExactlyTheKnownCases) {
  const std::vector<std::string> layers = children(open_group(ref_file(), "layers"));
  EXPECT_EQ(std::set<std::string>(layers.begin(), layers.end()),
            std::set<std::string>(kLayerCases.begin(), kLayerCases.end()));
  const std::vector<std::string> models = children(open_group(ref_file(), "models"));
  EXPECT_EQ(std::set<std::string>(models.begin(), models.end()),
            std::set<std::string>(kModelCases.begin(), kModelCases.end()));
}

// The dropout reference mask is Strata's documented one recomputed in python; the mask
// must drop a plausible fraction, or the case would test little.
TEST(LayerParity, DropoutReferenceMaskIsNotTrivial) {
  const io::h5::Group c = open_group(ref_file(), "layers/dropout");
  const Tensor keep = read_tensor(c, "keep");
  int64_t kept = 0;
  for (int64_t i = 0; i < keep.numel(); ++i) kept += keep.data<float>()[i] != 0.0f;
  const double p = num_attr(c, "p");
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
  const io::h5::Group c = open_group(ref_file(), "models/" + GetParam());
  ModelSpec spec;
  spec.name = io::h5::read_attr_string(c, "model");
  if (io::h5::has_attr(c, "hidden")) spec.hidden = parse_hidden(io::h5::read_attr_string(c, "hidden"));
  if (io::h5::has_attr(c, "depth")) spec.depth = static_cast<int>(int_attr(c, "depth"));
  if (io::h5::has_attr(c, "width")) spec.width = static_cast<int>(int_attr(c, "width"));
  const Tensor x = read_tensor(c, "input");
  const Tensor labels = read_tensor(c, "labels", DType::I32);
  const int classes = static_cast<int>(int_attr(c, "classes"));
  const Model model = build_model(spec, Shape(x.shape().begin() + 1, x.shape().end()), classes);
  const ParameterStore store(model, static_cast<uint64_t>(int_attr(c, "seed")));

  // Strata's own initial values must be the ones the reference recomputed from (seed, name)
  // and loaded into torch by name; then they are copied in (a no-op when they agree).
  const io::h5::Group params = open_group(c, "params");
  EXPECT_EQ(count_datasets(params), store.entries().size()) << "parameter count, reference vs Strata";
  for (const ParamEntry& e : store.entries()) {
    ASSERT_TRUE(io::h5::exists(params, e.name)) << "no reference parameter " << e.name;
    const Tensor ref = read_tensor(params, e.name);
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
  expect_close(GetParam() + "/logits", logits, read_tensor(c, "logits"), kTol);

  const int64_t batch = x.dim(0);
  SoftmaxCrossEntropy loss;
  Context lctx;
  const double sum = loss.forward(logits, labels, lctx);
  Tensor mean = Tensor::zeros({1});
  mean.data<float>()[0] = static_cast<float>(sum / static_cast<double>(batch));
  expect_close(GetParam() + "/loss", mean, read_tensor(c, "loss"), kTol);

  const Tensor dx = model.backward(loss.backward(lctx, 1.0f / static_cast<float>(batch)), ctx, 0, SIZE_MAX, {},
                                   /*input_grad=*/true);
  expect_close(GetParam() + "/grad_input", dx, read_tensor(c, "grad_input"), kTol);
  for (const ParamEntry& e : store.entries()) {
    if (e.trainable)
      expect_close(GetParam() + "/grad_" + e.name, store.grad(e), read_tensor(c, "grads/" + e.name).reshape(e.shape),
                   kTol);
    else
      expect_close(GetParam() + "/updated/" + e.name, store.value(e),
                   read_tensor(c, "updated/" + e.name).reshape(e.shape), kTol);
  }
}

INSTANTIATE_TEST_SUITE_P(Torch, ModelParity, ::testing::ValuesIn(kModelCases),
                         [](const ::testing::TestParamInfo<std::string>& p) { return p.param; });

}  // namespace
}  // namespace strata::layers
