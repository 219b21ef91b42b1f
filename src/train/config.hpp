// The train program's configuration: Boost.Program_options over the command line and an INI
// file (--config); command-line values override the file's. Enumerated options are parsed
// once, here, into the lower layers' types (their names for logs and checkpoints:
// parallel::device_kind_name, parallel::transport_name, parallel::to_string(ScheduleKind),
// precision_name); every rule that does not need the world size is checked by validate().
#pragma once

#include <cstdint>
#include <ctime>
#include <optional>
#include <string>
#include <vector>

#include "core/dtype.hpp"
#include "io/checkpoint/manager.hpp"
#include "layers/optimizer.hpp"
#include "layers/zoo.hpp"
#include "parallel/pipeline/schedule.hpp"
#include "parallel/plan/memory_plan.hpp"
#include "parallel/runtime/device.hpp"
#include "parallel/stage/engine.hpp"
#include "parallel/stage/fault_injection.hpp"

namespace strata::train {

// The sections each owner takes whole.

// The data and how the loader reads it.
struct DataSettings {
  std::string train;  // --data: an HDF5 file, a directory of shards or a glob
  std::string val;    // --val-data
  bool shuffle = true;
  int prefetch = 2;  // batches prepared ahead
};

// How the world splits the work (train::layout_of makes the parallel::Layout of it).
struct LayoutSettings {
  int64_t global_batch = 64;
  int64_t micro_batch = 0;         // 0: global batch / data-parallel ranks
  int pp = 1;                      // pipeline stages; dp = world size / (tp * pp)
  int tp = 1;                      // tensor-parallel ranks per layer (Megatron-style; gpt models)
  bool sequence_parallel = false;  // --sequence-parallel: with tp, the sequence cut between the tp regions
  int virtual_stages = 1;          // --virtual-stages: chunks per pipeline rank (interleaved)
  parallel::ScheduleKind schedule = parallel::ScheduleKind::OneFOneB;  // --schedule
  std::string partition = "balanced";                                  // or cut points "3,7"
  int zero = 0;                  // ZeRO stage: 0 (off), 1 (optimizer state sharded), 2 (+ gradients), 3 (+ parameters)
  float bucket_mb = 25;          // gradient all-reduce bucket size
  DType precision = DType::F32;  // --precision fp32 | bf16 | fp16: parameters and activations
  int64_t gradient_accumulation = 0;  // a --deepspeed-config's gradient_accumulation_steps (0: not given)
  bool auto_layout = false;           // --layout auto: tp, pp, ZeRO, micro-batch, recompute by the planner
};

// How long and how the model is optimised.
struct TrainingSettings {
  int64_t epochs = 0;  // 0: not set
  int64_t steps = 0;   // 0: not set
  layers::OptimizerConfig optimizer;
  layers::LrScheduleConfig lr_schedule;
  float clip_grad = 0.0f;  // 0: off
  uint64_t seed = 0;
  std::string loss_scale = "auto";   // auto (dynamic for fp16) | dynamic | none | a number
  double loss_scale_init = 65536.0;  // dynamic loss scaling starts here
  int64_t loss_scale_window = 2000;  // good steps before the scale doubles
};

// Devices, transports, threads and deadlines.
struct RuntimeSettings {
  DeviceKind device = DeviceKind::CPU;                  // --device cpu | cuda
  parallel::Transport comm = parallel::Transport::Mpi;  // --comm nccl | mpi | auto (resolved: nccl on cuda)
  bool shared_memory = true;                            // one node: collectives and pipeline messages in shared memory
  int threads = 0;                                      // 0: cores / ranks on the node
  bool tf32 = false;                                    // allow TF32 tensor cores for f32 GPU matrix products
  bool flush_denormals = true;                          // CPU kernels flush denormal floats to zero (FTZ, DAZ)
  // Seconds a rank waits for a communication operation during training before it reports and
  // aborts the job (watchdog.hpp).
  double timeout = 300;
  // Seconds from option parsing to the first step before a rank still in setup reports and
  // exits (blocking_deadline.hpp): loading data and checking a checkpoint whole may take long.
  double setup_timeout = 1800;
};

// What the run reports, and where.
struct MonitorSettings {
  int64_t log_every = 100, eval_every = 0;
  std::string metrics;      // --metrics FILE: one JSON object per progress line
  std::string tensorboard;  // --tensorboard DIR: the metrics as TensorBoard event files (rank 0)
  std::string log_file;     // rank 0 also appends its log lines here
  bool log_all_ranks = false;
  std::string timeline;                      // SVG of the last step's pipeline timeline
  std::string trace;                         // --trace FILE: Chrome trace-event JSON of every rank
  int64_t trace_first = 1, trace_last = 10;  // --trace-steps first:last (1-based, inclusive)
};

// --dry-run and --plan, and the memory every rank may use.
struct PlanSettings {
  bool dry_run = false;       // print the plan (per-rank bytes from shapes) and exit, allocating nothing
  int world = 0;              // plan for this many ranks (0: the ranks launched)
  bool search = false;        // --plan: search the layouts that fit --device-memory
  double tflops = 0;          // --plan-tflops: compute rate per rank (0: measured on the CPU; cuda: 300)
  double gbps = 0;            // --plan-gbps: communication bandwidth per rank, GB/s (0: plan_bandwidth's default)
  double rows = 0;            // --plan-rows: GEMM rows at half the rate (0: measured on the CPU; cuda: 1024)
  int top = 5;                // --plan-top: layouts listed
  int64_t device_memory = 0;  // --device-memory: bytes each rank may use (0: no limit)
};

// Testing and benchmark aids (--debug-*, --bench-stage-ms).
struct DebugSettings {
  parallel::FaultInjection faults;  // in the training step
  double setup_sleep = 0;           // rank faults.fail_rank sleeps this many seconds in setup
  // Every stage also sleeps this long per micro-batch forward (twice per backward): compute that
  // takes no core, to measure the bubble with more stages than cores.
  double stage_ms = 0;
};

struct Config {
  layers::ModelSpec model;
  DataSettings data;
  LayoutSettings layout;
  TrainingSettings training;
  RuntimeSettings runtime;
  io::CheckpointSettings checkpoint;  // read_only: --eval-only
  MonitorSettings monitor;
  PlanSettings plan;
  DebugSettings debug;

