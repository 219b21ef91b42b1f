// The model zoo: shape inference from the data's sample shape and class count, clear Input
// errors for bad combinations, the flat parameter layout (alignment, stable unique names,
// initialisation from (seed, name) only) and dropout masks that do not depend on how a batch
// is split.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <map>
#include <random>
#include <set>

#include "core/ops.hpp"
#include "expect_error.hpp"
#include "layers/basic.hpp"
#include "layers/loss.hpp"
#include "layers/model.hpp"
#include "layers/parameter_store.hpp"
#include "layers/zoo.hpp"

namespace strata::layers {
namespace {

Tensor random_input(const Shape& shape, uint32_t seed = 5) {
  std::mt19937 g(seed);
  std::normal_distribution<float> d;
  Tensor t = Tensor::empty(shape);
  for (int64_t i = 0; i < t.numel(); ++i) t.data<float>()[i] = d(g);
  return t;
}

Tensor labels_for(int64_t batch, int classes) {
  Tensor t = Tensor::empty({batch}, DType::I32);
  for (int64_t i = 0; i < batch; ++i) t.data<int32_t>()[i] = static_cast<int32_t>((i * 7 + 3) % classes);
  return t;
}

ModelSpec spec_of(const std::string& name) {
  ModelSpec s;
  s.name = name;
  return s;
}

ModelSpec mlp(std::vector<int64_t> hidden, float dropout = 0.0f) {
  ModelSpec s = spec_of("mlp");
  s.hidden = std::move(hidden);
  s.dropout = dropout;
  return s;
}

ModelSpec resnet(int depth, int width) {
  ModelSpec s = spec_of("resnet");
  s.depth = depth;
  s.width = width;
  return s;
}

// Index of the top-level layer called `name`.
size_t find_layer(const Model& m, const std::string& name) {
  for (size_t i = 0; i < m.size(); ++i)
    if (m.layer(i).name() == name) return i;
  ADD_FAILURE() << "no layer " << name;
  return 0;
}

const ParamEntry* find_entry(const ParameterStore& s, const std::string& name) {
  for (const ParamEntry& e : s.entries())
    if (e.name == name) return &e;
  return nullptr;
}

// Runs a batch through the model in train mode and checks the logits' shape and values.
void expect_runs(const Model& m, int64_t batch) {
  ParameterStore store(m, 1);
  std::vector<Context> ctx;
  StepInfo info;
  const Tensor y = m.forward(random_input(batch_shape(batch, m.input_shape())), ctx, info);
  ASSERT_EQ(shape_str(y.shape()), shape_str({batch, m.num_classes()}));
  EXPECT_TRUE(ops::all_finite(y));
}

// ---- shape inference -------------------------------------------------------------------------

TEST(ModelShapes, MlpFollowsTheSampleShapeAndClasses) {
  for (const auto& [input, classes] :
       std::vector<std::pair<Shape, int>>{{{1, 8, 8}, 7}, {{3, 5, 7}, 3}, {{20}, 4}, {{1, 28, 28}, 10}}) {
    SCOPED_TRACE(shape_str(input));
    const Model m = build_model(mlp({32, 16}), input, classes);
    EXPECT_EQ(m.size(), 6u);  // flatten, (fc, relu) x 2, fc
    EXPECT_EQ(m.shape(1), Shape{shape_numel(input)});
    EXPECT_EQ(m.shape(m.size()), Shape{classes});
    const ParameterStore store(m, 1);
    EXPECT_EQ(find_entry(store, "fc1/weight")->shape, (Shape{32, shape_numel(input)}));
    EXPECT_EQ(find_entry(store, "fc3/weight")->shape, (Shape{classes, 16}));
    EXPECT_EQ(store.num_trainable(), 32 * shape_numel(input) + 32 + 16 * 32 + 16 + classes * 16 + classes);
    expect_runs(m, 3);
  }
}

TEST(ModelShapes, MlpWithDropoutAddsOneDropoutPerHiddenLayer) {
  const Model m = build_model(mlp({8, 8, 8}, 0.5f), {10}, 2);
  int dropouts = 0;
  for (size_t i = 0; i < m.size(); ++i) dropouts += m.layer(i).describe().starts_with("dropout");
  EXPECT_EQ(dropouts, 3);
}

TEST(ModelShapes, CnnFollowsTheImageSizeAndClasses) {
  for (const auto& [input, classes] :
       std::vector<std::pair<Shape, int>>{{{1, 28, 28}, 10}, {{3, 32, 32}, 100}, {{2, 12, 20}, 5}, {{1, 13, 9}, 2}}) {
    SCOPED_TRACE(shape_str(input));
    const Model m = build_model(spec_of("cnn"), input, classes);
    const size_t flatten = find_layer(m, "flatten");
    // Two 2x2 poolings (floor) after size-preserving convolutions.
    const Shape pooled{64, input[1] / 2 / 2, input[2] / 2 / 2};
    EXPECT_EQ(m.shape(flatten), pooled);
    EXPECT_EQ(m.shape(flatten + 1), Shape{shape_numel(pooled)});
    EXPECT_EQ(m.shape(m.size()), Shape{classes});
    const ParameterStore store(m, 1);
    EXPECT_EQ(find_entry(store, "conv1/weight")->shape, (Shape{32, input[0], 3, 3}));
    EXPECT_EQ(find_entry(store, "fc1/weight")->shape, (Shape{128, shape_numel(pooled)}));
    EXPECT_EQ(find_entry(store, "fc2/weight")->shape, (Shape{classes, 128}));
    expect_runs(m, 2);
  }
}

TEST(ModelShapes, ResnetStagesHalveTheImageAndDoubleTheWidth) {
  struct Case {
    Shape input;
    int depth, width, classes;
  };
  for (const Case& c : std::vector<Case>{{{3, 32, 32}, 20, 16, 10}, {{3, 8, 8}, 8, 4, 10}, {{1, 12, 9}, 14, 6, 3}}) {
    SCOPED_TRACE(shape_str(c.input) + " depth " + std::to_string(c.depth));
    const Model m = build_model(resnet(c.depth, c.width), c.input, c.classes);
    const int n = (c.depth - 2) / 6;
    EXPECT_EQ(m.size(), static_cast<size_t>(3 + 3 * n + 2));    // conv, bn, relu, blocks, pool, fc
    auto down = [](int64_t s) { return (s + 2 - 3) / 2 + 1; };  // 3x3 conv, stride 2, padding 1
    const int64_t h2 = down(c.input[1]), w2 = down(c.input[2]);
    EXPECT_EQ(m.shape(find_layer(m, "block1_1")), (Shape{c.width, c.input[1], c.input[2]}));
    EXPECT_EQ(m.shape(find_layer(m, "block2_1") + 1), (Shape{2 * c.width, h2, w2}));
    EXPECT_EQ(m.shape(find_layer(m, "block3_1") + 1), (Shape{4 * c.width, down(h2), down(w2)}));
    EXPECT_EQ(m.shape(find_layer(m, "fc")), Shape{4 * c.width});
    EXPECT_EQ(m.shape(m.size()), Shape{c.classes});
    const ParameterStore store(m, 1);
    EXPECT_EQ(find_entry(store, "conv1/weight")->shape, (Shape{c.width, c.input[0], 3, 3}));
    // The first block of stages 2 and 3 has a projection shortcut; the others do not.
    EXPECT_NE(find_entry(store, "block2_1/shortcut/conv/weight"), nullptr);
    EXPECT_NE(find_entry(store, "block3_1/shortcut/bn/running_var"), nullptr);
    EXPECT_EQ(find_entry(store, "block1_1/shortcut/conv/weight"), nullptr);
    if (n > 1) {
      EXPECT_EQ(find_entry(store, "block2_2/shortcut/conv/weight"), nullptr);
    }
    expect_runs(m, 2);
  }
}

// ---- bad combinations ------------------------------------------------------------------------

using test::expect_input_error;

TEST(ModelErrors, CnnOnOneDimensionalSamples) {
  expect_input_error([] { build_model(spec_of("cnn"), {64}, 10); }, {"cnn", "C, H, W", "64"});
}

TEST(ModelErrors, ResnetOnOneDimensionalSamples) {
  expect_input_error([] { build_model(resnet(8, 4), {784}, 10); }, {"resnet", "784"});
}

TEST(ModelErrors, ResnetDepthNotSixNPlusTwo) {
  for (int depth : {9, 7, 2, 21})
    expect_input_error([&] { build_model(resnet(depth, 4), {3, 8, 8}, 10); }, {"depth", "6n+2", std::to_string(depth)});
}

TEST(ModelErrors, ResnetWidthZero) {
  expect_input_error([] { build_model(resnet(8, 0), {3, 8, 8}, 10); }, {"width", "0"});
}

TEST(ModelErrors, MlpHiddenSizeZeroOrNegative) {
  expect_input_error([] { build_model(mlp({0}), {1, 8, 8}, 10); }, {"hidden", "0"});
  expect_input_error([] { build_model(mlp({16, -3}), {1, 8, 8}, 10); }, {"hidden", "-3"});
}

TEST(ModelErrors, CnnImageTooSmall) {
  // 3x3 -> pool 1x1 -> the second pooling has nothing to pool.
  expect_input_error([] { build_model(spec_of("cnn"), {1, 3, 3}, 10); }, {"pool2"});
}

TEST(ModelErrors, WindowLargerThanThePaddedInput) {
  // (in + 2p - k) / s + 1 truncates a negative quotient to 0, which would give a 1x1 output.
  expect_input_error([] { Conv2d("c", 1, 1, 3, 2, 0).output_shape({1, 2, 2}); }, {"3x3"});
  expect_input_error([] { Pool2d("p", PoolKind::Max, 2, 2).output_shape({1, 1, 5}); }, {"2x2"});
  EXPECT_EQ(Pool2d("p", PoolKind::Max, 2, 2).output_shape({1, 2, 5}), (Shape{1, 1, 2}));
  EXPECT_EQ(Conv2d("c", 1, 1, 3, 2, 1).output_shape({1, 1, 1}), (Shape{1, 1, 1}));
}

TEST(ModelErrors, FewerThanTwoClassesAndUnknownModel) {
  expect_input_error([] { build_model(spec_of("cnn"), {1, 8, 8}, 1); }, {"classes", "1"});
  expect_input_error([] { build_model(spec_of("transformer9000"), {1, 8, 8}, 10); }, {"transformer9000"});
}

TEST(ModelErrors, OutputShapeMustMatchTheClasses) {
  std::vector<LayerPtr> layers;
  layers.push_back(std::make_unique<Linear>("fc", 4, 3));
  expect_input_error([&] { Model(std::move(layers), {4}, 5); }, {"5"});
}

// ---- parameter layout ------------------------------------------------------------------------

struct Built {
  std::string what;
  ModelSpec spec;
  Shape input;
  int classes;
};

std::vector<Built> zoo() {
  return {{"mlp", mlp({32, 16}), {1, 8, 8}, 7},
          {"cnn", spec_of("cnn"), {1, 12, 12}, 10},
          {"resnet8", resnet(8, 4), {3, 8, 8}, 10},
          {"resnet14", resnet(14, 3), {2, 9, 7}, 4}};
}

TEST(ParameterLayout, AlignedNonOverlappingAndUniquelyNamed) {
  for (const Built& b : zoo()) {
    SCOPED_TRACE(b.what);
    const Model m = build_model(b.spec, b.input, b.classes);
    const ParameterStore store(m, 3);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(store.params().raw()) % 64, 0u);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(store.grads().raw()) % 64, 0u);
    EXPECT_EQ(store.grads().numel(), store.params().numel());
    std::set<std::string> names;
    std::map<bool, std::vector<std::pair<int64_t, int64_t>>> ranges;  // trainable -> [begin, end)
    int64_t trainable = 0, expected_trainable = 0;
    for (const ParamEntry& e : store.entries()) {
      EXPECT_TRUE(names.insert(e.name).second) << "duplicate name " << e.name;
      EXPECT_EQ(e.offset % 16, 0) << e.name << " at " << e.offset << " is not 64-byte aligned";
      ranges[e.trainable].push_back({e.offset, e.offset + shape_numel(e.shape)});
      EXPECT_EQ(store.value(e).numel(), shape_numel(e.shape));
      if (e.trainable) {
        trainable += shape_numel(e.shape);
        EXPECT_EQ(reinterpret_cast<uintptr_t>(store.grad(e).raw()) % 64, 0u) << e.name;
      }
      EXPECT_EQ(reinterpret_cast<uintptr_t>(store.value(e).raw()) % 64, 0u) << e.name;
      EXPECT_EQ(e.trainable, !(e.name.ends_with("running_mean") || e.name.ends_with("running_var"))) << e.name;
    }
    for (size_t i = 0; i < m.size(); ++i)
      for (const ParamSpec& s : m.layer(i).param_specs())
        if (s.trainable) expected_trainable += shape_numel(s.shape);
    EXPECT_EQ(trainable, store.num_trainable());
    EXPECT_EQ(trainable, expected_trainable);
    for (auto& [is_trainable, r] : ranges) {
      std::sort(r.begin(), r.end());
      for (size_t i = 1; i < r.size(); ++i) EXPECT_LE(r[i - 1].second, r[i].first) << "overlapping entries";
      const Tensor& buf = is_trainable ? store.params() : store.buffers();
      EXPECT_LE(r.back().second, buf.numel());
      EXPECT_LT(buf.numel() - r.back().second, 16) << "more padding than alignment needs";
    }
    // Gradients start at zero.
    for (int64_t i = 0; i < store.grads().numel(); ++i) ASSERT_EQ(store.grads().data<float>()[i], 0.0f);
  }
}

