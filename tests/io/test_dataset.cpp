// Dataset: values read back (both the in-memory and the per-batch HDF5 path), spec forms,
// normalisation attributes, and one test per kind of bad input.
#include <gtest/gtest.h>

#include <fstream>
#include <limits>
#include <numeric>

#include "io/dataset.hpp"
#include "io/shard_files.hpp"
#include "io_test_util.hpp"

namespace strata::io {
namespace {

using test::expect_input_error;
using test::TempDir;
using test::write_raw;

// raw value j of sample i in the test datasets.
uint8_t raw_u8(int64_t i, int64_t j) { return static_cast<uint8_t>((i * 7 + j) % 256); }
float raw_f32(int64_t i, int64_t j) { return static_cast<float>(i) - 0.25f * static_cast<float>(j); }

// Writes samples [first, first + n) of the test pattern as one u8 or f32 shard.
void make_shard(const std::string& path, int64_t first, int64_t n, const Shape& sample, DType dtype,
                const ShardAttrs& attrs = {}, int label_mod = 5) {
  Shape shape{n};
  shape.insert(shape.end(), sample.begin(), sample.end());
  Tensor t = Tensor::empty(shape, dtype);
  const int64_t numel = shape_numel(sample);
  std::vector<int32_t> labels(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    labels[static_cast<size_t>(i)] = static_cast<int32_t>((first + i) % label_mod);
    for (int64_t j = 0; j < numel; ++j) {
      if (dtype == DType::U8)
        t.data<uint8_t>()[i * numel + j] = raw_u8(first + i, j);
      else
        t.data<float>()[i * numel + j] = raw_f32(first + i, j);
    }
  }
  write_shard(path, t, labels, attrs);
}

// Reads `indices` and compares with the pattern under (scale, mean, std) per channel.
void expect_batch(const Dataset& ds, const std::vector<int64_t>& indices, float scale, const std::vector<float>& mean,
                  const std::vector<float>& std, int label_mod = 5) {
  const Shape& sample = ds.info().sample_shape;
  Shape xs{static_cast<int64_t>(indices.size())};
  xs.insert(xs.end(), sample.begin(), sample.end());
  Tensor x = Tensor::empty(xs), y = Tensor::empty({xs[0]}, DType::I32);
  ds.read(indices, x, y);
  const int64_t numel = shape_numel(sample);
  const int64_t inner = numel / (mean.size() == 1 ? 1 : sample[0]);
  for (size_t b = 0; b < indices.size(); ++b) {
    const int64_t i = indices[b];
    EXPECT_EQ(y.data<int32_t>()[b], i % label_mod) << "sample " << i;
    for (int64_t j = 0; j < numel; ++j) {
      const size_t c = mean.size() == 1 ? 0 : static_cast<size_t>(j / inner);
      const float raw = ds.info().input_dtype == DType::U8 ? raw_u8(i, j) : raw_f32(i, j);
      const float want = (raw * scale - mean[c]) / std[c];
      ASSERT_NEAR(x.data<float>()[static_cast<int64_t>(b) * numel + j], want, 1e-5f * (1 + std::abs(want)))
          << "sample " << i << " element " << j;
    }
  }
}

class DatasetModes : public ::testing::TestWithParam<bool> {
 protected:
  DatasetOptions options() const { return {GetParam() ? int64_t{1} << 30 : 0}; }
};

TEST_P(DatasetModes, ReadsU8ShardsWithPerChannelNormalisation) {
  TempDir dir;
  ShardAttrs attrs{0.5f, {1.0f, 2.0f}, {2.0f, 4.0f}, 0};
  make_shard(dir / "d-0.h5", 0, 5, {2, 3, 2}, DType::U8, attrs);
  make_shard(dir / "d-1.h5", 5, 3, {2, 3, 2}, DType::U8, attrs);
  make_shard(dir / "d-2.h5", 8, 4, {2, 3, 2}, DType::U8, attrs);
  Dataset ds = Dataset::open(dir.path().string(), "--data", options());
  EXPECT_EQ(ds.in_memory(), GetParam());
  EXPECT_EQ(ds.size(), 12);
  EXPECT_EQ(ds.info().sample_shape, (Shape{2, 3, 2}));
  EXPECT_EQ(ds.info().input_dtype, DType::U8);
  EXPECT_EQ(ds.info().num_classes, 5);  // max label + 1
  EXPECT_EQ(ds.info().files.size(), 3u);
  ASSERT_EQ(ds.labels().size(), 12u);
  for (int i = 0; i < 12; ++i) EXPECT_EQ(ds.labels()[static_cast<size_t>(i)], i % 5);
  // Unordered, across shards, with duplicates and runs of consecutive indices.
  expect_batch(ds, {11, 0, 5, 5, 4, 6, 7, 3, 10, 11}, 0.5f, attrs.mean, attrs.std);
  expect_batch(ds, {7}, 0.5f, attrs.mean, attrs.std);
  std::vector<int64_t> all(12);
  std::iota(all.begin(), all.end(), 0);
  expect_batch(ds, all, 0.5f, attrs.mean, attrs.std);
}

TEST_P(DatasetModes, ReadsF32FeaturesWithDefaults) {
  TempDir dir;
  make_shard(dir / "f.h5", 0, 9, {4}, DType::F32);
  Dataset ds = Dataset::open(dir / "f.h5", "--data", options());
  EXPECT_EQ(ds.info().input_dtype, DType::F32);
  EXPECT_EQ(ds.info().scale, 1.0f);
  expect_batch(ds, {8, 2, 3, 2}, 1.0f, {0.0f}, {1.0f});
}

TEST_P(DatasetModes, NonFiniteInputIsNamedNotTrainedOn) {
  TempDir dir;
  Tensor x = Tensor::zeros({6, 3});
  x.data<float>()[4 * 3 + 1] = std::numeric_limits<float>::quiet_NaN();  // sample 4 of the second shard
  const std::vector<int32_t> y(6, 0);
  write_shard(dir / "a.h5", Tensor::zeros({2, 3}), std::span(y).first(2), {});
  write_shard(dir / "b.h5", x, y, {});
  const auto open_and_read = [&] {
    Dataset ds = Dataset::open(dir.path().string(), "--data", options());
    Tensor xb = Tensor::empty({3, 3}), yb = Tensor::empty({3}, DType::I32);
    ds.read(std::vector<int64_t>{0, 1, 3}, xb, yb);  // finite samples read fine
    ds.read(std::vector<int64_t>{0, 6, 1}, xb, yb);  // global 6 = sample 4 of b.h5
  };
  // Loaded at open: found there; read per batch: found in the batch that holds it.
  expect_input_error(open_and_read, {"--data: sample 4 of '", "b.h5", "non-finite"});
}

INSTANTIATE_TEST_SUITE_P(InMemoryAndFromFile, DatasetModes, ::testing::Bool());

TEST(Dataset, U8DefaultsAndNumClassesAttribute) {
  TempDir dir;
  make_shard(dir / "a.h5", 0, 6, {1, 2, 2}, DType::U8, {0.0f, {}, {}, 9});
  Dataset ds = Dataset::open(dir / "a.h5", "--data");
  EXPECT_FLOAT_EQ(ds.info().scale, 1.0f / 255.0f);
  EXPECT_EQ(ds.info().num_classes, 9);
  expect_batch(ds, {0, 5}, 1.0f / 255.0f, {0.0f}, {1.0f});
}

TEST(Dataset, ScalarMeanWithPerChannelStd) {
  TempDir dir;
  make_shard(dir / "a.h5", 0, 4, {3, 2}, DType::U8, {0.1f, {0.5f}, {1.0f, 2.0f, 4.0f}, 0});
  Dataset ds = Dataset::open(dir / "a.h5", "--data");
  expect_batch(ds, {0, 1, 2, 3}, 0.1f, {0.5f, 0.5f, 0.5f}, {1.0f, 2.0f, 4.0f});
}

TEST(Dataset, GlobAndDirectoryAreSortedByName) {
  TempDir dir;
  make_shard(dir / "b.h5", 3, 2, {1, 2}, DType::U8);
  make_shard(dir / "a.h5", 0, 3, {1, 2}, DType::U8);
  make_shard(dir / "c.other", 0, 1, {1, 2}, DType::U8);  // not *.h5: ignored in directories
  for (const std::string& spec : {dir.path().string(), dir / "*.h5"}) {
    Dataset ds = Dataset::open(spec, "--data");
    ASSERT_EQ(ds.info().files.size(), 2u) << spec;
    EXPECT_EQ(ds.info().files[0], dir / "a.h5");
    expect_batch(ds, {0, 1, 2, 3, 4}, 1.0f / 255.0f, {0.0f}, {1.0f});
  }
}

TEST(Dataset, ADirectoryOfTrainingAndValidationSplitsKeepsThemApart) {
  // What `strata-data tokenize --out dir/gpl` writes: training shards and a validation file.
  TempDir dir;
  for (const char* name : {"gpl-train-00000-of-00002.h5", "gpl-train-00001-of-00002.h5", "gpl-val.h5"})
    std::ofstream(dir / name) << "x";
  const std::string spec = dir.path().string();
  EXPECT_EQ(list_shards(spec, "--data"),
            (std::vector<std::string>{dir / "gpl-train-00000-of-00002.h5", dir / "gpl-train-00001-of-00002.h5"}));
  EXPECT_EQ(list_shards(spec, "--val-data"), std::vector<std::string>{dir / "gpl-val.h5"});
  EXPECT_EQ(left_out_note(spec, "--data"),
            "--data " + spec +
                ": left out gpl-val.h5 (named as evaluation splits: give them to --val-data); a glob "
                "such as '" +
                (dir / "*.h5") + "' takes every file");
  EXPECT_NE(left_out_note(spec, "--val-data").find("left out gpl-train-00000-of-00002.h5, gpl-train-00001"),
            std::string::npos);
  EXPECT_EQ(list_shards(dir / "*.h5", "--data").size(), 3u);  // a glob takes what it names
  EXPECT_EQ(list_shards(dir / "gpl-val.h5", "--data").size(), 1u);
  EXPECT_EQ(left_out_note(dir / "gpl-val.h5", "--data"), "");
  // A directory of one kind is taken whole, whatever its names.
  TempDir only_val;
  std::ofstream(only_val / "a-val.h5") << "x";
  EXPECT_EQ(list_shards(only_val.path().string(), "--data").size(), 1u);
  EXPECT_EQ(left_out_note(only_val.path().string(), "--data"), "");
}

TEST(Dataset, EvaluationSplitNames) {
  for (const char* name : {"x-val.h5", "x_val.h5", "x.valid.h5", "a/b-validation-00001-of-00004.h5", "x-TEST.h5",
                           "x_eval.h5", "val.h5", "test-00000-of-00002.h5"})
    EXPECT_TRUE(named_as_evaluation_split(name)) << name;
  for (const char* name :
       {"x-train.h5", "train.h5", "interval.h5", "x-values.h5", "contest.h5", "x-train-00000-of-00002.h5"})
    EXPECT_FALSE(named_as_evaluation_split(name)) << name;
}

// ---- bad input ---------------------------------------------------------------------------

TEST(DatasetBadInput, MissingPathsAndEmptyMatches) {
  TempDir dir;
  expect_input_error([&] { Dataset::open(dir / "nope.h5", "--data"); }, {"--data", "nope.h5", "does not exist"});
  expect_input_error([&] { Dataset::open(dir.path().string(), "--val-data"); },
                     {"--val-data", "contains no .h5 files"});
  expect_input_error([&] { Dataset::open(dir / "x-*.h5", "--data"); }, {"--data", "x-*.h5", "matches no files"});
}

TEST(DatasetBadInput, NotHdf5) {
  TempDir dir;
  std::ofstream(dir / "t.h5") << "just text\n";
  expect_input_error([&] { Dataset::open(dir / "t.h5", "--data"); }, {"--data", "t.h5", "not an HDF5 file"});
}

TEST(DatasetBadInput, MissingDatasets) {
  TempDir dir;
  std::vector<uint8_t> x(8);
  std::vector<int32_t> y(4);
  write_raw(dir / "noy.h5", "inputs", H5T_STD_U8LE, H5T_NATIVE_UINT8, {4, 2}, x.data());
  expect_input_error([&] { Dataset::open(dir / "noy.h5", "--data"); }, {"noy.h5", "no dataset 'labels'"});
  write_raw(dir / "nox.h5", "labels", H5T_STD_I32LE, H5T_NATIVE_INT32, {4}, y.data());
  expect_input_error([&] { Dataset::open(dir / "nox.h5", "--data"); }, {"nox.h5", "no dataset 'inputs'"});
}

TEST(DatasetBadInput, EmptyAndMismatchedLengths) {
  TempDir dir;
  std::vector<uint8_t> x(8);
  std::vector<int32_t> y(4);
  write_raw(dir / "e.h5", "inputs", H5T_STD_U8LE, H5T_NATIVE_UINT8, {0, 2}, nullptr);
  write_raw(dir / "e.h5", "labels", H5T_STD_I32LE, H5T_NATIVE_INT32, {0}, nullptr);
  expect_input_error([&] { Dataset::open(dir / "e.h5", "--data"); }, {"e.h5", "empty", "0 samples"});
  write_raw(dir / "m.h5", "inputs", H5T_STD_U8LE, H5T_NATIVE_UINT8, {4, 2}, x.data());
  write_raw(dir / "m.h5", "labels", H5T_STD_I32LE, H5T_NATIVE_INT32, {3}, y.data());
  expect_input_error([&] { Dataset::open(dir / "m.h5", "--data"); },
                     {"m.h5", "'labels' have shape [3]", "expected [4]"});
}

TEST(DatasetBadInput, LabelsOutOfRange) {
  TempDir dir;
  std::vector<uint8_t> x(8);
  std::vector<int32_t> neg{0, 1, -1, 2};
  write_raw(dir / "n.h5", "inputs", H5T_STD_U8LE, H5T_NATIVE_UINT8, {4, 2}, x.data());
  write_raw(dir / "n.h5", "labels", H5T_STD_I32LE, H5T_NATIVE_INT32, {4}, neg.data());
  expect_input_error([&] { Dataset::open(dir / "n.h5", "--data"); }, {"n.h5", "label -1", "index 2"});
  make_shard(dir / "k.h5", 0, 6, {1, 2}, DType::U8, {0.0f, {}, {}, 4}, 6);  // labels 0..5, num_classes 4
  expect_input_error([&] { Dataset::open(dir / "k.h5", "--data"); }, {"k.h5", "label 5", "num_classes attribute 4"});
  std::vector<float> fy(4);
  write_raw(dir / "f.h5", "inputs", H5T_STD_U8LE, H5T_NATIVE_UINT8, {4, 2}, x.data());
  write_raw(dir / "f.h5", "labels", H5T_IEEE_F32LE, H5T_NATIVE_FLOAT, {4}, fy.data());
  expect_input_error([&] { Dataset::open(dir / "f.h5", "--data"); }, {"f.h5", "float32", "expected an integer type"});
}

TEST(DatasetBadInput, ShardsThatDisagree) {
  TempDir dir;
  std::filesystem::create_directories(dir / "s");
  make_shard(dir / "s/a.h5", 0, 3, {1, 4}, DType::U8);
  make_shard(dir / "s/b.h5", 3, 3, {1, 5}, DType::U8);
  std::filesystem::create_directories(dir / "t");
  make_shard(dir / "t/a.h5", 0, 3, {4}, DType::U8);
  make_shard(dir / "t/b.h5", 3, 3, {4}, DType::F32);
  std::filesystem::create_directories(dir / "u");
  make_shard(dir / "u/a.h5", 0, 3, {4}, DType::U8, {0.5f, {}, {}, 0});
  make_shard(dir / "u/b.h5", 3, 3, {4}, DType::U8);
  expect_input_error([&] { Dataset::open(dir / "s", "--data"); }, {"b.h5", "[1, 5]", "[1, 4]", "agree"});
  expect_input_error([&] { Dataset::open(dir / "t", "--data"); }, {"b.h5", "f32", "u8", "agree"});
  expect_input_error([&] { Dataset::open(dir / "u", "--data"); }, {"b.h5", "scale", "agree"});
}

TEST(DatasetBadInput, UnsupportedTypesAndAttributes) {
  TempDir dir;
  std::vector<double> xd(8);
  std::vector<int32_t> y(4);
  write_raw(dir / "d.h5", "inputs", H5T_IEEE_F64LE, H5T_NATIVE_DOUBLE, {4, 2}, xd.data());
  write_raw(dir / "d.h5", "labels", H5T_STD_I32LE, H5T_NATIVE_INT32, {4}, y.data());
  expect_input_error([&] { Dataset::open(dir / "d.h5", "--data"); }, {"d.h5", "float64", "expected uint8 or float32"});
  std::vector<uint8_t> x(4);
  write_raw(dir / "r.h5", "inputs", H5T_STD_U8LE, H5T_NATIVE_UINT8, {4}, x.data());
  write_raw(dir / "r.h5", "labels", H5T_STD_I32LE, H5T_NATIVE_INT32, {4}, y.data());
  expect_input_error([&] { Dataset::open(dir / "r.h5", "--data"); }, {"r.h5", "[4]", "at least 2 dimensions"});
  make_shard(dir / "m.h5", 0, 3, {2, 4}, DType::U8, {0.0f, {0.1f, 0.2f, 0.3f}, {}, 0});
  expect_input_error([&] { Dataset::open(dir / "m.h5", "--data"); },
                     {"m.h5", "'mean' has 3 values", "expected 1 or 2"});
  make_shard(dir / "z.h5", 0, 3, {2, 4}, DType::U8, {0.0f, {}, {0.0f}, 0});
  expect_input_error([&] { Dataset::open(dir / "z.h5", "--data"); }, {"z.h5", "'std'", "> 0"});
  const float inf = std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
  make_shard(dir / "i.h5", 0, 3, {2, 4}, DType::U8, {0.0f, {}, {inf}, 0});
  expect_input_error([&] { Dataset::open(dir / "i.h5", "--data"); }, {"i.h5", "'std' holds inf", "finite"});
  make_shard(dir / "n.h5", 0, 3, {2, 4}, DType::U8, {0.0f, {nan}, {}, 0});
  expect_input_error([&] { Dataset::open(dir / "n.h5", "--data"); }, {"n.h5", "'mean' holds nan", "finite"});
  make_shard(dir / "s.h5", 0, 3, {2, 4}, DType::U8, {-1.0f, {}, {}, 0});
  expect_input_error([&] { Dataset::open(dir / "s.h5", "--data"); }, {"s.h5", "'scale' is -1", "> 0"});
  std::vector<float> none;
  write_raw(dir / "e.h5", "inputs", H5T_IEEE_F32LE, H5T_NATIVE_FLOAT, {4, 0}, none.data());
  write_raw(dir / "e.h5", "labels", H5T_STD_I32LE, H5T_NATIVE_INT32, {4}, y.data());
  expect_input_error([&] { Dataset::open(dir / "e.h5", "--data"); }, {"e.h5", "[4, 0]", "at least one value"});
}

}  // namespace
}  // namespace strata::io
