// The training loop over a pp x dp process grid: this rank runs one pipeline stage (a range of
// the model's layers) for one data-parallel replica. A step runs the stage's checked schedule
// of micro-batch forwards, backwards and activation/gradient messages; the stage's gradient
// buckets are all-reduced over its replicas during the step's last backward; then the
// optimizer steps. Evaluation, metrics and checkpoints (gathered to rank 0) are here too.
#pragma once

#include <memory>

#include "io/checkpoint.hpp"
#include "io/dataset.hpp"
#include "io/loader.hpp"
#include "io/sampler.hpp"
#include "layers/loss.hpp"
#include "layers/loss_scaler.hpp"
#include "layers/model.hpp"
#include "layers/optimizer.hpp"
#include "parallel/gradient_sync.hpp"
#include "parallel/mpi.hpp"
#include "parallel/partition.hpp"
#include "parallel/process_grid.hpp"
#include "parallel/schedule.hpp"
#include "parallel/zero.hpp"
#include "train/config.hpp"

namespace strata::train {

// Exit code of a run stopped by SIGTERM, SIGUSR1 or SIGINT after saving a checkpoint: a batch
// script requeues the job, which continues with --resume auto (docs/checkpoints.md).
constexpr int kExitPreempted = 3;

// How train() ended. Diverged: a step's loss was not finite; nothing after the last checkpoint
// was saved, and every rank exits 1.
enum class TrainEnd { Finished, Preempted, Diverged };

// Installs async-signal-safe handlers for SIGTERM, SIGUSR1 and SIGINT that only set a flag;
// train() acts on it at the next step boundary.
void install_preemption_handlers();

struct EvalResult {
  double loss = 0;  // mean over samples
  double accuracy = 0;
  int64_t samples = 0;
};

class Trainer {
 public:
  // Setup: opens the data, builds the model, cuts it into stages, builds this stage's
  // parameters, checks batch sizes and the schedule, loads --init-from. Every bad input is
  // found here, before the first step.
  Trainer(const Config& config, MPI_Comm world);

  // Trains (nothing with --dry-run: setup has printed the memory table). All ranks agree on
  // how it ended: a preemption signal stops it early (a checkpoint saved if --checkpoint-dir is
  // set), a non-finite loss stops it without saving.
  TrainEnd train();
  // Collective over the world: every rank calls it.
  EvalResult evaluate(const io::Dataset& data);
  // The dataset evaluated at the end and by --eval-only; none with --dry-run.
  const io::Dataset* eval_data() const;
  // Collective: replica 0 of every stage sends its parameters and buffers, and every rank
  // owning part of a tensor's optimizer state sends its piece, to rank 0, which assembles and
  // writes one full tensor at a time; then `latest` is updated and --keep applied.
  void save_checkpoint(int64_t step);

 private:
  bool first_stage() const { return stage_ == 0; }
  bool last_stage() const { return stage_ == grid_->pp_size() - 1; }
  // One optimizer step over this replica's slice of the global batch; returns the global
  // batch's summed loss (on every rank) and sets stop_agreed_ when any rank was signalled.
  double train_step(const io::Batch& batch, int64_t step);
  // Forward through this stage's layers; with ZeRO 3 one layer at a time, each bound to its
  // gathered parameters just before it runs.
  Tensor forward_stage(const Tensor& x, std::vector<layers::Context>& ctx, const layers::StepInfo& info);
  // Sums values over every rank of the world (stages that have no value contribute 0).
  void sum_over_world(std::vector<double>& values);
  // x in the compute dtype on this rank's device (x itself when it already is).
  Tensor to_compute(const Tensor& x) const;
  // Labels (or any tensor) on this rank's device.
  Tensor to_device(const Tensor& t) const;
  // Mixed precision: checks the summed gradients for inf/NaN on every rank together and
  // unscales them; returns whether the optimizer may step (see LossScaler).
  bool unscale_and_check(const Tensor& grads, int64_t step);
  // Rank 0 prints each stage's layers and, gathered from every rank, the bytes of its real
  // allocations: parameters (+ buffers), gradients, optimizer state; activations per
  // micro-batch from shape inference. Collective over the world.
  void print_plan();
  void log_progress(int64_t step, int64_t epoch, double loss, float lr, double samples_per_s, double comm_fraction,
                    double eta_s) const;
  void write_timeline(const std::vector<parallel::TimelineEvent>& mine);
  // This rank's parameters and buffers from /model (each tensor read whole, crc-checked, and
  // the owned part kept).
  void check_output_paths() const;  // rank 0: --checkpoint-dir, --metrics, --timeline writable
  void load_model(const io::CheckpointReader& reader);
  // --resume: the model, this rank's optimizer-state shard, the step count and data position.
  void resume_from(const std::string& path);
  // The flat-layout range of stage s's optimizer state that replica r owns ({0, used} for
  // every replica without ZeRO).
  parallel::Shard state_range(int s, int r) const;

  Config config_;
  DType dtype_ = DType::F32;       // parameters and activations (--precision)
  Device device_ = Device::cpu();  // this rank's device (--device)
  layers::LossScaler scaler_;
  std::unique_ptr<parallel::ProcessGrid> grid_;
  int rank_ = 0, dp_ = 1, replica_ = 0, stage_ = 0;
  std::unique_ptr<io::Dataset> train_data_, val_data_;
  std::unique_ptr<io::EpochSampler> sampler_;
  std::unique_ptr<layers::Model> model_;
  std::vector<parallel::StageRange> stages_;
  size_t begin_ = 0, end_ = 0;  // this stage's layers
  std::unique_ptr<layers::ParameterStore> store_;
  std::unique_ptr<parallel::ShardedOptimizer> optimizer_;  // the whole buffer with --zero 0
  std::unique_ptr<parallel::GradientSync> sync_;
  std::unique_ptr<parallel::ParameterGather> gather_;  // ZeRO 3 only
  layers::SoftmaxCrossEntropy loss_;
  int64_t local_batch_ = 0, micro_batch_ = 0, micro_batches_ = 0, total_steps_ = 0, start_step_ = 0;
  int64_t num_classes_ = 0;            // the model's output classes
  mutable bool metrics_lost_ = false;  // a --metrics write failed (warned once)
  // Data position of the next batch: from (0, 0), or a checkpoint's (epoch, step_in_epoch).
  int64_t next_epoch_ = 0, next_in_epoch_ = 0;

  // Pipeline state, sized once: one entry per micro-batch.
  parallel::StageProgram program_;
  size_t last_backward_ = 0;  // position of the step's last Backward in program_
  std::vector<std::vector<layers::Context>> contexts_;
  std::vector<Tensor> received_activations_, received_grads_;  // reused receive buffers
  std::vector<Tensor> outputs_, input_grads_;                  // what this stage sends
  std::vector<parallel::WorkPtr> sends_;
  int peak_in_flight_ = 0;  // measured: micro-batches forwarded but not yet backwarded
  std::vector<parallel::TimelineEvent> timeline_;

  bool stop_agreed_ = false;       // some rank received a preemption signal (agreed by all)
  double window_loss_ = 0;         // loss summed over the steps since the last progress line
  int64_t window_steps_ = 0;       // and their count (both saved in checkpoints)
  double exposed_comm_s_ = 0;      // waiting for gradient buckets since the last progress line
  int64_t dp_bytes_per_step_ = 0;  // sent on the dp communicator by this rank in the last step
};

}  // namespace strata::train
