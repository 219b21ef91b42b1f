// The shared-filesystem checks under mpiexec. One machine has one filesystem, so a node that
// does not share it is what it looks like to the code: the same path naming other storage.
// Here each rank is given its own directory (or file) where a cluster would show one path.
#include <gtest/gtest.h>
#include <mpi.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "core/error.hpp"
#include "io/shared_files.hpp"

namespace strata::io {
namespace {

namespace fs = std::filesystem;

class SharedFiles : public testing::Test {
 protected:
  void SetUp() override {
    MPI_Comm_rank(MPI_COMM_WORLD, &rank_);
    MPI_Comm_size(MPI_COMM_WORLD, &size_);
    // One scratch directory for the job (rank 0's pid), made before anyone uses it.
    long long pid = rank_ == 0 ? static_cast<long long>(getpid()) : 0;
    MPI_Bcast(&pid, 1, MPI_LONG_LONG, 0, MPI_COMM_WORLD);
    root_ = fs::temp_directory_path() / ("strata-shared-files-" + std::to_string(pid));
    if (rank_ == 0) fs::create_directories(root_);
    MPI_Barrier(MPI_COMM_WORLD);
  }
  void TearDown() override {
    MPI_Barrier(MPI_COMM_WORLD);
    if (rank_ == 0) fs::remove_all(root_);
  }
  static void write(const fs::path& path, const std::string& bytes) {
    fs::create_directories(path.parent_path());
    std::ofstream(path, std::ios::binary) << bytes;
  }
  // The Input error every rank must throw, or a failure.
  template <typename F>
  static std::string error_of(F f) {
    try {
      f();
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::Input) << e.what();
      return e.message();
    }
    ADD_FAILURE() << "no error";
    return "";
  }
  int rank_ = 0, size_ = 1;
  fs::path root_;
};

TEST_F(SharedFiles, OneDirectoryPassesAndLeavesNothing) {
  const fs::path dir = root_ / "ck";
  if (rank_ == 0) fs::create_directories(dir);
  require_shared_directory(MPI_COMM_WORLD, dir.string(), "--checkpoint-dir");
  MPI_Barrier(MPI_COMM_WORLD);
  EXPECT_TRUE(fs::is_empty(dir));  // the probe is gone
}

TEST_F(SharedFiles, RanksWithTheirOwnDirectoryAreNamed) {
  // Odd ranks see a directory of their own: the probe rank 0 wrote is not there.
  const fs::path dir = rank_ % 2 == 0 ? root_ / "ck" : root_ / ("local-" + std::to_string(rank_));
  fs::create_directories(dir);
  const std::string message =
      error_of([&] { require_shared_directory(MPI_COMM_WORLD, dir.string(), "--checkpoint-dir"); });
  EXPECT_NE(message.find("--checkpoint-dir '"), std::string::npos) << message;
  if (size_ == 2) {
    EXPECT_NE(message.find(": rank 1 (host "), std::string::npos) << message;
    EXPECT_NE(message.find("does not see what rank 0 sees: no probe file .strata-probe-"), std::string::npos)
        << message;
  } else {
    EXPECT_NE(message.find(": ranks 1 (host "), std::string::npos) << message;
    EXPECT_NE(message.find("), 3 (host "), std::string::npos) << message;
    EXPECT_NE(message.find("do not see what rank 0 sees; rank 1: no probe file .strata-probe-"), std::string::npos)
        << message;
  }
  EXPECT_NE(message.find("a filesystem every node mounts"), std::string::npos) << message;
  EXPECT_TRUE(fs::is_empty(root_ / "ck"));
}

TEST_F(SharedFiles, SameDataOrIdenticalCopiesPass) {
  const std::string bytes(200000, 'x');
  if (rank_ == 0) write(root_ / "data" / "a.h5", bytes);
  if (rank_ == 0) write(root_ / "data" / "b.h5", "small");
  MPI_Barrier(MPI_COMM_WORLD);
  require_same_files(MPI_COMM_WORLD, (root_ / "data").string(), "--data");
  // Each rank with its own identical copy at the same relative place: fine.
  const fs::path copy = root_ / ("copy-" + std::to_string(rank_));
  write(copy / "a.h5", bytes);
  write(copy / "b.h5", "small");
  // The same path on every node means the same string: give each rank its copy through cwd.
  const fs::path before = fs::current_path();
  fs::current_path(copy);
  require_same_files(MPI_COMM_WORLD, ".", "--data");
  fs::current_path(before);
}

TEST_F(SharedFiles, DifferentOrMissingDataIsNamed) {
  std::string bytes(200000, 'x');
  const fs::path mine = root_ / ("copy-" + std::to_string(rank_));
  if (rank_ == 1) bytes[199999] = 'y';  // same size, the last byte differs
  write(mine / "a.h5", bytes);
  const fs::path before = fs::current_path();
  fs::current_path(mine);
  std::string message = error_of([&] { require_same_files(MPI_COMM_WORLD, "a.h5", "--data"); });
  EXPECT_NE(message.find("--data 'a.h5': rank 1 (host "), std::string::npos) << message;
  EXPECT_NE(message.find("sees: 'a.h5' has other bytes than rank 0's; every node needs"), std::string::npos) << message;
  if (rank_ == size_ - 1) fs::remove(mine / "a.h5");
  if (rank_ == 1 && size_ > 2) write(mine / "a.h5", std::string(200000, 'x'));
  message = error_of([&] { require_same_files(MPI_COMM_WORLD, "a.h5", "--data"); });
  const int missing = size_ - 1;
  EXPECT_NE(message.find("rank " + std::to_string(missing) + " (host "), std::string::npos) << message;
  if (size_ > 2) {
    EXPECT_EQ(message.find("rank 1 (host "), std::string::npos) << message;  // rank 1 is fine again
  }
  EXPECT_NE(message.find("does not exist"), std::string::npos) << message;
  fs::current_path(before);
}

TEST_F(SharedFiles, EverySizeAndASampleOfBytesAreCompared) {
  // Ten shards: rank 1's shard 5 (not sampled) is one byte longer, then its shard 9 (the last,
  // sampled) has another last byte: both are seen. Only sizes are read of shard 5.
  const fs::path mine = root_ / ("shards-" + std::to_string(rank_));
  const auto write_shards = [&](int odd_size, int odd_bytes) {
    for (int k = 0; k < 10; ++k) {
      std::string bytes(1000 + k, 'a' + k);
      if (rank_ == 1 && k == odd_size) bytes += 'x';
      if (rank_ == 1 && k == odd_bytes) bytes.back() = 'z';
      write(mine / ("part-" + std::to_string(k) + ".h5"), bytes);
    }
  };
  write_shards(5, -1);
  const fs::path before = fs::current_path();
  fs::current_path(mine);  // "." is each rank's own copy, as on its node
  std::string message = error_of([&] { require_same_files(MPI_COMM_WORLD, ".", "--data"); });
  EXPECT_NE(message.find("'./part-5.h5' has 1006 bytes, rank 0's 1005"), std::string::npos) << message;
  write_shards(-1, 9);
  message = error_of([&] { require_same_files(MPI_COMM_WORLD, ".", "--data"); });
  EXPECT_NE(message.find("'./part-9.h5' has other bytes than rank 0's"), std::string::npos) << message;
  write_shards(-1, -1);
  require_same_files(MPI_COMM_WORLD, ".", "--data");
  fs::current_path(before);
}

}  // namespace
}  // namespace strata::io