TEST(ParameterLayout, NamesAreStableAcrossBuilds) {
  for (const Built& b : zoo()) {
    const Model m1 = build_model(b.spec, b.input, b.classes);
    const Model m2 = build_model(b.spec, b.input, b.classes);
    const ParameterStore s1(m1, 1), s2(m2, 2);
    ASSERT_EQ(s1.entries().size(), s2.entries().size()) << b.what;
    for (size_t i = 0; i < s1.entries().size(); ++i) {
      EXPECT_EQ(s1.entries()[i].name, s2.entries()[i].name);
      EXPECT_EQ(s1.entries()[i].offset, s2.entries()[i].offset);
    }
  }
  // The names checkpoints rely on.
  const Model m = build_model(mlp({32, 16}), {1, 8, 8}, 7);
  const ParameterStore s(m, 1);
  std::vector<std::string> names;
  for (const ParamEntry& e : s.entries()) names.push_back(e.name);
  EXPECT_EQ(names,
            (std::vector<std::string>{"fc1/weight", "fc1/bias", "fc2/weight", "fc2/bias", "fc3/weight", "fc3/bias"}));
}

TEST(ParameterLayout, InitialisationFollowsSpecs) {
  const Model m = build_model(resnet(8, 4), {3, 8, 8}, 10);
  const ParameterStore store(m, 11);
  for (const ParamEntry& e : store.entries()) {
    const Tensor v = store.value(e);
    const float* p = v.data<float>();
    const std::string leaf = e.name.substr(e.name.rfind('/') + 1);
    const bool bn = e.name.find("bn") != std::string::npos;
    if (bn && (leaf == "weight" || leaf == "running_var")) {
      for (int64_t i = 0; i < v.numel(); ++i) ASSERT_EQ(p[i], 1.0f) << e.name;
    } else if (bn) {
      for (int64_t i = 0; i < v.numel(); ++i) ASSERT_EQ(p[i], 0.0f) << e.name;
    } else {
      // U(-1/sqrt(fan_in), 1/sqrt(fan_in)), fan_in = in * k * k (or the fc's input).
      const Shape& s = e.shape;
      const int64_t fan_in =
          leaf == "weight"
              ? shape_numel(s) / s[0]
              : shape_numel(find_entry(store, e.name.substr(0, e.name.rfind('/')) + "/weight")->shape) / s[0];
      const double bound = 1.0 / std::sqrt(static_cast<double>(fan_in));
      double lo = 1, hi = -1;
      for (int64_t i = 0; i < v.numel(); ++i) {
        ASSERT_LE(std::abs(p[i]), bound * (1 + 1e-6)) << e.name;
        lo = std::min<double>(lo, p[i]);
        hi = std::max<double>(hi, p[i]);
      }
      if (v.numel() >= 100) {  // spread over the whole interval
        EXPECT_LT(lo, -0.8 * bound) << e.name;
        EXPECT_GT(hi, 0.8 * bound) << e.name;
      }
    }
  }
}

