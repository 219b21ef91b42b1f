// Loader: yields exactly the sampler's slices in order across an epoch boundary, restarts
// with start(), reports reader errors from next(), and matches read_range.
#include <gtest/gtest.h>

#include <cstdio>

#include "io/loader.hpp"
#include "io_test_util.hpp"

namespace strata::io {
namespace {

// A dataset whose sample i has every value equal to i (f32, no normalisation): x identifies
// the sample read.
Dataset make_identity_dataset(const test::TempDir& dir, int64_t n, DatasetOptions options = {}) {
  Tensor x = Tensor::empty({n, 3}, DType::F32);
  std::vector<int32_t> y(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    for (int j = 0; j < 3; ++j) x.data<float>()[i * 3 + j] = static_cast<float>(i);
    y[static_cast<size_t>(i)] = static_cast<int32_t>(i % 7);
  }
  write_shard(dir / "a.h5", x.slice(0, n / 2), std::span(y).first(static_cast<size_t>(n / 2)), {});
  write_shard(dir / "b.h5", x.slice(n / 2, n), std::span(y).subspan(static_cast<size_t>(n / 2)), {});
  return Dataset::open(dir.path().string(), "--data", options);
}

// Checks that `b` holds positions [begin, begin + size) of the sampler's batch.
void expect_slice(const Batch& b, const BatchOrder& s, int64_t epoch, int64_t step, int64_t begin, int64_t size) {
  ASSERT_EQ(b.epoch, epoch);
  ASSERT_EQ(b.step_in_epoch, step);
  EXPECT_EQ(b.first_sample, (epoch * s.steps_per_epoch() + step) * s.global_batch() + begin);
  std::vector<int64_t> want(static_cast<size_t>(size));
  s.slice(epoch, step, begin, want);
  for (int64_t k = 0; k < size; ++k) {
    const int64_t i = want[static_cast<size_t>(k)];
    EXPECT_EQ(b.x.data<float>()[k * 3], static_cast<float>(i));
    EXPECT_EQ(b.y.data<int32_t>()[k], i % 7);
  }
}

TEST(Loader, FollowsTheSamplerAcrossEpochsAndRestarts) {
  test::TempDir dir;
  for (int64_t limit : {int64_t{0}, int64_t{1} << 30}) {  // from file, in memory
    Dataset ds = make_identity_dataset(dir, 50, {limit});
    BatchOrder s(50, 8, 11, true);  // 6 steps per epoch, 2 samples dropped
    for (int depth : {1, 2, 4}) {
      Loader loader(ds, s, 2, 4, depth);
      loader.start(0, 4);
      const void* first_buffer = nullptr;
      for (int64_t k = 0; k < 10; ++k) {  // through the end of epoch 0 into epoch 1
        const Batch& b = loader.next();
        const int64_t global = 4 + k;
        expect_slice(b, s, global / 6, global % 6, 2, 4);
        if (k == 0) first_buffer = b.x.raw();
      }
      loader.start(3, 1);
      for (int64_t k = 0; k < 3; ++k) expect_slice(loader.next(), s, 3, 1 + k, 2, 4);
      // Buffers are reused, never reallocated per step.
      bool reused = false;
      for (int k = 0; k < depth + 1; ++k) reused |= loader.next().x.raw() == first_buffer;
      EXPECT_TRUE(reused);
    }
  }
}

TEST(Loader, DestroysCleanlyWhileFull) {
  test::TempDir dir;
  Dataset ds = make_identity_dataset(dir, 40);
  BatchOrder s(40, 4, 1, true);
  { Loader never_started(ds, s, 0, 4); }
  Loader loader(ds, s, 0, 4, 3);
  loader.start(0, 0);
  loader.next();
}

TEST(Loader, ReadRangeReadsEverySampleInOrder) {
  test::TempDir dir;
  Dataset ds = make_identity_dataset(dir, 21);
  Tensor x = Tensor::empty({21, 3}), y = Tensor::empty({21}, DType::I32);
  read_range(ds, 0, 21, x, y);
  for (int64_t i = 0; i < 21; ++i) {
    EXPECT_EQ(x.data<float>()[i * 3 + 2], static_cast<float>(i));
    EXPECT_EQ(y.data<int32_t>()[i], i % 7);
  }
}

TEST(Loader, RethrowsReaderErrorsFromNext) {
  test::TempDir dir;
  const std::string path = dir / "c.h5";
  {  // compressed chunks, so that corrupt bytes make H5Dread fail rather than return garbage
    h5::File f(H5Fcreate(path.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT));
    hsize_t dims[2] = {64, 256}, chunk[2] = {8, 256}, n = 64;
    h5::Space space(H5Screate_simple(2, dims, nullptr)), lspace(H5Screate_simple(1, &n, nullptr));
    h5::PList dcpl(H5Pcreate(H5P_DATASET_CREATE));
    H5Pset_chunk(dcpl, 2, chunk);
    H5Pset_deflate(dcpl, 6);
    std::vector<uint8_t> x(64 * 256);
    for (size_t i = 0; i < x.size(); ++i) x[i] = static_cast<uint8_t>(i * 31 % 251);
    std::vector<int32_t> y(64, 1);
    h5::DataSet in(H5Dcreate2(f, "inputs", H5T_STD_U8LE, space, H5P_DEFAULT, dcpl, H5P_DEFAULT));
    H5Dwrite(in, H5T_NATIVE_UINT8, H5S_ALL, H5S_ALL, H5P_DEFAULT, x.data());
    h5::DataSet lab(H5Dcreate2(f, "labels", H5T_STD_I32LE, lspace, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT));
    H5Dwrite(lab, H5T_NATIVE_INT32, H5S_ALL, H5S_ALL, H5P_DEFAULT, y.data());
  }
  Dataset ds = Dataset::open(path, "--data", {0});
  {  // overwrite everything after the metadata read at open with garbage, in place
    std::FILE* f = std::fopen(path.c_str(), "r+b");
    ASSERT_NE(f, nullptr);
    std::fseek(f, 0, SEEK_END);
    const long size = std::ftell(f);
    std::fseek(f, 2048, SEEK_SET);
    std::vector<char> junk(static_cast<size_t>(size - 2048), '\x5a');
    std::fwrite(junk.data(), 1, junk.size(), f);
    std::fclose(f);
  }
  BatchOrder s(64, 8, 1, true);
  Loader loader(ds, s, 0, 8);
  loader.start(0, 0);
  EXPECT_THROW(loader.next(), Error);
  BatchOrder other(30, 5, 1, false);
  EXPECT_THROW(Loader(ds, other, 0, 5), Error);  // a sampler for another dataset size
}

}  // namespace
}  // namespace strata::io
