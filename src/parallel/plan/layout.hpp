// The one layout type: how a world of pp x dp x tp ranks trains a model — ZeRO stage, dtype,
// optimizer, buckets, the batch split into micro-batches, the pipeline schedule. MPI-free, so the
// planner takes it for worlds that were not launched (--dry-run --world N, --plan) and the stage
// engine and DataParallel take the same values for the world that was.
#pragma once

#include <cstdint>

#include "core/dtype.hpp"
#include "layers/optimizer.hpp"
#include "parallel/pipeline/schedule.hpp"

namespace strata::parallel {

// train's configuration makes it once (train::layout_of); the rank arithmetic of pp x dp x tp is
// GridLayout's.
struct Layout {
  int pp = 1, dp = 1, tp = 1, zero = 0;
  // With tp > 1: activations between the tensor-parallel regions cut along the sequence
  // (layers::TensorParallelGroup::sequence_parallel), so they differ between the tp ranks.
  bool sequence_parallel = false;
  DType dtype = DType::F32;  // parameters and activations
  layers::OptimizerConfig optimizer;
  int64_t bucket_bytes = 25 << 20;
  int64_t micro = 1;      // samples per micro-batch
  int micro_batches = 1;  // per replica and step
  ScheduleKind schedule = ScheduleKind::OneFOneB;
  int virtual_stages = 1;  // chunks per pipeline rank (interleaved)
  bool cpu = true;         // CPU kernels: bf16/f16 ops stage their tensors through f32 scratch

  int64_t global_batch() const { return micro * micro_batches * dp; }
};

}  // namespace strata::parallel