TEST(ParameterLayout, InitialisationDependsOnlyOnSeedAndName) {
  for (const Built& b : zoo()) {
    SCOPED_TRACE(b.what);
    const Model full_model = build_model(b.spec, b.input, b.classes);
    const ParameterStore full(full_model, 21);
    std::map<std::string, Tensor> by_name;
    for (const ParamEntry& e : full.entries()) by_name[e.name] = full.value(e);

    // Cut the model into two stages anywhere: each stage's store has the same values.
    for (size_t cut : {size_t{1}, full_model.size() / 2, full_model.size() - 1}) {
      const Model staged = build_model(b.spec, b.input, b.classes);
      const ParameterStore first(staged, 21, {.end = cut}), second(staged, 21, {.begin = cut});
      EXPECT_EQ(first.entries().size() + second.entries().size(), full.entries().size()) << "cut " << cut;
      for (const ParameterStore* s : {&first, &second})
        for (const ParamEntry& e : s->entries()) {
          ASSERT_TRUE(by_name.count(e.name)) << e.name;
          const Tensor a = s->value(e), w = by_name[e.name];
          for (int64_t i = 0; i < a.numel(); ++i)
            ASSERT_EQ(a.data<float>()[i], w.data<float>()[i]) << e.name << " cut " << cut;
        }
    }

    // Same seed: same values. Another seed: other weights.
    const Model again = build_model(b.spec, b.input, b.classes);
    const ParameterStore same(again, 21), other(again, 22);
    int64_t differ_same = 0, differ_other = 0;
    for (int64_t i = 0; i < full.params().numel(); ++i) {
      differ_same += same.params().data<float>()[i] != full.params().data<float>()[i];
      differ_other += other.params().data<float>()[i] != full.params().data<float>()[i];
    }
    EXPECT_EQ(differ_same, 0);
    EXPECT_GT(differ_other, full.num_trainable() / 2);
  }
}

