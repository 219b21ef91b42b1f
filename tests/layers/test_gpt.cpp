// The GPT model: the zoo's gpt and its presets (shapes, parameter names and counts, Input
// errors), GPT-2's init (Normal draws from (seed, name), residual projections scaled), the
// no-weight-decay parameter groups and their optimizer segments, flash vs plain attention,
// and dropout masks that do not depend on how a batch is split. Gradients: test_gradcheck;
// parity with a nanoGPT-style torch model: test_torch_parity.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <random>
#include <set>

#include "core/ops.hpp"
#include "expect_error.hpp"
#include "layers/gpt.hpp"
#include "layers/loss.hpp"
#include "layers/model.hpp"
#include "layers/optimizer.hpp"
#include "layers/parameter_store.hpp"
#include "layers/zoo.hpp"

namespace strata::layers {
namespace {

ModelSpec gpt(int layers = 2, int heads = 2, int64_t embed = 32, bool tied = true, float dropout = 0.0f,
              const std::string& attention = "flash") {
  ModelSpec s;
  s.name = "gpt";
  s.layers = layers;
  s.heads = heads;
  s.embed = embed;
  s.tie_embeddings = tied;
  s.dropout = dropout;
  s.attention = attention;
  return s;
}

Tensor tokens(int64_t batch, int64_t t, int vocab, uint32_t seed = 3) {
  std::mt19937 g(seed);
  Tensor x = Tensor::empty({batch, t}, DType::I32);
  for (int64_t i = 0; i < x.numel(); ++i) x.data<int32_t>()[i] = static_cast<int32_t>(g() % vocab);
  return x;
}

using test::expect_input_error;

int64_t count_params(const Model& m) {
  int64_t n = 0;
  for (const ParamEntry& e : ParameterStore::layout(m))
    if (e.trainable) n += shape_numel(e.shape);
  return n;
}

TEST(Gpt, ShapesNamesAndGroups) {
  for (const bool tied : {true, false}) {
    const Model m = build_model(gpt(2, 2, 32, tied), {16}, 256);
    EXPECT_EQ(shape_str(m.input_shape()), shape_str({16}));
    EXPECT_EQ(shape_str(m.shape(m.size())), shape_str({16, 256}));
    EXPECT_EQ(m.num_classes(), 256);
    ASSERT_EQ(m.size(), 5u);  // embedding, h0, h1, ln_f, lm_head
    std::map<std::string, const ParamEntry*> by_name;
    const std::vector<ParamEntry> entries = ParameterStore::layout(m);
    for (const ParamEntry& e : entries) by_name[e.name] = &e;
    std::vector<std::string> want = {"wte/weight", "wpe/weight", "ln_f/weight", "ln_f/bias"};
    for (const char* b : {"h0", "h1"})
      for (const char* p : {"ln_1/weight", "ln_1/bias", "attn/c_attn/weight", "attn/c_attn/bias", "attn/c_proj/weight",
                            "attn/c_proj/bias", "ln_2/weight", "ln_2/bias", "mlp/c_fc/weight", "mlp/c_fc/bias",
                            "mlp/c_proj/weight", "mlp/c_proj/bias"})
        want.push_back(std::string(b) + "/" + p);
    if (!tied) want.push_back("lm_head/weight");
    EXPECT_EQ(entries.size(), want.size());
    for (const std::string& n : want) {
      ASSERT_TRUE(by_name.count(n)) << "no parameter " << n;
      // nanoGPT's groups: decay only the 2-D weights of the Linear maps (not the embeddings).
      const bool decays =
          by_name[n]->shape.size() == 2 && n.find("wte") == std::string::npos && n.find("wpe") == std::string::npos;
      EXPECT_EQ(by_name[n]->no_weight_decay, !decays) << n;
    }
    EXPECT_EQ(shape_str(by_name["wte/weight"]->shape), shape_str({256, 32}));
    EXPECT_EQ(shape_str(by_name["wpe/weight"]->shape), shape_str({16, 32}));
    EXPECT_EQ(shape_str(by_name["h1/attn/c_attn/weight"]->shape), shape_str({96, 32}));
    EXPECT_EQ(shape_str(by_name["h1/mlp/c_fc/weight"]->shape), shape_str({128, 32}));
  }
}

TEST(Gpt, PresetsSetTheShapeAndParameterCounts) {
  struct Case {
    const char* name;
    int layers, heads;
    int64_t embed;
  };
  for (const Case c : {Case{"gpt2-124m", 12, 12, 768}, Case{"gpt2-350m", 24, 16, 1024}, Case{"gpt2-774m", 36, 20, 1280},
                       Case{"gpt2-1.5b", 48, 25, 1600}}) {
    ModelSpec s;
    s.name = c.name;
    const ModelSpec r = resolve_preset(s);
    EXPECT_EQ(r.layers, c.layers);
    EXPECT_EQ(r.heads, c.heads);
    EXPECT_EQ(r.embed, c.embed);
    EXPECT_EQ(r.seq_len, 1024);
    EXPECT_EQ(r.vocab, 50257);
    const Model m = build_model(s, {1024}, 50257);
    const int64_t l = c.layers, d = c.embed;
    EXPECT_EQ(count_params(m), 12 * l * d * d + 13 * l * d + 50257 * d + 1024 * d + 2 * d) << c.name;
  }
  ModelSpec s;
  s.name = "gpt2-124m";
  EXPECT_EQ(count_params(build_model(s, {1024}, 50257)), 124439808);  // GPT-2 small, tied
  s.tie_embeddings = false;
  EXPECT_EQ(count_params(build_model(s, {1024}, 50257)), 124439808 + 50257 * 768);
  // Shorter data sequences use the first rows of wpe; --vocab pads a preset's vocabulary
  // (nanoGPT's 50304, which tensor parallelism needs divisible by --tp).
  s.vocab = 50304;
  const Model short_seq = build_model(s, {256}, 50257);
  EXPECT_EQ(shape_str(short_seq.shape(short_seq.size())), shape_str({256, 50304}));
}

TEST(Gpt, InputErrors) {
  expect_input_error([] { build_model(gpt(2, 3, 32), {16}, 256); }, {"heads", "3", "32"});
  expect_input_error([] { build_model(gpt(2, 2, 32), {4, 4}, 256); }, {"gpt", "[T]"});
  ModelSpec s = gpt();
  s.seq_len = 8;
  expect_input_error([&] { build_model(s, {16}, 256); }, {"16", "8"});
  s = gpt();
  s.vocab = 100;
  expect_input_error([&] { build_model(s, {16}, 256); }, {"vocab", "100", "256"});
  s = gpt();
  s.attention = "fast";
  expect_input_error([&] { build_model(s, {16}, 256); }, {"attention", "fast"});
}

TEST(Gpt, Gpt2InitFromSeedAndName) {
  const int layers = 4;
  const Model m = build_model(gpt(layers, 2, 64, false), {32}, 512);
  const ParameterStore a(m, 7), b(m, 7), c(m, 8);
  for (const ParamEntry& e : a.entries()) {
    const Tensor va = a.value(e), vb = b.value(e), vc = c.value(e);
    const float* pa = va.data<float>();
    double sum = 0, sum2 = 0;
    int64_t same_as_other_seed = 0;
    for (int64_t i = 0; i < va.numel(); ++i) {
      ASSERT_EQ(pa[i], vb.data<float>()[i]) << e.name << ": init must be a function of (seed, name)";
      same_as_other_seed += pa[i] == vc.data<float>()[i];
      sum += pa[i];
      sum2 += static_cast<double>(pa[i]) * pa[i];
    }
    const double n = static_cast<double>(va.numel());
    const double mean = sum / n, std = std::sqrt(sum2 / n - mean * mean);
    const bool is_bias = e.name.ends_with("bias");
    const bool is_ln = e.name.find("ln_") != std::string::npos;
    if (is_ln && e.name.ends_with("weight")) {
      EXPECT_EQ(mean, 1.0) << e.name;
      EXPECT_EQ(std, 0.0) << e.name;
    } else if (is_bias) {
      EXPECT_EQ(sum2, 0.0) << e.name;
    } else {
      const bool residual = e.name.ends_with("c_proj/weight");
      const double want = residual ? 0.02 / std::sqrt(2.0 * layers) : 0.02;
      EXPECT_NEAR(std, want, 0.05 * want) << e.name;
      EXPECT_NEAR(mean, 0.0, 5 * want / std::sqrt(n)) << e.name;
      EXPECT_LT(same_as_other_seed, 3) << e.name;
    }
  }
}

// Forward of a batch of tokens through a model with fresh parameters.
Tensor run(const Model& m, const ParameterStore& store, const Tensor& x, const StepInfo& info) {
  (void)store;
  std::vector<Context> ctx;
  return m.forward(x, ctx, info);
}

TEST(Gpt, FlashAndPlainAttentionAgreeAndTheLossIsFinite) {
  StepInfo info;
  info.seed = 11;
  info.step = 2;
  for (const float dropout : {0.0f, 0.2f}) {
    const Model flash = build_model(gpt(2, 2, 32, true, dropout, "flash"), {16}, 256);
    const Model plain = build_model(gpt(2, 2, 32, true, dropout, "plain"), {16}, 256);
    const ParameterStore sf(flash, 1), sp(plain, 1);
    const Tensor x = tokens(3, 16, 256);
    const Tensor yf = run(flash, sf, x, info), yp = run(plain, sp, x, info);
    ASSERT_EQ(shape_str(yf.shape()), shape_str({3, 16, 256}));
    double diff = 0, ref = 0;
    for (int64_t i = 0; i < yf.numel(); ++i) {
      diff = std::max(diff, std::abs(static_cast<double>(yf.data<float>()[i]) - yp.data<float>()[i]));
      ref = std::max(ref, std::abs(static_cast<double>(yp.data<float>()[i])));
    }
    EXPECT_LE(diff, 1e-5 * ref + 1e-6) << "dropout " << dropout;
    SoftmaxCrossEntropy loss;
    Context lctx;
    const double sum = loss.forward(yf, tokens(3, 16, 256, 9), lctx);
    // Near-uniform logits at init: the mean token loss is about ln(256).
    EXPECT_NEAR(sum / (3 * 16), std::log(256.0), 0.3);
  }
}

TEST(Gpt, DropoutMasksDoNotDependOnTheBatchSplit) {
  const Model m = build_model(gpt(2, 2, 32, true, 0.3f), {8}, 64);
  const ParameterStore store(m, 1);
  const Tensor x = tokens(4, 8, 64);
  StepInfo info;
  info.seed = 5;
  info.step = 9;
  const Tensor whole = run(m, store, x, info);
  for (int64_t first : {0, 2}) {
    StepInfo part = info;
    part.first_sample = first;
    const Tensor y = run(m, store, x.slice(first, first + 2).clone(), part);
    const Tensor want = whole.slice(first, first + 2);
    for (int64_t i = 0; i < y.numel(); ++i)
      ASSERT_NEAR(y.data<float>()[i], want.data<float>()[i], 1e-6f * (1 + std::abs(want.data<float>()[i])))
          << "samples from " << first << ", element " << i;
  }
  // The masks do change with the step.
  StepInfo other = info;
  other.step = 10;
  const Tensor y = run(m, store, x, other);
  int64_t differ = 0;
  for (int64_t i = 0; i < y.numel(); ++i) differ += y.data<float>()[i] != whole.data<float>()[i];
  EXPECT_GT(differ, 0);
}

TEST(Gpt, FlopsForPartitioning) {
  const Model m = build_model(gpt(2, 2, 32), {16}, 256);
  for (size_t i = 0; i < m.size(); ++i) EXPECT_GE(m.layer(i).flops(m.shape(i)), 0) << m.layer(i).name();
  const int64_t t = 16, d = 32;
  EXPECT_EQ(m.layer(1).flops(m.shape(1)), 12 * t * d * d + t * t * d);  // a block
  EXPECT_EQ(m.layer(4).flops(m.shape(4)), t * d * 256);                 // the head
}

// ---- activation recomputation (--recompute) ---------------------------------------------------

// The bytes of the distinct tensors held in the contexts (views of one buffer counted once).
int64_t saved_bytes(const Context& ctx, std::set<const void*>& seen) {
  int64_t bytes = 0;
  for (const Tensor& t : ctx.saved)
    if (t.defined() && seen.insert(t.raw()).second) bytes += static_cast<int64_t>(t.nbytes());
  for (const Context& child : ctx.children) bytes += saved_bytes(child, seen);
  return bytes;
}

struct TrainPass {
  double loss = 0;
  std::vector<uint32_t> logits, grads;  // bit patterns
  int64_t saved = 0;                    // activation bytes held after forward
};

std::vector<uint32_t> bits(const Tensor& t) {
  std::vector<uint32_t> b(static_cast<size_t>(t.numel()));
  std::memcpy(b.data(), t.data<float>(), b.size() * sizeof(float));
  return b;
}

// Forward + backward of one micro-batch of the tiny GPT (2 blocks, 4 heads, width 32, T 16,
// dropout 0.1, untied) with the given recompute and attention.
TrainPass train_pass(const std::string& recompute, const std::string& attention) {
  ModelSpec s = gpt(2, 4, 32, false, 0.1f, attention);
  s.recompute = recompute;
  const Model m = build_model(s, {16}, 64);
  const ParameterStore store(m, 1);
  store.grads().fill_zero();
  StepInfo info;
  info.seed = 7;
  info.step = 3;
  info.first_sample = 5;
  std::vector<Context> ctx;
  const Tensor logits = m.forward(tokens(3, 16, 64), ctx, info);
  TrainPass r;
  std::set<const void*> seen;
  for (const Context& c : ctx) r.saved += saved_bytes(c, seen);
  SoftmaxCrossEntropy loss;
  Context lctx;
  r.loss = loss.forward(logits, tokens(3, 16, 64, 9), lctx);
  m.backward(loss.backward(lctx, 1.0f / 48), ctx);
  r.logits = bits(logits);
  r.grads = bits(store.grads());
  return r;
}

TEST(Recompute, BlockAndFullAreBitIdenticalAndKeepLess) {
  for (const std::string attention : {"flash", "plain"}) {
    const TrainPass none = train_pass("none", attention);
    const TrainPass block = train_pass("block", attention);
    const TrainPass full = train_pass("full", attention);
    std::printf("saved activation bytes after forward (%s attention, B 3): none %lld, block %lld, full %lld\n",
                attention.c_str(), static_cast<long long>(none.saved), static_cast<long long>(block.saved),
                static_cast<long long>(full.saved));
    for (const TrainPass* r : {&block, &full}) {
      const char* name = r == &block ? "block" : "full";
      EXPECT_EQ(std::memcmp(&r->loss, &none.loss, sizeof(double)), 0) << name << " " << attention;
      EXPECT_TRUE(r->logits == none.logits) << name << " " << attention;
      ASSERT_EQ(r->grads.size(), none.grads.size());
      size_t differ = 0;
      for (size_t i = 0; i < none.grads.size(); ++i) differ += r->grads[i] != none.grads[i];
      EXPECT_EQ(differ, 0u) << name << " " << attention << ": gradient elements not bit-identical to none";
    }
    // Non-trivial gradients (a test of zeros would pass anything).
    size_t nonzero = 0;
    for (uint32_t g : none.grads) nonzero += (g & 0x7fffffffu) != 0;
    EXPECT_GT(nonzero, none.grads.size() / 2);
    EXPECT_LT(block.saved, none.saved);
    EXPECT_LE(full.saved, block.saved);
  }
  expect_input_error(
      [] {
        build_model(
            [] {
              ModelSpec s = gpt();
              s.recompute = "all";
              return s;
            }(),
            {16}, 256);
      },
      {"--recompute", "none, block or full", "all"});
  expect_input_error(
      [] {
        ModelSpec s;
        s.name = "mlp";
        s.recompute = "block";
        build_model(s, {4}, 2);
      },
      {"--recompute", "mlp", "none"});
}

// ---- parameter groups in the optimizer --------------------------------------------------------

TEST(ParameterGroups, NoRangesWithoutMarkedParameters) {
  ModelSpec s;
  s.name = "mlp";
  s.hidden = {16};
  const Model m = build_model(s, {8}, 4);
  EXPECT_TRUE(no_decay_ranges(ParameterStore::layout(m), 0, 1000).empty());
}

TEST(ParameterGroups, RangesCoverTheMarkedEntriesAndClipToTheShard) {
  const Model m = build_model(gpt(1, 2, 16), {4}, 32);
  const std::vector<ParamEntry> entries = ParameterStore::layout(m);
  const int64_t n = ParameterStore::layout_numel(entries);
  const std::vector<Optimizer::Range> all = no_decay_ranges(entries, 0, n);
  std::vector<bool> no_decay(static_cast<size_t>(n), false);
  for (const Optimizer::Range& r : all)
    for (int64_t i = r.begin; i < r.end; ++i) no_decay[static_cast<size_t>(i)] = true;
  for (const ParamEntry& e : entries)
    for (int64_t i = e.offset; i < e.offset + shape_numel(e.shape); ++i)
      ASSERT_EQ(no_decay[static_cast<size_t>(i)], e.no_weight_decay) << e.name;
  for (size_t k = 1; k < all.size(); ++k) EXPECT_LT(all[k - 1].end, all[k].begin) << "merged";
  // A shard [b, e): the same elements, relative to b.
  const int64_t b = 37, e = n - 21;
  for (const Optimizer::Range& r : no_decay_ranges(entries, b, e)) {
    EXPECT_GE(r.begin, 0);
    EXPECT_LE(r.end, e - b);
    for (int64_t i = r.begin; i < r.end; ++i) EXPECT_TRUE(no_decay[static_cast<size_t>(i + b)]);
  }
}

// Stepping in segments is the same update as separate optimizers over the parts (AdamW and
// SGD are element-wise), bit for bit.
TEST(ParameterGroups, SegmentedStepEqualsSeparateGroups) {
  for (const char* name : {"adamw", "sgd"}) {
    OptimizerConfig cfg;
    cfg.name = name;
    cfg.weight_decay = 0.1f;
    const int64_t n = 50;
    std::mt19937 g(4);
    std::normal_distribution<float> d;
    Tensor p = Tensor::empty({n}), grad = Tensor::empty({n});
    for (int64_t i = 0; i < n; ++i) p.data<float>()[i] = d(g);
    const Tensor p_ref = p.clone();
    Optimizer seg(cfg, n);
    seg.set_no_decay({{10, 25}, {40, 50}});
    OptimizerConfig no_wd = cfg;
    no_wd.weight_decay = 0.0f;
    // Groups: decay [0,10) [25,40); none [10,25) [40,50).
    struct Part {
      int64_t b, e;
      bool decay;
    };
    const Part parts[] = {{0, 10, true}, {10, 25, false}, {25, 40, true}, {40, 50, false}};
    std::vector<std::unique_ptr<Optimizer>> refs;
    for (const Part& q : parts) refs.push_back(std::make_unique<Optimizer>(q.decay ? cfg : no_wd, q.e - q.b));
    for (int step = 0; step < 3; ++step) {
      for (int64_t i = 0; i < n; ++i) grad.data<float>()[i] = d(g);
      seg.step(p, grad, 0.01f);
      for (size_t k = 0; k < 4; ++k)
        refs[k]->step(p_ref.view(parts[k].b, {parts[k].e - parts[k].b}),
                      grad.view(parts[k].b, {parts[k].e - parts[k].b}), 0.01f);
    }
    for (int64_t i = 0; i < n; ++i) ASSERT_EQ(p.data<float>()[i], p_ref.data<float>()[i]) << name << " " << i;
  }
}

}  // namespace
}  // namespace strata::layers
