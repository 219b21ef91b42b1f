// ParallelCheckpointFile under mpiexec (2 and 4 ranks): every rank writes its part of tensors cut
// the ways a training layout cuts them (tensor-parallel shards with segments, ZeRO ranges, both,
// one owner), rank 0 finishes the file as CheckpointWriter does, and CheckpointReader reads back
// the full tensors with their crc32 checked, written at once or deferred (--async-save: the
// values copied at write(), written by each rank's own thread). Parts that leave a gap are an error that leaves no
// file behind. (A full disk is tested through `train`, cases_parallel_io.py: after a failed
// collective write the file cannot be closed, and the job ends.)
#include <gtest/gtest.h>
#include <mpi.h>
#include <unistd.h>

#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include "core/error.hpp"
#include "io/checkpoint/directory.hpp"
#include "io/checkpoint/file.hpp"
#include "io/checkpoint/parallel_file.hpp"
#include "parallel/runtime/mpi.hpp"

namespace strata::io {
namespace {

namespace fs = std::filesystem;

// Tensor t's full value: t * 1000 + i at flat index i (exact in f32).
Tensor full_value(int t, const Shape& shape) {
  Tensor v = Tensor::empty(shape);
  for (int64_t i = 0; i < v.numel(); ++i) v.data<float>()[i] = static_cast<float>(t * 1000 + i);
  return v;
}

// How a tensor is cut: the shard this rank holds (split.index) and the element range of it that
// it writes.
struct Cut {
  std::string name;
  Shape full;
  layers::TensorSplit split;  // index set per rank
  int64_t begin = 0, end = 0;
};

class ParallelCheckpoint : public testing::Test {
 protected:
  void SetUp() override {
    if (!ParallelCheckpointFile::available()) GTEST_SKIP() << "this build's HDF5 is serial";
    MPI_Comm_rank(MPI_COMM_WORLD, &rank_);
    MPI_Comm_size(MPI_COMM_WORLD, &size_);
    long long pid = rank_ == 0 ? static_cast<long long>(getpid()) : 0;
    MPI_Bcast(&pid, 1, MPI_LONG_LONG, 0, MPI_COMM_WORLD);
    dir_ = fs::temp_directory_path() / ("strata-parallel-checkpoint-" + std::to_string(pid));
    if (rank_ == 0) fs::create_directories(dir_);
    MPI_Barrier(MPI_COMM_WORLD);
  }
  void TearDown() override {
    MPI_Barrier(MPI_COMM_WORLD);
    if (rank_ == 0) fs::remove_all(dir_);
  }

  // This rank's cuts of five tensors: a tp shard per rank (dim 1); a tp shard of 3 segments (q|k|v,
  // dim 0); a ZeRO range of an unsplit tensor; tp 2 x ZeRO over the other ranks; rank 0 alone.
  std::vector<Cut> cuts() const {
    std::vector<Cut> c;
    const int tp = 2, replicas = size_ / 2, tp_rank = rank_ % tp, replica = rank_ / tp;
    c.push_back({"model/h0/w", {6, 8}, {size_, rank_, 1, 1}, 0, 6 * 8 / size_});
    c.push_back({"model/h0/qkv", {12, 4}, {size_, rank_, 0, 3}, 0, 12 * 4 / size_});
    c.push_back({"optimizer/exp_avg/h0/w", {5, 7}, {}, 35 * rank_ / size_, 35 * (rank_ + 1) / size_});
    c.push_back({"optimizer/exp_avg/h0/qkv",
                 {8, 6},
                 {tp, tp_rank, 0, 1},
                 24 * replica / replicas,
                 24 * (replica + 1) / replicas});
    c.push_back({"model/ln/bias", {3}, {}, 0, rank_ == 0 ? 3 : 0});
    return c;
  }

  // Writes the cuts into DIR/step-00000001.h5 (all but rank `skip`'s part of tensor 2);
  // `deferred`: as --async-save does, each rank's values from a thread of its own after the
  // tensors exist, the shards they were copied from overwritten first.
  ParallelCheckpointFile::Written write_all(const std::string& path, int skip = -1, bool deferred = false) {
    ParallelCheckpointFile file(path, MPI_COMM_WORLD, deferred);
    std::vector<Tensor> shards;
    int t = 0;
    for (Cut& cut : cuts()) {
      const Tensor full = full_value(t, cut.full);
      Shape local = cut.full;
      if (cut.split.split()) local[static_cast<size_t>(cut.split.dim)] /= cut.split.parts;
      const Tensor shard = Tensor::empty(local);
      layers::take_shard(full, cut.split, shard);
      if (rank_ == skip && t == 2) cut.end = cut.begin;
      const int64_t n = cut.end - cut.begin;
      file.write(cut.name, local, cut.split, cut.begin, cut.end, n > 0 ? shard.view(cut.begin, {n}) : Tensor());
      shards.push_back(shard);
      ++t;
    }
    if (!deferred) return file.close();
    file.close_metadata();
    for (const Tensor& shard : shards) shard.fill_zero();  // training moved on: the file must have the copies
    std::thread writer([&] { file.write_deferred(); });
    writer.join();
    return file.close();
  }

