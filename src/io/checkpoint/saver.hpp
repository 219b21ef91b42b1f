// CheckpointSaver: the writing side of a training checkpoint (rank 0's), synchronous or on a
// background thread (--async-save). A save is begin(step), add() for each tensor, finish(): the
// file is committed (CheckpointWriter: tmp, fsync, rename), `latest` points at it, the job's
// older checkpoints are pruned to --keep, and one line is logged:
//   saved checkpoint DIR/step-NNNNNNNN.h5 (12.30 MiB in 0.04 s)
// (async: "..., written in the background: training held 0.002 s", the stall of the step).
// Async: add() keeps the tensors it is given (StateGather hands over fresh ones, so nothing is
// copied: rank 0 holds the whole state in host memory until the write ends) and finish() hands
// them to a background thread and returns; training goes on while it writes. The next begin(),
// wait() and the destructor wait for that write (deadline: `timeout_s`) and rethrow its error,
// so a checkpoint is `latest` only once complete and no write is lost at the end.
#pragma once

#include <cstdint>
#include <functional>
#include <future>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "core/tensor.hpp"
#include "io/checkpoint/file.hpp"
#include "io/checkpoint/parallel_file.hpp"

namespace strata::io {

class CheckpointSaver {
 public:
  // Root attributes (the run state), written after the tensors.
  using Attributes = std::function<void(CheckpointWriter&)>;

  CheckpointSaver(std::string dir, int64_t keep, bool async, double timeout_s);
  // Waits for a write in flight (errors are logged, not thrown: it runs during unwinding too).
  ~CheckpointSaver();
  CheckpointSaver(const CheckpointSaver&) = delete;
  CheckpointSaver& operator=(const CheckpointSaver&) = delete;

  // Starts the checkpoint of `step` (DIR/step-NNNNNNNN.h5), after the previous write is done.
  // `in_parallel`: every rank writes its tensors (ParallelCheckpointFile, into the same
  // PATH.tmp) and finish_parallel() completes it.
  void begin(int64_t step, bool in_parallel = false);
  // Stores `t` (host) under `name`: written now, or kept for the background write.
  void add(const std::string& name, const Tensor& t);
  // Writes `attributes` and commits: now (`wait`, or not async), or on the background thread.
  void finish(Attributes attributes, bool wait = false);
  // After ParallelCheckpointFile::close(): the tensors' crc32s and `attributes`, then commit,
  // as finish().
  void finish_parallel(const ParallelCheckpointFile::Written& written, Attributes attributes, bool wait = false);
  // Training goes on from now while the ranks write their parts (a background parallel save):
  // the stall the save's line reports ends here rather than at finish.
  void handed_over();
  // Until the write in flight (if any) is complete; rethrows its error. An error after
  // `timeout_s` (the write goes on: a later wait() may still see it end).
  void wait();

  bool async() const { return async_; }

 private:
  // One checkpoint: what is written, and the job's checkpoints so far (for --keep).
  struct Save {
    std::string dir, path;
    std::vector<std::pair<std::string, Tensor>> tensors;  // async: kept until written
    std::unique_ptr<CheckpointWriter> writer;             // sync: open from begin()
    bool in_parallel = false;                             // the tensors are in PATH.tmp already
    std::vector<std::pair<std::string, uint32_t>> crc32;  // their checksums (in_parallel)
    int64_t bytes = 0;
    double started = 0, handed_over = 0;  // seconds on the steady clock: begin(), finish()
  };
  // Commits `save` (writing its kept tensors first), moves `latest`, prunes, logs.
  static void complete(Save& save, const Attributes& attributes, std::vector<std::string>& written, int64_t keep,
                       bool background);

  std::string dir_;
  int64_t keep_;
  bool async_;
  double timeout_s_;
  std::unique_ptr<Save> save_;                         // between begin() and finish()
  std::shared_ptr<std::vector<std::string>> written_;  // this job's checkpoints, oldest first
  std::future<void> in_flight_;                        // the background write's outcome
  std::thread thread_;
};

}  // namespace strata::io
