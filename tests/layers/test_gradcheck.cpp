// Finite-difference gradient checks for every layer and the loss, in the spirit of Caffe's
// GradientChecker: for loss = sum(y * r) with a fixed random r, the analytic backward must
// match central differences of the forward w.r.t. the input and every trainable parameter.
//
// Tolerance (float32): the forward is float32 and the loss is summed in double, so a central
// difference carries (a) round-off ~ eps_f32 * |y| * |r| * (#outputs touched) / (2h) and
// (b) truncation ~ h^2 * |f'''| / 6. With h = 1e-2 both stay near 1e-4..1e-3 for the O(1)
// values used here, so we require |analytic - numeric| <= 1e-2 * max(|a|, |n|) + 2e-3: tight
// enough that a wrong factor, a missing term or a transposed index fails (they give O(1)
// relative errors), robust to float32 noise. Kinks (ReLU at 0, ties in max pooling) are kept
// further than h from every input, so the function is smooth where it is differenced.
#include <gtest/gtest-spi.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <random>
#include <tuple>

#include "layers/basic.hpp"
#include "layers/composite.hpp"
#include "layers/gpt.hpp"
#include "layers/llama.hpp"
#include "layers/loss.hpp"

namespace strata::layers {
namespace {

std::mt19937& gen() {
  static std::mt19937 g(1234567);
  return g;
}

Tensor randn(const Shape& shape, float scale = 1.0f, float shift = 0.0f) {
  Tensor t = Tensor::empty(shape);
  std::normal_distribution<float> d(0.0f, 1.0f);
  for (int64_t i = 0; i < t.numel(); ++i) t.data<float>()[i] = shift + scale * d(gen());
  return t;
}

// Values at least `gap` away from 0 (for ReLU): sign * U(gap, 1).
Tensor away_from_zero(const Shape& shape, float gap) {
  Tensor t = Tensor::empty(shape);
  std::uniform_real_distribution<float> u(gap, 1.0f);
  std::bernoulli_distribution sign(0.5);
  for (int64_t i = 0; i < t.numel(); ++i) t.data<float>()[i] = (sign(gen()) ? 1.0f : -1.0f) * u(gen());
  return t;
}

// A random permutation of {0, gap, 2 gap, ...} - 1: no two values closer than `gap` (max pool).
Tensor distinct(const Shape& shape, float gap) {
  Tensor t = Tensor::empty(shape);
  std::vector<int64_t> idx(static_cast<size_t>(t.numel()));
  for (size_t i = 0; i < idx.size(); ++i) idx[i] = static_cast<int64_t>(i);
  std::shuffle(idx.begin(), idx.end(), gen());
  for (int64_t i = 0; i < t.numel(); ++i) t.data<float>()[i] = static_cast<float>(idx[i]) * gap - 1.0f;
  return t;
}

// The layer's parameters, each its own allocation, bound as the ParameterStore would.
struct Params {
  std::vector<ParamSpec> specs;
  std::vector<Tensor> values, grads;
};

Params bind_random(Layer& layer) {
  Params p;
  p.specs = layer.param_specs();
  for (const ParamSpec& s : p.specs) {
    Tensor v;
    const bool is_scale = s.init == Init::Ones && s.trainable;  // norm gamma
    if (s.name.ends_with("running_var")) {                      // positive
      v = randn(s.shape);
      for (int64_t i = 0; i < v.numel(); ++i) v.data<float>()[i] = 1.0f + 0.4f * std::abs(v.data<float>()[i]);
    } else if (is_scale) {
      v = randn(s.shape, 0.3f, 1.0f);
    } else {
      v = randn(s.shape, 0.5f);
    }
    p.values.push_back(v);
    p.grads.push_back(s.trainable ? Tensor::zeros(s.shape) : Tensor());
  }
  layer.bind(p.values, p.grads);
  return p;
}

// Each test starts the generator afresh, so its data do not depend on which tests ran before.
class GradCheck : public ::testing::Test {
 protected:
  void SetUp() override { gen().seed(1234567); }
};

class GradientChecker {
 public:
  // max_kinked: the fraction of elements that may be skipped as straddling a kink (see
  // compare()); 0 for smooth layers, where any inconsistency is a failure.
  GradientChecker(double step, double max_kinked = 0.0, double rel = 1e-2, double abs = 2e-3)
      : h_(step), max_kinked_(max_kinked), rel_(rel), abs_(abs) {}

