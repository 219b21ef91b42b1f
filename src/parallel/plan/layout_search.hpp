// `train --dry-run --plan`: the layouts of a world (tp x pp x dp, ZeRO stage, micro-batch,
// recomputation) whose plan fits the device, fastest first by a step-time model simple enough
// to check by hand (docs/parallelism.md, "Will it fit?"). Per rank of the slowest stage:
//   compute = 2 x 3 x multiply-adds per sample of the stage x samples per replica / rate
//             (2 x 4 with recomputation: one more forward)
//   bubble  = compute x (P - 1) / m                 (1F1B: a step is (m + P - 1) / m computes)
//   dp      = 2 (dp - 1) / dp x the stage's f32 gradient bytes / bandwidth (x 1.5 for ZeRO 3,
//             whose parameters are gathered for forward and again for backward)
//   tp      = 2 (tp - 1) / tp x 4 all-reduces per block and micro-batch (6 with recomputation)
//             of the block's activations (micro x T x D) / bandwidth
//   pp      = 2 messages per micro-batch of the stage's output / bandwidth
// Communication counts as exposed, none overlapped: a bound that ranks layouts, not a
// prediction of seconds. GPipe is left out (1F1B's bubble with less memory), as are
// interleaved schedules (fewer bubbles for more messages: try them from the best layout).
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "layers/gpt.hpp"
#include "parallel/plan/memory_plan.hpp"

namespace strata::parallel {

struct Rates {
  double flops_per_s = 0;  // per rank, on large matrix products
  double bytes_per_s = 0;  // per rank, for every collective and message
  // The rows of a matrix product (a micro-batch's tokens, or samples) at which a rank computes at
  // half flops_per_s: small micro-batches run at flops_per_s * rows / (rows + half_rate_rows),
  // which is how a GEMM's rate falls with its rows. 0: every size at flops_per_s.
  double half_rate_rows = 0;
  double rate_at(double rows) const {
    return half_rate_rows > 0 ? flops_per_s * rows / (rows + half_rate_rows) : flops_per_s;
  }
};

struct StepTime {
  double compute_s = 0, bubble_s = 0, dp_s = 0, tp_s = 0, pp_s = 0;
  double total() const { return compute_s + bubble_s + dp_s + tp_s + pp_s; }
};

// A layout the search tried (1F1B, one chunk per rank) and what it costs.
struct LayoutChoice {
  Layout layout;
  layers::Recompute recompute = layers::Recompute::None;
  int64_t bytes = 0;  // the fullest rank's plan
  StepTime time;
};

struct SearchSpace {
  int world = 1;
  int64_t global_batch = 1;
  int64_t device_bytes = 0;  // per rank; 0: any layout fits
  Layout base;               // dtype, optimizer, bucket bytes, device kind (the rest is searched)
  std::string partition = "balanced";
  bool can_recompute = false;  // the model has blocks to recompute (GPT)
  int max_tp = 8;              // tensor parallelism stays within a node's GPUs
  RuntimeSpec runtime;         // what the run holds besides (memory_plan.hpp), in each layout's bytes
};

// The model for one tensor-parallel width and recomputation, built with `group` (a
// PlannedTensorParallel of that width, or null for 1). An Input error (heads or vocabulary
// that do not divide by tp) skips the width.
using ModelFor = std::function<layers::Model(int tp, layers::Recompute recompute, layers::TensorParallelGroup* group)>;

struct SearchResult {
  std::vector<LayoutChoice> fitting;  // fastest first
  int tried = 0;
  LayoutChoice smallest;             // the layout with the least memory, fitting or not
  std::vector<std::string> skipped;  // "tp 2: <why the model cannot be split so>"
};

SearchResult search_layouts(const SearchSpace& space, const Rates& rates, const ModelFor& model_for);

// The model's time for one step of `choice` (built for its tp and recomputation, cut into `stages`).
StepTime estimate_step_time(const layers::Model& model, const std::vector<StageRange>& stages,
                            const LayoutChoice& choice, int64_t global_batch, const Rates& rates);

}  // namespace strata::parallel
