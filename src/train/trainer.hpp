// The training loop: data-parallel over the MPI world (pp = 1 for now) with bucketed gradient
// all-reduce overlapped with backward, micro-batch gradient accumulation, optimizer and
// schedule, evaluation, metrics and checkpoints.
#pragma once

#include <memory>

#include "io/dataset.hpp"
#include "io/loader.hpp"
#include "io/sampler.hpp"
#include "layers/loss.hpp"
#include "layers/model.hpp"
#include "layers/optimizer.hpp"
#include "parallel/gradient_sync.hpp"
#include "parallel/mpi.hpp"
#include "parallel/process_grid.hpp"
#include "train/config.hpp"

namespace strata::train {

struct EvalResult {
  double loss = 0;  // mean over samples
  double accuracy = 0;
  int64_t samples = 0;
};

class Trainer {
 public:
  // Setup: opens the data, builds the model and its parameters, checks batch sizes, loads
  // --init-from. Every bad input is found here, before the first step.
  Trainer(const Config& config, MPI_Comm world);

  void train();
  EvalResult evaluate(const io::Dataset& data);
  // The dataset evaluated at the end and by --eval-only.
  const io::Dataset* eval_data() const;
  void save_checkpoint(int64_t step, int64_t epoch);

 private:
  // One optimizer step over this rank's slice of the global batch; returns the global
  // batch's summed loss.
  double train_step(const io::Batch& batch, int64_t step);
  // Sums values over the data-parallel replicas (metrics).
  void sum_over_replicas(std::vector<double>& values) const;
  // comm_fraction: share of the window's time spent waiting for gradient buckets.
  void log_progress(int64_t step, int64_t epoch, double loss, float lr, double samples_per_s, double comm_fraction,
                    double eta_s) const;

  Config config_;
  std::unique_ptr<parallel::ProcessGrid> grid_;
  int rank_ = 0, dp_ = 1, replica_ = 0;
  std::unique_ptr<io::Dataset> train_data_, val_data_;
  std::unique_ptr<io::EpochSampler> sampler_;
  std::unique_ptr<layers::Model> model_;
  std::unique_ptr<layers::ParameterStore> store_;
  std::unique_ptr<layers::Optimizer> optimizer_;
  std::unique_ptr<parallel::GradientSync> sync_;
  layers::SoftmaxCrossEntropy loss_;
  int64_t local_batch_ = 0, micro_batch_ = 0, total_steps_ = 0, start_step_ = 0;
  std::vector<layers::Context> contexts_;
  double exposed_comm_s_ = 0;  // waiting for gradient buckets since the last progress line
};

}  // namespace strata::train
