// The training program's wiring and epoch loop over a pp x dp x tp process grid: this rank runs
// one pipeline stage (a range of the model's layers) for one data-parallel replica, holding its
// tensor-parallel rank's shards of those layers. The parallel
// logic has its owners in src/parallel — the pipeline executor runs the stage's schedule,
// DataParallel syncs gradients and steps the (ZeRO-sharded) optimizer, StateGather assembles
// checkpoints — and the file formats theirs in src/io; the trainer supplies data, loss and
// logging to them.
#pragma once

#include <memory>

#include "io/checkpoint.hpp"
#include "io/checkpoint_saver.hpp"
#include "io/dataset.hpp"
#include "io/loader.hpp"
#include "io/metrics.hpp"
#include "io/sampler.hpp"
#include "io/samples.hpp"
#include "layers/loss.hpp"
#include "layers/loss_scaler.hpp"
#include "layers/model.hpp"
#include "layers/optimizer.hpp"
#include "parallel/batch_plan.hpp"
#include "parallel/data_parallel.hpp"
#include "parallel/memory_plan.hpp"
#include "parallel/mpi.hpp"
#include "parallel/partition.hpp"
#include "parallel/pipeline.hpp"
#include "parallel/process_grid.hpp"
#include "parallel/state_gather.hpp"
#include "parallel/tensor_parallel.hpp"
#include "parallel/tied_embedding.hpp"
#include "parallel/trace_collect.hpp"
#include "train/config.hpp"

namespace strata::train {

// Exit code of a run stopped by SIGTERM, SIGUSR1 or SIGINT after saving a checkpoint: a batch
// script requeues the job, which continues with --resume auto (docs/checkpoints.md).
constexpr int kExitPreempted = 3;
// Exit code of a run stopped by a second SIGTERM or SIGINT before the first one's save was done
// (nothing saved by this run after its last checkpoint; --resume auto continues from that one).
constexpr int kExitSecondSignal = 4;

// How train() ended. Diverged: a step's loss was not finite; nothing after the last checkpoint
// was saved, and every rank exits 1.
enum class TrainEnd { Finished, Preempted, Diverged };

// Installs async-signal-safe handlers for SIGTERM, SIGUSR1 and SIGINT that only set a flag;
// train() acts on it at the next step boundary. A second SIGTERM or SIGINT exits at once
// (kExitSecondSignal).
void install_preemption_handlers();

struct EvalResult {
  double loss = 0;  // mean over targets: samples, or the tokens of language-model windows
  double accuracy = 0;
  int64_t samples = 0;
  bool tokens = false;  // a language model's: perplexity = exp(loss)
};

class Trainer {
 public:
  // Setup: opens the data, builds the model, cuts it into stages, assembles this stage's
  // data-parallel replica and pipeline executor, checks batch sizes, loads --init-from or
  // --resume. Every bad input is found here, before the first step.
  Trainer(const Config& config, MPI_Comm world);

  // Trains. All ranks agree on
  // how it ended: a preemption signal stops it early (a checkpoint saved if --checkpoint-dir is
  // set), a non-finite loss stops it without saving.
  TrainEnd train();
  // Collective over the world: every rank calls it.
  EvalResult evaluate(const io::Samples& data);
  // The dataset evaluated at the end and by --eval-only.
  const io::Samples* eval_data() const;
  // Rank 0 appends an evaluation to --metrics (at the step training reached).
  void record_evaluation(const std::string& what, const EvalResult& r);
  // Collective: the full training state (StateGather) goes to rank 0's CheckpointSaver, which
  // commits it, moves `latest` and applies --keep; with --async-save in the background unless
  // `wait` (a stop signal, the end of training). With --checkpoint-io parallel every rank writes
  // its own part of the file instead (io::ParallelCheckpointFile) and rank 0 finishes it;
  // `at_stop` (a preemption signal) takes that way whenever the build and flags allow it: it is
  // the fastest, and nothing is left to a background thread.
  void save_checkpoint(int64_t step, bool wait, bool at_stop = false);
  // Collective: with --trace, writes the trace file (after the final evaluation, so it is in it).
  void write_trace();

