// The --plan layout search: the step-time model against numbers worked out by hand, and the
// search's rules (every layout of the world tried, only those within the device listed,
// fastest first, the smallest named when none fits, widths the model cannot take skipped).
#include <gtest/gtest.h>

#include <map>
#include <set>
#include <tuple>

#include "layers/zoo.hpp"
#include "parallel/pipeline/partition.hpp"
#include "parallel/plan/layout_search.hpp"
#include "parallel/plan/memory_plan.hpp"

namespace strata::parallel {
namespace {

layers::ModelSpec tiny_gpt() {
  layers::ModelSpec spec;
  spec.name = "gpt";
  spec.layers = 4;
  spec.heads = 4;
  spec.embed = 32;
  spec.seq_len = 16;
  return spec;
}

ModelFor gpt_for(const layers::ModelSpec& spec) {
  return [spec](int, layers::Recompute recompute, layers::TensorParallelGroup* group) {
    layers::ModelSpec s = spec;
    s.recompute = recompute == layers::Recompute::None    ? "none"
                  : recompute == layers::Recompute::Block ? "block"
                                                          : "full";
    return layers::build_model(s, {16}, 64, group);
  };
}

TEST(LayoutSearch, StepTimeIsTheDocumentedModel) {
  const layers::Model model = gpt_for(tiny_gpt())(1, layers::Recompute::None, nullptr);
  const std::vector<StageRange> stages = partition_layers(model, 2, "balanced");
  LayoutChoice c;
  c.layout.pp = 2;
  c.layout.dp = 2;
  c.layout.micro = 2;
  c.layout.micro_batches = 4;  // 16 samples per replica of a global batch of 32
  const Rates rates{1e9, 1e6};
  const StepTime t = estimate_step_time(model, stages, c, 32, rates);
  // By hand, for each stage: MACs per sample from the layers, trainable elements, block inputs.
  double slowest = 0;
  StepTime expected;
  for (const StageRange& r : stages) {
    double macs = 0, trainable = 0;
    for (size_t i = r.begin; i < r.end; ++i) {
      macs += static_cast<double>(model.layer(i).flops(model.shape(i)));
      for (const layers::ParamSpec& p : model.layer(i).param_specs())
        trainable += static_cast<double>(shape_numel(p.shape));
      EXPECT_EQ(model.layer(i).tp_all_reduced_elements(model.shape(i), false), 0);  // built without tp
    }
    StepTime s;
    s.compute_s = 6 * macs * 16 / 1e9;
    s.bubble_s = s.compute_s * 1 / 4;
    s.dp_s = 2.0 * 1 / 2 * 4 * trainable / 1e6;
    s.tp_s = 0;
    // Stage 0 sends its output forward, stage 1 its input's gradient back: not the logits.
    const Shape& sent = &r == &stages.front() ? model.shape(r.end) : model.shape(r.begin);
    s.pp_s = 2.0 * static_cast<double>(shape_numel(sent)) * 4 * 4 / 1e6;
    if (s.total() > slowest) {
      slowest = s.total();
      expected = s;
    }
  }
  EXPECT_DOUBLE_EQ(t.compute_s, expected.compute_s);
  EXPECT_DOUBLE_EQ(t.bubble_s, expected.bubble_s);
  EXPECT_NEAR(t.dp_s, expected.dp_s, 1e-12 * expected.dp_s + 1e-15);  // padding-free: sums of the same shapes
  EXPECT_DOUBLE_EQ(t.pp_s, expected.pp_s);
  EXPECT_LT(t.pp_s, 2.0 * 2 * static_cast<double>(shape_numel(model.shape(model.size()))) * 4 * 4 / 1e6);
  // Small matrix products run slower: a micro-batch of 2 windows of 16 tokens is 32 rows, so at
  // half rate below 32 rows the compute doubles; below 96, it is (32 + 96) / 32 = 4 times (a
  // quarter of the rate).
  EXPECT_DOUBLE_EQ(estimate_step_time(model, stages, c, 32, Rates{1e9, 1e6, 32}).compute_s, 2 * expected.compute_s);
  const StepTime quarter_rate = estimate_step_time(model, stages, c, 32, Rates{0.25e9, 1e6});
  EXPECT_NEAR(estimate_step_time(model, stages, c, 32, Rates{1e9, 1e6, 96}).compute_s, quarter_rate.compute_s,
              1e-12 * quarter_rate.compute_s);
  // ... and larger micro-batches less so: the search prefers them where memory allows.
  LayoutChoice larger = c;
  larger.layout.micro = 8;
  larger.layout.micro_batches = 1;
  EXPECT_LT(estimate_step_time(model, stages, larger, 32, Rates{1e9, 1e6, 32}).compute_s,
            estimate_step_time(model, stages, c, 32, Rates{1e9, 1e6, 32}).compute_s);
  // Recomputation adds a forward: 4/3 of the compute; tensor parallelism costs all-reduces.
  c.recompute = layers::Recompute::Block;
  EXPECT_DOUBLE_EQ(estimate_step_time(model, stages, c, 32, rates).compute_s, expected.compute_s * 4 / 3);
}

// Tensor parallelism's traffic: each block all-reduces its input's size twice in forward and twice
// in backward (6 times recomputed), over 2 (tp - 1) / tp of ring bandwidth; a Llama whose kv heads
// tp replicates adds backward's sum of their gradients (k and v of every kv head: 2 G Dh per token).
// Sequence-parallel: 5 and 7 all-reduces' bytes (a gather and a scatter per region forward, two
// gathers and a scatter backward, each half an all-reduce of the whole sequence).
TEST(LayoutSearch, TensorParallelTrafficByHand) {
  PlannedTensorParallel group(2);
  layers::ModelSpec llama = tiny_gpt();
  llama.name = "llama";
  llama.kv_heads = 1;
  for (const bool sequence_parallel : {false, true})
    for (const layers::ModelSpec& spec : {tiny_gpt(), llama})
      for (const layers::Recompute recompute : {layers::Recompute::None, layers::Recompute::Block}) {
        group.set_sequence_parallel(sequence_parallel);
        const layers::Model model = gpt_for(spec)(2, recompute, &group);
        const std::vector<StageRange> stages = partition_layers(model, 1, "balanced");
        LayoutChoice c;
        c.layout.tp = 2;
        c.layout.micro = 4;
        c.layout.micro_batches = 2;  // 8 samples per step
        c.recompute = recompute;
        const double regions = recompute == layers::Recompute::None ? 4 : 6;
        const double per_token = (regions + (sequence_parallel ? 1 : 0)) * 32 + (spec.kv_heads == 1 ? 2 * 8 : 0);
        const double expected = 2.0 * 1 / 2 * spec.layers * per_token * 16 * 4 * 8 / 1e6;
        EXPECT_DOUBLE_EQ(estimate_step_time(model, stages, c, 8, Rates{1e9, 1e6}).tp_s, expected) << spec.name;
      }
}

TEST(LayoutSearch, ListsTheLayoutsThatFitFastestFirst) {
  SearchSpace space;
  space.world = 4;
  space.global_batch = 16;
  space.can_recompute = true;
  const Rates rates{1e9, 1e9};
  const SearchResult all = search_layouts(space, rates, gpt_for(tiny_gpt()));
  ASSERT_FALSE(all.fitting.empty());
  EXPECT_EQ(static_cast<int>(all.fitting.size()), all.tried);  // no cap: every layout fits
  using Key = std::tuple<int, bool, int, int, int, int64_t, int>;
  const auto key = [](const LayoutChoice& c, bool sequence_parallel) {
    const Layout& l = c.layout;
    return Key(l.tp, sequence_parallel, l.pp, l.dp, l.zero, l.micro, static_cast<int>(c.recompute));
  };
  std::map<Key, const LayoutChoice*> seen;
  for (size_t k = 0; k < all.fitting.size(); ++k) {
    const LayoutChoice& c = all.fitting[k];
    const Layout& l = c.layout;
    EXPECT_EQ(l.tp * l.pp * l.dp, 4);
    EXPECT_EQ(l.micro * l.micro_batches * l.dp, 16);
    EXPECT_TRUE(l.dp > 1 || l.zero == 0);
    EXPECT_TRUE(l.tp > 1 || !l.sequence_parallel);
    EXPECT_TRUE(seen.emplace(key(c, l.sequence_parallel), &c).second);
    if (k > 0) {
      EXPECT_LE(all.fitting[k - 1].time.total(), c.time.total());
    }
  }
  // Every tp layout also with sequence parallelism: fewer bytes (its activations cut by tp), more
  // time (its tp traffic).
  int64_t sequence_parallel = 0;
  for (const auto& [k, c] : seen) {
    if (!std::get<1>(k)) continue;
    ++sequence_parallel;
    Key plain = k;
    std::get<1>(plain) = false;
    ASSERT_TRUE(seen.count(plain));
    EXPECT_LT(c->bytes, seen[plain]->bytes);
    EXPECT_GT(c->time.tp_s, seen[plain]->time.tp_s);
  }
  EXPECT_EQ(sequence_parallel, std::count_if(all.fitting.begin(), all.fitting.end(), [](const LayoutChoice& c) {
              return c.layout.tp > 1 && !c.layout.sequence_parallel;
            }));
  // tp 1, 2 and 4 (4 heads), pp up to the cut's limit, ZeRO 0-3, three recomputations.
  EXPECT_TRUE(
      std::any_of(all.fitting.begin(), all.fitting.end(), [](const LayoutChoice& c) { return c.layout.tp == 4; }));
  EXPECT_TRUE(
      std::any_of(all.fitting.begin(), all.fitting.end(), [](const LayoutChoice& c) { return c.layout.pp == 4; }));

  // A cap between the smallest and the largest: exactly the layouts within it are listed.
  int64_t largest = 0;
  for (const LayoutChoice& c : all.fitting) largest = std::max(largest, c.bytes);
  space.device_bytes = (all.smallest.bytes + largest) / 2;
  const SearchResult capped = search_layouts(space, rates, gpt_for(tiny_gpt()));
  EXPECT_EQ(capped.tried, all.tried);
  const auto within = std::count_if(all.fitting.begin(), all.fitting.end(),
                                    [&](const LayoutChoice& c) { return c.bytes <= space.device_bytes; });
  EXPECT_EQ(static_cast<int64_t>(capped.fitting.size()), within);
  EXPECT_GT(within, 0);
  EXPECT_LT(within, all.tried);
  for (const LayoutChoice& c : capped.fitting) EXPECT_LE(c.bytes, space.device_bytes);

  // Below the smallest: nothing fits, and the smallest is named.
  space.device_bytes = all.smallest.bytes - 1;
  const SearchResult none = search_layouts(space, rates, gpt_for(tiny_gpt()));
  EXPECT_TRUE(none.fitting.empty());
  EXPECT_EQ(none.smallest.bytes, all.smallest.bytes);
}

TEST(LayoutSearch, SkipsWidthsTheModelCannotTake) {
  layers::ModelSpec spec = tiny_gpt();
  spec.heads = 2;  // tp 4 cannot split 2 heads
  SearchSpace space;
  space.world = 4;
  space.global_batch = 8;
  const SearchResult r = search_layouts(space, Rates{1e9, 1e9}, gpt_for(spec));
  ASSERT_EQ(r.skipped.size(), 1u);
  EXPECT_NE(r.skipped[0].find("tp 4: --heads (2) must be divisible by --tp (4)"), std::string::npos) << r.skipped[0];
  for (const LayoutChoice& c : r.fitting) EXPECT_LE(c.layout.tp, 2);
}

}  // namespace
}  // namespace strata::parallel
