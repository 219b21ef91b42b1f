// The training program's wiring and epoch loop. Each capability has its owner and the trainer
// only connects them: the process grid (parallel), the data and its sampler (io), the model
// (layers), the stage engine that runs a step on this rank's part of the layout
// (parallel::StageEngine), the checkpoint manager (io::CheckpointManager) and the monitor that
// reports (train/monitor.hpp).
#pragma once

#include <memory>
#include <string>

#include "io/batch_order.hpp"
#include "io/checkpoint/manager.hpp"
#include "io/data_source.hpp"
#include "io/loader.hpp"
#include "layers/model.hpp"
#include "parallel/runtime/process_grid.hpp"
#include "parallel/stage/engine.hpp"
#include "train/config.hpp"
#include "train/monitor.hpp"

namespace strata::train {

// How train() ended. Diverged: a step's loss was not finite; nothing after the last checkpoint
// was saved, and every rank exits 1.
enum class TrainEnd { Finished, Preempted, Diverged };

class Trainer {
 public:
  // Setup: opens the data, builds the model, plans it and refuses a layout that does not fit,
  // builds the stage engine, loads --init-from or --resume. Every bad input is found here,
  // before the first step.
  Trainer(const Config& config, MPI_Comm world);

  // Trains. All ranks agree on how it ended: a stop signal ends it early (a checkpoint saved if
  // --checkpoint-dir is set), a non-finite loss ends it without saving.
  TrainEnd train();
  // Collective over the world: every rank calls it.
  EvalResult evaluate(const io::DataSource& data);
  // The dataset evaluated at the end and by --eval-only.
  const io::DataSource* eval_data() const;
  // Rank 0 appends an evaluation to --metrics (at the step training reached).
  void record_evaluation(const std::string& what, const EvalResult& r);
  // Collective: with --trace, writes the trace file.
  void write_trace() { monitor_->write_trace(); }

 private:
  // The data position of the next batch, and the steps of the run.
  struct Position {
    int64_t start_step = 0, total_steps = 0;
    int64_t epoch = 0, in_epoch = 0;
  };
  // What a checkpoint of step `step` holds besides the tensors.
  io::RunState run_state(int64_t step) const;
  // Continues from a resumed checkpoint's state.
  void restore(const io::RunState& saved);
  // Collective: the step loop's save when a stop signal arrived.
  void save_at_stop(int64_t done);

  Config config_;
  std::unique_ptr<parallel::ProcessGrid> grid_;
  std::unique_ptr<Monitor> monitor_;
  std::unique_ptr<io::CheckpointManager> checkpoints_;
  std::unique_ptr<io::DataSource> train_data_, val_data_;
  std::unique_ptr<io::BatchOrder> sampler_;
  std::unique_ptr<layers::Model> model_;
  std::unique_ptr<parallel::StageEngine> engine_;
  Position position_;
  int64_t classes_ = 0;  // the model's output classes (a language model's vocabulary)
};

}  // namespace strata::train
