// bench_step.hpp: the training step every step benchmark times — the product's own
// (parallel::StageEngine::step, what `train` runs), on a process grid of pipeline size 1 over
// `comm`'s ranks, for a model and one fixed batch per rank held in memory. A benchmark never
// re-implements the step; --profile breaks it down from the trace spans the step itself records.
#pragma once

#include <mpi.h>

#include <cstdio>
#include <map>
#include <string>
#include <vector>

#include "core/trace.hpp"
#include "layers/zoo.hpp"
#include "parallel/pipeline/partition.hpp"
#include "parallel/runtime/process_grid.hpp"
#include "parallel/stage/engine.hpp"

namespace strata::bench {

// What the step benchmarks vary; the rest is train's defaults.
struct StepSetup {
  layers::OptimizerConfig optimizer;
  int zero = 0;
  int64_t bucket_bytes = 25 << 20;
  int64_t batch = 1;         // samples per rank and step, one micro-batch
  DType dtype = DType::F32;  // parameters and activations (train's --precision)
  uint64_t seed = 1;
  float lr = 0.01f;
  bool shared_memory = true;  // one-node groups through shared memory (train's default)
};

class StepBench {
 public:
  // Collective over `comm`. `build`: the model for the grid's tensor-parallel group (none here).
  template <typename BuildModel>
  StepBench(MPI_Comm comm, const StepSetup& setup, BuildModel build)
      : grid_(comm, 1, parallel::Transport::Mpi, Device::cpu(), setup.shared_memory),
        model_(build()),
        engine_(grid_, model_, parallel::partition_layers(model_, 1, "balanced", 1), settings(setup, grid_.dp_size())),
        lr_(setup.lr),
        first_sample_(setup.batch * grid_.replica()) {}

  // This rank's batch: x of (batch, input...), y of (batch, target...).
  void set_batch(Tensor x, Tensor y) {
    x_ = std::move(x);
    y_ = std::move(y);
  }
  // One training step; returns its loss (the mean over the global batch's targets).
  double step() { return engine_.step(x_, y_, first_sample_, steps_++, lr_).loss; }

  parallel::ProcessGrid& grid() { return grid_; }
  const layers::Model& model() const { return model_; }
  parallel::StageEngine& engine() { return engine_; }

 private:
  static parallel::EngineSettings settings(const StepSetup& s, int dp) {
    parallel::EngineSettings e;
    e.layout.dp = dp;
    e.layout.zero = s.zero;
    e.layout.optimizer = s.optimizer;
    e.layout.bucket_bytes = s.bucket_bytes;
    e.layout.micro = s.batch;
    e.layout.dtype = s.dtype;
    e.seed = s.seed;
    return e;
  }

  parallel::ProcessGrid grid_;
  layers::Model model_;
  parallel::StageEngine engine_;
  Tensor x_, y_;
  float lr_;
  int64_t first_sample_, steps_ = 0;
};

// Runs `steps` steps with the trace recording and prints where their time went, per layer of
// the model (the spans Model::forward and Model::backward record inside the executor's forward
// and backward), the loss and the optimizer step; "other" is the rest of the wall time.
inline void print_profile(StepBench& b, int steps) {
  trace::take();  // nothing recorded before
  trace::set_recording(true);
  const int64_t t0 = trace::now_ns();
  for (int s = 0; s < steps; ++s) b.step();
  const double wall = static_cast<double>(trace::now_ns() - t0) * 1e-9;
  trace::set_recording(false);
  const std::vector<trace::Event> events = trace::take();
  // The executor's spans say which pass a layer's span belongs to.
  std::vector<std::pair<int64_t, int64_t>> backward;
  for (const trace::Event& e : events)
    if (e.track == trace::Track::Compute && e.name == "backward") backward.emplace_back(e.begin_ns, e.end_ns);
  const auto in_backward = [&](const trace::Event& e) {
    for (const auto& [begin, end] : backward)
      if (e.begin_ns >= begin && e.end_ns <= end) return true;
    return false;
  };
  std::map<std::string, std::pair<double, double>> layer;  // name -> forward, backward seconds
  double loss = 0, optimizer = 0;
  for (const trace::Event& e : events) {
    const double s = static_cast<double>(e.end_ns - e.begin_ns) * 1e-9;
    if (e.track == trace::Track::Optimizer) optimizer += s;
    if (e.track != trace::Track::Compute || e.name == "forward" || e.name == "backward") continue;
    if (e.name == "loss") {
      loss += s;
      continue;
    }
    (in_backward(e) ? layer[e.name].second : layer[e.name].first) += s;
  }
  const double k = 1e3 / steps;  // ms per step
  double counted = loss + optimizer;
  std::printf("\nper-step breakdown (mean of %d profiled steps, ms; from the step's own trace spans)\n", steps);
  std::printf("  %-12s %-60s %9s %9s %6s\n", "layer", "kind", "forward", "backward", "%");
  const layers::Model& model = b.model();
  for (size_t i = 0; i < model.size(); ++i) {
    const layers::Layer& l = model.layer(i);
    const auto [fwd, bwd] = layer[l.name()];
    counted += fwd + bwd;
    std::string kind = l.describe();
    if (kind.size() > 60) kind = kind.substr(0, 57) + "...";
    std::printf("  %-12s %-60s %9.3f %9.3f %5.1f%%\n", l.name().c_str(), kind.c_str(), fwd * k, bwd * k,
                100.0 * (fwd + bwd) / wall);
  }
  std::printf("  %-12s %-60s %9.3f %9s %5.1f%%\n", "loss", "softmax cross-entropy, forward and backward", loss * k, "",
              100.0 * loss / wall);
  std::printf("  %-12s %-60s %9.3f %9s %5.1f%%\n", "optimizer", "the optimizer step", optimizer * k, "",
              100.0 * optimizer / wall);
  std::printf("  %-12s %-60s %9.3f %9s %5.1f%%\n", "other", "zeroing gradients, executor, agreement",
              (wall - counted) * k, "", 100.0 * (wall - counted) / wall);
  std::printf("  %-12s %-60s %9.3f\n", "total", "", wall * k);
}

}  // namespace strata::bench