TEST(ParameterLayout, DistinctParametersGetDistinctValues) {
  // Two same-shape weights must not share one stream (e.g. a key that ignores the name).
  const Model m = build_model(mlp({16, 16, 16}), {16}, 16);
  const ParameterStore s(m, 5);
  const Tensor a = s.value(*find_entry(s, "fc2/weight")), b = s.value(*find_entry(s, "fc3/weight"));
  int64_t equal = 0;
  for (int64_t i = 0; i < a.numel(); ++i) equal += a.data<float>()[i] == b.data<float>()[i];
  EXPECT_LT(equal, 3);
}

TEST(ParameterLayout, LayersComputeWithTheStoreViews) {
  const Model m = build_model(mlp({8}), {6}, 3);
  const ParameterStore store(m, 1);
  // Zero every weight: the logits are then the last bias, for every sample.
  for (const ParamEntry& e : store.entries())
    if (e.name.ends_with("weight")) store.value(e).fill_zero();
  std::vector<Context> ctx;
  const Tensor y = m.forward(random_input({4, 6}), ctx, StepInfo{});
  const Tensor bias = store.value(*find_entry(store, "fc2/bias"));
  for (int64_t r = 0; r < 4; ++r)
    for (int64_t k = 0; k < 3; ++k) EXPECT_EQ(y.data<float>()[r * 3 + k], bias.data<float>()[k]);
}

