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
int64_t full_index(const Shape& local, const TensorSplit& s, int64_t i) {
  std::vector<int64_t> coord(local.size());
  for (size_t d = local.size(); d-- > 0;) {
    coord[d] = i % local[d];
    i /= local[d];
  }
  const int64_t piece = local[s.dim] / s.segments;
  const int64_t c = coord[s.dim];
  coord[s.dim] = (c / piece) * piece * s.parts + s.index * piece + c % piece;
  int64_t flat = 0;
  for (size_t d = 0; d < local.size(); ++d)
    flat = flat * (d == static_cast<size_t>(s.dim) ? local[d] * s.parts : local[d]) + coord[d];
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

TEST(TensorSplit, ShapeMismatchesAreRefused) {
  const Tensor full = iota({8, 4});
  EXPECT_THROW(take_shard(full, {2, 0, 0, 1}, Tensor::empty({4, 2})), Error);  // wrong dimension split
  EXPECT_THROW(take_shard(full, {4, 0, 0, 1}, Tensor::empty({4, 4})), Error);  // 4 x 4 rows != 8
  EXPECT_THROW(put_shard(Tensor::empty({4, 4}), {2, 0, 1, 1}, full), Error);
}

}  // namespace
}  // namespace strata::layers
