#include "train/monitor.hpp"

#include <cmath>
#include <cstdio>
#include <sstream>

#include "core/allocator.hpp"
#include "core/log.hpp"
#include "core/trace.hpp"
#include "io/shared_files.hpp"
#include "io/timeline.hpp"
#include "parallel/runtime/device.hpp"
#include "parallel/runtime/host_values.hpp"
#include "parallel/runtime/mpi.hpp"

namespace strata::train {

Monitor::Monitor(const MonitorSettings& settings, parallel::ProcessGrid& grid, double peak_flops)
    : settings_(settings), grid_(grid), peak_flops_(peak_flops) {
  // The GEMM's buffers go back, and out of the high-water mark, at once.
  host_allocator().release_cached();
  host_allocator().reset_peak();
}

void Monitor::open_outputs(bool evaluation_only, bool resuming, int64_t start_step) {
  const int rank = grid_.world().rank();
  // What rank 0 writes during training, checked now rather than after hours of it.
  parallel::agree(grid_.mpi_world().comm(), [&] {
    if (rank != 0) return;
    if (!evaluation_only)
      for (const auto& [flag, path] : {std::pair{"--metrics", settings_.metrics},
                                       {"--timeline", settings_.timeline},
                                       {"--trace", settings_.trace}})
        if (!path.empty()) io::require_writable_file(path, flag);
    // Also creates --tensorboard's file, which marks the step a training run starts from.
    metrics_ = io::MetricsWriter(settings_.metrics, settings_.tensorboard,
                                 evaluation_only ? std::nullopt : std::optional<int64_t>(start_step));
  });
  parallel::agree(grid_.mpi_world().comm(), [&] {
    // Also when --resume auto found nothing: the run starts again from step 0.
    if (resuming) metrics_.drop_after(start_step);
  });
}

void Monitor::start(parallel::StageEngine& engine, const layers::Model& model,
                    const std::vector<parallel::RankBytes>& planned, int64_t total_steps, int64_t start_step,
                    double window_loss, int64_t window_steps) {
  engine_ = &engine;
  total_steps_ = total_steps;
  start_step_ = start_step;
  window_loss_ = window_loss;
  window_steps_ = window_steps;
  const int rank = grid_.world().rank();
  check_plan(planned);
  // MFU's numerator: the model's FLOPs, 2 per multiply-add, forward and twice that backward,
  // each layer counted once (replica 0's ranks: every stage, every tensor-parallel shard);
  // recomputation is not counted (model FLOPs, as PaLM defines MFU).
  int64_t mine = 0;
  const parallel::StageMap& map = engine.map();
  if (grid_.replica() == 0)
    for (int c = 0; c < map.chunks(); ++c) {
      const parallel::StageRange range = map.range(grid_.stage(), c);
      for (size_t i = range.begin; i < range.end; ++i) mine += 6 * model.layer(i).flops(model.shape(i));
    }
  for (const int64_t flops : parallel::all_gather_values(grid_.mpi_world(), {mine}))
    flops_per_sample_ += static_cast<double>(flops);
  hosts_ = parallel::host_names(grid_.mpi_world().comm());
  if (!settings_.trace.empty())
    trace_ = std::make_unique<parallel::TraceSession>(
        grid_.mpi_world(), settings_.trace, settings_.trace_first, settings_.trace_last,
        detail::cat("rank ", rank, ": stage ", grid_.stage(), ", replica ", grid_.replica(), ", tp ", grid_.tp_rank()));
  const parallel::StageEngine::Blocked blocked = parallel::StageEngine::blocked_seconds();
  pipeline_wait_before_ = blocked.pipeline;
  comm_wait_before_ = blocked.collectives;
  window_start_ = run_start_ = Clock::now();
}

void Monitor::check_plan(const std::vector<parallel::RankBytes>& planned) {
  // The plan is computed from shapes (what --dry-run prints); rank 0 checks it against what
  // every rank allocated, so a plan that drifts from the allocations is seen, not trusted.
  const std::vector<int64_t> real = parallel::all_gather_values(grid_.mpi_world(), engine_->allocated_bytes());
  // Which groups go through shared memory (all on one node) and which through MPI: what a
  // cluster, or STRATA_RANKS_PER_NODE on one machine, changes. Collective over each group.
  std::string transport;
  if (grid_.device().is_cpu())
    for (const parallel::AxisSize& axis : grid_.layout().axes())
      if (*axis.size > 1)
        transport += detail::cat(transport.empty() ? " " : ", ", parallel::axis_name(axis.axis), " ",
                                 grid_.mpi_comm(axis.axis).node_local() ? "shared memory" : "MPI");
  if (grid_.world().rank() != 0) return;
  if (!transport.empty()) log::info("  rank 0's groups communicate through:", transport);
  for (int k = 0; k < grid_.world().size(); ++k) {
    const parallel::RankBytes& p = planned[static_cast<size_t>(k)];
    const int64_t* r = real.data() + 3 * k;
    if (r[0] != p.params || r[1] != p.grads || r[2] != p.optimizer)
      log::warn("rank ", k, " allocated params ", r[0], ", grads ", r[1], ", optimizer ", r[2], " but its plan says ",
                p.params, ", ", p.grads, ", ", p.optimizer, " (an error in the plan; training goes on)");
  }
}

Monitor::TracedStep::TracedStep(Monitor& monitor, int64_t step) {
  if (monitor.trace_) monitor.trace_->begin_step(step + 1);
  trace::set_step(step + 1);  // what this thread records until the step is done belongs to it
  span_.emplace(trace::Track::Step, trace::recording() ? detail::cat("step ", step + 1) : "");
}

Monitor::TracedStep::~TracedStep() {
  span_.reset();  // recorded as the step's
  trace::set_step(-1);
}

bool Monitor::records_timeline(int64_t step) const { return !settings_.timeline.empty() && step + 1 == total_steps_; }

void Monitor::end_step(int64_t done, int64_t epoch, float lr, const parallel::StepResult& result) {
  if (records_timeline(done - 1)) write_timeline();
  last_dp_bytes_ = result.dp_bytes;
  last_tp_bytes_ = result.tp_bytes;
  window_loss_ += result.loss;
  ++window_steps_;
  ++timed_steps_;
  if (done % settings_.log_every != 0 && done != total_steps_) return;
  const auto now = Clock::now();
  const double seconds = std::chrono::duration<double>(now - window_start_).count();
  const double elapsed = std::chrono::duration<double>(now - run_start_).count();
  const double eta = elapsed / static_cast<double>(done - start_step_) * static_cast<double>(total_steps_ - done);
  log_progress(done, epoch, lr, seconds, eta);
  window_loss_ = 0;
  window_steps_ = 0;
  timed_steps_ = 0;
  window_start_ = Clock::now();
}

void Monitor::log_progress(int64_t step, int64_t epoch, float lr, double seconds, double eta_s) {
  const parallel::StageEngine::Blocked blocked = parallel::StageEngine::blocked_seconds();
  const double pipeline_now = blocked.pipeline, comm_now = blocked.collectives;
  // Every rank's window: its own waits, and its memory high-water mark.
  const auto us = [](double s) { return static_cast<int64_t>(s * 1e6); };
  const std::vector<int64_t> all = parallel::all_gather_values(
      grid_.mpi_world(), {us(seconds), us(comm_now - comm_wait_before_), us(pipeline_now - pipeline_wait_before_),
                          us(data_wait_s_), peak_bytes(), grid_.stage()});
  // The next window starts after this gather: its wait belongs to neither window (a share of
  // the next one's time counted it, up to 107% comm on 6 ms steps across two nodes).
  const parallel::StageEngine::Blocked after = parallel::StageEngine::blocked_seconds();
  pipeline_wait_before_ = after.pipeline;
  comm_wait_before_ = after.collectives;
  data_wait_s_ = 0;
  if (grid_.world().rank() != 0) return;
  const int ranks = grid_.world().size();
  std::vector<io::RankWindow> windows;
  int64_t peak = 0;
  for (int r = 0; r < ranks; ++r) {
    const int64_t* v = all.data() + 6 * r;
    windows.push_back({static_cast<double>(v[0]) * 1e-6, static_cast<double>(v[1]) * 1e-6,
                       static_cast<double>(v[2]) * 1e-6, static_cast<double>(v[3]) * 1e-6, static_cast<int>(v[5])});
    peak = std::max(peak, v[4]);
  }
  io::ProgressRecord record;
  record.step = step;
  record.epoch = epoch;
  record.loss = window_loss_ / static_cast<double>(window_steps_);
  record.lr = lr;
  record.step_time_s = seconds / static_cast<double>(std::max<int64_t>(timed_steps_, 1));
  record.samples_per_s = static_cast<double>(engine_->layout().global_batch()) / std::max(record.step_time_s, 1e-9);
  const int64_t targets = engine_->targets_per_sample();
  if (targets > 1) record.tokens_per_s = record.samples_per_s * static_cast<double>(targets);
  // NCCL's waits order streams and return at once: the host's wait measures nothing there.
  if (grid_.transport() != parallel::Transport::Nccl || ranks == 1) {
    record.split = io::average_split(windows);
    // Named once it is the straggler of two windows running (one slow window is noise).
    const std::optional<io::Straggler> straggler = io::find_straggler(windows, timed_steps_);
    if (straggler && straggler->rank == last_straggler_) {
      record.straggler = straggler;
      record.straggler->host = hosts_.at(static_cast<size_t>(straggler->rank));
    }
    last_straggler_ = straggler ? straggler->rank : -1;
  }
  record.tflops_per_rank = flops_per_sample_ * record.samples_per_s / ranks / 1e12;
  if (peak_flops_ > 0) record.mfu = record.tflops_per_rank * 1e12 / peak_flops_;
  record.dp_bytes_per_step = last_dp_bytes_;
  record.tp_bytes_per_step = last_tp_bytes_;
  record.peak_bytes = peak;
  record.eta_s = eta_s;
  log::info(io::progress_line(record, total_steps_));
  metrics_.append(record);
}

std::string evaluation_text(const EvalResult& r) {
  char text[160];
  if (r.tokens)  // a language model: per-token loss, its perplexity and next-token accuracy
    std::snprintf(text, sizeof text, "loss %.6f  perplexity %.3f  next-token accuracy %.2f%%  (%lld windows)", r.loss,
                  std::exp(r.loss), 100.0 * r.accuracy, static_cast<long long>(r.samples));
  else
    std::snprintf(text, sizeof text, "loss %.6f  accuracy %.2f%%  (%lld samples)", r.loss, 100.0 * r.accuracy,
                  static_cast<long long>(r.samples));
  return text;
}

void Monitor::evaluation(int64_t done, const EvalResult& r) {
  log::info("eval at step ", done, ": ", evaluation_text(r),
            evaluated_ ? ""
                       : "\n  (evaluation has buffers of its own: the progress line's mem, a high-water mark, includes "
                         "them from here on)");
  evaluated_ = true;
  record_evaluation(done, "val", r);
}

void Monitor::record_evaluation(int64_t step, const std::string& what, const EvalResult& r) {
  if (grid_.world().rank() == 0) metrics_.append(io::EvalRecord{step, what, r.loss, r.accuracy, r.samples, r.tokens});
}

void Monitor::finish() {
  // Peak micro-batches in flight per stage (activation memory), from replica 0 of each.
  std::vector<double> peaks(static_cast<size_t>(grid_.pp_size()), 0.0);
  if (grid_.replica() == 0 && grid_.tp_rank() == 0)
    peaks[static_cast<size_t>(grid_.stage())] = engine_->peak_in_flight();
  parallel::all_reduce_sum(grid_.world(), peaks);
  std::ostringstream os;
  for (double p : peaks) os << " " << p;
  log::info("peak micro-batches in flight per stage:", os.str(), " (", parallel::to_string(engine_->layout().schedule),
            ", ", engine_->layout().micro_batches, " micro-batches)");
  // The Megatron collectives, the cross-entropy's and the pipeline's all-gathers, as the tp
  // communicator counts them (parallel::Communicator::bytes_sent): the formula's check.
  if (grid_.has(parallel::Axis::Tensor))
    log::info("tensor-parallel bytes sent by rank 0 in the last step: ", last_tp_bytes_);
  // What every rank needed at most, to set beside the plan printed at the start.
  const std::vector<int64_t> peaks_bytes = parallel::all_gather_values(grid_.mpi_world(), {peak_bytes()});
  std::ostringstream mem;
  for (int64_t b : peaks_bytes) mem << " " << b;
  log::info("memory high-water mark per rank (bytes: allocator and shared-memory buffers):", mem.str());
}

int64_t Monitor::peak_bytes() const { return parallel::peak_memory_bytes(grid_.device()); }

void Monitor::write_trace() {
  if (!trace_) return;
  const std::string summary = trace_->write();
  if (grid_.world().rank() == 0) log::info(summary);
}

void Monitor::write_timeline() {
  const std::vector<parallel::TimelineEvent> all = engine_->gather_timeline();
  if (grid_.replica() != 0 || grid_.tp_rank() != 0 || grid_.stage() != 0) return;
  log::info(io::write_timeline(settings_.timeline, all, grid_.pp_size(), engine_->layout().micro_batches,
                               parallel::to_string(engine_->layout().schedule)));
}

}  // namespace strata::train