 private:
  bool first_stage() const { return stage_ == 0; }
  // The layers of this rank's chunk c (virtual stage c·P + stage).
  parallel::StageRange chunk_range(int chunk) const {
    return stages_[static_cast<size_t>(chunk * grid_->pp_size() + stage_)];
  }
  bool last_stage() const { return stage_ == grid_->pp_size() - 1; }
  // One optimizer step over this replica's slice of the global batch; returns the global
  // batch's summed loss (on every rank) and sets stop_agreed_ when any rank was signalled.
  double train_step(const io::Batch& batch, int64_t step);
  // Sums values over every rank of the world (stages that have no value contribute 0).
  void sum_over_world(std::vector<double>& values);
  // x in the compute dtype on this rank's device (x itself when it already is).
  Tensor to_compute(const Tensor& x) const;
  // Labels (or any tensor) on this rank's device.
  Tensor to_device(const Tensor& t) const;
  // Rank 0 prints the plan (train/plan.hpp) and warns where a rank's real allocations differ
  // from it. Collective over the world.
  void print_plan();
  // Collective over the world (every rank logs at the same steps): rank 0 prints the progress
  // line and appends it to --metrics, with the step-time split averaged over the ranks and the
  // largest memory high-water mark.
  void log_progress(int64_t step, int64_t epoch, double loss, int64_t steps, double seconds, double eta_s);
  void write_timeline();
  // This rank's memory high-water mark so far: its allocator's and its shared-memory buffers.
  int64_t peak_bytes() const;
  void check_output_paths() const;  // rank 0: --checkpoint-dir, --metrics, --timeline writable
  // One line on stdout when a checkpoint has no manifest (docs/checkpoints.md).
  void note_unchecked(const io::CheckpointReader& reader) const;
  // --resume: the model, this rank's optimizer-state shard, the step count and data position,
  // from a file rank 0 has checked whole (so no rank reads all of it again for its crc32).
  void resume_from(const std::string& path);

  Config config_;
  // Rank 0's lock on --checkpoint-dir, held for the run, and its writer of checkpoints (after
  // the lock: destroyed first, once its last write is done).
  std::unique_ptr<io::DirectoryLock> directory_lock_;
  std::unique_ptr<io::CheckpointSaver> saver_;
  bool parallel_io_ = false, parallel_io_at_stop_ = false;  // --checkpoint-io, resolved
  DType dtype_ = DType::F32;                                // parameters and activations (--precision)
  Device device_ = Device::cpu();                           // this rank's device (--device)
  layers::LossScaler scaler_;
  std::unique_ptr<parallel::ProcessGrid> grid_;
  int rank_ = 0, dp_ = 1, replica_ = 0, stage_ = 0, tp_rank_ = 0;
  // The layers' tensor-parallel group (null without --tp): the Megatron collectives.
  std::unique_ptr<parallel::TensorParallel> tensor_parallel_;
  std::unique_ptr<io::Samples> train_data_, val_data_;
  std::unique_ptr<io::EpochSampler> sampler_;
  std::unique_ptr<layers::Model> model_;
  // Every virtual stage's layers: P x v of them, chunk c of pipeline rank s being virtual stage
  // c·P + s (v = --virtual-stages, 1 but with the interleaved schedule).
  std::vector<parallel::StageRange> stages_;
  std::vector<parallel::RankBytes> planned_;       // every rank's plan (plan_ranks), computed once
  std::unique_ptr<parallel::TiedEmbedding> tied_;  // a tied LM head's copy of wte, where it needs one
  // This rank's chunks, each a stage's layers replicated over the dp group, and plain pointers to them.
  std::vector<std::unique_ptr<parallel::DataParallel>> chunks_;
  std::vector<parallel::DataParallel*> chunk_ptrs_;
  std::unique_ptr<parallel::PipelineExecutor> pipeline_;
  std::unique_ptr<parallel::StateGather> state_gather_;
  layers::SoftmaxCrossEntropy loss_;
  parallel::BatchPlan plan_;  // global = micro x count x dp
  int64_t total_steps_ = 0, start_step_ = 0;
  int64_t num_classes_ = 0;         // the model's output classes (a language model's vocabulary)
  int64_t targets_per_sample_ = 1;  // 1 label, or a window's T next tokens
  // The loss is the mean over a global batch's targets.
  int64_t targets_per_batch() const { return config_.global_batch * targets_per_sample_; }
  io::MetricsWriter metrics_{""};
  // Data position of the next batch: from (0, 0), or a checkpoint's (epoch, step_in_epoch).
  int64_t next_epoch_ = 0, next_in_epoch_ = 0;

  bool stop_agreed_ = false;  // some rank received a preemption signal (agreed by all)
  double window_loss_ = 0;    // loss summed over the steps since the last progress line
  int64_t window_steps_ = 0;  // and their count (both saved in checkpoints)
  // Since the last progress line: seconds waiting for the loader, and the waits' totals then
  // (watchdog::waited_seconds: pipeline, other groups).
  double data_wait_s_ = 0;
  double pipeline_wait_before_ = 0, comm_wait_before_ = 0;
  double flops_per_sample_ = 0;  // model FLOPs of one sample's training step (6 x forward multiply-adds)
  double peak_flops_ = 0;        // per rank, for MFU (0: unknown)
  std::unique_ptr<parallel::TraceSession> trace_;  // --trace
  int64_t dp_bytes_per_step_ = 0;                  // sent on the dp communicator by this rank in the last step
  int64_t tp_bytes_per_step_ = 0;                  // and on the tp communicator
};

}  // namespace strata::train
