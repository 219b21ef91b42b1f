// CheckpointManager: the one owner of a run's checkpoints, which the trainer only hands its state
// to (torchtitan's CheckpointManager and Stateful). It holds rank 0's lock on --checkpoint-dir
// and its CheckpointSaver, decides how a save is written (rank 0 alone, possibly in the
// background, or every rank its part: --checkpoint-io) and when (--save-every, the end, a stop
// signal), opens --init-from, picks the checkpoint --resume continues from (auto: the newest
// complete one) and checks its run state against this run before anything is loaded.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "io/checkpoint/file.hpp"
#include "io/checkpoint/lock.hpp"
#include "io/checkpoint/run_state.hpp"
#include "io/checkpoint/saver.hpp"
#include "parallel/runtime/process_grid.hpp"
#include "parallel/stage/state_gather.hpp"

namespace strata::io {

// The configuration's checkpoint section.
struct CheckpointSettings {
  std::string dir;              // --checkpoint-dir ("": no checkpoints are written)
  int64_t save_every = 0;       // steps between saves (0: only at the end and at a stop)
  int64_t keep = 0;             // step files kept (0: all)
  bool async = false;           // rank 0 writes in the background
  std::string io = "auto";      // rank0 | parallel | auto
  std::string init_from;        // a checkpoint whose model starts the run
  std::string resume = "none";  // none | auto | PATH
  bool read_only = false;       // --eval-only: nothing is written
};

// --checkpoint-io resolved: whether every rank writes its own part of a checkpoint (parallel,
// or auto where this build's HDF5 is parallel) rather than rank 0 all of it.
bool writes_in_parallel(const CheckpointSettings& settings);

// What a resumed run state must agree with.
struct ResumeExpectations {
  std::string optimizer;     // the same optimizer (its state is loaded)
  int64_t global_batch = 0;  // another one makes the data position approximate (a warning)
  int64_t samples = 0;       // training samples (0: no --data)
  int64_t total_steps = -1;  // this run's steps (-1: not training)
};

class CheckpointManager {
 public:
  ~CheckpointManager();
  // Collective over the grid's world: rank 0 locks and checks the directory, every rank checks
  // that it sees rank 0's files; --init-from is checked whole by rank 0 and opened by every rank.
  CheckpointManager(const CheckpointSettings& settings, parallel::ProcessGrid& grid);

  // The classes --init-from's model was trained for (0: not recorded, or no --init-from).
  int64_t init_from_classes() const;
  // Collective: loads --init-from's model tensors into `state` (each rank its own parts).
  void load_init_from(parallel::StateGather& state);
  // Collective: --resume's run state, its model and optimizer state loaded into `state`, or
  // nothing (--resume none, or auto with no complete checkpoint). An Input error on every rank
  // when the state does not fit `expected`. The data position is in this run's batches.
  std::optional<RunState> resume(parallel::StateGather& state, const ResumeExpectations& expected);

  bool writes() const { return !settings_.dir.empty() && !settings_.read_only; }
  // Collective: saves when step `done` of `total` is due (--save-every, not the last step).
  void save_if_due(int64_t done, int64_t total, const std::function<RunState()>& run, parallel::StateGather& state);
  // Collective: the full training state (StateGather) goes to rank 0's CheckpointSaver, which
  // commits it, moves `latest` and applies --keep; with --async-save in the background unless
  // `wait` (a stop signal, the end of training). With --checkpoint-io parallel every rank writes
  // its own part of the file instead and rank 0 finishes it (with --async-save: each rank keeps
  // a copy of its part and writes it on a thread of its own; poll() finishes the file once all
  // have). A save first finishes the one in flight.
  void save(const RunState& run, parallel::StateGather& state, bool wait);
  // Collective, at a step boundary: finishes a background parallel save once every rank has
  // written its part (one small all-reduce per step while one is in flight; none otherwise).
  void poll();

 private:
  // A parallel save whose ranks write their parts in the background (--async-save).
  struct Pending;
  // Collective: waits (deadline: kCheckpointTimeoutS) for every rank's part of the pending save,
  // then finishes it (rank 0's saver commits it, in its background thread).
  void finish_pending();
  // One line on stdout when a checkpoint has no manifest (docs/checkpoints.md).
  void note_unchecked(const CheckpointReader& reader) const;
  RunState load(const std::string& path, parallel::StateGather& state, const ResumeExpectations& expected);

  CheckpointSettings settings_;
  parallel::ProcessGrid& grid_;
  int rank_ = 0;
  // Rank 0's lock, held for the run, and its writer (after the lock: destroyed first, once its
  // last write is done).
  std::unique_ptr<DirectoryLock> lock_;
  std::unique_ptr<CheckpointSaver> saver_;
  bool parallel_io_ = false;  // --checkpoint-io, resolved
  std::unique_ptr<CheckpointReader> init_from_;
  std::unique_ptr<Pending> pending_;  // destroyed first: its thread may still use the file
};

}  // namespace strata::io
