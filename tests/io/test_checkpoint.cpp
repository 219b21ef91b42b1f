// Checkpoints: round trip, atomic commit, crc32 corruption, one-line input errors, and the
// checkpoint directory (latest pointer, --keep pruning, newest complete checkpoint). With
// STRATA_CHECKPOINT_ORACLE=PATH set, CheckpointOracle.Write writes a known checkpoint there
// for tests/io/py/check_checkpoint.py to read with h5py.
#include <gtest/gtest.h>
#include <sys/resource.h>

#include <csignal>
#include <cstdlib>
#include <filesystem>
#include <fstream>

#include "io/checkpoint.hpp"
#include "io_test_util.hpp"

namespace strata::io {
namespace {

namespace fs = std::filesystem;

Tensor arange(Shape shape, float start) {
  Tensor t = Tensor::empty(std::move(shape));
  for (int64_t i = 0; i < t.numel(); ++i) t.data<float>()[i] = start + 0.5f * static_cast<float>(i);
  return t;
}

// The checkpoint the oracle reads: keep in step with py/check_checkpoint.py.
void write_known(const std::string& path) {
  CheckpointWriter w(path);
  w.write_tensor("model/conv1/weight", arange({2, 1, 3, 3}, -4.0f));
  w.write_tensor("model/conv1/bias", arange({2}, 1.0f));
  w.write_tensor("model/fc/weight", arange({3, 4}, 0.0f));
  Tensor counts = Tensor::empty({5}, DType::I32);
  for (int i = 0; i < 5; ++i) counts.data<int32_t>()[i] = i * i - 3;
  w.write_tensor("state/counts", counts);
  w.set_attr("step", 1234);
  w.set_attr("lr", 0.05);
  w.set_attr("model", "cnn");
  w.commit();
}

TEST(Checkpoint, RoundTrip) {
  test::TempDir dir;
  write_known(dir / "c.h5");
  CheckpointReader r(dir / "c.h5");
  EXPECT_EQ(r.attr_int("format_version"), kCheckpointFormatVersion);
  EXPECT_EQ(r.attr_int("step"), 1234);
  EXPECT_DOUBLE_EQ(r.attr_double("lr"), 0.05);
  EXPECT_EQ(r.attr_string("model"), "cnn");
  EXPECT_TRUE(r.has("model/conv1/weight"));
  EXPECT_FALSE(r.has("model/conv1"));  // a group, not a tensor
  EXPECT_FALSE(r.has("model/conv2/weight"));
  EXPECT_EQ(r.shape("model/conv1/weight"), (Shape{2, 1, 3, 3}));
  EXPECT_EQ(r.list_tensors(),
            (std::vector<std::string>{"model/conv1/bias", "model/conv1/weight", "model/fc/weight", "state/counts"}));
  EXPECT_EQ(r.list_tensors("model/conv1"), (std::vector<std::string>{"model/conv1/bias", "model/conv1/weight"}));
  Tensor w = Tensor::empty({2, 1, 3, 3});
  r.read_tensor("model/conv1/weight", w);
  Tensor want = arange({2, 1, 3, 3}, -4.0f);
  for (int64_t i = 0; i < w.numel(); ++i) EXPECT_EQ(w.data<float>()[i], want.data<float>()[i]);
  Tensor counts = Tensor::empty({5}, DType::I32);
  r.read_tensor("state/counts", counts);
  EXPECT_EQ(counts.data<int32_t>()[4], 13);
}

TEST(Checkpoint, NothingAtPathUntilCommit) {
  test::TempDir dir;
  const std::string path = dir / "c.h5";
  {
    CheckpointWriter w(path);
    w.write_tensor("model/a", arange({3}, 0.0f));
    EXPECT_FALSE(fs::exists(path));
    EXPECT_TRUE(fs::exists(path + ".tmp"));
  }  // no commit: the temporary file is removed
  EXPECT_FALSE(fs::exists(path));
  EXPECT_FALSE(fs::exists(path + ".tmp"));

  write_known(path);  // an earlier good checkpoint survives an abandoned rewrite
  {
    CheckpointWriter w(path);
    w.write_tensor("model/a", arange({3}, 0.0f));
  }
  EXPECT_EQ(CheckpointReader(path).attr_int("step"), 1234);
  {
    CheckpointWriter w(path);
    w.set_attr("step", 7);
    w.commit();
    EXPECT_FALSE(fs::exists(path + ".tmp"));
  }
  EXPECT_EQ(CheckpointReader(path).attr_int("step"), 7);
}

TEST(Checkpoint, DetectsCorruptData) {
  test::TempDir dir;
  const std::string path = dir / "c.h5";
  {
    CheckpointWriter w(path);
    w.write_tensor("model/w", arange({256}, 1.0f));
    w.commit();
  }
  {  // flip one value in place through HDF5, leaving the crc32 attribute as it was
    h5::File f(H5Fopen(path.c_str(), H5F_ACC_RDWR, H5P_DEFAULT));
    h5::DataSet ds(H5Dopen2(f, "model/w", H5P_DEFAULT));
    Tensor t = arange({256}, 1.0f);
    t.data<float>()[100] += 1.0f;
    ASSERT_GE(H5Dwrite(ds, H5T_NATIVE_FLOAT, H5S_ALL, H5S_ALL, H5P_DEFAULT, t.raw()), 0);
  }
  Tensor out = Tensor::empty({256});
  test::expect_input_error([&] { CheckpointReader(path).read_tensor("model/w", out); },
                           {"c.h5", "model/w", "corrupt", "crc32"});
}

TEST(Checkpoint, InputErrors) {
  test::TempDir dir;
  test::expect_input_error([&] { CheckpointReader r(dir / "none.h5"); }, {"none.h5", "does not exist"});
  std::ofstream(dir / "text.h5") << "hello\n";
  test::expect_input_error([&] { CheckpointReader r(dir / "text.h5"); }, {"text.h5", "not an HDF5 file"});
  std::vector<uint8_t> x(4);
  test::write_raw(dir / "other.h5", "inputs", H5T_STD_U8LE, H5T_NATIVE_UINT8, {4}, x.data());
  test::expect_input_error([&] { CheckpointReader r(dir / "other.h5"); },
                           {"other.h5", "not a Strata checkpoint", "format_version"});
  write_known(dir / "c.h5");
  CheckpointReader r(dir / "c.h5");
  Tensor wrong = Tensor::empty({2, 1, 5, 5});
  test::expect_input_error([&] { r.read_tensor("model/conv1/weight", wrong); },
                           {"model/conv1/weight", "[2, 1, 3, 3]", "expects [2, 1, 5, 5]"});
  test::expect_input_error([&] { r.read_tensor("model/nope", wrong); }, {"c.h5", "no tensor 'model/nope'"});
  test::expect_input_error([&] { r.attr_int("epoch"); }, {"c.h5", "no attribute 'epoch'"});
}

// A checkpoint directory: `latest` names the newest, pruning keeps the newest K, and the
// newest complete checkpoint skips a corrupt or truncated file for the one before it.
TEST(CheckpointDir, LatestKeepAndNewest) {
  test::TempDir dir;
  const std::string d = dir.path().string();
  EXPECT_EQ(newest_checkpoint(d), "");
  for (int64_t step : {10, 20, 30, 40}) {
    const std::string path = checkpoint_path(d, step);
    write_known(path);
    update_latest(d, path);
  }
  EXPECT_FALSE(fs::exists(dir / "latest.tmp"));
  std::string latest;
  std::ifstream(dir / "latest") >> latest;
  EXPECT_EQ(latest, "step-00000040.h5");
  prune_checkpoints(d, 3, checkpoint_path(d, 40));
  EXPECT_FALSE(fs::exists(checkpoint_path(d, 10)));
  EXPECT_TRUE(fs::exists(checkpoint_path(d, 20)));
  EXPECT_EQ(newest_checkpoint(d), checkpoint_path(d, 40));
  // A run that starts again below another run's files prunes only up to its own newest.
  write_known(checkpoint_path(d, 5));
  write_known(checkpoint_path(d, 6));
  prune_checkpoints(d, 1, checkpoint_path(d, 6));
  EXPECT_TRUE(fs::exists(checkpoint_path(d, 6)));
  EXPECT_FALSE(fs::exists(checkpoint_path(d, 5)));
  for (int64_t step : {20, 30, 40}) EXPECT_TRUE(fs::exists(checkpoint_path(d, step))) << step;
  // Truncate the newest (named by latest) and corrupt the next: the third is chosen.
  fs::resize_file(checkpoint_path(d, 40), fs::file_size(checkpoint_path(d, 40)) / 2);
  {
    h5::File f(H5Fopen(checkpoint_path(d, 30).c_str(), H5F_ACC_RDWR, H5P_DEFAULT));
    h5::DataSet ds(H5Dopen2(f, "model/fc/weight", H5P_DEFAULT));
    Tensor t = arange({3, 4}, 1.0f);
    ASSERT_GE(H5Dwrite(ds, H5T_NATIVE_FLOAT, H5S_ALL, H5S_ALL, H5P_DEFAULT, t.raw()), 0);
  }
  EXPECT_EQ(newest_checkpoint(d), checkpoint_path(d, 20));
}

// A full disk while saving, emulated by a file-size limit: an error that says which file, no
// `.tmp` left behind, and `latest` still naming the previous checkpoint.
TEST(CheckpointDir, FullDiskKeepsThePreviousCheckpoint) {
  test::TempDir dir;
  const std::string d = dir.path().string();
  write_known(checkpoint_path(d, 1));
  update_latest(d, checkpoint_path(d, 1));
  rlimit old{};
  ASSERT_EQ(getrlimit(RLIMIT_FSIZE, &old), 0);
  const auto previous = std::signal(SIGXFSZ, SIG_IGN);  // writes past the limit fail with EFBIG
  const auto limit_to = [&](rlim_t bytes) {
    rlimit small = old;
    small.rlim_cur = bytes;
    ASSERT_EQ(setrlimit(RLIMIT_FSIZE, &small), 0);
  };
  const auto expect_failure = [](auto&& fn, const std::string& words) {
    try {
      fn();
      ADD_FAILURE() << "no error; expected one mentioning " << words;
    } catch (const Error& e) {
      EXPECT_NE(e.kind(), ErrorKind::Input) << e.what();  // the disk, not the user's input
      EXPECT_NE(e.message().find(words), std::string::npos) << e.message();
    }
  };
  {
    CheckpointWriter w(checkpoint_path(d, 2));
    limit_to(16 << 10);
    expect_failure([&] { w.write_tensor("model/big", Tensor::zeros({int64_t{64} << 10})); }, "step-00000002.h5.tmp");
    // The limit goes before the writer is destroyed: an HDF5 file whose close failed would
    // crash this test process's exit (train itself leaves through MPI_Abort or _exit).
    ASSERT_EQ(setrlimit(RLIMIT_FSIZE, &old), 0);
  }
  limit_to(0);
  expect_failure([&] { update_latest(d, checkpoint_path(d, 1)); }, "latest.tmp");
  ASSERT_EQ(setrlimit(RLIMIT_FSIZE, &old), 0);
  std::signal(SIGXFSZ, previous);
  EXPECT_FALSE(fs::exists(checkpoint_path(d, 2) + ".tmp"));
  EXPECT_FALSE(fs::exists(checkpoint_path(d, 2)));
  EXPECT_FALSE(fs::exists(dir / "latest.tmp"));
  EXPECT_EQ(newest_checkpoint(d), checkpoint_path(d, 1));
}

TEST(CheckpointOracle, Write) {
  const char* path = std::getenv("STRATA_CHECKPOINT_ORACLE");
  if (!path) GTEST_SKIP() << "STRATA_CHECKPOINT_ORACLE not set";
  fs::create_directories(fs::path(path).parent_path());
  write_known(path);
}

}  // namespace
}  // namespace strata::io
