// CheckpointSaver: synchronous and background saves write the same files, move `latest` only
// once a file is complete, apply --keep across saves, rethrow a background write's error at the
// next wait, and time out rather than wait forever.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "io/checkpoint/directory.hpp"
#include "io/checkpoint/file.hpp"
#include "io/checkpoint/manifest.hpp"
#include "io/checkpoint/saver.hpp"
#include "io_test_util.hpp"

namespace strata::io {
namespace {

namespace fs = std::filesystem;

using test::arange;

// One save of `step`: two tensors whose values depend on the step, and a root attribute.
void save(CheckpointSaver& saver, int64_t step) {
  saver.begin(step);
  saver.add("model/fc/weight", arange({64, 32}, static_cast<float>(step)));
  saver.add("model/fc/bias", arange({32}, -static_cast<float>(step)));
  saver.finish([step](CheckpointWriter& w) { w.set_attr("step", step); });
}

std::string latest(const fs::path& dir) {
  std::ifstream in(dir / "latest");
  std::string name;
  in >> name;
  return name;
}

std::vector<float> read(const std::string& path, const std::string& name, Shape shape) {
  CheckpointReader r(path);
  Tensor t = Tensor::empty(std::move(shape));
  r.read_tensor(name, t);
  return {t.data<float>(), t.data<float>() + t.numel()};
}

std::vector<float> read_values(const Tensor& t) { return {t.data<float>(), t.data<float>() + t.numel()}; }

TEST(CheckpointSaver, BackgroundSavesEqualSynchronousOnes) {
  test::TempDir dir;
  const fs::path sync_dir = dir / "sync", async_dir = dir / "async";
  fs::create_directory(sync_dir);
  fs::create_directory(async_dir);
  {
    CheckpointSaver sync(sync_dir, 0, false, 60), async(async_dir, 0, true, 60);
    EXPECT_FALSE(sync.async());
    EXPECT_TRUE(async.async());
    for (int64_t step : {5, 10}) {
      save(sync, step);
      save(async, step);
    }
    async.wait();
    EXPECT_EQ(latest(async_dir), "step-00000010.h5");
  }
  for (const char* name : {"step-00000005.h5", "step-00000010.h5"}) {
    const std::string a = (async_dir / name).string(), s = (sync_dir / name).string();
    EXPECT_EQ(read(a, "model/fc/weight", {64, 32}), read(s, "model/fc/weight", {64, 32})) << name;
    EXPECT_EQ(read(a, "model/fc/bias", {32}), read(s, "model/fc/bias", {32})) << name;
    EXPECT_EQ(CheckpointReader(a).attr_int("step"), CheckpointReader(s).attr_int("step"));
    EXPECT_TRUE(check_manifest(a).has_value()) << "a background save writes its manifest";
  }
}

// HDF5 from two threads at once, as in training: background saves of 16 tensors while the main
// thread reads another checkpoint again and again. Debian's parallel libhdf5 is not thread-safe:
// without the process-wide lock (h5::Guard) this corrupts the library's state; under TSan (the
// sanitizer stage) an access of ours outside the lock is a report.
TEST(CheckpointSaver, ReadsOnOneThreadWhileAnotherWrites) {
  test::TempDir dir;
  const std::string other = dir / "other.h5";
  {
    CheckpointWriter w(other);
    w.write_tensor("model/w", arange({128, 64}, 3.0f));
    w.commit();
  }
  const std::vector<float> expected = read(other, "model/w", {128, 64});
  {
    CheckpointSaver saver(dir.path().string(), 0, true, 60);
    for (int64_t step = 1; step <= 3; ++step) {
      saver.begin(step);
      for (int t = 0; t < 16; ++t)
        saver.add("model/t" + std::to_string(t), arange({256, 64}, static_cast<float>(step * 100 + t)));
      saver.finish([step](CheckpointWriter& w) { w.set_attr("step", step); });
      for (int i = 0; i < 20; ++i) ASSERT_EQ(read(other, "model/w", {128, 64}), expected) << "step " << step;
    }
    saver.wait();
  }
  for (int64_t step = 1; step <= 3; ++step)
    EXPECT_EQ(read(checkpoint_path(dir.path().string(), step), "model/t7", {256, 64}),
              read_values(arange({256, 64}, static_cast<float>(step * 100 + 7))));
}

TEST(CheckpointSaver, TensorsAreWrittenAsTheyWereAddedNotAsTheyAreLater) {
  // The background write keeps the tensors it was given: the caller hands over fresh ones
  // (StateGather does) and may drop its handles at once.
  test::TempDir dir;
  CheckpointSaver saver(dir.path(), 0, true, 60);
  saver.begin(1);
  {
    Tensor t = arange({1000}, 3.0f);
    saver.add("model/t", t);
  }
  saver.finish([](CheckpointWriter&) {});
  saver.wait();
  const Tensor want = arange({1000}, 3.0f);
  EXPECT_EQ(read(dir / "step-00000001.h5", "model/t", {1000}),
            std::vector<float>(want.data<float>(), want.data<float>() + 1000));
}

TEST(CheckpointSaver, KeepPrunesAcrossBackgroundSaves) {
  test::TempDir dir;
  {
    CheckpointSaver saver(dir.path(), 2, true, 60);
    for (int64_t step = 1; step <= 5; ++step) save(saver, step);
  }  // the destructor waits for the last write
  std::vector<std::string> files;
  for (const auto& e : fs::directory_iterator(dir.path())) files.push_back(e.path().filename().string());
  std::sort(files.begin(), files.end());
  EXPECT_EQ(files, (std::vector<std::string>{"latest", "step-00000004.h5", "step-00000004.h5.manifest",
                                             "step-00000005.h5", "step-00000005.h5.manifest"}));
  EXPECT_EQ(latest(dir.path()), "step-00000005.h5");
}

TEST(CheckpointSaver, BackgroundErrorIsRethrownAtTheNextWaitAndLatestStays) {
  test::TempDir dir;
  CheckpointSaver saver(dir.path(), 0, true, 60);
  save(saver, 1);
  saver.wait();
  // A directory where the file's temporary must go: creating it fails on the background thread.
  fs::create_directory(dir / "step-00000002.h5.tmp");
  fs::create_directory(dir / "step-00000002.h5.tmp/x");
  save(saver, 2);
  EXPECT_THROW(saver.wait(), Error);
  EXPECT_EQ(latest(dir.path()), "step-00000001.h5");
  EXPECT_NO_THROW(saver.wait()) << "an error is reported once";
  save(saver, 3);  // the saver goes on working
  saver.wait();
  EXPECT_EQ(latest(dir.path()), "step-00000003.h5");
}

TEST(CheckpointSaver, WaitHasADeadline) {
  test::TempDir dir;
  CheckpointSaver saver(dir.path(), 0, true, 1e-6);
  saver.begin(1);
  saver.add("model/big", Tensor::zeros({16 << 20}));  // 64 MiB: far longer than a microsecond to write
  saver.finish([](CheckpointWriter&) {});
  try {
    saver.wait();
    FAIL() << "no timeout";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("did not finish within"), std::string::npos) << e.what();
  }
  // The write went on: waiting again (until it ends) finds it complete.
  for (bool done = false; !done;) {
    try {
      saver.wait();
      done = true;
    } catch (const Error&) {
    }
  }
  EXPECT_EQ(latest(dir.path()), "step-00000001.h5");
}

}  // namespace
}  // namespace strata::io
