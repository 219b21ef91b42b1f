// Reads the datasets tests/io/py/write_dataset.py wrote with h5py (directory in
// STRATA_PYDATA_DIR) and compares with the values numpy computed for them.
#include <gtest/gtest.h>

#include <cstdlib>
#include <vector>

#include "expect_error.hpp"
#include "io/dataset.hpp"
#include "io_test_util.hpp"

namespace strata::io {
namespace {

template <class T>
std::vector<T> read_expected(const std::string& path, const std::string& name, hid_t mem_type) {
  h5::File f(H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT));
  h5::DataSet ds(H5Dopen2(f, name.c_str(), H5P_DEFAULT));
  h5::Space space(H5Dget_space(ds));
  std::vector<T> v(static_cast<size_t>(H5Sget_simple_extent_npoints(space)));
  EXPECT_GE(H5Dread(ds, mem_type, H5S_ALL, H5S_ALL, H5P_DEFAULT, v.data()), 0) << name;
  return v;
}

class PyOracle : public ::testing::TestWithParam<std::tuple<std::string, bool>> {};

TEST_P(PyOracle, MatchesNumpy) {
  const char* dir = std::getenv("STRATA_PYDATA_DIR");
  if (!dir) GTEST_SKIP() << "STRATA_PYDATA_DIR not set";
  const auto& [kind, in_memory] = GetParam();
  const std::string expected = std::string(dir) + "/expected.h5";
  Dataset ds = Dataset::open(std::string(dir) + "/" + kind, "--data", {in_memory ? int64_t{1} << 30 : 0});
  auto indices = read_expected<int64_t>(expected, kind + "/indices", H5T_NATIVE_INT64);
  auto want_x = read_expected<float>(expected, kind + "/x", H5T_NATIVE_FLOAT);
  auto want_y = read_expected<int32_t>(expected, kind + "/y", H5T_NATIVE_INT32);
  EXPECT_EQ(ds.info().num_classes, kind == "u8" ? 6 : 4);

  Shape xs{static_cast<int64_t>(indices.size())};
  xs.insert(xs.end(), ds.info().sample_shape.begin(), ds.info().sample_shape.end());
  Tensor x = Tensor::empty(xs), y = Tensor::empty({xs[0]}, DType::I32);
  ds.read(indices, x, y);
  ASSERT_EQ(static_cast<size_t>(x.numel()), want_x.size());
  for (size_t i = 0; i < want_x.size(); ++i)
    ASSERT_NEAR(x.data<float>()[i], want_x[i], 1e-5f * (1 + std::abs(want_x[i]))) << "element " << i;
  for (size_t b = 0; b < want_y.size(); ++b) EXPECT_EQ(y.data<int32_t>()[b], want_y[b]);
}

// Damage found while training (data read per batch): an Input error naming the flag, the file
// and the dataset, not an internal one; batches that avoid the damaged chunk still read.
TEST(PyOracleDamaged, ChunkChecksumFailsWhenRead) {
  const char* dir = std::getenv("STRATA_PYDATA_DIR");
  if (!dir) GTEST_SKIP() << "STRATA_PYDATA_DIR not set";
  const std::string path = std::string(dir) + "/damaged/chunks.h5";
  Dataset ds = Dataset::open(path, "--data", {0});
  ASSERT_FALSE(ds.in_memory());
  Shape xs{2};
  xs.insert(xs.end(), ds.info().sample_shape.begin(), ds.info().sample_shape.end());
  Tensor x = Tensor::empty(xs), y = Tensor::empty({2}, DType::I32);
  const std::vector<int64_t> good{0, 15}, bad{3, 9};
  EXPECT_NO_THROW(ds.read(good, x, y));
  test::expect_input_error([&] { ds.read(bad, x, y); },
                           {"--data: '", "chunks.h5' 'inputs' cannot be read", "Fletcher32"});
}

INSTANTIATE_TEST_SUITE_P(Kinds, PyOracle, ::testing::Combine(::testing::Values("u8", "f32"), ::testing::Bool()));

}  // namespace
}  // namespace strata::io
