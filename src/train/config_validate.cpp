// validate(): every rule of a parsed Config that does not need the world size, each broken one
// a one-line Input error naming the flag.
#include <cmath>
#include <limits>
#include <thread>

#include "core/error.hpp"
#include "core/limits.hpp"
#include "io/checkpoint/parallel_file.hpp"
#include "layers/loss_scaler.hpp"
#include "layers/zoo.hpp"
#include "train/config.hpp"

namespace strata::train {

namespace {

// Upper bounds of the other numeric options (docs/options.md), low enough that
// the buffers a value sizes (prefetched batches, buckets) stay within memory.
using limits::kMaxBatch, limits::kMaxEpochs, limits::kMaxModelSize, limits::kMaxSteps;
constexpr int64_t kMaxRanks = int64_t{1} << 20;  // --world, and --pp, --tp, --virtual-stages
constexpr int64_t kMaxPrefetch = 64;             // each prefetched batch is a batch in memory
constexpr double kMaxBucketMb = 65536;           // 64 GiB per all-reduce bucket

// One line naming the flag, the valid range and the value found. NaN fails every comparison,
// and a finite upper bound refuses inf.
template <class T>
void require_in(const char* flag, T value, T lo, T hi) {
  STRATA_REQUIRE(value >= lo && value <= hi, flag, " must be in [", lo, ", ", hi, "], found ", value);
}

// The most threads a rank may run: 4 per hardware thread (oversubscription beyond that only
// slows it down; OpenBLAS allocates a buffer per thread).
int64_t max_threads() {
  const unsigned hw = std::thread::hardware_concurrency();
  return 4 * static_cast<int64_t>(hw > 0 ? hw : 256);
}

}  // namespace

void validate(const Config& c) {
  require_in("--global-batch", c.layout.global_batch, int64_t{1}, kMaxBatch);
  require_in("--micro-batch", c.layout.micro_batch, int64_t{0}, c.layout.global_batch);
  require_in("--epochs", c.training.epochs, int64_t{0}, kMaxEpochs);
  require_in("--steps", c.training.steps, int64_t{0}, kMaxSteps);
  STRATA_REQUIRE(c.training.lr_schedule.lr > 0 && std::isfinite(c.training.lr_schedule.lr),
                 "--lr must be positive and finite, found ", c.training.lr_schedule.lr);
  STRATA_REQUIRE(c.training.optimizer.momentum >= 0 && c.training.optimizer.momentum < 1,
                 "--momentum must be in [0, 1), found ", c.training.optimizer.momentum);
  STRATA_REQUIRE(c.training.optimizer.weight_decay >= 0 && std::isfinite(c.training.optimizer.weight_decay),
                 "--weight-decay must be finite and >= 0, found ", c.training.optimizer.weight_decay);
  require_in("--warmup-steps", c.training.lr_schedule.warmup_steps, int64_t{0}, kMaxSteps);
  require_in("--lr-step-size", c.training.lr_schedule.step_size, int64_t{0}, kMaxSteps);
  STRATA_REQUIRE(c.training.lr_schedule.gamma > 0 && c.training.lr_schedule.gamma <= 1,
                 "--lr-gamma must be in (0, 1], found ", c.training.lr_schedule.gamma);
  STRATA_REQUIRE(c.training.lr_schedule.min_lr >= 0 && c.training.lr_schedule.min_lr <= c.training.lr_schedule.lr,
                 "--min-lr must be in [0, --lr ", c.training.lr_schedule.lr, "], found ",
                 c.training.lr_schedule.min_lr);
  require_in("--bench-stage-ms", c.debug.stage_ms, 0.0, 60000.0);
  STRATA_REQUIRE(c.training.clip_grad >= 0 && std::isfinite(c.training.clip_grad),
                 "--clip-grad must be finite and >= 0 (0: off), found ", c.training.clip_grad);
  require_in("--threads", int64_t{c.runtime.threads}, int64_t{0}, max_threads());
  require_in("--log-every", c.monitor.log_every, int64_t{1}, kMaxSteps);
  require_in("--prefetch", int64_t{c.data.prefetch}, int64_t{1}, kMaxPrefetch);
  require_in("--save-every", c.checkpoint.save_every, int64_t{0}, kMaxSteps);
  require_in("--eval-every", c.monitor.eval_every, int64_t{0}, kMaxSteps);
  require_in("--keep", c.checkpoint.keep, int64_t{0}, kMaxSteps);
  require_in("--pp", int64_t{c.layout.pp}, int64_t{1}, kMaxRanks);
  require_in("--tp", int64_t{c.layout.tp}, int64_t{1}, kMaxRanks);
  require_in("--virtual-stages", int64_t{c.layout.virtual_stages}, int64_t{1}, kMaxRanks);
  require_in("--world", int64_t{c.plan.world}, int64_t{0}, kMaxRanks);
  require_in("--depth", int64_t{c.model.depth}, int64_t{1}, kMaxModelSize);
  require_in("--width", int64_t{c.model.width}, int64_t{1}, kMaxModelSize);
  require_in("--layers", int64_t{c.model.layers}, int64_t{1}, kMaxModelSize);
  require_in("--heads", int64_t{c.model.heads}, int64_t{1}, kMaxModelSize);
  require_in("--embed", int64_t{c.model.embed}, int64_t{1}, kMaxModelSize);
  require_in("--seq-len", int64_t{c.model.seq_len}, int64_t{0}, kMaxModelSize);
  require_in("--kv-heads", int64_t{c.model.kv_heads}, int64_t{0}, kMaxModelSize);
  require_in("--ffn-hidden", c.model.ffn_hidden, int64_t{0}, kMaxModelSize);
  for (int64_t h : c.model.hidden) require_in("--hidden", h, int64_t{1}, kMaxModelSize);
  // More layers than any MLP has: planning is quadratic in them (10^5 took 18 s, 350,000 minutes).
  STRATA_REQUIRE(c.model.hidden.size() <= 10000, "--hidden: at most 10000 layers, found ", c.model.hidden.size());
  require_in("--debug-fail-step", c.debug.faults.fail_step, int64_t{-1}, kMaxSteps);
  require_in("--debug-fail-rank", int64_t{c.debug.faults.fail_rank}, int64_t{-1}, kMaxRanks);
  require_in("--debug-overflow-step", c.debug.faults.overflow_step, int64_t{-1}, kMaxSteps);
  require_in("--debug-mismatch-step", c.debug.faults.mismatch_step, int64_t{-1}, kMaxSteps);
  require_in("--timeout", c.runtime.timeout, 1.0, 86400.0);
  require_in("--setup-timeout", c.runtime.setup_timeout, 1.0, 86400.0);
  require_in("--debug-setup-sleep", c.debug.setup_sleep, 0.0, 86400.0);
  require_in("--debug-slow-ms", c.debug.faults.slow_ms, 0.0, 60000.0);
  STRATA_REQUIRE(c.training.optimizer.name == "sgd" || c.training.optimizer.name == "adamw",
                 "--optimizer must be sgd or adamw, found '", c.training.optimizer.name, "'");
  const std::string& kind = c.training.lr_schedule.kind;
  STRATA_REQUIRE(kind == "constant" || kind == "step" || kind == "cosine" || kind == "linear" || kind == "wsd",
                 "--lr-schedule must be constant, step, cosine, linear or wsd, found '", kind, "'");
  const std::string& shape = c.training.lr_schedule.decay_shape;
  STRATA_REQUIRE(shape == "linear" || shape == "sqrt" || shape == "cosine",
                 "--lr-decay-shape must be linear, sqrt or cosine, found '", shape, "'");
  require_in("--lr-decay-steps", c.training.lr_schedule.decay_steps, int64_t{0}, kMaxSteps);
  STRATA_REQUIRE(c.training.lr_schedule.kind != "step" || c.training.lr_schedule.step_size > 0,
                 "--lr-schedule step needs --lr-step-size > 0, found ", c.training.lr_schedule.step_size);
  STRATA_REQUIRE(c.training.optimizer.beta1 >= 0 && c.training.optimizer.beta1 < 1 && c.training.optimizer.beta2 >= 0 &&
                     c.training.optimizer.beta2 < 1,
                 "--beta1 and --beta2 must be in [0, 1), found ", c.training.optimizer.beta1, " and ",
                 c.training.optimizer.beta2);
  STRATA_REQUIRE(c.training.optimizer.eps > 0 && c.training.optimizer.eps <= 1, "--eps must be in (0, 1], found ",
                 c.training.optimizer.eps);
  STRATA_REQUIRE(c.model.dropout >= 0 && c.model.dropout < 1, "--dropout must be in [0, 1), found ", c.model.dropout);
  STRATA_REQUIRE(c.model.recompute == "none" || c.model.recompute == "block" || c.model.recompute == "full",
                 "--recompute must be none, block or full, found '", c.model.recompute, "'");
  STRATA_REQUIRE(c.model.recompute == "none" || layers::is_language_model(c.model), "--recompute ", c.model.recompute,
                 " applies to the gpt models' transformer blocks; --model ", c.model.name,
                 " runs with --recompute none");
  STRATA_REQUIRE(c.checkpoint.resume != "auto" || !c.checkpoint.dir.empty(), "--resume auto needs --checkpoint-dir");
  STRATA_REQUIRE(c.checkpoint.io == "auto" || c.checkpoint.io == "rank0" || c.checkpoint.io == "parallel",
                 "--checkpoint-io must be auto, rank0 or parallel, found '", c.checkpoint.io, "'");
  STRATA_REQUIRE(c.checkpoint.io != "parallel" || io::ParallelCheckpointFile::available(),
                 "--checkpoint-io parallel needs a parallel HDF5 and this build's is serial (install "
                 "libhdf5-openmpi-dev and rebuild, or use --checkpoint-io rank0)");
  STRATA_REQUIRE(c.checkpoint.resume == "none" || c.checkpoint.init_from.empty(),
                 "give --resume or --init-from, not both");
  STRATA_REQUIRE(c.layout.zero >= 0 && c.layout.zero <= 3, "--zero must be 0, 1, 2 or 3, found ", c.layout.zero);
  STRATA_REQUIRE(c.layout.bucket_mb > 0 && c.layout.bucket_mb <= kMaxBucketMb, "--bucket-mb must be in (0, ",
                 kMaxBucketMb, "], found ", c.layout.bucket_mb);
  STRATA_REQUIRE(c.plan.world == 0 || c.plan.dry_run, "--world ", c.plan.world,
                 " plans a layout without launching it: it needs --dry-run");
  STRATA_REQUIRE(!c.plan.search || c.plan.dry_run,
                 "--plan searches layouts without launching them: it needs --dry-run");
  require_in("--plan-tflops", c.plan.tflops, 0.0, 1e6);                     // 0: measure
  if (c.plan.gbps != 0) require_in("--plan-gbps", c.plan.gbps, 1e-3, 1e6);  // 0: plan_bandwidth's default
  require_in("--plan-rows", c.plan.rows, 0.0, 1e9);
  require_in("--plan-top", int64_t{c.plan.top}, int64_t{1}, int64_t{100000});
  require_in("--vocab", int64_t{c.model.vocab}, int64_t{0}, int64_t{std::numeric_limits<int32_t>::max()});
  // parallel::select_device checks this too; here it is found before any communicator exists.
  STRATA_REQUIRE(c.runtime.device == DeviceKind::CUDA || c.runtime.comm == parallel::Transport::Mpi,
                 "--comm nccl needs --device cuda (NCCL moves GPU memory); use --comm mpi or auto with --device cpu");
  STRATA_REQUIRE(std::isfinite(c.training.loss_scale_init) && c.training.loss_scale_init > 0,
                 "--loss-scale-init must be finite and > 0, found ", c.training.loss_scale_init);
  require_in("--loss-scale-window", c.training.loss_scale_window, int64_t{1}, kMaxSteps);
  // --loss-scale, --loss-scale-init and --loss-scale-window, as the trainer's scaler reads them.
  layers::LossScaler::from_flags(c.training.loss_scale, precision_name(c.layout.precision), c.training.loss_scale_init,
                                 c.training.loss_scale_window);
  if (c.eval_only) {
    STRATA_REQUIRE(!c.checkpoint.init_from.empty(), "--eval-only needs --init-from CHECKPOINT");
    STRATA_REQUIRE(!c.data.val.empty() || !c.data.train.empty(), "--eval-only needs --val-data (or --data)");
  } else if (!c.plan.dry_run) {  // --dry-run plans from shapes: a GPT's may come from --vocab and --seq-len
    STRATA_REQUIRE(!c.data.train.empty(),
                   "--data is required: an HDF5 file, a directory of .h5 shards, or a glob (train --help lists every "
                   "option; jobs/configs/*.ini are whole runs: train --config FILE)");
    STRATA_REQUIRE(c.training.epochs > 0 || c.training.steps > 0 || c.plan.dry_run,
                   "give --epochs or --steps (how long to train)");
  }
}

}  // namespace strata::train