// ---- splitting batches -----------------------------------------------------------------------

void expect_equal_rows(const Tensor& full, int64_t row0, const Tensor& part, const char* what) {
  const int64_t cols = part.numel() / part.dim(0);
  for (int64_t i = 0; i < part.numel(); ++i) {
    const float a = full.data<float>()[row0 * cols + i], b = part.data<float>()[i];
    ASSERT_NEAR(a, b, 1e-6f * (1.0f + std::abs(a))) << what << " element " << i;
  }
}

int64_t count_different(const Tensor& a, const Tensor& b) {
  int64_t n = 0;
  for (int64_t i = 0; i < a.numel(); ++i) n += std::abs(a.data<float>()[i] - b.data<float>()[i]) > 1e-5f;
  return n;
}

TEST(DropoutMasks, IndependentOfHowTheBatchIsSplit) {
  const Model m = build_model(mlp({32, 16}, 0.5f), {1, 4, 4}, 5);
  const ParameterStore store(m, 8);
  const Tensor x = random_input({8, 1, 4, 4});
  StepInfo info;
  info.mode = Mode::Train;
  info.seed = 77;
  info.step = 4;

  std::vector<Context> c_full, c_lo, c_hi, c_wrong;
  info.first_sample = 0;
  const Tensor full = m.forward(x, c_full, info).clone();
  const Tensor lo = m.forward(x.slice(0, 4), c_lo, info).clone();
  info.first_sample = 4;
  const Tensor hi = m.forward(x.slice(4, 8), c_hi, info).clone();
  expect_equal_rows(full, 0, lo, "first half");
  expect_equal_rows(full, 4, hi, "second half");

  // The offset matters: the second half keyed as samples 0..3 gets other masks.
  info.first_sample = 0;
  const Tensor wrong = m.forward(x.slice(4, 8), c_wrong, info);
  EXPECT_GT(count_different(wrong, hi), 0);
  // ... and so does the step.
  std::vector<Context> c_step;
  info.step = 5;
  EXPECT_GT(count_different(m.forward(x, c_step, info), full), 0);
  // In eval mode there is no dropout: the output does not depend on the key at all.
  std::vector<Context> c_e1, c_e2;
  StepInfo eval;
  eval.mode = Mode::Eval;
  const Tensor e1 = m.forward(x, c_e1, eval).clone();
  eval.step = 9;
  eval.first_sample = 100;
  EXPECT_EQ(count_different(m.forward(x, c_e2, eval), e1), 0);
  EXPECT_GT(count_different(e1, full), 0);
}

