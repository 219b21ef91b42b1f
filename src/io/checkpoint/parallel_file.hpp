// ParallelCheckpointFile: the tensors of a checkpoint written by every rank at once, each its own
// part, into one file (parallel HDF5 over MPI-IO: --checkpoint-io parallel). The file is the
// format CheckpointWriter writes: the same full tensors under the same names, contiguous, f32,
// each with the crc32 of its whole bytes. Each rank hands over, tensor by tensor and in the same
// order on every rank, which elements of its tensor-parallel shard it owns (a ZeRO shard's
// overlap, or all of it; replicas nothing) and their values; HDF5 writes them collectively into
// their hyperslabs of the full tensor. Each rank checksums its runs, and rank 0 combines them
// into each tensor's crc32 (zlib's crc32_combine, in the full tensor's order) after checking
// that the parts cover every element exactly once. Rank 0 then finishes the file as any other
// (CheckpointWriter's Reopen: crc32 and root attributes, fsync, manifest, rename), so a crash
// before that leaves PATH.tmp, never a PATH that is not whole. Deferred (--async-save), the
// collective part creates the tensors at the save step and each rank writes its values into
// their places from a thread of its own while training goes on (no MPI on that thread: the MPI
// thread level stays FUNNELED).
#pragma once

#include <mpi.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "core/tensor.hpp"
#include "io/hdf5.hpp"
#include "layers/tensor_parallel.hpp"

namespace strata::io {

class ParallelCheckpointFile {
 public:
  // Whether this build's HDF5 does parallel I/O (Debian's libhdf5-openmpi-dev; CMake prefers it).
  static bool available();

  // Collective over `comm`: creates PATH.tmp (replacing a stale one) with the MPI-IO driver.
  // Errors are agreed: every rank throws alike (parallel::agree), so none is left waiting.
  // `deferred`: write() creates each tensor and keeps a copy of this rank's part; the values
  // reach the file later, through write_deferred() (in the background: no MPI, no HDF5).
  ParallelCheckpointFile(std::string path, MPI_Comm comm, bool deferred = false);
  // Closes the file if it is still open (collectively: every rank gets here alike, errors being
  // agreed) and, on rank 0, removes PATH.tmp unless close() has run.
  ~ParallelCheckpointFile();
  ParallelCheckpointFile(const ParallelCheckpointFile&) = delete;
  ParallelCheckpointFile& operator=(const ParallelCheckpointFile&) = delete;

  // Collective: creates f32 tensor `name` of the full shape of a shard `local` split as `split`,
  // and writes this rank's part of it: elements [begin, end) of the shard, whose values `part`
  // holds (host f32, end - begin elements; undefined when begin == end: this rank writes none).
  void write(const std::string& name, const Shape& local, const layers::TensorSplit& split, int64_t begin, int64_t end,
             const Tensor& part);

  struct Written {
    std::vector<std::pair<std::string, uint32_t>> crc32;  // rank 0: every tensor's, in write order
    int64_t bytes = 0;                                    // the tensors' bytes
  };
  // Deferred, collective: closes HDF5's side of the file. Every tensor has its place in it (a
  // parallel HDF5 allocates contiguous datasets at creation) and none of its values yet.
  void close_metadata();
  // Deferred, after close_metadata(), on any one thread: writes the kept parts into their places
  // with pwrite, checksums them and syncs them to the disk; the copies go back to the allocator.
  void write_deferred();

  // Collective: closes the file and syncs every rank's writes to the disk (fsync); rank
  // 0 gets each tensor's crc32 (an internal error when the ranks' parts leave a gap or overlap).
  // Deferred: after write_deferred() on every rank. PATH.tmp stays for rank 0 to finish
  // (CheckpointWriter::Reopen).
  Written close();

  const std::string& path() const { return path_; }

 private:
  // Runs `step` on every rank and agrees on its outcome. On a failure anywhere (a full disk), the
  // file is abandoned: rank 0 removes PATH.tmp, then every rank throws. It is not closed: after a
  // failed collective write the ranks' metadata caches disagree, and the collective close would
  // wait forever (seen with Open MPI's OMPIO on 4 ranks); the job ends on the error anyway.
  void collective(const std::function<void()>& step);

  struct Run {  // a contiguous run of one tensor in the full tensor's order, in bytes
    int64_t tensor, offset, length, crc32;
  };
  struct Kept {  // deferred: a part's values and where in the file each of its runs goes
    Tensor values;
    std::vector<std::pair<int64_t, int64_t>> at;  // (file offset, bytes), in the part's order
  };

  std::string path_, tmp_path_;
  MPI_Comm comm_;
  int rank_ = 0;  // in comm_ (asked once: the destructor may run on a writing thread, without MPI)
  bool deferred_;
  h5::File file_;
  std::vector<std::pair<std::string, int64_t>> tensors_;  // name, bytes
  std::vector<Run> runs_;                                 // this rank's (deferred: crc32 set by write_deferred)
  std::vector<Kept> kept_;                                // deferred: this rank's parts, in runs_' order
  bool closed_ = false;
};

}  // namespace strata::io
