// full_shape, take_shard and put_shard (layers/tensor_parallel.hpp) against an independent
// element-by-element formula: which element of the full tensor each shard element is.
#include <gtest/gtest.h>

#include <vector>

#include "core/error.hpp"
#include "core/ops.hpp"
#include "layers/tensor_parallel.hpp"

namespace strata::layers {
namespace {

// full[i] = i, exactly representable.
Tensor iota(const Shape& shape) {
  Tensor t = Tensor::empty(shape);
  for (int64_t i = 0; i < t.numel(); ++i) t.data<float>()[i] = static_cast<float>(i);
  return t;
}

// The full tensor's flat index of shard element `i` (row-major), by coordinates: along `dim`,
// local coordinate c is segment c / piece, row c % piece of that segment's piece `index`.
// A padded split's rows at or past `extent` are in no place of the full tensor: -1.
int64_t full_index(const Shape& local, const TensorSplit& s, int64_t i) {
  std::vector<int64_t> coord(local.size());
  for (size_t d = local.size(); d-- > 0;) {
    coord[d] = i % local[d];
    i /= local[d];
  }
  const int64_t piece = local[s.dim] / s.segments;
  const int64_t c = coord[s.dim];
  coord[s.dim] = (c / piece) * piece * s.parts + s.index * piece + c % piece;
  if (s.extent > 0 && coord[s.dim] >= s.extent) return -1;
  int64_t flat = 0;
  for (size_t d = 0; d < local.size(); ++d) {
    const int64_t size = d != static_cast<size_t>(s.dim) ? local[d] : s.extent > 0 ? s.extent : local[d] * s.parts;
    flat = flat * size + coord[d];
  }
  return flat;
}

TEST(TensorSplit, FullShape) {
  EXPECT_EQ(shape_str(full_shape({4, 6}, {})), shape_str({4, 6}));
  EXPECT_EQ(shape_str(full_shape({4, 6}, {2, 1, 1, 1})), shape_str({4, 12}));
  EXPECT_EQ(shape_str(full_shape({12, 8}, {4, 3, 0, 3})), shape_str({48, 8}));
  EXPECT_THROW(full_shape({4, 6}, {2, 2, 0, 1}), Error);  // index outside [0, parts)
  EXPECT_THROW(full_shape({4, 6}, {2, 0, 2, 1}), Error);  // no dimension 2
  EXPECT_THROW(full_shape({4, 6}, {2, 0, 0, 3}), Error);  // 4 rows are not 3 segments
}

// Every (dim, parts, segments) case: each element of every shard is the full tensor's element
// the formula names, and the shards put back together rebuild the full tensor exactly.
TEST(TensorSplit, TakeAndPutMatchTheFormula) {
  struct Case {
    Shape full;
    int dim, parts, segments;
  };
  const Case cases[] = {
      {{12, 5}, 0, 2, 1},   {{12, 5}, 0, 4, 3},    {{24, 3}, 0, 2, 3}, {{6, 8}, 1, 4, 1},
      {{3, 8, 2}, 1, 2, 1}, {{3, 12, 2}, 1, 2, 3}, {{16}, 0, 4, 1},    {{18}, 0, 3, 3},
  };
  for (const Case& c : cases) {
    const Tensor full = iota(c.full);
    Tensor rebuilt = Tensor::zeros(c.full);
    for (int index = 0; index < c.parts; ++index) {
      const TensorSplit s{c.parts, index, c.dim, c.segments};
      Shape local = c.full;
      local[c.dim] /= c.parts;
      ASSERT_EQ(shape_str(full_shape(local, s)), shape_str(c.full));
      const Tensor shard = Tensor::empty(local);
      take_shard(full, s, shard);
      for (int64_t i = 0; i < shard.numel(); ++i)
        ASSERT_EQ(shard.data<float>()[i], static_cast<float>(full_index(local, s, i)))
            << shape_str(c.full) << " dim " << c.dim << " piece " << index << "/" << c.parts << " segments "
            << c.segments << " element " << i;
      put_shard(shard, s, rebuilt);
    }
    for (int64_t i = 0; i < full.numel(); ++i)
      ASSERT_EQ(rebuilt.data<float>()[i], full.data<float>()[i]) << shape_str(c.full) << " element " << i;
  }
}

// put_shard writes only its own elements.
TEST(TensorSplit, PutTouchesOnlyItsPiece) {
  const Shape full_shape_{12, 4};
  const TensorSplit s{2, 1, 0, 3};
  const Tensor shard = Tensor::empty({6, 4});
  ops::fill(shard, 7.0f);
  Tensor full = Tensor::zeros(full_shape_);
  put_shard(shard, s, full);
  int64_t sevens = 0;
  for (int64_t i = 0; i < full.numel(); ++i) {
    const int64_t row = i / 4;
    const bool mine = (row % 4) >= 2;  // segment rows 2, 3 of each 4
    EXPECT_EQ(full.data<float>()[i], mine ? 7.0f : 0.0f) << "row " << row;
    sevens += mine;
  }
  EXPECT_EQ(sevens, shard.numel());
}

// Unsplit: plain copies; other dtypes convert (bf16 holds these small integers exactly).
TEST(TensorSplit, ReplicatedAndConvertingCopies) {
  const Tensor full = iota({4, 6});
  Tensor copy = Tensor::empty({4, 6});
  take_shard(full, {}, copy);
  for (int64_t i = 0; i < full.numel(); ++i) EXPECT_EQ(copy.data<float>()[i], static_cast<float>(i));
  const TensorSplit s{2, 1, 1, 1};
  const Tensor half = Tensor::empty({4, 3}, DType::BF16);
  take_shard(full, s, half);
  Tensor back = Tensor::empty({4, 3});
  ops::copy(half, back);
  for (int64_t i = 0; i < back.numel(); ++i)
    EXPECT_EQ(back.data<float>()[i], static_cast<float>(full_index({4, 3}, s, i))) << i;
}

// A vocabulary that the parts do not divide (row_split): every piece holds ceil(rows / parts)
// rows, the last pieces' rows past the full tensor are padding, zeroed by take_shard and left
// out by put_shard; the real rows still rebuild the full tensor exactly.
TEST(TensorSplit, PaddedRowsAreZeroAndLeftOut) {
  struct Case {
    int64_t rows;
    int parts;
  };
  for (const Case c : {Case{7, 3}, Case{9, 4}, Case{13, 4}, Case{8, 4}}) {
    EXPECT_EQ(rows_per_piece(c.rows, c.parts), (c.rows + c.parts - 1) / c.parts);
    const Shape full_shape_{c.rows, 3};
    const Shape local{rows_per_piece(c.rows, c.parts), 3};
    const Tensor full = iota(full_shape_);
    Tensor rebuilt = Tensor::zeros(full_shape_);
    int64_t stored_total = 0;
    for (int index = 0; index < c.parts; ++index) {
      const TensorSplit s = row_split(c.parts, index, c.rows);
      EXPECT_EQ(s.extent, c.rows % c.parts ? c.rows : 0);
      ASSERT_EQ(shape_str(full_shape(local, s)), shape_str(full_shape_));
      const Tensor shard = Tensor::empty(local);
      ops::fill(shard, -1.0f);
      take_shard(full, s, shard);
      const int64_t stored = stored_elements(local, s);
      stored_total += stored;
      for (int64_t i = 0; i < shard.numel(); ++i) {
        const int64_t at = full_index(local, s, i);
        ASSERT_EQ(at >= 0, i < stored) << c.rows << " rows, piece " << index << " element " << i;
        ASSERT_EQ(shard.data<float>()[i], at >= 0 ? static_cast<float>(at) : 0.0f)
            << c.rows << " rows over " << c.parts << ", piece " << index << " element " << i;
      }
      ops::fill(shard.view(stored, {shard.numel() - stored}), 99.0f);  // padding must not land
      put_shard(shard, s, rebuilt);
    }
    EXPECT_EQ(stored_total, full.numel());
    for (int64_t i = 0; i < full.numel(); ++i) ASSERT_EQ(rebuilt.data<float>()[i], full.data<float>()[i]) << i;
  }
  // The rows must be whole pieces of the padded split.
  EXPECT_THROW(full_shape({2, 3}, row_split(3, 0, 7)), Error);
  EXPECT_THROW(full_shape({3, 3}, TensorSplit{3, 0, 1, 1, 1, 7}), Error);  // rows only
}

TEST(TensorSplit, ShapeMismatchesAreRefused) {
  const Tensor full = iota({8, 4});
  EXPECT_THROW(take_shard(full, {2, 0, 0, 1}, Tensor::empty({4, 2})), Error);  // wrong dimension split
  EXPECT_THROW(take_shard(full, {4, 0, 0, 1}, Tensor::empty({4, 4})), Error);  // 4 x 4 rows != 8
  EXPECT_THROW(put_shard(Tensor::empty({4, 4}), {2, 0, 1, 1}, full), Error);
}

// shard_boxes and shard_runs against the formula: for parts of shards ([begin, end) ranges, as
// a ZeRO shard cuts them), the boxes cover exactly the part's full-tensor elements, disjoint, and
// listed in row-major order they are the part's elements in order; the runs likewise.
TEST(TensorSplit, BoxesAndRunsOfAPart) {
  struct Case {
    Shape local;
    TensorSplit split;
  };
  const std::vector<Case> cases = {
      {{5}, {}},
      {{3, 4}, {}},
      {{2, 3, 4}, {}},
      {{4, 6}, {2, 1, 1, 1}},
      {{6, 4}, {3, 2, 0, 3}},
      {{2, 6, 5}, {2, 0, 1, 3}},
      {{2, 3, 4}, {4, 3, 2, 2}},
      {{3, 2, 4}, {2, 1, 0, 1}},
      {{3, 4}, row_split(3, 1, 7)},  // padded rows (a vocabulary tp does not divide): none here
      {{3, 4}, row_split(3, 2, 7)},  // one real row, two padding rows
      {{3, 2}, row_split(4, 3, 9)},  // only padding
  };
  for (const Case& c : cases) {
    const Shape full = full_shape(c.local, c.split);
    const int64_t n = shape_numel(c.local);
    for (int64_t begin = 0; begin <= n; ++begin)
      for (int64_t end = begin; end <= n; ++end) {
        std::vector<int64_t> expected;  // padding (-1) is the shard's tail and has no place
        for (int64_t i = begin; i < end; ++i)
          if (const int64_t at = full_index(c.local, c.split, i); at >= 0) expected.push_back(at);
        const auto where = [&] {
          return shape_str(c.local) + " [" + std::to_string(begin) + ", " + std::to_string(end) + ")";
        };
        // Boxes: mark every element, row-major, and read the marks back in order.
        std::vector<int> marks(static_cast<size_t>(shape_numel(full)), 0);
        const std::vector<Box> boxes = shard_boxes(c.local, c.split, begin, end);
        for (const Box& b : boxes) {
          ASSERT_EQ(b.start.size(), full.size()) << where();
          std::vector<int64_t> at = b.start;
          int64_t size = 1;
          for (int64_t k : b.count) size *= k;
          for (int64_t e = 0; e < size; ++e) {
            int64_t flat = 0;
            for (size_t d = 0; d < full.size(); ++d) {
              ASSERT_LT(at[d], full[d]) << where();
              flat = flat * full[d] + at[d];
            }
            ++marks[static_cast<size_t>(flat)];
            for (size_t d = full.size(); d-- > 0;) {  // next coordinate inside the box
              if (++at[d] < b.start[d] + b.count[d]) break;
              at[d] = b.start[d];
            }
          }
        }
        std::vector<int64_t> covered;
        for (size_t i = 0; i < marks.size(); ++i) {
          ASSERT_LE(marks[i], 1) << "boxes overlap: " << where();
          if (marks[i]) covered.push_back(static_cast<int64_t>(i));
        }
        EXPECT_EQ(covered, expected) << where();
        // Runs: expanded in their order, the same elements in the same order.
        std::vector<int64_t> from_runs;
        for (const auto& [at, len] : shard_runs(c.local, c.split, begin, end))
          for (int64_t i = 0; i < len; ++i) from_runs.push_back(at + i);
        EXPECT_EQ(from_runs, expected) << where();
      }
  }
  const std::vector<Box> whole = shard_boxes({4, 6}, {2, 1, 1, 1}, 0, 24);
  EXPECT_EQ(whole.size(), 1u);  // a whole shard split along one dimension is one hyperslab
  EXPECT_EQ(shard_runs({6, 4}, {}, 3, 20).size(), 1u);
  EXPECT_THROW(shard_boxes({4, 6}, {}, 5, 25), Error);
}

}  // namespace
}  // namespace strata::layers
