// GradientRing's pure arithmetic, no MPI: ZeRO 2/3's tiles of the layers' gradients and their
// placement in the ring. The reductions themselves are tested against the replicated step in
// test_data_parallel (2 and 4 ranks).
#include <gtest/gtest.h>

#include <cstdint>
#include <map>
#include <tuple>

#include "core/error.hpp"
#include "layers/model.hpp"
#include "layers/parameter_store.hpp"
#include "layers/zoo.hpp"
#include "parallel/data/gradient_ring.hpp"
#include "parallel/gradient_layout.hpp"

namespace strata::parallel {
namespace {

using namespace testing_layout;  // Ranges, kRanges, kFlat, kBucketBytes

TEST(Ring, LargestLayerPlusOneBucketAtMostTheBuffer) {
  EXPECT_EQ(ring_elements(whole_layer_tiles(kRanges, kFlat), kBucketBytes), 288 + 64);
  EXPECT_EQ(ring_elements(whole_layer_tiles(kRanges, kFlat), 1000 * 4), kFlat);
  EXPECT_EQ(ring_elements({}, kBucketBytes), 0);
}

std::vector<std::tuple<size_t, int64_t, bool>> placement(const std::vector<RingSlot>& slots) {
  std::vector<std::tuple<size_t, int64_t, bool>> t;
  for (const RingSlot& s : slots) t.emplace_back(s.layer, s.offset, s.wraps);
  return t;
}

TEST(Ring, LayersGoDownInBackwardOrderAndWrapToTheTop) {
  // Ring of 352: layer 5 (48) at [304, 352), layer 4 (16) right below, layer 3 (288) fills
  // [0, 288), layer 1 (112) does not fit below 0 and wraps to [240, 352).
  const std::vector<RingSlot> slots = place_in_ring(whole_layer_tiles(kRanges, kFlat), 352);
  EXPECT_EQ(placement(slots), (std::vector<std::tuple<size_t, int64_t, bool>>{
                                  {5, 304, false}, {4, 288, false}, {3, 0, false}, {1, 240, true}}));
  // Flat order inside the ring: one shift between wraps.
  EXPECT_EQ(slots[0].begin - slots[0].offset, slots[2].begin - slots[2].offset);
  // A ring of 300 wraps twice: layer 3 does not fit below 236, layer 1 not below 12.
  EXPECT_EQ(placement(place_in_ring(whole_layer_tiles(kRanges, kFlat), 300)),
            (std::vector<std::tuple<size_t, int64_t, bool>>{
                {5, 252, false}, {4, 236, false}, {3, 12, true}, {1, 188, true}}));
  // The whole buffer: the flat layout itself, no wrap.
  EXPECT_EQ(placement(place_in_ring(whole_layer_tiles(kRanges, kFlat), kFlat)),
            (std::vector<std::tuple<size_t, int64_t, bool>>{
                {5, 416, false}, {4, 400, false}, {3, 112, false}, {1, 0, false}}));
  EXPECT_THROW(place_in_ring(whole_layer_tiles(kRanges, kFlat), 287), Error);  // layer 3 does not fit at all
}

// ZeRO 2 with a tied head on its embedding's stage: the first extent keeps [0, 112) of the ring
// for the whole backward (the head writes it first, the embedding last); the others cycle in
// the 304 elements above it.
TEST(Ring, PinnedFirstExtentKeepsItsPlace) {
  constexpr int64_t bucket = 16 * 4;
  EXPECT_EQ(ring_elements(whole_layer_tiles(kRanges, kFlat), bucket, /*pinned=*/true), 112 + 288 + 16);
  EXPECT_EQ(ring_elements(whole_layer_tiles(kRanges, kFlat), kBucketBytes, /*pinned=*/true),
            kFlat);  // at most the buffer
  const std::vector<RingSlot> slots = place_in_ring(whole_layer_tiles(kRanges, kFlat), 416, /*pinned=*/true);
  // Layer 5 at [368, 416), 4 right below, 3 (288) does not fit above 112 and wraps, 1 pinned at 0.
  EXPECT_EQ(placement(slots), (std::vector<std::tuple<size_t, int64_t, bool>>{
                                  {5, 368, false}, {4, 352, false}, {3, 128, true}, {1, 0, true}}));
  for (size_t k = 0; k < slots.size(); ++k) EXPECT_EQ(slots[k].pinned, k + 1 == slots.size());
  for (const RingSlot& s : slots) EXPECT_TRUE(s.pinned || s.offset >= 112) << s.layer;  // never over the pinned part
}

TEST(Ring, PinsATiedEmbeddingOnItsStageOnly) {
  layers::ModelSpec spec;
  spec.name = "gpt";
  spec.layers = 2;
  spec.heads = 2;
  spec.embed = 16;
  spec.seq_len = 8;
  spec.tie_embeddings = true;
  const layers::Model tied = layers::build_model(spec, {8}, 32);
  EXPECT_TRUE(pins_tied_embedding(tied, 0, tied.size()));
  EXPECT_FALSE(pins_tied_embedding(tied, 1, tied.size()));  // the head's embedding is elsewhere: a copy
  spec.tie_embeddings = false;
  const layers::Model untied = layers::build_model(spec, {8}, 32);
  EXPECT_FALSE(pins_tied_embedding(untied, 0, untied.size()));
}

TEST(Ring, SlotsSinceAWrapAreDisjointAndKeepFlatOrder) {
  layers::ModelSpec spec;
  spec.name = "mlp";
  spec.hidden = {40, 3, 24, 64};
  const layers::Model model = layers::build_model(spec, {1, 6, 6}, 5);
  const Ranges ranges = layers::ParameterStore::layer_ranges(layers::ParameterStore::layout(model));
  const int64_t flat = 4096;
  for (int64_t elements : {1, 16, 100, 1000}) {
    SCOPED_TRACE(elements);
    const int64_t ring = ring_elements(whole_layer_tiles(ranges, flat), elements * 4);
    const std::vector<RingSlot> slots = place_in_ring(whole_layer_tiles(ranges, flat), ring);
    ASSERT_EQ(slots.size(), ranges.size());
    int64_t top = ring;
    for (size_t k = 0; k < slots.size(); ++k) {
      const RingSlot& s = slots[k];
      EXPECT_EQ(s.layer, ranges[ranges.size() - 1 - k].layer);  // backward order
      EXPECT_GE(s.offset, 0);
      EXPECT_LE(s.offset + s.end - s.begin, ring);
      // Right below the one before (flat order kept: the same shift), unless it did not fit.
      EXPECT_EQ(s.wraps, k > 0 && s.end - s.begin > top);
      if (k > 0) {
        EXPECT_EQ(s.end, slots[k - 1].begin);
      }
      if (k > 0 && !s.wraps) {
        EXPECT_EQ(s.begin - s.offset, slots[k - 1].begin - slots[k - 1].offset);
      }
      top = s.offset;
    }
  }
}

// ZeRO 2/3 with the zoo's MLP (784 -> 1024 -> 1024 -> 10) and 1 MiB buckets: fc1 and fc2 are
// three and four buckets large and stream, fc3 (10,250 elements) is one whole tile, so the ring
// is two buckets instead of fc2 + a bucket (five).
TEST(GradientTiles, LargeLinearLayersStreamInPiecesOfABucket) {
  layers::ModelSpec spec;
  spec.name = "mlp";
  spec.hidden = {1024, 1024};
  const layers::Model model = layers::build_model(spec, {1, 28, 28}, 10);
  const std::vector<layers::ParamEntry> entries = layers::ParameterStore::layout(model);
  const int64_t flat = (layers::ParameterStore::layout_numel(entries) + 31) / 32 * 32;  // dp 2's padding
  constexpr int64_t bucket = int64_t{1} << 20, elements = bucket / 4;

  const std::vector<GradientTile> tiles = gradient_tiles(model, entries, flat, bucket);
  int64_t end = 0;
  std::map<size_t, int64_t> written;  // per layer
  for (const GradientTile& t : tiles) {
    EXPECT_EQ(t.begin, end) << "tiles tile the buffer";
    end = t.end;
    EXPECT_LE(t.end - t.begin, elements + 15) << "a bucket, give or take the alignment padding";
    EXPECT_EQ(t.streamed, t.layer != 5) << t.layer;  // fc1 and fc2 stream, fc3 is whole
    if (!t.streamed) continue;
    EXPECT_LE(t.begin, t.written_begin);
    EXPECT_LT(t.written_begin, t.written_end);
    EXPECT_LE(t.written_end, t.end);
    written[t.layer] += t.written_end - t.written_begin;
  }
  EXPECT_EQ(end, flat);
  EXPECT_EQ(written[1], 784 * 1024 + 1024);
  EXPECT_EQ(written[3], 1024 * 1024 + 1024);

  const int64_t ring = ring_elements(tiles, bucket);
  EXPECT_LE(ring, 2 * elements + 15);
  EXPECT_EQ(ring_elements(whole_layer_tiles(layers::ParameterStore::layer_ranges(entries), flat), bucket),
            1024 * 1024 + 1024 + elements);
  const std::vector<RingSlot> slots = place_in_ring(tiles, ring);
  ASSERT_EQ(slots.size(), tiles.size());
  for (size_t k = 0; k < slots.size(); ++k) EXPECT_EQ(slots[k].begin, tiles[tiles.size() - 1 - k].begin);

  // Buckets of 25 MiB hold every layer whole: the tiles are the layers' extents.
  const std::vector<GradientTile> whole = gradient_tiles(model, entries, flat, int64_t{25} << 20);
  ASSERT_EQ(whole.size(), 3u);
  for (const GradientTile& t : whole) EXPECT_FALSE(t.streamed);
}

}  // namespace
}  // namespace strata::parallel