  // Checks d(sum(y * r))/dx and d/d(every trainable parameter) of `layer` at x. An integer x
  // (tokens) has no gradient: the layer must return none, and only parameters are checked.
  void check(Layer& layer, Params& params, const Tensor& x, const StepInfo& info) {
    const bool differentiable = x.dtype() == DType::F32;
    // r is fixed per check; the loss in double over float32 outputs.
    Context probe;
    const Tensor y0 = layer.forward(x, probe, info);
    const Tensor r = randn(y0.shape());
    auto loss = [&]() {
      Context ctx;
      const Tensor y = layer.forward(x, ctx, info);
      double l = 0;
      for (int64_t i = 0; i < y.numel(); ++i) l += static_cast<double>(y.data<float>()[i]) * r.data<float>()[i];
      return l;
    };

    // Analytic: parameter gradients accumulate, so zero them first.
    for (const Tensor& g : params.grads)
      if (g.defined()) g.fill_zero();
    Context ctx;
    layer.forward(x, ctx, info);
    const Tensor dx_raw = layer.backward(r, ctx);
    ASSERT_EQ(dx_raw.defined(), differentiable) << "an input gradient exactly for float inputs";
    const Tensor dx = differentiable ? dx_raw.clone() : Tensor();
    std::vector<Tensor> analytic;
    for (const Tensor& g : params.grads) analytic.push_back(g.defined() ? g.clone() : Tensor());

    if (differentiable) compare("input", x, dx, loss);
    for (size_t k = 0; k < params.specs.size(); ++k)
      if (params.specs[k].trainable) compare(params.specs[k].name, params.values[k], analytic[k], loss);

    // A second backward without zeroing: parameter gradients add up (+=), dx does not.
    Context ctx2;
    layer.forward(x, ctx2, info);
    const Tensor dx2 = layer.backward(r, ctx2);
    for (int64_t i = 0; differentiable && i < dx.numel(); ++i)
      ASSERT_FLOAT_EQ(dx2.data<float>()[i], dx.data<float>()[i]) << "dx must be overwritten, not accumulated";
    for (size_t k = 0; k < params.specs.size(); ++k) {
      if (!params.specs[k].trainable) continue;
      const float* a = analytic[k].data<float>();
      const float* g = params.grads[k].data<float>();
      for (int64_t i = 0; i < analytic[k].numel(); ++i)
        ASSERT_NEAR(g[i], 2.0f * a[i], 1e-5f * (1.0f + std::abs(a[i])))
            << params.specs[k].name << "[" << i << "]: gradients must accumulate (+=) into the bound view";
    }
  }

  // Central differences of `loss` w.r.t. every element of `var` (modified in place and
  // restored) against `analytic`. Where ReLUs follow batch normalisation (the residual
  // block) kinks cannot be kept away by choosing inputs. A kink within h of the point makes
  // the central difference average the two one-sided slopes, while the analytic gradient is
  // the slope on the point's own side, which the one-sided difference away from the kink
  // measures. So there, and only up to max_kinked of the elements, an element also passes
  // when it matches the forward or the backward difference; it is counted as kinked. (The
  // residual block is checked exactly against torch in test_torch_parity as well.)
  void compare(const std::string& what, const Tensor& var, const Tensor& analytic,
               const std::function<double()>& loss) {
    ASSERT_EQ(var.numel(), analytic.numel()) << what;
    float* v = var.data<float>();
    const double l0 = loss();
    auto close = [&](double a, double b) {
      return std::abs(a - b) <= rel_ * std::max(std::abs(a), std::abs(b)) + abs_;
    };
    int bad = 0, kinked = 0;
    double max_abs = 0;
    for (int64_t i = 0; i < var.numel(); ++i) {
      const float saved = v[i];
      // The steps actually taken in float32 (saved +- h is rounded).
      const float up = saved + static_cast<float>(h_), down = saved - static_cast<float>(h_);
      v[i] = up;
      const double lp = loss();
      v[i] = down;
      const double lm = loss();
      v[i] = saved;
      const double numeric = (lp - lm) / (static_cast<double>(up) - down);
      const double a = analytic.data<float>()[i];
      max_abs = std::max({max_abs, std::abs(a), std::abs(numeric)});
      if (close(a, numeric)) continue;
      const double forward = (lp - l0) / (static_cast<double>(up) - saved);
      const double backward = (l0 - lm) / (static_cast<double>(saved) - down);
      if (max_kinked_ > 0 && (close(a, forward) || close(a, backward))) {
        ++kinked;
        continue;
      }
      if (++bad <= 5)
        ADD_FAILURE() << "d loss / d " << what << "[" << i << "]: analytic " << a << ", numeric " << numeric
                      << " (one-sided " << forward << ", " << backward << ")";
    }
    EXPECT_EQ(bad, 0) << what << ": " << bad << " of " << var.numel() << " elements off";
    if (kinked > 0)
      std::printf("[ kinks   ] %s: %d of %lld elements matched a one-sided difference\n", what.c_str(), kinked,
                  static_cast<long long>(var.numel()));
    EXPECT_LE(kinked, std::ceil(max_kinked_ * static_cast<double>(var.numel())))  // 10% of 3 is 1
        << what << ": too many elements straddle a kink for the check to mean anything";
    // A gradient that is zero everywhere would pass trivially: the cases are built so it is not.
    EXPECT_GT(max_abs, 10 * abs_) << what << ": gradient too small for the check to mean anything";
  }

