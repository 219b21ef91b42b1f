// Pipeline partitions and ZeRO shards: pure arithmetic over a model's layers and a buffer.
#include <gtest/gtest.h>

#include <algorithm>
#include <functional>
#include <limits>

#include "layers/model.hpp"
#include "layers/zoo.hpp"
#include "parallel/data/zero.hpp"
#include "parallel/pipeline/partition.hpp"

namespace strata::parallel {
namespace {

layers::Model mlp(std::vector<int64_t> hidden) {
  layers::ModelSpec spec;
  spec.name = "mlp";
  spec.hidden = std::move(hidden);
  return layers::build_model(spec, {1, 6, 6}, 4);
}

int64_t stage_cost(const layers::Model& m, StageRange r) {
  int64_t c = 0;
  for (size_t i = r.begin; i < r.end; ++i) c += layer_cost(m, i);
  return c;
}

// The smallest possible largest-stage cost, by trying every set of cut points.
int64_t brute_force_best(const layers::Model& m, int stages) {
  const size_t n = m.size();
  int64_t best = std::numeric_limits<int64_t>::max();
  std::vector<size_t> cuts(static_cast<size_t>(stages - 1));
  // Enumerate increasing cut vectors in [1, n).
  std::function<void(size_t, size_t)> go = [&](size_t k, size_t from) {
    if (k == cuts.size()) {
      int64_t worst = 0;
      size_t begin = 0;
      for (size_t c : cuts) {
        worst = std::max(worst, stage_cost(m, {begin, c}));
        begin = c;
      }
      best = std::min(best, std::max(worst, stage_cost(m, {begin, n})));
      return;
    }
    for (size_t c = from; c < n; ++c) {
      cuts[k] = c;
      go(k + 1, c + 1);
    }
  };
  go(0, 1);
  return best;
}

TEST(Partition, BalancedIsContiguousCoveringAndOptimal) {
  const layers::Model m = mlp({64, 16, 128, 8, 32});
  for (int stages = 1; stages <= 5; ++stages) {
    const std::vector<StageRange> r = partition_layers(m, stages, "balanced");
    ASSERT_EQ(r.size(), static_cast<size_t>(stages));
    EXPECT_EQ(r.front().begin, 0u);
    EXPECT_EQ(r.back().end, m.size());
    int64_t worst = 0;
    for (size_t s = 0; s < r.size(); ++s) {
      EXPECT_LT(r[s].begin, r[s].end) << "stage " << s << " is empty";
      if (s > 0) {
        EXPECT_EQ(r[s].begin, r[s - 1].end);
      }
      worst = std::max(worst, stage_cost(m, r[s]));
    }
    EXPECT_EQ(worst, brute_force_best(m, stages)) << stages << " stages";
  }
}

TEST(Partition, CutPoints) {
  const layers::Model m = mlp({16, 16});  // flatten fc1 relu1 fc2 relu2 fc3: 6 layers
  const std::vector<StageRange> r = partition_layers(m, 3, "2,5");
  ASSERT_EQ(r.size(), 3u);
  EXPECT_EQ(r[0].begin, 0u);
  EXPECT_EQ(r[0].end, 2u);
  EXPECT_EQ(r[1].end, 5u);
  EXPECT_EQ(r[2].end, 6u);
}

void expect_input_error(const layers::Model& m, int stages, const std::string& spec, const std::string& words) {
  try {
    partition_layers(m, stages, spec);
    FAIL() << "no error for --pp " << stages << " --partition " << spec;
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::Input);
    EXPECT_NE(e.message().find(words), std::string::npos) << e.message();
  }
}

TEST(Partition, BadInput) {
  const layers::Model m = mlp({16, 16});
  expect_input_error(m, 7, "balanced", "--pp 7 needs at least 7 layers, but the model has 6");
  expect_input_error(m, 0, "balanced", "--pp must be at least 1");
  expect_input_error(m, 3, "2", "makes 2 stages but --pp is 3");
  expect_input_error(m, 3, "5,2", "must increase");
  expect_input_error(m, 2, "6", "'6'");
  expect_input_error(m, 2, "0", "'0'");
  expect_input_error(m, 2, "x", "'x'");
}

TEST(Shards, CoverTheBufferInAlignedEqualChunks) {
  for (int64_t used : {1, 15, 16, 17, 1000, 6384, 123457})
    for (int dp : {1, 2, 3, 4, 7}) {
      int64_t covered = 0;
      for (int r = 0; r < dp; ++r) {
        const Shard s = shard_of(used, dp, r);
        EXPECT_EQ(s.size % kShardAlign, 0);
        EXPECT_GE(s.size * dp, used);
        EXPECT_LT(s.size - kShardAlign, (used + dp - 1) / dp);  // no more than the alignment over ceil(N/dp)
        EXPECT_EQ(s.begin, std::min<int64_t>(r * s.size, used));
        EXPECT_LE(s.numel(), s.size);
        EXPECT_EQ(s.begin, covered) << "shards must be contiguous";
        covered = s.end;
      }
      EXPECT_EQ(covered, used) << used << " elements over " << dp;
      // The store's padding makes the buffer exactly dp chunks of S.
      const int64_t pad = shard_pad_multiple(dp);
      EXPECT_EQ((used + pad - 1) / pad * pad, dp * shard_of(used, dp, 0).size) << used << " over " << dp;
    }
}

}  // namespace
}  // namespace strata::parallel
