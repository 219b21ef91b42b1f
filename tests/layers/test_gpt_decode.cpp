// The GPT decoder (layers/gpt_decode.hpp): its KV-cached logits equal the full forward's
// (Mode::Eval) at every position, tied and untied, flash and plain; greedy generation equals
// running the full forward over the (cropped) context and taking the argmax, also past the
// model's positions (the sliding window); token choice is deterministic for a seed, top-k 1 is
// greedy, and draws follow the softmax; bad tokens and a full cache are Input errors. The same
// for a Llama (grouped-query, rotary, SwiGLU).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <span>
#include <utility>

#include "expect_error.hpp"
#include "layers/gpt_decode.hpp"
#include "layers/model.hpp"
#include "layers/parameter_store.hpp"
#include "layers/zoo.hpp"

namespace strata::layers {
namespace {

constexpr int64_t kT = 16;
constexpr int kVocab = 50;

ModelSpec gpt(bool tied, const std::string& attention = "flash") {
  ModelSpec s;
  s.name = "gpt";
  s.layers = 2;
  s.heads = 2;
  s.embed = 32;
  s.seq_len = kT;
  s.tie_embeddings = tied;
  s.attention = attention;
  return s;
}

// GPT-2's init gives logits near 0 everywhere; larger random values make the model's
// positions and tokens matter (and the argmax well separated).
void randomize(const ParameterStore& store, uint32_t seed) {
  std::mt19937 g(seed);
  std::normal_distribution<float> n(0.0f, 0.3f);
  for (const ParamEntry& e : store.entries()) {
    const Tensor v = store.value(e);
    const bool ln_weight =
        (e.name.find("ln_") != std::string::npos || e.name.ends_with("norm/weight")) && e.name.ends_with("/weight");
    for (int64_t i = 0; i < v.numel(); ++i) v.data<float>()[i] = (ln_weight ? 1.0f : 0.0f) + n(g);
  }
}

struct Fixture {
  Model model;
  ParameterStore store;
  Fixture(bool tied, const std::string& attention = "flash", uint32_t seed = 5) : Fixture(gpt(tied, attention), seed) {}
  Fixture(const ModelSpec& spec, uint32_t seed) : model(build_model(spec, {kT}, kVocab)), store(model, 1) {
    randomize(store, seed);
  }
  // Logits (len, V) of the full forward over `tokens` (len <= T).
  std::vector<float> forward(const std::vector<int32_t>& tokens) const {
    Tensor x = Tensor::empty({1, static_cast<int64_t>(tokens.size())}, DType::I32);
    std::copy(tokens.begin(), tokens.end(), x.data<int32_t>());
    std::vector<Context> ctx;
    StepInfo info;
    info.mode = Mode::Eval;
    const Tensor y = model.forward(x, ctx, info);
    EXPECT_EQ(y.numel(), static_cast<int64_t>(tokens.size()) * kVocab);
    return std::vector<float>(y.data<float>(), y.data<float>() + y.numel());
  }
};

std::vector<int32_t> random_tokens(size_t n, uint32_t seed) {
  std::mt19937 g(seed);
  std::vector<int32_t> t(n);
  for (int32_t& x : t) x = static_cast<int32_t>(g() % kVocab);
  return t;
}

int32_t argmax(const float* l, int64_t n) { return static_cast<int32_t>(std::max_element(l, l + n) - l); }

using test::expect_input_error;

TEST(GptDecode, LogitsEqualTheFullForwardAtEveryPosition) {
  for (const bool tied : {true, false})
    for (const char* attention : {"flash", "plain"}) {
      SCOPED_TRACE(std::string(tied ? "tied " : "untied ") + attention);
      const Fixture f(tied, attention);
      GptDecoder d(f.model, f.store);
      EXPECT_EQ(d.layers(), 2);
      EXPECT_EQ(d.heads(), 2);
      EXPECT_EQ(d.embed(), 32);
      EXPECT_EQ(d.vocab(), kVocab);
      EXPECT_EQ(d.max_positions(), kT);
      const std::vector<int32_t> tokens = random_tokens(kT, 9);
      const std::vector<float> full = f.forward(tokens);
      float scale = 0.0f, worst = 0.0f;
      for (const float v : full) scale = std::max(scale, std::abs(v));
      EXPECT_GT(scale, 1.0f);                 // logits that are not all near zero
      for (int pass = 0; pass < 2; ++pass) {  // a reset cache gives the same again
        d.reset();
        for (int64_t t = 0; t < kT; ++t) {
          EXPECT_EQ(d.position(), t);
          const Tensor& logits = d.step(tokens[static_cast<size_t>(t)]);
          ASSERT_EQ(logits.numel(), kVocab);
          for (int64_t v = 0; v < kVocab; ++v)
            worst = std::max(worst, std::abs(logits.data<float>()[v] - full[static_cast<size_t>(t * kVocab + v)]));
        }
      }
      EXPECT_LE(worst, 1e-5f) << "largest |logit| " << scale;
      // Batched: 7 positions in one prefill, then 9 more in one; each returns its last logits.
      d.reset();
      worst = 0.0f;
      for (const auto& [begin, end] : {std::pair{0, 7}, {7, 16}}) {
        const Tensor& logits = d.prefill(std::span(tokens).subspan(begin, end - begin));
        EXPECT_EQ(d.position(), end);
        for (int64_t v = 0; v < kVocab; ++v)
          worst =
              std::max(worst, std::abs(logits.data<float>()[v] - full[static_cast<size_t>((end - 1) * kVocab + v)]));
      }
      EXPECT_LE(worst, 1e-5f);
    }
}

TEST(GptDecode, GreedyGenerationEqualsRepeatedFullForwards) {
  for (const bool tied : {true, false}) {
    SCOPED_TRACE(tied ? "tied" : "untied");
    const Fixture f(tied);
    GptDecoder d(f.model, f.store);
    // 5 prompt tokens and 25 new ones: the last 14 slide the window over the 16 positions.
    const std::vector<int32_t> prompt = random_tokens(5, 4);
    std::vector<int32_t> streamed;
    const std::vector<int32_t> got =
        generate(d, prompt, 25, SampleOptions{0.0f, 0, 0}, [&](int32_t t) { streamed.push_back(t); });
    EXPECT_EQ(got, streamed);
    std::vector<int32_t> ctx = prompt, want;
    for (int i = 0; i < 25; ++i) {
      const std::vector<int32_t> window(ctx.end() - std::min<ptrdiff_t>(ctx.size(), kT), ctx.end());
      const std::vector<float> full = f.forward(window);
      want.push_back(argmax(full.data() + (window.size() - 1) * kVocab, kVocab));
      ctx.push_back(want.back());
    }
    EXPECT_EQ(got, want);
    // A prompt longer than the positions: cropped to its last 16 tokens.
    const std::vector<int32_t> long_prompt = random_tokens(kT + 7, 8);
    const std::vector<int32_t> cropped(long_prompt.end() - kT, long_prompt.end());
    EXPECT_EQ(generate(d, long_prompt, 6, SampleOptions{0.0f, 0, 0}),
              generate(d, cropped, 6, SampleOptions{0.0f, 0, 0}));
  }
}

// Llama: 4 query heads over kv heads 2 and 1, rotary positions with Llama 3.1's scaling, tied
// and untied: the cached logits (one by one, and two prefills) equal the full forward's, and
// greedy generation past the 16 positions equals the full forward over the cropped window.
ModelSpec llama(int kv_heads, bool tied) {
  ModelSpec s;
  s.name = "llama";
  s.layers = 2;
  s.heads = 4;
  s.kv_heads = kv_heads;
  s.embed = 32;
  s.ffn_hidden = 48;
  s.seq_len = kT;
  s.rope_theta = 100;
  s.rope_scaling = 8;
  s.tie_embeddings = tied;
  return s;
}

TEST(GptDecode, LlamaLogitsAndGreedyGenerationEqualTheFullForward) {
  for (const int kv : {2, 1})
    for (const bool tied : {false, true}) {
      SCOPED_TRACE(detail::cat("kv heads ", kv, tied ? ", tied" : ", untied"));
      const Fixture f(llama(kv, tied), 7);
      GptDecoder d(f.model, f.store);
      EXPECT_EQ(d.heads(), 4);
      EXPECT_EQ(d.max_positions(), kT);
      const std::vector<int32_t> tokens = random_tokens(kT, 3);
      const std::vector<float> full = f.forward(tokens);
      float scale = 0.0f, worst = 0.0f;
      for (const float v : full) scale = std::max(scale, std::abs(v));
      EXPECT_GT(scale, 1.0f);
      for (int64_t t = 0; t < kT; ++t) {
        const Tensor& logits = d.step(tokens[static_cast<size_t>(t)]);
        for (int64_t v = 0; v < kVocab; ++v)
          worst = std::max(worst, std::abs(logits.data<float>()[v] - full[static_cast<size_t>(t * kVocab + v)]));
      }
      d.reset();
      for (const auto& [begin, end] : {std::pair{0, 5}, {5, 16}}) {
        const Tensor& logits = d.prefill(std::span(tokens).subspan(begin, end - begin));
        for (int64_t v = 0; v < kVocab; ++v)
          worst =
              std::max(worst, std::abs(logits.data<float>()[v] - full[static_cast<size_t>((end - 1) * kVocab + v)]));
      }
      EXPECT_LE(worst, 1e-5f * std::max(1.0f, scale)) << "largest |logit| " << scale;
      std::printf("[ llama   ] kv heads %d%s: worst |cached - full| logit %.2e of largest %.2f\n", kv,
                  tied ? ", tied" : "", worst, scale);

      const std::vector<int32_t> prompt = random_tokens(5, 4);
      const std::vector<int32_t> got = generate(d, prompt, 20, SampleOptions{0.0f, 0, 0});
      std::vector<int32_t> ctx = prompt, want;
      for (int i = 0; i < 20; ++i) {
        const std::vector<int32_t> window(ctx.end() - std::min<ptrdiff_t>(ctx.size(), kT), ctx.end());
        const std::vector<float> logits = f.forward(window);
        want.push_back(argmax(logits.data() + (window.size() - 1) * kVocab, kVocab));
        ctx.push_back(want.back());
      }
      EXPECT_EQ(got, want);
    }
}

TEST(GptDecode, SamplingIsDeterministicForASeed) {
  const Fixture f(true);
  GptDecoder d(f.model, f.store);
  const std::vector<int32_t> prompt = random_tokens(3, 2);
  const SampleOptions a{1.0f, 0, 7}, b{1.0f, 0, 8};
  const std::vector<int32_t> first = generate(d, prompt, 30, a);
  EXPECT_EQ(generate(d, prompt, 30, a), first);
  EXPECT_NE(generate(d, prompt, 30, b), first);
  // top-k 1 and a near-zero temperature are greedy.
  const std::vector<int32_t> greedy = generate(d, prompt, 30, SampleOptions{0.0f, 0, 0});
  EXPECT_EQ(generate(d, prompt, 30, SampleOptions{1.0f, 1, 7}), greedy);
  EXPECT_EQ(generate(d, prompt, 30, SampleOptions{1e-4f, 0, 7}), greedy);
  EXPECT_TRUE(generate(d, prompt, 0, a).empty());
}

TEST(GptDecode, PickTokenFollowsTheSoftmaxAndTopK) {
  Tensor logits = Tensor::empty({4});
  float* l = logits.data<float>();
  l[0] = 0.0f;
  l[1] = std::log(3.0f);  // p = 3/7
  l[2] = std::log(2.0f);  // p = 2/7
  l[3] = 0.0f;            // p = 1/7, like token 0
  EXPECT_EQ(pick_token(logits, SampleOptions{0.0f, 0, 0}, 0), 1);
  int counts[4] = {0, 0, 0, 0}, top2[4] = {0, 0, 0, 0};
  const int n = 20000;
  for (int i = 0; i < n; ++i) {
    ++counts[pick_token(logits, SampleOptions{1.0f, 0, 3}, i)];
    ++top2[pick_token(logits, SampleOptions{1.0f, 2, 3}, i)];
  }
  const double want[4] = {1.0 / 7, 3.0 / 7, 2.0 / 7, 1.0 / 7};
  for (int i = 0; i < 4; ++i) EXPECT_NEAR(counts[i] / double(n), want[i], 0.015) << "token " << i;
  EXPECT_EQ(top2[0] + top2[3], 0);
  EXPECT_NEAR(top2[1] / double(n), 0.6, 0.015);
  // Temperature 2 flattens: p ~ exp(l / 2).
  int hot = 0;
  for (int i = 0; i < n; ++i) hot += pick_token(logits, SampleOptions{2.0f, 0, 5}, i) == 1;
  const double z = 1 + std::sqrt(3.0) + std::sqrt(2.0) + 1;
  EXPECT_NEAR(hot / double(n), std::sqrt(3.0) / z, 0.015);
  // vocab_limit: ids at or above it are never chosen (padded logits).
  EXPECT_EQ(pick_token(logits, SampleOptions{0.0f, 0, 0, 1}, 0), 0);
  for (int i = 0; i < 1000; ++i) EXPECT_LT(pick_token(logits, SampleOptions{1.0f, 0, 3, 3}, i), 3);
  expect_input_error([&] { pick_token(logits, SampleOptions{-1.0f, 0, 0}, 0); }, {"temperature"});
  expect_input_error([&] { pick_token(logits, SampleOptions{1.0f, -2, 0}, 0); }, {"top-k"});
}

TEST(GptDecode, BadTokensAndAFullCacheAreInputErrors) {
  const Fixture f(false);
  GptDecoder d(f.model, f.store);
  expect_input_error([&] { d.step(kVocab); }, {"vocabulary"});
  expect_input_error([&] { d.step(-1); }, {"vocabulary"});
  const std::vector<int32_t> ones(kT - 3, 1);
  d.prefill(ones);
  expect_input_error([&] { d.prefill(std::vector<int32_t>(4, 1)); }, {"full"});
  for (int i = 0; i < 3; ++i) d.step(1);
  expect_input_error([&] { d.step(1); }, {"full"});
  expect_input_error([&] { generate(d, {}, 3, SampleOptions{}); }, {"context"});
}

}  // namespace
}  // namespace strata::layers
