// BucketReducer's pure arithmetic, no MPI: layer extents and fixed-size buckets over the flat
// gradient buffer. The reductions themselves are tested against the replicated step in
// test_data_parallel (2 and 4 ranks).
#include <gtest/gtest.h>

#include <cstdint>
#include <tuple>

#include "core/error.hpp"
#include "layers/model.hpp"
#include "layers/parameter_store.hpp"
#include "layers/zoo.hpp"
#include "parallel/data/bucket_reducer.hpp"
#include "parallel/gradient_layout.hpp"

namespace strata::parallel {
namespace {

using namespace testing_layout;  // Ranges, kRanges, kFlat, kBucketBytes

std::vector<std::tuple<int64_t, int64_t, size_t>> as_tuples(const std::vector<Bucket>& buckets) {
  std::vector<std::tuple<int64_t, int64_t, size_t>> t;
  for (const Bucket& b : buckets) t.emplace_back(b.begin, b.end, b.first_layer);
  return t;
}

TEST(LayerExtents, TileTheBufferWithEachLayersPadding) {
  const Ranges e = layer_extents(kRanges, kFlat);
  ASSERT_EQ(e.size(), 4u);
  const std::vector<std::tuple<size_t, int64_t, int64_t>> want = {
      {1, 0, 112}, {3, 112, 400}, {4, 400, 416}, {5, 416, 464}};
  for (size_t k = 0; k < e.size(); ++k) EXPECT_EQ(std::make_tuple(e[k].layer, e[k].begin, e[k].end), want[k]) << k;
  EXPECT_THROW(layer_extents(kRanges, 419), Error);  // the last layer ends at 420
}

TEST(MakeBuckets, FixedSizeRangesFromTheEnd) {
  // 464 = 7 x 64 + 16: seven full buckets from the end, the one at element 0 shorter. Layer 3
  // (288 elements) spans five buckets; layers 4 and 5 share the last one, whose first layer is 4.
  // A bucket is complete after the layer whose extent holds its first element.
  const std::vector<std::tuple<int64_t, int64_t, size_t>> want = {
      {400, 464, 4}, {336, 400, 3}, {272, 336, 3}, {208, 272, 3}, {144, 208, 3}, {80, 144, 1}, {16, 80, 1}, {0, 16, 1}};
  EXPECT_EQ(as_tuples(make_buckets(kRanges, kFlat, kBucketBytes)), want);
}

TEST(MakeBuckets, BucketOnALayerStartBelongsToThatLayer) {
  // 48-element buckets: [416, 464) is layer 5's alone, [368, 416) starts in layer 3.
  const std::vector<Bucket> b = make_buckets(kRanges, kFlat, 48 * 4);
  ASSERT_GE(b.size(), 2u);
  EXPECT_EQ(std::make_tuple(b[0].begin, b[0].end, b[0].first_layer), std::make_tuple(416, 464, size_t{5}));
  EXPECT_EQ(std::make_tuple(b[1].begin, b[1].end, b[1].first_layer), std::make_tuple(368, 416, size_t{3}));
}

TEST(MakeBuckets, OneBucketWhenLargerThanTheBufferNoneWithoutLayers) {
  const std::vector<std::tuple<int64_t, int64_t, size_t>> one = {{0, kFlat, 1}};
  EXPECT_EQ(as_tuples(make_buckets(kRanges, kFlat, int64_t{25} << 20)), one);
  EXPECT_TRUE(make_buckets({}, 0, kBucketBytes).empty());
  EXPECT_EQ(make_buckets(kRanges, kFlat, 1).size(), static_cast<size_t>(kFlat));  // at least one element each
}

TEST(MakeBuckets, RealModelBucketsTileAndWaitForTheirLowestLayer) {
  layers::ModelSpec spec;
  spec.name = "mlp";
  spec.hidden = {40, 24};
  const layers::Model model = layers::build_model(spec, {1, 6, 6}, 5);
  const Ranges ranges = layers::ParameterStore::layer_ranges(layers::ParameterStore::layout(model));
  const Ranges extents = layer_extents(ranges, 3200);
  for (int64_t elements : {1, 7, 16, 100, 1000, 5000}) {
    SCOPED_TRACE(elements);
    const std::vector<Bucket> buckets = make_buckets(ranges, 3200, elements * 4);
    int64_t end = 3200;
    for (const Bucket& b : buckets) {
      EXPECT_EQ(b.end, end);
      EXPECT_EQ(b.end - b.begin, std::min(elements, end));
      // first_layer: the lowest layer whose extent meets [begin, end).
      size_t lowest = SIZE_MAX;
      for (const auto& e : extents)
        if (e.begin < b.end && e.end > b.begin) lowest = std::min(lowest, e.layer);
      EXPECT_EQ(b.first_layer, lowest) << b.begin;
      end = b.begin;
    }
    EXPECT_EQ(end, 0);
  }
}

}  // namespace
}  // namespace strata::parallel
