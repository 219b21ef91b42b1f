#include "io/checkpoint/manager.hpp"

#include <chrono>
#include <future>
#include <optional>
#include <thread>
#include <vector>

#include "core/log.hpp"
#include "core/trace.hpp"
#include "io/checkpoint/directory.hpp"
#include "io/checkpoint/parallel_file.hpp"
#include "io/shared_files.hpp"
#include "layers/parameter_store.hpp"
#include "parallel/runtime/blocking_deadline.hpp"
#include "parallel/runtime/host_values.hpp"
#include "parallel/runtime/mpi.hpp"
#include "parallel/runtime/watchdog.hpp"

namespace strata::io {

namespace {

// Saves make blocking MPI calls the watchdog cannot see (libhdf5's, in a parallel write): a rank
// or link lost during one ends the job after the checkpoint deadline instead of hanging it.
parallel::BlockingDeadline save_deadline(const std::string& what) {
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  return {rank, parallel::watchdog::kCheckpointTimeoutS, what, "the checkpoint deadline",
          "a rank stopped or lost, a link cut, or the filesystem stalled"};
}

}  // namespace

bool writes_in_parallel(const CheckpointSettings& settings) {
  return settings.io == "parallel" || (settings.io == "auto" && ParallelCheckpointFile::available());
}

struct CheckpointManager::Pending {
  RunState run;
  // Shared with the thread: a rank that gives up on its write (an error elsewhere) leaves the
  // file to the thread, which no longer needs MPI.
  std::shared_ptr<ParallelCheckpointFile> file;
  std::future<void> written;  // this rank's part in the file
  std::thread thread;
  ~Pending() {
    if (thread.joinable()) thread.detach();
  }
};

CheckpointManager::~CheckpointManager() = default;

CheckpointManager::CheckpointManager(const CheckpointSettings& settings, parallel::ProcessGrid& grid)
    : settings_(settings), grid_(grid), rank_(grid.world().rank()) {
  const MPI_Comm world = grid.mpi_world().comm();
  // One job per checkpoint directory, from before anything is read or written in it to the end.
  parallel::agree(world, [&] {
    if (rank_ != 0 || !writes()) return;
    lock_ = std::make_unique<DirectoryLock>(settings_.dir);  // first: the probe is ours
    require_writable_directory(settings_.dir, "--checkpoint-dir");
    saver_ = std::make_unique<CheckpointSaver>(settings_.dir, settings_.keep, settings_.async,
                                               parallel::watchdog::kCheckpointTimeoutS);
  });
  // auto: every rank writes its part where HDF5 is parallel (with --async-save, each from a
  // thread of its own); a stop signal's save takes that way too when the build allows it.
  if (writes()) {
    parallel_io_ = writes_in_parallel(settings_);
    log::info("checkpoints: ",
              parallel_io_ ? detail::cat("every rank writes its own part", settings_.async ? " in the background" : "",
                                         " (--checkpoint-io parallel: parallel HDF5 over MPI-IO)")
                           : detail::cat("rank 0 writes them", settings_.async ? " in the background" : "",
                                         " (--checkpoint-io rank0)"));
    // Every rank reads and writes where rank 0 does (multi-node: a shared filesystem), checked
    // now rather than at the first resume; each throws alike on every rank.
    require_shared_directory(world, settings_.dir, "--checkpoint-dir");
  }
  const std::string resume_path = settings_.resume == "auto" || settings_.resume == "none" ? "" : settings_.resume;
  for (const auto& [flag, path] : {std::pair{"--init-from", settings_.init_from}, {"--resume", resume_path}})
    if (!path.empty()) require_same_files(world, path, flag);
  if (settings_.init_from.empty()) return;
  // Rank 0 checks the file whole (its manifest's crc32: one read of the file), then every rank opens it.
  parallel::agree(world, [&] {
    if (rank_ == 0) CheckpointReader checked(settings_.init_from);
  });
  parallel::agree(world, [&] {
    init_from_ = std::make_unique<CheckpointReader>(settings_.init_from, /*whole_file=*/false);
    note_unchecked(*init_from_);
  });
}

int64_t CheckpointManager::init_from_classes() const {
  return init_from_ && init_from_->has_attr("num_classes") ? init_from_->attr_int("num_classes") : 0;
}

void CheckpointManager::load_init_from(parallel::StateGather& state) {
  // Each stage reads its own tensors: a bad one fails that stage's ranks only.
  parallel::agree(grid_.mpi_world().comm(), [&] {
    if (init_from_)
      state.load_model(
          [&](const std::string&, const layers::ParamEntry& e, int64_t begin, int64_t end, const Tensor& out) {
            init_from_->read_part(model_value_tensor(*init_from_, e.name, e.trainable, e.full_shape()), e.shape,
                                  e.split, begin, end, out);
          });
  });
}

std::optional<RunState> CheckpointManager::resume(parallel::StateGather& state, const ResumeExpectations& expected) {
  const MPI_Comm world = grid_.mpi_world().comm();
  std::string path = settings_.resume;
  if (settings_.resume == "none") return std::nullopt;
  if (settings_.resume == "auto") {
    // Rank 0 picks and verifies (warning once per skipped file) and tells the others the step.
    int64_t step = -1;
    if (rank_ == 0) {
      const std::string newest = newest_checkpoint(settings_.dir);
      if (!newest.empty()) step = CheckpointReader(newest, /*whole_file=*/false).attr_int("step");  // checked
    }
    step = parallel::broadcast_value(grid_.mpi_world(), step, 0);
    if (step < 0) {
      log::info("--resume auto: no complete checkpoint in ", settings_.dir, ", starting from step 0");
      return std::nullopt;
    }
    path = checkpoint_path(settings_.dir, step);
  } else {
    parallel::agree(world, [&] {
      if (rank_ == 0) CheckpointReader checked(path);  // one whole-file check for the job
    });
  }
  RunState saved;
  parallel::agree(world, [&] { saved = load(path, state, expected); });
  return saved;
}

RunState CheckpointManager::load(const std::string& path, parallel::StateGather& state,
                                 const ResumeExpectations& expected) {
  const CheckpointReader reader(path, /*whole_file=*/false);  // rank 0 has checked it whole
  note_unchecked(reader);
  STRATA_REQUIRE(reader.attr_int("format_version") >= 2, "checkpoint ", path,
                 " holds no training state (format_version 1): use --init-from to start from its model");
  RunState saved = read_run_state(reader);
  STRATA_REQUIRE(saved.optimizer == expected.optimizer, "checkpoint ", path, " was saved with --optimizer ",
                 saved.optimizer, " but this run uses --optimizer ", expected.optimizer);
  // Each rank reads only its own parts (its tp shards, its ZeRO shard of the optimizer state).
  const auto read = [&](const std::string& name, const layers::ParamEntry& e, int64_t begin, int64_t end,
                        const Tensor& out) {
    const std::string tensor =
        name.empty() ? model_value_tensor(reader, e.name, e.trainable, e.full_shape()) : optimizer_tensor(name, e.name);
    reader.read_part(tensor, e.shape, e.split, begin, end, out);
  };
  state.load_model(read);
  state.load_optimizer(read);
  const int64_t saved_batch = saved.global_batch;  // read_run_state held the position to the options' ranges
  STRATA_REQUIRE(expected.samples == 0 || saved.step_in_epoch * saved_batch <= expected.samples, "checkpoint ", path,
                 " is at step ", saved.step_in_epoch, " of an epoch of batches of ", saved_batch, ", beyond the ",
                 expected.samples, " samples of --data");
  if (saved_batch != expected.global_batch) {
    // Same samples seen, counted in this run's batches: the position is approximate.
    saved.step_in_epoch = saved.step_in_epoch * saved_batch / expected.global_batch;
    if (rank_ == 0)
      log::warn("checkpoint ", path, " was saved with --global-batch ", saved_batch, ", this run uses ",
                expected.global_batch, ": the data position is approximate");
  }
  STRATA_REQUIRE(expected.total_steps < 0 || saved.step <= expected.total_steps, "checkpoint ", path, " is at step ",
                 saved.step, ", beyond the ", expected.total_steps, " steps of this run");
  log::info("resuming from ", path, " at step ", saved.step, " (epoch ", saved.epoch, ", step ", saved.step_in_epoch,
            " of the epoch)");
  return saved;
}

void CheckpointManager::save_if_due(int64_t done, int64_t total, const std::function<RunState()>& run,
                                    parallel::StateGather& state) {
  if (writes() && settings_.save_every > 0 && done % settings_.save_every == 0 && done != total)
    save(run(), state, /*wait=*/false);
}

void CheckpointManager::save(const RunState& run, parallel::StateGather& state, bool wait) {
  // rank0: rank 0 writes the whole file (or hands it to its background thread) while the others
  // wait in the next collective. parallel: every rank writes its part, rank 0 finishes the file.
  const parallel::watchdog::AtLeast io_deadline(parallel::watchdog::kCheckpointTimeoutS);
  finish_pending();
  const parallel::BlockingDeadline deadline = save_deadline(detail::cat("the checkpoint save of step ", run.step));
  const trace::Span span(trace::Track::Checkpoint, detail::cat("save checkpoint of step ", run.step));
  STRATA_CHECK(rank_ != 0 || saver_, "checkpoint of step ", run.step, " without a checkpoint directory");
  const bool in_parallel = parallel_io_;
  const bool deferred = in_parallel && settings_.async && !wait;
  if (saver_) saver_->begin(run.step, in_parallel);
  std::optional<ParallelCheckpointFile::Written> written;
  if (in_parallel) {
    auto file = std::make_shared<ParallelCheckpointFile>(checkpoint_path(settings_.dir, run.step),
                                                         grid_.mpi_world().comm(), deferred);
    state.write_parts(
        [&](const std::string& name, const layers::ParamEntry& e, int64_t begin, int64_t end, const Tensor& values) {
          file->write(state_tensor(name, e.name), e.shape, e.split, begin, end, values);
        });
    if (deferred) {  // training goes on while every rank writes its part; poll() finishes the file
      file->close_metadata();
      pending_ = std::make_unique<Pending>();
      pending_->run = run;
      pending_->file = file;
      std::packaged_task<void()> task([file] {
        const trace::Span write(trace::Track::Writer, "write checkpoint part");
        file->write_deferred();
      });
      pending_->written = task.get_future();
      pending_->thread = std::thread(std::move(task));
      if (saver_) saver_->handed_over();
      return;
    }
    written = file->close();
  } else {
    state.gather([&](const std::string& name, const layers::ParamEntry& e, const Tensor& full) {
      saver_->add(state_tensor(name, e.name), full);
    });
  }
  if (!saver_) return;
  const auto attributes = [run](CheckpointWriter& writer) { write_run_state(writer, run); };
  if (written)
    saver_->finish_parallel(*written, attributes, wait);
  else
    saver_->finish(attributes, wait);
}

void CheckpointManager::poll() {
  if (!pending_) return;  // the same on every rank: set and cleared by collective saves
  const bool written = pending_->written.wait_for(std::chrono::seconds(0)) == std::future_status::ready;
  std::vector<double> writing{written ? 0.0 : 1.0};
  parallel::all_reduce_sum(grid_.world(), writing);
  if (writing[0] == 0) finish_pending();
}

void CheckpointManager::finish_pending() {
  if (!pending_) return;
  const std::unique_ptr<Pending> pending = std::move(pending_);
  const parallel::watchdog::AtLeast io_deadline(parallel::watchdog::kCheckpointTimeoutS);
  const parallel::BlockingDeadline deadline =
      save_deadline(detail::cat("the background checkpoint save of step ", pending->run.step));
  const trace::Span span(trace::Track::Checkpoint, detail::cat("finish checkpoint of step ", pending->run.step));
  parallel::agree(grid_.mpi_world().comm(), [&] {
    const auto timeout = std::chrono::duration<double>(parallel::watchdog::kCheckpointTimeoutS);
    STRATA_CHECK(pending->written.wait_for(timeout) == std::future_status::ready, "this rank's part of ",
                 pending->file->path(), " was not written within ", parallel::watchdog::kCheckpointTimeoutS, " s");
    pending->thread.join();
    pending->written.get();  // rethrows the write's error
  });
  const ParallelCheckpointFile::Written written = pending->file->close();
  if (saver_) saver_->finish_parallel(written, [run = pending->run](CheckpointWriter& w) { write_run_state(w, run); });
}

void CheckpointManager::note_unchecked(const CheckpointReader& reader) const {
  if (!reader.has_manifest() && rank_ == 0)
    log::info("note: checkpoint ", reader.path(), " has no manifest (written before manifests): its whole-file ",
              "checksum and position are not checked");
}

}  // namespace strata::io
