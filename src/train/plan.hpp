// The plan of a run, which rank 0 prints before training and which --dry-run prints alone: the
// process grid, each stage's layers and parameters, and the bytes every rank allocates
// (parallel::plan_rank, from shapes alone), ranks with equal bytes on one line and the fullest
// marked. --dry-run builds only the model (layers know shapes; nothing is bound or allocated),
// so every GPT-2 preset plans on any machine, and for any world size with --world N.
#pragma once

#include <mpi.h>

#include <string>
#include <vector>

#include "io/data_source.hpp"
#include "layers/model.hpp"
#include "parallel/pipeline/partition.hpp"
#include "parallel/plan/grid_layout.hpp"
#include "parallel/plan/layout_search.hpp"
#include "parallel/plan/memory_plan.hpp"
#include "train/config.hpp"

namespace strata::train {

// The grid of a world of `world_size` ranks for the configuration: {pp, dp, tp}, tp fastest
// (Input errors when the sizes do not fit the world).
parallel::GridLayout grid_layout(const Config& config, int world_size);

// What the run holds around its model and step (parallel::RuntimeSpec): the shared-memory
// transport on a CPU, the data's buffers (the loader's batches of `train`, the sources' read
// buffers, evaluation's of `val` or else `train`; with neither, token windows of `windows`), and
// the checkpoints it reads or writes.
parallel::RuntimeSpec runtime_spec(const Config& config, const io::DataSource* train, const io::DataSource* val,
                                   const Shape& windows);

// Every rank's bytes in a world of `world_size` ranks (pp x dp x tp, tp fastest): parameters,
// gradients and optimizer state from the layout's arithmetic (parallel::plan_rank), activations
// from running each stage on meta tensors (parallel::plan_activations) on another model built
// like `model` (for `classes`), and what `runtime` holds. Computed once per run: the report and
// the check take it.
std::vector<parallel::RankBytes> plan_ranks(const Config& config, const layers::Model& model, int classes,
                                            const std::vector<parallel::StageRange>& stages, int world_size,
                                            const parallel::RuntimeSpec& runtime);

// The plan's text for the world of `ranks` (plan_ranks).
std::string plan_report(const Config& config, const layers::Model& model,
                        const std::vector<parallel::StageRange>& stages, const std::vector<parallel::RankBytes>& ranks);

// A rank's compute rate in FLOP/s (--plan's step-time model, MFU's denominator): --plan-tflops,
// or on the CPU a 512^3 GEMM in the run's precision timed here (best of 5); 300 TFLOP/s on a GPU.
double compute_rate(const PlanSettings& plan, DeviceKind device, DType precision);
// The planner's bandwidth per rank, and where it came from (printed beside the plan).
struct Bandwidth {
  double bytes_per_s = 0;
  std::string source;
};
// --plan-gbps; else, for the CPU device launched on several ranks, what an all-reduce between
// them costs while they compute, measured here (collective over `world`); else 25 GB/s. On a
// CPU the reductions run on the cores that compute and wait for the slowest rank: charged at
// what idle cores reach (bench_collectives), tp's collectives cost several times the model's.
Bandwidth plan_bandwidth(const PlanSettings& plan, DeviceKind device, DType precision, MPI_Comm world);
// The planner's rates: compute as compute_rate's on large products, how it falls for products of
// few rows (--plan-rows, or on the CPU measured from 8- and 512-row GEMMs; 1024 on a GPU: an
// estimate), and the bandwidth.
parallel::Rates planning_rates(const PlanSettings& plan, DeviceKind device, DType precision,
                               const Bandwidth& bandwidth);

// --device-memory: an Input error (one line, the same on every rank) when the plan of some rank
// (plan_ranks) needs more, naming the fullest rank, its parts and the largest.
void check_fits(const Config& config, const std::vector<parallel::RankBytes>& ranks);

// --layout auto: sets the configuration's tp, pp, ZeRO stage, micro-batch and recomputation to
// the planner's fastest layout that fits --device-memory on the world's ranks (--world for a dry
// run), as --plan ranks them; rank 0 searches and prints it with the runner-up, every rank takes
// it. Input error (one line) when none fits. Collective over `world`. `bandwidth`: plan_bandwidth's.
void choose_layout(Config& config, MPI_Comm world, const Bandwidth& bandwidth);

// --dry-run: reads the data's shapes (or, for a language model without --data, --vocab and
// --seq-len), builds the model and prints the plan for --world ranks (default: the job's).
// Collective over `world`: every rank checks, rank 0 prints. `bandwidth`: plan_bandwidth's.
void dry_run(const Config& config, MPI_Comm world, const Bandwidth& bandwidth);

}  // namespace strata::train
