// The monitor: everything a run reports while it trains. The plan printed at the start and
// checked against every rank's allocations; the progress line every --log-every steps (loss,
// learning rate, throughput, where the step time went, MFU, memory; --metrics gets it as JSON,
// --tensorboard as scalars); evaluation lines; the --trace session and the --timeline of the last
// step; the end-of-run report (micro-batches in flight, tensor-parallel bytes, memory high-water
// marks). The trainer tells it what happened; it owns the cadence, the clocks and the text.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "core/trace.hpp"
#include "io/metrics.hpp"
#include "parallel/plan/memory_plan.hpp"
#include "parallel/runtime/process_grid.hpp"
#include "parallel/runtime/trace_collect.hpp"
#include "parallel/stage/engine.hpp"
#include "train/config.hpp"

namespace strata::train {

struct EvalResult {
  double loss = 0;  // mean over targets: samples, or the tokens of language-model windows
  double accuracy = 0;
  int64_t samples = 0;
  bool tokens = false;  // a language model's: perplexity = exp(loss)
};

// "loss 2.301  perplexity 9.98  next-token accuracy 5.71%  (24 windows)": every evaluation line's.
std::string evaluation_text(const EvalResult& r);

class Monitor {
 public:
  // `peak_flops`: a rank's compute rate, MFU's denominator (0: unknown, no MFU). The memory
  // high-water mark starts here: construct it after measuring that rate (compute_rate's GEMM)
  // and before anything of the run is allocated.
  Monitor(const MonitorSettings& settings, parallel::ProcessGrid& grid, double peak_flops);

  // Collective: checks the files rank 0 writes during training (none when `evaluation_only`) and
  // opens --metrics and --tensorboard (dropping their records past `start_step` when `resuming`).
  void open_outputs(bool evaluation_only, bool resuming, int64_t start_step);
  // Collective, once the engine holds the model: checks the plan (`planned`, every rank's)
  // against what every rank allocated, counts the model's FLOPs, opens --trace. `window_*`: a
  // resumed run's progress window.
  void start(parallel::StageEngine& engine, const layers::Model& model, const std::vector<parallel::RankBytes>& planned,
             int64_t total_steps, int64_t start_step, double window_loss, int64_t window_steps);

  // While alive: step `step` (from 0) is traced, its span and everything recorded meanwhile.
  class TracedStep {
   public:
    TracedStep(Monitor& monitor, int64_t step);
    ~TracedStep();
    TracedStep(const TracedStep&) = delete;
    TracedStep& operator=(const TracedStep&) = delete;

   private:
    std::optional<trace::Span> span_;
  };
  // The seconds the loader kept a step waiting.
  void waited_for_data(double seconds) { data_wait_s_ += seconds; }
  // Whether step `step` (from 0) records the pipeline timeline (--timeline: the last step).
  bool records_timeline(int64_t step) const;
  // Collective after each step (`done` counts from 1): the progress line when due, the timeline
  // after its step.
  void end_step(int64_t done, int64_t epoch, float lr, const parallel::StepResult& result);
  // An evaluation's line (`done`: at that step) and its --metrics record (rank 0).
  void evaluation(int64_t done, const EvalResult& r);
  void record_evaluation(int64_t step, const std::string& what, const EvalResult& r);
  // Collective: the end-of-run report.
  void finish();
  // Collective: with --trace, writes the trace file.
  void write_trace();

  // The progress window a checkpoint keeps (a resumed run logs the same averages).
  double window_loss() const { return window_loss_; }
  int64_t window_steps() const { return window_steps_; }

 private:
  // Rank 0 warns where a rank's real allocations differ from the plan.
  void check_plan(const std::vector<parallel::RankBytes>& planned);
  // Collective: rank 0 prints the progress line and appends it to --metrics, with the step-time
  // split averaged over the ranks and the largest memory high-water mark.
  void log_progress(int64_t step, int64_t epoch, float lr, double seconds, double eta_s);
  void write_timeline();
  // This rank's memory high-water mark so far: its allocator's and its shared-memory buffers.
  int64_t peak_bytes() const;

  using Clock = std::chrono::steady_clock;
  const MonitorSettings settings_;
  parallel::ProcessGrid& grid_;
  parallel::StageEngine* engine_ = nullptr;
  io::MetricsWriter metrics_{""};
  std::unique_ptr<parallel::TraceSession> trace_;
  double peak_flops_ = 0;        // per rank, for MFU (0: unknown)
  double flops_per_sample_ = 0;  // model FLOPs of one sample's training step (6 x forward multiply-adds)
  int64_t total_steps_ = 0, start_step_ = 0;
  // The window since the last progress line: loss summed over its steps (a resumed window began
  // in an earlier run), the steps this process timed, seconds waiting for the loader, and the
  // watchdog's totals of waits when it began.
  double window_loss_ = 0;
  int64_t window_steps_ = 0, timed_steps_ = 0;
  double data_wait_s_ = 0, pipeline_wait_before_ = 0, comm_wait_before_ = 0;
  Clock::time_point window_start_, run_start_;
  int64_t last_dp_bytes_ = 0, last_tp_bytes_ = 0;  // the last step's
  bool evaluated_ = false;                         // an evaluation ran (its buffers count in mem)
  // Rank 0: every rank's host, and the straggler of the last window (-1: none), for "persistently".
  std::vector<std::string> hosts_;
  int last_straggler_ = -1;
};

}  // namespace strata::train