 private:
  double h_, max_kinked_, rel_, abs_;
};

StepInfo train_info() {
  StepInfo info;
  info.mode = Mode::Train;
  info.seed = 99;
  info.step = 3;
  info.first_sample = 5;
  return info;
}

void run(Layer& layer, const Tensor& x, double step = 1e-2, double max_kinked = 0.0) {
  Params p = bind_random(layer);
  GradientChecker(step, max_kinked).check(layer, p, x, train_info());
}

// ---- the checker itself ----------------------------------------------------------------------

// y = 2 x with a backward that is off by a relative `error_`: the checker must notice 5%.
class WrongGradient final : public Layer {
 public:
  explicit WrongGradient(float error) : Layer("wrong"), error_(error) {}
  std::string describe() const override { return "wrong"; }
  Shape output_shape(const Shape& input) const override { return input; }
  Tensor forward(const Tensor& x, Context& ctx, const StepInfo& info) override {
    Tensor y = x.clone();
    ops::scale(y, 2.0f);
    return y;
  }
  Tensor backward(const Tensor& dy, Context& ctx) override {
    Tensor dx = dy.clone();
    ops::scale(dx, 2.0f * (1.0f + error_));
    return dx;
  }

 private:
  float error_;
};

void check_wrong(float error, double max_kinked) {
  gen().seed(1);
  WrongGradient layer(error);
  Params p;
  GradientChecker(1e-2, max_kinked).check(layer, p, randn({3, 4}), train_info());
}

// Number of test failures `f` raises, intercepted (they do not fail the enclosing test).
int failures_of(const std::function<void()>& f) {
  ::testing::TestPartResultArray results;
  {
    ::testing::ScopedFakeTestPartResultReporter reporter(
        ::testing::ScopedFakeTestPartResultReporter::INTERCEPT_ONLY_CURRENT_THREAD, &results);
    f();
  }
  return results.size();
}

TEST_F(GradCheck, CheckerAcceptsARightGradient) {
  EXPECT_EQ(failures_of([] { check_wrong(0.0f, 0.0); }), 0);
}

TEST_F(GradCheck, CheckerRejectsAGradientFivePercentOff) {
  EXPECT_GT(failures_of([] { check_wrong(0.05f, 0.0); }), 0);
  // The kink allowance does not hide it: one-sided differences of a linear map agree too.
  EXPECT_GT(failures_of([] { check_wrong(0.05f, 0.1); }), 0);
  // 2% off is still caught (the relative tolerance is 1%, plus the float noise floor).
  EXPECT_GT(failures_of([] { check_wrong(0.02f, 0.0); }), 0);
}

// ---- dense and convolution -------------------------------------------------------------------

TEST_F(GradCheck, LinearWithBias) {
  Linear l("fc", 6, 4, true);
  run(l, randn({3, 6}));
}

TEST_F(GradCheck, LinearWithoutBias) {
  Linear l("fc", 5, 3, false);
  EXPECT_EQ(l.param_specs().size(), 1u);
  run(l, randn({4, 5}));
}

struct ConvCase {
  int64_t c, o, k, stride, pad, h, w;
  bool bias;
};

class ConvGradCheck : public ::testing::TestWithParam<ConvCase> {
 protected:
  void SetUp() override { gen().seed(7654321); }
};

TEST_P(ConvGradCheck, InputWeightAndBias) {
  const ConvCase p = GetParam();
  Conv2d conv("conv", p.c, p.o, p.k, p.stride, p.pad, p.bias);
  run(conv, randn({2, p.c, p.h, p.w}));
}

INSTANTIATE_TEST_SUITE_P(Shapes, ConvGradCheck,
                         ::testing::Values(ConvCase{2, 3, 3, 1, 0, 6, 5, true},   // non-square, no padding
                                           ConvCase{2, 3, 3, 1, 1, 5, 7, true},   // same padding
                                           ConvCase{3, 2, 3, 2, 1, 7, 6, true},   // stride 2, padding 1
                                           ConvCase{2, 4, 3, 2, 0, 8, 5, false},  // stride 2, no padding
                                           ConvCase{3, 4, 1, 1, 0, 4, 5, true},   // 1x1
                                           ConvCase{3, 2, 1, 2, 0, 5, 6, false}   // 1x1 stride 2 (shortcut)
                                           ));

// ---- pooling ---------------------------------------------------------------------------------

TEST_F(GradCheck, MaxPoolNoPadding) {
  Pool2d pool("pool", PoolKind::Max, 2, 2);
  run(pool, distinct({2, 3, 6, 8}, 0.05f), 5e-3);  // values 0.05 apart, steps of 5e-3: no ties
}

TEST_F(GradCheck, MaxPoolOverlappingWithPadding) {
  Pool2d pool("pool", PoolKind::Max, 3, 2, 1);
  run(pool, distinct({2, 2, 7, 6}, 0.05f), 5e-3);
}

TEST_F(GradCheck, AvgPool) {
  Pool2d pool("pool", PoolKind::Avg, 2, 2);
  run(pool, randn({2, 3, 6, 4}));
}

TEST_F(GradCheck, AvgPoolWithPadding) {
  Pool2d pool("pool", PoolKind::Avg, 3, 2, 1);
  run(pool, randn({2, 2, 7, 6}));
}

TEST_F(GradCheck, GlobalAvgPool) {
  GlobalAvgPool pool("gap");
  run(pool, randn({3, 4, 3, 5}));
}

// ---- activations, dropout, flatten -----------------------------------------------------------

TEST_F(GradCheck, ReLUAwayFromTheKink) {
  ActivationLayer relu("relu", Activation::ReLU);
  run(relu, away_from_zero({3, 4, 5}, 0.05f), 1e-2);  // |x| >= 0.05 > h
}

TEST_F(GradCheck, GELU) {
  ActivationLayer gelu("gelu", Activation::GELU);
  run(gelu, randn({3, 4, 5}, 2.0f));
}

TEST_F(GradCheck, GELUTanh) {
  ActivationLayer gelu("gelu", Activation::GELUTanh);
  run(gelu, randn({3, 4, 5}, 2.0f));
}

TEST_F(GradCheck, DropoutTrainModeMaskFixedByKey) {
  Dropout drop("dropout", 0.4f);
  drop.set_index(3);
  const Tensor x = randn({4, 3, 5});
  // The mask must be non-trivial, or the check would be the identity's.
  Context ctx;
  const Tensor y = drop.forward(x, ctx, train_info());
  int64_t zeros = 0;
  for (int64_t i = 0; i < y.numel(); ++i) zeros += y.data<float>()[i] == 0.0f;
  EXPECT_GT(zeros, 0);
  EXPECT_LT(zeros, y.numel());
  run(drop, x);
}

TEST_F(GradCheck, Flatten) {
  Flatten f("flatten");
  run(f, randn({2, 3, 4, 2}));
}

// ---- normalisation ---------------------------------------------------------------------------

TEST_F(GradCheck, BatchNorm2dTrainMode) {
  BatchNorm2d bn("bn", 3);
  run(bn, randn({4, 3, 3, 5}, 2.0f, 0.5f));
}

TEST_F(GradCheck, LayerNorm2d) {
  LayerNorm ln("ln", 8);
  run(ln, randn({5, 8}, 1.5f, 0.3f));
}

TEST_F(GradCheck, LayerNorm3d) {
  LayerNorm ln("ln", 6);
  run(ln, randn({2, 3, 6}, 1.5f, -0.2f));
}

// ---- composite -------------------------------------------------------------------------------

// ReLUs sit after batch normalisation here, so kinks cannot be placed by construction: a
// smaller step keeps differences that straddle one rare, and those few are recognised by a
// one-sided difference (GradientChecker::compare), allowed for at most 10% (rounded up) of each tensor's elements.
TEST_F(GradCheck, ResidualBlockIdentityShortcut) {
  LayerPtr block = ResidualBlock::basic("block", 3, 3, 1);
  run(*block, randn({3, 3, 5, 4}), 2e-3, 0.1);
}

TEST_F(GradCheck, ResidualBlockProjectionShortcut) {
  LayerPtr block = ResidualBlock::basic("block", 2, 4, 2);
  EXPECT_EQ(block->param_specs().size(), 15u);  // 3 convs (no bias) + 3 BNs (4 each)
  run(*block, randn({3, 2, 6, 5}), 2e-3, 0.1);
}

// ---- inputs with leading dimensions (B, T, F) ------------------------------------------------

TEST_F(GradCheck, LinearOnSequences) {
  Linear l("fc", 6, 4, true);
  EXPECT_EQ(shape_str(l.output_shape({5, 6})), shape_str({5, 4}));
  run(l, randn({2, 3, 6}));
}

TEST_F(GradCheck, LinearGptInitOnSequences) {
  Linear l("fc", 5, 7, true);
  l.set_gpt_init(0.02);
  run(l, randn({3, 2, 5}));
}

// ---- GPT layers ------------------------------------------------------------------------------

Tensor tokens(int64_t batch, int64_t t, int vocab) {
  Tensor x = Tensor::empty({batch, t}, DType::I32);
  std::uniform_int_distribution<int> u(0, vocab - 1);
  for (int64_t i = 0; i < x.numel(); ++i) x.data<int32_t>()[i] = u(gen());
  x.data<int32_t>()[1] = x.data<int32_t>()[0];  // a repeated token: its rows' gradients add up
  return x;
}

TEST_F(GradCheck, EmbeddingParameters) {
  Embedding e("embedding", 7, 5, 4);  // T = 4 of Tmax = 5: the last wpe row stays unused
  EXPECT_EQ(shape_str(e.output_shape({4})), shape_str({4, 4}));
  run(e, tokens(3, 4, 7));
}

TEST_F(GradCheck, CausalSelfAttentionFlash) {
  CausalSelfAttention a("attn", 8, 2);
  run(a, randn({2, 5, 8}));
}

TEST_F(GradCheck, CausalSelfAttentionPlain) {
  CausalSelfAttention a("attn", 8, 2, 0.0f, AttentionKind::Plain);
  run(a, randn({2, 5, 8}));
}

// Dropout on the probabilities and after the projection: the masks are fixed by the key, so
// the layer is a smooth function of its input and parameters.
TEST_F(GradCheck, CausalSelfAttentionWithDropout) {
  for (const AttentionKind kind : {AttentionKind::Flash, AttentionKind::Plain}) {
    CausalSelfAttention a("attn", 8, 4, 0.25f, kind);
    a.set_index(3);
    run(a, randn({2, 6, 8}));
  }
}

TEST_F(GradCheck, TransformerBlock) {
  TransformerBlock b("h0", 8, 2);
  EXPECT_EQ(b.param_specs().size(), 12u);
  run(b, randn({2, 4, 8}));
}

TEST_F(GradCheck, TransformerBlockWithDropoutPlainAttention) {
  TransformerBlock b("h1", 8, 2, 0.2f, AttentionKind::Plain);
  b.set_index(2);
  run(b, randn({2, 5, 8}));
}

TEST_F(GradCheck, LMHeadUntied) {
  LMHead head("lm_head", 6, 9);
  EXPECT_EQ(head.param_specs().size(), 1u);
  run(head, randn({2, 3, 6}));
}

// Tied: the head has no parameters; its gradient w.r.t. the embedding's wte accumulates into
// the embedding's gradient view.
TEST_F(GradCheck, LMHeadTiedToTheEmbedding) {
  Embedding e("embedding", 9, 4, 6);
  Params ep = bind_random(e);
  LMHead head("lm_head", 6, 9, &e);
  EXPECT_TRUE(head.param_specs().empty());
  Params p;  // wte only: the head does not touch wpe
  p.specs = {ep.specs[0]};
  p.values = {ep.values[0]};
  p.grads = {ep.grads[0]};
  GradientChecker(1e-2).check(head, p, randn({2, 3, 6}), train_info());
}

// ---- loss ------------------------------------------------------------------------------------

// (B, T, V) logits with (B, T) labels are the B * T rows of the 2-D loss.
TEST_F(GradCheck, SoftmaxCrossEntropyOnSequences) {
  const Tensor logits = randn({2, 3, 5}, 2.0f);
  Tensor labels = Tensor::empty({2, 3}, DType::I32);
  for (int64_t i = 0; i < 6; ++i) labels.data<int32_t>()[i] = static_cast<int32_t>((i * 2 + 1) % 5);
  SoftmaxCrossEntropy loss;
  Context c3, c2;
  const double s3 = loss.forward(logits, labels, c3);
  const double s2 = loss.forward(logits.reshape({6, 5}), labels.reshape({6}), c2);
  EXPECT_EQ(s3, s2);
  const Tensor d3 = loss.backward(c3, 0.5f), d2 = loss.backward(c2, 0.5f);
  EXPECT_EQ(shape_str(d3.shape()), shape_str({2, 3, 5}));
  for (int64_t i = 0; i < d3.numel(); ++i) EXPECT_EQ(d3.data<float>()[i], d2.data<float>()[i]);
}

TEST_F(GradCheck, SoftmaxCrossEntropyLogits) {
  const int64_t batch = 5, classes = 4;
  Tensor logits = randn({batch, classes}, 2.0f);
  Tensor labels = Tensor::empty({batch}, DType::I32);
  for (int64_t i = 0; i < batch; ++i) labels.data<int32_t>()[i] = static_cast<int32_t>((i * 3 + 1) % classes);
  SoftmaxCrossEntropy loss;
  for (const float scale : {1.0f, 1.0f / batch}) {
    Context ctx;
    loss.forward(logits, labels, ctx);
    const Tensor dlogits = loss.backward(ctx, scale);
    const double h = 1e-2;
    for (int64_t i = 0; i < logits.numel(); ++i) {
      float* v = logits.data<float>() + i;
      const float saved = *v;
      Context c1, c2;
      *v = saved + static_cast<float>(h);
      const double lp = loss.forward(logits, labels, c1);
      *v = saved - static_cast<float>(h);
      const double lm = loss.forward(logits, labels, c2);
      *v = saved;
      const double numeric = scale * (lp - lm) / (2 * h);
      const double a = dlogits.data<float>()[i];
      EXPECT_NEAR(a, numeric, 1e-2 * std::max(std::abs(a), std::abs(numeric)) + 2e-3 * scale)
          << "scale " << scale << " logit " << i;
    }
  }
}

// ---- streamed gradients ----------------------------------------------------------------------

// ZeRO 2/3 hand a layer its gradient memory piece by piece (Layer::set_gradient_sink): the
// pieces a layer writes through a sink, put at their places in its layout, must equal the
// gradients it writes whole into views of that layout (up to rounding), and dx bit for bit.
class PieceRecorder final : public GradientSink {
 public:
  explicit PieceRecorder(std::vector<GradientPiece> expected) : expected_(std::move(expected)) {}
  Tensor next_piece() override {
    EXPECT_FALSE(out_) << "a piece asked for before the last was written";
    out_ = true;
    const GradientPiece& p = expected_.at(pieces_.size());
    pieces_.push_back(Tensor::zeros({p.end - p.begin}));
    return pieces_.back();
  }
  void piece_written() override { out_ = false; }
  // The pieces at their places in a layout of `size` elements.
  std::vector<float> assembled(int64_t size) const {
    EXPECT_EQ(pieces_.size(), expected_.size());
    EXPECT_FALSE(out_);
    std::vector<float> flat(static_cast<size_t>(size), 0.0f);
    for (size_t k = 0; k < pieces_.size(); ++k)
      std::copy_n(pieces_[k].data<float>(), pieces_[k].numel(), flat.begin() + expected_[k].begin);
    return flat;
  }