  int rank_ = 0, size_ = 1;
  fs::path dir_;
};

class EitherWay : public ParallelCheckpoint, public testing::WithParamInterface<bool> {};

TEST_P(EitherWay, EveryRanksPartsMakeTheFullTensorsWithTheirCrc32) {
  const std::string path = checkpoint_path(dir_.string(), 1);
  const ParallelCheckpointFile::Written written = write_all(path, -1, /*deferred=*/GetParam());
  EXPECT_EQ(written.bytes, (48 + 48 + 35 + 48 + 3) * 4);
  if (rank_ == 0) {
    ASSERT_EQ(written.crc32.size(), 5u);
    CheckpointWriter writer(path, CheckpointWriter::Reopen{});
    for (const auto& [name, crc] : written.crc32) writer.set_crc32(name, crc);
    writer.set_position({1, 0, 1, 7});
    writer.commit();
  }
  MPI_Barrier(MPI_COMM_WORLD);
  EXPECT_FALSE(fs::exists(path + ".tmp"));
  // Every rank reads every tensor whole: the values, and the crc32 (read_tensor checks it).
  const CheckpointReader reader(path);
  int t = 0;
  for (const Cut& cut : cuts()) {
    const Tensor expected = full_value(t++, cut.full);
    ASSERT_EQ(shape_str(reader.shape(cut.name)), shape_str(cut.full)) << cut.name;
    const Tensor got = Tensor::empty(cut.full);
    reader.read_tensor(cut.name, got);
    for (int64_t i = 0; i < got.numel(); ++i)
      ASSERT_EQ(got.data<float>()[i], expected.data<float>()[i]) << cut.name << " element " << i;
  }
  EXPECT_EQ(reader.attr_int("format_version"), kCheckpointFormatVersion);
  EXPECT_EQ(reader.attr_int("step"), 1);
}

INSTANTIATE_TEST_SUITE_P(AtOnceOrDeferred, EitherWay, testing::Bool());

// A deep directory (a path of 300+ characters, as on a project filesystem): Open MPI's
// `lockedfile` component overflows a buffer with such a name when MPI-IO opens the file (an
// abort), so the runtime leaves it out (parallel::MpiRuntime).
TEST_F(ParallelCheckpoint, APathOfThreeHundredCharacters) {
  fs::path deep = dir_;
  for (int i = 0; i < 6; ++i) deep /= std::string(50, static_cast<char>('a' + i));
  if (rank_ == 0) fs::create_directories(deep);
  MPI_Barrier(MPI_COMM_WORLD);
  const std::string path = checkpoint_path(deep.string(), 4);
  ASSERT_GT(path.size(), 300u);
  const ParallelCheckpointFile::Written written = write_all(path);
  EXPECT_EQ(written.crc32.size(), rank_ == 0 ? 5u : 0u);
  MPI_Barrier(MPI_COMM_WORLD);
  if (rank_ == 0) fs::remove(path + ".tmp");
}

// One rank leaves out its part of a tensor: rank 0's close() says which tensor has a gap, and
// the destructor removes the temporary file.
TEST_F(ParallelCheckpoint, AGapIsAnErrorAndLeavesNoFile) {
  const std::string path = checkpoint_path(dir_.string(), 2);
  if (rank_ == 0) {
    try {
      write_all(path, size_ - 1);
      ADD_FAILURE() << "no error for a gap";
    } catch (const Error& e) {
      EXPECT_NE(e.message().find("'optimizer/exp_avg/h0/w'"), std::string::npos) << e.message();
      EXPECT_NE(e.message().find("leave a gap"), std::string::npos) << e.message();
    }
  } else {
    EXPECT_NO_THROW(write_all(path, size_ - 1));
  }
  MPI_Barrier(MPI_COMM_WORLD);
  EXPECT_FALSE(fs::exists(path + ".tmp"));
  EXPECT_FALSE(fs::exists(path));
}

}  // namespace
}  // namespace strata::io