TEST(DropoutMasks, MicroBatchGradientsAddUpToTheFullBatch) {
  const Model m = build_model(mlp({32, 16}, 0.3f), {1, 4, 4}, 5);
  const ParameterStore store(m, 8);
  const Tensor x = random_input({8, 1, 4, 4});
  const Tensor labels = labels_for(8, 5);
  SoftmaxCrossEntropy loss;
  StepInfo info;
  info.seed = 3;
  info.step = 1;

  auto pass = [&](int64_t begin, int64_t end) {
    std::vector<Context> ctx;
    Context lctx;
    info.first_sample = begin;
    const Tensor y = m.forward(x.slice(begin, end), ctx, info);
    const Tensor lab = labels.slice(begin, end);
    const double l = loss.forward(y, lab, lctx);
    m.backward(loss.backward(lctx, 1.0f / 8.0f), ctx);
    return l;
  };
  const double full_loss = pass(0, 8);
  const Tensor full = store.grads().clone();
  store.grads().fill_zero();
  const double split_loss = pass(0, 4) + pass(4, 8);
  EXPECT_NEAR(split_loss, full_loss, 1e-5 * std::abs(full_loss));
  double diff2 = 0, ref2 = 0;
  for (int64_t i = 0; i < full.numel(); ++i) {
    const double d = store.grads().data<float>()[i] - full.data<float>()[i];
    diff2 += d * d;
    ref2 += static_cast<double>(full.data<float>()[i]) * full.data<float>()[i];
  }
  EXPECT_GT(ref2, 0.0);
  EXPECT_LE(std::sqrt(diff2 / ref2), 1e-5);
}

TEST(ModelRanges, StagesComposeToTheWholeModel) {
  // Forward/backward over [0, k) then [k, n) equals the whole model (a pipeline of two stages).
  const Model m = build_model(spec_of("cnn"), {1, 12, 12}, 10);
  const ParameterStore store(m, 4);
  const Tensor x = random_input({3, 1, 12, 12});
  const Tensor dy = random_input({3, 10}, 9);
  std::vector<Context> c1, c2;
  StepInfo info;
  const Tensor y = m.forward(x, c1, info).clone();
  const Tensor dx = m.backward(dy, c1, 0, SIZE_MAX, {}, /*input_grad=*/true).clone();
  const Tensor g = store.grads().clone();
  store.grads().fill_zero();
  const size_t k = find_layer(m, "flatten");
  const Tensor h = m.forward(x, c2, info, 0, k);
  const Tensor y2 = m.forward(h, c2, info, k);
  const Tensor dh = m.backward(dy, c2, k, SIZE_MAX, {}, /*input_grad=*/true);
  const Tensor dx2 = m.backward(dh, c2, 0, k, {}, /*input_grad=*/true);
  EXPECT_EQ(count_different(y, y2), 0);
  EXPECT_EQ(count_different(dx, dx2), 0);
  EXPECT_EQ(count_different(g, store.grads()), 0);
}

}  // namespace
}  // namespace strata::layers