 private:
  std::vector<GradientPiece> expected_;
  std::vector<Tensor> pieces_;
  bool out_ = false;
};

std::vector<float> values_of(const Tensor& t) { return {t.data<float>(), t.data<float>() + t.numel()}; }

void expect_streams_like_whole(Layer& layer, const Tensor& x, int64_t limit) {
  Params p = bind_random(layer);
  const TrainableLayout layout = trainable_layout(p.specs);
  const Tensor flat = Tensor::zeros({layout.size});
  std::vector<Tensor> views;
  for (size_t i = 0; i < p.specs.size(); ++i)
    views.push_back(p.specs[i].trainable ? flat.view(layout.offsets[i], p.specs[i].shape) : Tensor());
  layer.bind(p.values, views);
  Context probe;
  const Tensor dy = randn(layer.forward(x, probe, train_info()).shape());

  Context ctx;
  layer.forward(x, ctx, train_info());
  const Tensor dx_whole = layer.backward(dy, ctx);

  const std::vector<GradientPiece> pieces = layer.gradient_pieces(limit);
  ASSERT_GT(pieces.size(), 1u) << "the layer is larger than " << limit << " elements";
  EXPECT_TRUE(layer.gradient_pieces(layout.size).empty()) << "it fits one piece of its own size";
  int64_t top = layout.size;
  for (const GradientPiece& piece : pieces) {
    EXPECT_LT(piece.begin, piece.end);
    EXPECT_LE(piece.end, top) << "pieces go down the layout";
    top = piece.begin;
  }
  PieceRecorder sink(pieces);
  layer.set_gradient_sink(&sink, limit);
  Context ctx2;
  layer.forward(x, ctx2, train_info());
  const Tensor dx_streamed = layer.backward(dy, ctx2);
  layer.set_gradient_sink(nullptr, 0);
  // A block of rows is its own GEMM: OpenBLAS kernels may add its products in another order
  // than the whole GEMM's (OPENBLAS_CORETYPE=Haswell does), so rounding apart.
  const std::vector<float> streamed = sink.assembled(layout.size), whole = values_of(flat);
  float largest = 0.0f;
  for (float v : whole) largest = std::max(largest, std::fabs(v));
  for (size_t i = 0; i < whole.size(); ++i) {
    ASSERT_NEAR(streamed[i], whole[i], 1e-6f * largest) << "element " << i << " of " << whole.size();
  }
  if (dx_whole.defined()) {
    EXPECT_EQ(values_of(dx_streamed), values_of(dx_whole));
  }
}

TEST_F(GradCheck, StreamedGradientsEqualTheWholeLinear) {
  Linear with_bias("fc", 7, 10, true), without_bias("fc", 7, 10, false);
  expect_streams_like_whole(with_bias, randn({2, 3, 7}), 15);  // the bias, then blocks of two rows
  expect_streams_like_whole(without_bias, randn({4, 7}), 3);   // at least one row per piece
  EXPECT_EQ(with_bias.gradient_pieces(15).size(), 6u);
  EXPECT_EQ(without_bias.gradient_pieces(3).size(), 10u);
}

TEST_F(GradCheck, StreamedGradientsEqualTheWholeEmbeddingAndHead) {
  Embedding embedding("wte", 11, 6, 4);
  Tensor tokens = Tensor::empty({2, 5}, DType::I32);
  for (int64_t i = 0; i < tokens.numel(); ++i) tokens.data<int32_t>()[i] = static_cast<int32_t>((i * 7 + 2) % 11);
  expect_streams_like_whole(embedding, tokens, 9);  // wpe, then wte in blocks of two rows
  LMHead head("lm_head", 8, 20);
  expect_streams_like_whole(head, randn({2, 3, 8}), 30);
}

TEST_F(GradCheck, StreamedGradientsEqualTheWholeComposites) {
  for (Recompute recompute : {Recompute::None, Recompute::Block, Recompute::Full}) {
    SCOPED_TRACE("recompute " + std::to_string(static_cast<int>(recompute)));
    // c_attn (16 x 48 + 48) and c_fc (16 x 64 + 64) stream, the LayerNorms are one piece each.
    TransformerBlock block("h0", 16, 2, 0.1f, AttentionKind::Flash, kGptInitStd, nullptr, recompute);
    expect_streams_like_whole(block, randn({2, 5, 16}), 100);
  }
  // Convolutions do not stream: each child of the main path and of the shortcut is one piece.
  LayerPtr residual = ResidualBlock::basic("block", 4, 8, 2);
  expect_streams_like_whole(*residual, randn({2, 4, 6, 6}), 100);
}

// ---- Llama layers ----------------------------------------------------------------------------

TEST_F(GradCheck, RMSNorm) {
  RMSNorm n("norm", 6, 1e-5f);
  run(n, randn({2, 3, 6}));
}

// The rotation as a layer (rope forward, the inverse rotation backward), positions from 3.
class Rotary final : public Layer {
 public:
  explicit Rotary(std::vector<float> freq) : Layer("rope"), freq_(std::move(freq)) {}
  std::string describe() const override { return "rope"; }
  Shape output_shape(const Shape& input) const override { return input; }
  Tensor forward(const Tensor& x, Context& ctx, const StepInfo& info) override {
    Tensor y = Tensor::empty(x.shape());
    ops::rope(x, y, freq_, 3);
    return y;
  }
  Tensor backward(const Tensor& dy, Context& ctx) override {
    Tensor dx = Tensor::empty(dy.shape());
    ops::rope(dy, dx, freq_, 3, true);
    return dx;
  }