  bool eval_only = false;
  // --run-dir: this run's directory (checkpoints, metrics.jsonl, train.log, config.ini); `{time}`
  // in it becomes the start time (apply_run_dir).
  std::string run_dir;
  std::string deepspeed_config;                    // --deepspeed-config FILE (mapped into the options above)
  bool strict_config = false;                      // its unmapped keys are an error, not warnings
  std::vector<std::string> deepspeed_unsupported;  // its keys not mapped (one warning each)

  // "key = value" lines of every option, for the start-of-run printout.
  std::vector<std::pair<std::string, std::string>> effective;
  // The flags given on the command line or in --config (not defaulted), for the commands --plan prints.
  std::vector<std::pair<std::string, std::string>> given;
};

// Parses argv (and the --config file), then validate()s. Returns nullopt after printing
// --help. Throws an Input error with one line for unknown options, bad values and inconsistent
// settings.
std::optional<Config> parse_config(int argc, const char* const argv[], bool print_help);

// --run-dir: `{time}` becomes `start` as YYYYMMDD-HHMMSS (local time; the caller passes rank 0's,
// so every rank names the same directory), and --checkpoint-dir, --metrics and --log-file that
// were not given go into it (the directory itself, metrics.jsonl, train.log). No --run-dir: no change.
void apply_run_dir(Config& config, std::time_t start);
// A run's config.ini: every option's value (`train --config FILE` repeats the run), except
// --config itself and the paths --run-dir chose; --run-dir as written (a new run gets a new
// directory), the directory it became in a comment.
std::string run_config_text(const Config& config, const std::string& run_dir_as_given);
// The options given (not defaulted; a --config file's too), for the short summary printed at
// the start: "--config jobs/x.ini --model cnn --epochs 5 ...".
std::string given_options(const Config& config);

// Every check of a parsed Config that does not need the world size (value ranges and the rules
// between options); the first broken one is thrown as a one-line Input error. What needs the
// world (--pp against the ranks, the batch split: parallel::split_batch) or the data is
// checked by the trainer.
void validate(const Config& c);

// What the planner and the stage engine take: the layout of a world with `dp` data-parallel
// replicas, and the engine's settings.
parallel::Layout layout_of(const Config& config, int dp);
parallel::EngineSettings engine_settings(const Config& config, int dp);

// Parses "1024,1024" into sizes; throws an Input error naming the flag otherwise.
std::vector<int64_t> parse_int_list(const std::string& text, const std::string& flag);
// "80GiB", "512MiB", "1.5GB", "4096" -> bytes; an Input error naming `flag` otherwise.
int64_t parse_bytes(const std::string& text, const std::string& flag);

}  // namespace strata::train
