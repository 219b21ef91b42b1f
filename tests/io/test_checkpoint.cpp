// Checkpoints: round trip, atomic commit, crc32 corruption, one-line input errors, manifests
// (whole-file checksum, position), and the checkpoint directory (latest pointer, --keep pruning
// of this job's files, newest valid checkpoint, the directory lock). With
// STRATA_CHECKPOINT_ORACLE=PATH set, CheckpointOracle.Write writes a known checkpoint there
// for tests/io/py/check_checkpoint.py to read with h5py.
#include <gtest/gtest.h>
#include <sys/resource.h>
#include <unistd.h>

#include <cmath>
#include <csignal>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "io/checkpoint/directory.hpp"
#include "io/checkpoint/file.hpp"
#include "io/checkpoint/lock.hpp"
#include "io/checkpoint/manifest.hpp"
#include "io/checkpoint/run_state.hpp"
#include "io_test_util.hpp"

namespace strata::io {
namespace {

namespace fs = std::filesystem;

using test::arange;

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

// A training checkpoint at `step` (position and run state, as train writes it).
void write_run(const std::string& path, int64_t step) {
  CheckpointWriter w(path);
  w.write_tensor("model/fc/weight", arange({3, 4}, static_cast<float>(step)));
  RunState s;
  s.step = s.optimizer_step = step;
  s.epoch = step / 8;
  s.step_in_epoch = step % 8;
  s.seed = 3;
  s.global_batch = 16;
  s.optimizer = "sgd";
  write_run_state(w, s);
  w.commit();
}

std::string read_text(const std::string& path) {
  std::ostringstream text;
  text << std::ifstream(path).rdbuf();
  return text.str();
}

void flip_byte(const std::string& path, int64_t offset) {
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  f.seekg(offset);
  char c = 0;
  f.get(c);
  f.seekp(offset);
  f.put(static_cast<char>(c ^ 0x10));
}

// Rewrites a root attribute with HDF5 (int or double).
template <class T>
void set_root_attr(const std::string& path, const std::string& name, T value) {
  h5::File f(H5Fopen(path.c_str(), H5F_ACC_RDWR, H5P_DEFAULT));
  ASSERT_TRUE(f.valid());
  H5Adelete(f, name.c_str());
  h5::write_attr(f, name, value);
}

// The manifest made to match the file's bytes again, as a tool that re-sealed a file would.
void reseal(const std::string& path) {
  const auto [size, crc] = file_size_and_crc32(path);
  std::istringstream in(read_text(manifest_path(path)));
  std::string out;
  char hex[16];
  std::snprintf(hex, sizeof hex, "%08x", crc);
  for (std::string line; std::getline(in, line);)
    out += (line.starts_with("size ")    ? "size " + std::to_string(size)
            : line.starts_with("crc32 ") ? "crc32 " + std::string(hex)
                                         : line) +
           "\n";
  std::ofstream(manifest_path(path)) << out;
}

TEST(Manifest, WrittenWithTheFileAndChecked) {
  test::TempDir dir;
  const std::string path = checkpoint_path(dir.path().string(), 20);
  write_run(path, 20);
  const std::string text = read_text(manifest_path(path));
  const auto [size, crc] = file_size_and_crc32(path);
  EXPECT_EQ(size, static_cast<int64_t>(fs::file_size(path)));
  EXPECT_NE(text.find("strata-checkpoint-manifest 1\nfile step-00000020.h5\nsize " + std::to_string(size)),
            std::string::npos)
      << text;
  EXPECT_NE(text.find("step 20\nepoch 2\nstep_in_epoch 4\nseed 3\nposition_crc32 "), std::string::npos) << text;
  const std::optional<Manifest> m = check_manifest(path);
  ASSERT_TRUE(m && m->position);
  EXPECT_EQ(m->crc32, crc);
  EXPECT_EQ(*m->position, (Position{20, 2, 4, 3}));
  EXPECT_FALSE(fs::exists(manifest_path(path) + ".tmp"));
  CheckpointReader r(path);
  EXPECT_TRUE(r.has_manifest());
  EXPECT_EQ(read_run_state(r).step, 20);
}

// Any flipped byte is refused by the whole-file crc32 before HDF5 opens the file, as is a file
// of another size.
TEST(Manifest, FlippedByteAndWrongSize) {
  test::TempDir dir;
  const std::string path = checkpoint_path(dir.path().string(), 20);
  write_run(path, 20);
  const auto size = static_cast<int64_t>(fs::file_size(path));
  for (int64_t offset : {int64_t{0}, size / 3, size - 1}) {
    flip_byte(path, offset);
    test::expect_input_error([&] { CheckpointReader r(path); }, {"step-00000020.h5", "is corrupt: whole-file crc32"});
    flip_byte(path, offset);  // back: the file is whole again
    EXPECT_NO_THROW(CheckpointReader r(path));
  }
  std::ofstream(path, std::ios::app) << 'x';
  test::expect_input_error([&] { CheckpointReader r(path); },
                           {"step-00000020.h5", "has " + std::to_string(size + 1) + " bytes, its manifest says"});
}

// A file one rank checked whole is opened by the others without reading all of it again: the
// size and the manifest's position are still checked, the whole-file crc32 is not.
TEST(Manifest, OpenedWithoutTheWholeFileCrcOnceChecked) {
  test::TempDir dir;
  const std::string path = checkpoint_path(dir.path().string(), 20);
  write_run(path, 20);
  const auto size = static_cast<int64_t>(fs::file_size(path));
  flip_byte(path, size - 1);  // the last byte: past what HDF5 reads to open the file
  test::expect_input_error([&] { CheckpointReader r(path); }, {"is corrupt: whole-file crc32"});
  CheckpointReader unchecked(path, /*whole_file=*/false);
  EXPECT_TRUE(unchecked.has_manifest());
  EXPECT_EQ(read_run_state(unchecked).step, 20);
  std::ofstream(path, std::ios::app) << 'x';
  test::expect_input_error([&] { CheckpointReader r(path, /*whole_file=*/false); }, {"bytes, its manifest says"});
}

// Position attributes: covered by the manifest (even when the file's checksum was redone), by
// the file's name, and by range checks that need no manifest.
TEST(Manifest, TamperedPosition) {
  test::TempDir dir;
  const std::string d = dir.path().string(), path = checkpoint_path(d, 20);
  write_run(path, 20);
  const std::string manifest = read_text(manifest_path(path));
  set_root_attr(path, "step", int64_t{7});
  test::expect_input_error([&] { CheckpointReader r(path); }, {"is corrupt: whole-file crc32"});
  reseal(path);  // the bytes match again; the attribute still differs from the manifest's position
  test::expect_input_error([&] { CheckpointReader r(path); }, {"holds step 7 but its name says step 20"});
  set_root_attr(path, "step", int64_t{20});
  set_root_attr(path, "seed", int64_t{4});
  reseal(path);
  test::expect_input_error([&] { CheckpointReader r(path); },
                           {"position attributes (step 20, epoch 2, step_in_epoch 4, seed 4)",
                            "differ from its manifest's (step 20, epoch 2, step_in_epoch 4, seed 3)"});
  // The manifest's own position edited: its checksum fails.
  write_run(path, 20);
  std::string edited = read_text(manifest_path(path));
  edited.replace(edited.find("epoch 2"), 7, "epoch 1");
  std::ofstream(manifest_path(path)) << edited;
  test::expect_input_error([&] { CheckpointReader r(path); }, {"manifest's position fails its checksum"});
  // A step-20 file and its manifest renamed to step 30.
  write_run(path, 20);
  fs::copy_file(path, checkpoint_path(d, 30));
  fs::copy_file(manifest_path(path), manifest_path(checkpoint_path(d, 30)));
  test::expect_input_error([&] { CheckpointReader r(checkpoint_path(d, 30)); },
                           {"its manifest describes 'step-00000020.h5', not 'step-00000030.h5'"});
}

// Manifests damaged as the fuzzer found them (tests/fuzz/cases/): a control byte inside a line
// or a value is quoted as \xNN (the error stays one line on a terminal), and a seed that is not
// a number is an input error, not std::invalid_argument.
TEST(Manifest, DamagedTextIsOneQuotedLine) {
  test::TempDir dir;
  const std::string path = checkpoint_path(dir.path().string(), 20);
  const auto edit = [&](const std::string& from, const std::string& to) {
    write_run(path, 20);
    std::string text = read_text(manifest_path(path));
    text.replace(text.find(from), from.size(), to);
    std::ofstream(manifest_path(path)) << text;
  };
  edit("strata-checkpoint", "strata-che\rkpoint");
  test::expect_input_error([&] { CheckpointReader r(path); }, {"malformed line 'strata-che\\x0dkpoint"});
  edit("\nseed 3", "\nseed 3\x1c");
  test::expect_input_error([&] { CheckpointReader r(path); }, {"'seed' is not a number (found '3\\x1c')"});
  for (const std::string seed : {"x3", "-3", "99999999999999999999"}) {
    edit("\nseed 3", "\nseed " + seed);
    test::expect_input_error([&] { CheckpointReader r(path); }, {"'seed' is not a number (found '" + seed + "')"});
  }
}

// A checkpoint from before manifests loads (with a note); its position is still range- and
// name-checked: step 7 in the step-20 file, a negative or NaN step, epoch 2^62.
TEST(Manifest, MissingManifestLoadsAsOlderFormat) {
  test::TempDir dir;
  const std::string path = checkpoint_path(dir.path().string(), 20);
  write_run(path, 20);
  fs::remove(manifest_path(path));
  EXPECT_FALSE(check_manifest(path).has_value());
  {
    CheckpointReader r(path);
    EXPECT_FALSE(r.has_manifest());
    EXPECT_EQ(read_run_state(r).step, 20);
    Tensor t = Tensor::empty({3, 4});
    r.read_tensor("model/fc/weight", t);
    EXPECT_EQ(t.data<float>()[1], 20.5f);
  }
  set_root_attr(path, "step", int64_t{7});
  test::expect_input_error([&] { CheckpointReader r(path); }, {"holds step 7 but its name says step 20"});
  // The range checks, on a copy whose name says no step.
  const std::string copy = dir / "copy.h5";
  fs::copy_file(path, copy);
  set_root_attr(copy, "step", int64_t{-5});
  test::expect_input_error([&] { CheckpointReader r(copy); }, {"impossible position: step -5"});
  set_root_attr(copy, "step", std::nan(""));
  test::expect_input_error([&] { CheckpointReader r(copy); }, {"attribute 'step' is not an integer (found nan)"});
  set_root_attr(copy, "step", int64_t{20});
  set_root_attr(copy, "epoch", int64_t{1} << 62);
  test::expect_input_error([&] { CheckpointReader r(copy); },
                           {"impossible position: step 20, epoch 4611686018427387904"});
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
  test::expect_input_error([&] { CheckpointReader r(path); }, {"c.h5", "is corrupt: whole-file crc32"});
  fs::remove(manifest_path(path));  // as a file from before manifests: the tensor's crc32 sees it
  test::expect_input_error([&] { CheckpointReader(path).read_tensor("model/w", out); },
                           {"c.h5", "model/w", "corrupt", "crc32"});
}

// read_part: each tp shard's ranges of a stored tensor, read as hyperslabs, equal the same
// elements cut from the whole tensor; a file without a manifest is read whole (its crc32
// checked) and cut, so damage is still seen.
TEST(Checkpoint, ReadPartIsTheShardsElements) {
  test::TempDir dir;
  const std::string path = dir / "p.h5";
  const Tensor full = arange({6, 8}, 1.0f);
  {
    CheckpointWriter w(path);
    w.write_tensor("model/w", full);
    w.commit();
  }
  const auto expect_parts = [&](const CheckpointReader& r) {
    for (const layers::TensorSplit split :
         {layers::TensorSplit{}, layers::TensorSplit{2, 1, 1, 1}, layers::TensorSplit{2, 0, 0, 3}}) {
      Shape local = {6, 8};
      local[static_cast<size_t>(split.dim)] /= split.parts;
      const Tensor shard = Tensor::empty(local);
      layers::take_shard(full, split, shard);
      for (const auto& [begin, end] : {std::pair<int64_t, int64_t>{0, shard.numel()}, {5, 19}, {7, 8}, {3, 3}}) {
        const Tensor part = Tensor::empty({end - begin});
        r.read_part("model/w", local, split, begin, end, part);
        for (int64_t i = 0; i < end - begin; ++i)
          ASSERT_EQ(part.data<float>()[i], shard.data<float>()[begin + i])
              << "split " << split.parts << "/" << split.dim << " [" << begin << ", " << end << ") element " << i;
      }
    }
  };
  expect_parts(CheckpointReader(path));
  fs::remove(manifest_path(path));  // as a file from before manifests
  expect_parts(CheckpointReader(path));
  {  // flip one value: without a manifest the part's read sees it through the tensor's crc32
    h5::File f(H5Fopen(path.c_str(), H5F_ACC_RDWR, H5P_DEFAULT));
    h5::DataSet ds(H5Dopen2(f, "model/w", H5P_DEFAULT));
    Tensor t = arange({6, 8}, 1.0f);
    t.data<float>()[40] += 1.0f;
    ASSERT_GE(H5Dwrite(ds, H5T_NATIVE_FLOAT, H5S_ALL, H5S_ALL, H5P_DEFAULT, t.raw()), 0);
  }
  const Tensor two = Tensor::empty({2});
  test::expect_input_error(
      [&] {
        CheckpointReader(path).read_part("model/w", {6, 8}, {}, 0, 2, two);
      },
      {"p.h5", "model/w", "corrupt", "crc32"});
  test::expect_input_error(
      [&] {
        CheckpointReader(path).read_part("model/w", {6, 4}, {}, 0, 2, two);
      },
      {"model/w", "[6, 8]", "expects [6, 4]"});
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

// A checkpoint directory: `latest` names the newest, pruning removes only this job's older
// files (with their manifests), and the newest valid checkpoint skips a truncated file, a
// corrupt one and one whose run state does not read for the one before them.
TEST(CheckpointDir, LatestKeepAndNewest) {
  test::TempDir dir;
  const std::string d = dir.path().string();
  EXPECT_EQ(newest_checkpoint(d), "");
  write_run(checkpoint_path(d, 5), 5);  // an earlier job's: not this one's to delete
  std::vector<std::string> written;
  for (int64_t step : {10, 20, 30, 40, 50}) {
    const std::string path = checkpoint_path(d, step);
    write_run(path, step);
    update_latest(d, path);
    written.push_back(path);
    prune_checkpoints(written, 4);
  }
  EXPECT_FALSE(fs::exists(dir / "latest.tmp"));
  std::string latest;
  std::ifstream(dir / "latest") >> latest;
  EXPECT_EQ(latest, "step-00000050.h5");
  EXPECT_EQ(written, (std::vector<std::string>{checkpoint_path(d, 20), checkpoint_path(d, 30), checkpoint_path(d, 40),
                                               checkpoint_path(d, 50)}));
  EXPECT_FALSE(fs::exists(checkpoint_path(d, 10)));
  EXPECT_FALSE(fs::exists(manifest_path(checkpoint_path(d, 10))));
  EXPECT_TRUE(fs::exists(checkpoint_path(d, 5)));
  EXPECT_EQ(newest_checkpoint(d), checkpoint_path(d, 50));
  // Truncate the newest (named by latest), corrupt the next, give the third an empty string
  // attribute (resealed, so only the run state's read fails): the fourth is chosen.
  fs::resize_file(checkpoint_path(d, 50), fs::file_size(checkpoint_path(d, 50)) / 2);
  {
    h5::File f(H5Fopen(checkpoint_path(d, 40).c_str(), H5F_ACC_RDWR, H5P_DEFAULT));
    h5::DataSet ds(H5Dopen2(f, "model/fc/weight", H5P_DEFAULT));
    Tensor t = arange({3, 4}, 1.0f);
    ASSERT_GE(H5Dwrite(ds, H5T_NATIVE_FLOAT, H5S_ALL, H5S_ALL, H5P_DEFAULT, t.raw()), 0);
  }
  {
    h5::File f(H5Fopen(checkpoint_path(d, 30).c_str(), H5F_ACC_RDWR, H5P_DEFAULT));
    H5Adelete(f, "optimizer_step");
  }
  reseal(checkpoint_path(d, 30));
  EXPECT_EQ(newest_checkpoint(d), checkpoint_path(d, 20));
  prune_checkpoints(written, 0);  // keep 0: nothing removed
  EXPECT_EQ(written.size(), 4u);
}

// One job per directory: a second lock (even in this process: flock is per open file) is an
// Input error naming the holder; once the holder is gone the lock is free again.
TEST(CheckpointDir, DirectoryLock) {
  test::TempDir dir;
  const std::string d = dir.path().string();
  ::setenv("SLURM_JOB_ID", "4242", 1);
  {
    DirectoryLock held(d);
    ::unsetenv("SLURM_JOB_ID");
    EXPECT_NE(read_text(dir / ".lock").find("pid " + std::to_string(::getpid()) + " slurm_job 4242"), std::string::npos)
        << read_text(dir / ".lock");
    test::expect_input_error([&] { DirectoryLock second(d); }, {"--checkpoint-dir " + d + " is in use by another job",
                                                                "pid " + std::to_string(::getpid())});
  }
  EXPECT_NO_THROW(DirectoryLock again(d));
}

// A full disk while saving, emulated by a file-size limit: an error that says which file, no
// `.tmp` left behind, and `latest` still naming the previous checkpoint.
TEST(CheckpointDir, FullDiskKeepsThePreviousCheckpoint) {
  test::TempDir dir;
  const std::string d = dir.path().string();
  write_run(checkpoint_path(d, 1), 1);
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
  EXPECT_FALSE(fs::exists(manifest_path(checkpoint_path(d, 2))));
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
