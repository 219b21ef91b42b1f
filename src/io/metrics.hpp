// --metrics: one JSON object per logged step, appended to a file (JSON lines; fields in
// docs/formats.md), and --tensorboard: the same lines' numbers as TensorBoard scalars (the JSON
// line is the one record both sinks get, so they cannot drift apart). Losing a line must not
// stop training: a failed write is warned about once.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "io/tensorboard.hpp"

namespace strata::io {

// `path` names a file that can be written (created, or appended to, and left as it was); an
// Input error naming `flag` otherwise. For --metrics and --timeline, checked at setup.
void require_writable_file(const std::string& path, const std::string& flag);

// Where a step's time went (shares of it, averaged over the ranks): blocked in collectives of
// the data-/tensor-parallel groups and the world (`comm`, exposed communication and waiting for
// slower ranks), blocked on pipeline messages (`pipeline`: the bubble and the transfers),
// waiting for the loader (`data`), and the rest (`compute`).
struct StepSplit {
  double compute = 0, comm = 0, pipeline = 0, data = 0;
};

// A rank the others of its pipeline stage waited for, persistently (find_straggler).
struct Straggler {
  int rank = 0;
  std::string host;
  double slower = 0;  // its busy time (compute, its loader) over the median of its stage's others
                      // (at least kStragglerSeconds a step), minus 1
  std::string cause;  // "compute" | "data" (waiting for its loader)
};

struct ProgressRecord {
  int64_t step = 0, epoch = 0;
  double loss = 0, lr = 0, samples_per_s = 0;
  double tokens_per_s = 0;         // language models; 0: not written
  double step_time_s = 0;          // wall time per step since the last line
  std::optional<StepSplit> split;  // null where waits are not measured (NCCL)
  double tflops_per_rank = 0;      // model FLOPs (6 x forward multiply-adds per sample) per second per rank
  std::optional<double> mfu;       // over --plan-tflops (or the GEMM rate measured at start); null: unknown
  int64_t dp_bytes_per_step = 0;   // sent by rank 0 on its data-parallel communicator in the last step
  int64_t tp_bytes_per_step = 0;   // on the tensor-parallel communicator (0 without --tp)
  int64_t peak_bytes = 0;          // the largest memory high-water mark of any rank (allocator + shared buffers)
  double eta_s = 0;                // to the end of training at the pace so far
  std::optional<Straggler> straggler;
};

// An evaluation: of --val-data every --eval-every steps ("val"), at the end ("final", or
// "final-train" without --val-data: the training data) or by --eval-only ("eval-only").
struct EvalRecord {
  int64_t step = 0;
  std::string what;
  double loss = 0, accuracy = 0;
  int64_t samples = 0;
  bool tokens = false;  // a language model's: the line adds its perplexity, exp(loss)
};

// One rank's logging window: its length and the time it spent blocked in collectives, on
// pipeline messages and waiting for the loader (seconds), and its pipeline stage.
struct RankWindow {
  double seconds = 0, comm_s = 0, pipeline_s = 0, data_s = 0;
  int stage = 0;
};
// The shares of the windows averaged over the ranks; compute is the rest (never below 0).
StepSplit average_split(const std::vector<RankWindow>& ranks);

// A synchronous step goes at the pace of its busiest rank: the others wait for it in the
// collectives. A rank is the straggler of a window when its busy time (the window less its
// waits on others: compute, and its loader's) exceeds the median of its stage's other ranks (which
// do the same work) by more than kStragglerShare of it and by more than kStragglerSeconds per step
// (timer noise on tiny steps): then every other rank of the stage spent at least that share of
// the step waiting. 15% is above the few percent identical ranks differ by on one machine (OS
// jitter, a shared core) and below what a throttled core, a busy neighbour or a failing disk
// costs. The cause is what its excess is mostly made of. Host left empty.
constexpr double kStragglerShare = 0.15, kStragglerSeconds = 0.002;
std::optional<Straggler> find_straggler(const std::vector<RankWindow>& ranks, int64_t steps);

// The console line of a record: "step 8/12  epoch 0  loss 1.0566  lr 0.05  196385 samples/s
// 0.2 ms (comm 51%, pipeline 36%, data 10%)  MFU 3.4%  mem 3.1 MiB  eta 0m00s" (tokens/s for a
// language model; the waits only, compute being the rest; "split n/a under NCCL" without a
// split; no MFU unknown; "  slow: rank 3 (node2) +45% compute" after a straggler).
std::string progress_line(const ProgressRecord& record, int64_t total_steps);

// The TensorBoard scalars of one of MetricsWriter's JSON lines, at its "step": every number under
// its key ("loss"; a nested object's as "split/compute"), prefixed by the line's text field (an
// evaluation's "eval": "val/eval_loss"); null and text fields are not scalars.
TensorBoardEvent tensorboard_event(const std::string& json_line);

class MetricsWriter {
 public:
  // An empty path writes no JSON lines; an empty `tensorboard_dir` no event file (else one is
  // created in it now, for a training run that continues from step `continues_from`: see
  // TensorBoardWriter).
  explicit MetricsWriter(std::string path, const std::string& tensorboard_dir = "",
                         std::optional<int64_t> continues_from = std::nullopt);

  void append(const ProgressRecord& record);
  void append(const EvalRecord& record);
  // A resumed run logs again the steps after its checkpoint: their earlier lines go (written
  // to a new file, then renamed), so the file reads as one uninterrupted run.
  void drop_after(int64_t step) const;

 private:
  // Appends one line, and its event; a failed write is warned about once.
  void write(const char* json);

  std::string path_;
  std::optional<TensorBoardWriter> tensorboard_;
  bool lost_ = false;  // a write failed (warned once)
};

}  // namespace strata::io
