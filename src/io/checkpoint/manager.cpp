#include "io/checkpoint/manager.hpp"

#include <optional>

#include "core/log.hpp"
#include "core/trace.hpp"
#include "io/checkpoint/directory.hpp"
#include "io/checkpoint/parallel_file.hpp"
#include "io/shared_files.hpp"
#include "layers/parameter_store.hpp"
#include "parallel/runtime/host_values.hpp"
#include "parallel/runtime/mpi.hpp"
#include "parallel/runtime/watchdog.hpp"

namespace strata::io {

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
  // auto: every rank writes its part where HDF5 is parallel; --async-save's background thread
  // is rank 0's (no MPI there), but a stop signal's save waits anyway, so it goes in parallel.
  if (writes()) {
    const bool automatic = settings_.io == "auto" && ParallelCheckpointFile::available();
    parallel_io_ = settings_.io == "parallel" || (automatic && !settings_.async);
    parallel_io_at_stop_ = parallel_io_ || automatic;
    log::info(
        "checkpoints: ",
        parallel_io_
            ? "every rank writes its own part (--checkpoint-io parallel: parallel HDF5 over MPI-IO)"
            : detail::cat("rank 0 writes them", settings_.async ? " in the background" : "", " (--checkpoint-io rank0",
                          parallel_io_at_stop_ ? "; after a stop signal every rank writes its part" : "", ")"));
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

void CheckpointManager::save(const RunState& run, parallel::StateGather& state, bool wait, bool at_stop) {
  // rank0: rank 0 writes the whole file (or hands it to its background thread) while the others
  // wait in the next collective. parallel: every rank writes its part, rank 0 finishes the file.
  const parallel::watchdog::AtLeast io_deadline(parallel::watchdog::kCheckpointTimeoutS);
  const trace::Span span(trace::Track::Checkpoint, detail::cat("save checkpoint of step ", run.step));
  STRATA_CHECK(rank_ != 0 || saver_, "checkpoint of step ", run.step, " without a checkpoint directory");
  const bool in_parallel = at_stop ? parallel_io_at_stop_ : parallel_io_;
  if (saver_) saver_->begin(run.step, in_parallel);
  std::optional<ParallelCheckpointFile::Written> written;
  if (in_parallel) {
    ParallelCheckpointFile file(checkpoint_path(settings_.dir, run.step), grid_.mpi_world().comm());
    state.write_parts(
        [&](const std::string& name, const layers::ParamEntry& e, int64_t begin, int64_t end, const Tensor& values) {
          file.write(state_tensor(name, e.name), e.shape, e.split, begin, end, values);
        });
    written = file.close();
  } else {
    state.gather([&](const std::string& name, const layers::ParamEntry& e, const Tensor& full) {
      saver_->add(state_tensor(name, e.name), full);
    });
  }
  if (!saver_) return;
  const auto attributes = [run](CheckpointWriter& writer) { write_run_state(writer, run); };
  if (written)
    saver_->finish_parallel(*written, attributes);
  else
    saver_->finish(attributes);
  if (wait) saver_->wait();
}

void CheckpointManager::note_unchecked(const CheckpointReader& reader) const {
  if (!reader.has_manifest() && rank_ == 0)
    log::info("note: checkpoint ", reader.path(), " has no manifest (written before manifests): its whole-file ",
              "checksum and position are not checked");
}

}  // namespace strata::io