 private:
  std::vector<float> freq_;
};

TEST_F(GradCheck, RotaryEmbedding) {
  // theta 10 so that every pair turns visibly over 4 positions; with Llama 3.1's scaling too.
  const RopeScaling scaling{8.0, 1.0, 4.0, 16};
  for (const RopeScaling* s : {static_cast<const RopeScaling*>(nullptr), &scaling}) {
    Rotary r(rope_frequencies(8, 10.0, s));
    run(r, randn({2, 3, 4, 8}));
  }
  // The inverse rotation undoes the rotation, in place.
  const Tensor x = randn({1, 2, 5, 8});
  Tensor y = x.clone();
  const std::vector<float> f = rope_frequencies(8, 10.0);
  ops::rope(y, y, f);
  ops::rope(y, y, f, 0, true);
  for (int64_t i = 0; i < x.numel(); ++i) EXPECT_NEAR(y.data<float>()[i], x.data<float>()[i], 1e-6f);
}

TEST_F(GradCheck, SwiGLU) {
  SwiGLU m("mlp", 6, 10, 0.02);
  EXPECT_EQ(m.param_specs().size(), 3u);
  run(m, randn({2, 3, 6}));
}

// Grouped-query attention with rotary positions: 4 query heads over 2 kv heads, and multi-query.
TEST_F(GradCheck, GroupedQueryAttentionFlashAndPlain) {
  for (const AttentionKind kind : {AttentionKind::Flash, AttentionKind::Plain})
    for (const int64_t kv : {2, 1}) {
      SCOPED_TRACE(detail::cat(kind == AttentionKind::Flash ? "flash" : "plain", ", kv heads ", kv));
      CausalSelfAttention a("self_attn", 16, 4, 0.0f, kind, kGptInitStd, nullptr,
                            {kv, rope_frequencies(4, 10.0), /*fused=*/false});
      EXPECT_EQ(a.param_specs().size(), 4u);  // q_proj, k_proj, v_proj, o_proj: no biases
      EXPECT_EQ(shape_str(a.param_specs()[1].shape), shape_str({kv * 4, 16}));
      run(a, randn({2, 5, 16}));
    }
}

// Flash attention over T > its 64-row tiles, grouped: the same as the plain one.
TEST_F(GradCheck, GroupedQueryFlashEqualsPlainAcrossTiles) {
  const Tensor q = randn({2, 6, 70, 8}), k = randn({2, 2, 70, 8}), v = randn({2, 2, 70, 8}), dy = randn({2, 6, 70, 8});
  Tensor y[2], dq[2], dk[2], dv[2];
  for (int i = 0; i < 2; ++i) {
    y[i] = Tensor::empty(q.shape());
    dq[i] = Tensor::empty(q.shape());
    dk[i] = Tensor::empty(k.shape());
    dv[i] = Tensor::empty(v.shape());
  }
  Tensor lse = Tensor::empty({2, 6, 70}), probs = Tensor::empty({2, 6, 70, 70});
  ops::flash_attention_forward(q, k, v, y[0], lse);
  ops::flash_attention_backward(q, k, v, y[0], lse, dy, dq[0], dk[0], dv[0]);
  ops::attention_forward(q, k, v, y[1], probs);
  ops::attention_backward(q, k, v, probs, dy, dq[1], dk[1], dv[1]);
  for (const auto& [a, b] : {std::pair{&y[0], &y[1]}, {&dq[0], &dq[1]}, {&dk[0], &dk[1]}, {&dv[0], &dv[1]}})
    for (int64_t i = 0; i < a->numel(); ++i) ASSERT_NEAR(a->data<float>()[i], b->data<float>()[i], 2e-5f) << i;
}

std::unique_ptr<TransformerBlock> llama_block(const std::string& name, int64_t embed, int64_t heads, int64_t kv,
                                              Recompute recompute = Recompute::None) {
  BlockParts parts{
      std::make_unique<RMSNorm>("input_layernorm", embed, 1e-5f),
      std::make_unique<CausalSelfAttention>("self_attn", embed, heads, 0.0f, AttentionKind::Flash, kGptInitStd, nullptr,
                                            AttentionOptions{kv, rope_frequencies(embed / heads, 10.0), false}),
      std::make_unique<RMSNorm>("post_attention_layernorm", embed, 1e-5f),
      std::make_unique<SwiGLU>("mlp", embed, 2 * embed, kGptInitStd)};
  return std::make_unique<TransformerBlock>(name, std::move(parts), recompute);
}

TEST_F(GradCheck, LlamaBlock) {
  for (Recompute recompute : {Recompute::None, Recompute::Full}) {
    auto b = llama_block("layers.0", 8, 2, 1, recompute);
    EXPECT_EQ(b->param_specs().size(), 9u);
    run(*b, randn({2, 4, 8}));
  }
}

// Embedding without positions, two blocks, the final norm and an untied head: every parameter.
TEST_F(GradCheck, TinyLlamaModel) {
  std::vector<LayerPtr> layers;
  layers.push_back(std::make_unique<Embedding>("embedding", 7, 8, 8, nullptr, /*positions=*/false));
  layers.push_back(llama_block("layers.0", 8, 4, 2));
  layers.push_back(llama_block("layers.1", 8, 4, 2));
  layers.push_back(std::make_unique<RMSNorm>("norm", 8, 1e-5f));
  layers.push_back(std::make_unique<LMHead>("lm_head", 8, 7));
  Sequential model("llama", std::move(layers));
  // The composition curves more than one layer: a smaller step keeps the truncation error down.
  run(model, tokens(2, 5, 7), 3e-3);
}

TEST_F(GradCheck, StreamedGradientsEqualTheWholeLlamaBlock) {
  for (Recompute recompute : {Recompute::None, Recompute::Block, Recompute::Full}) {
    SCOPED_TRACE("recompute " + std::to_string(static_cast<int>(recompute)));
    expect_streams_like_whole(*llama_block("layers.0", 16, 4, 2, recompute), randn({2, 5, 16}), 100);
  }
}

}  // namespace
}  // namespace strata::layers
