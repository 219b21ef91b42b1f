// Options and their defaults (their checks: config_validate.cpp). Option names are stable:
// later features add options, they never rename these.
#include "train/config.hpp"

#include <algorithm>
#include <boost/program_options.hpp>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <sstream>
#include <utility>
#include <vector>

#include "core/error.hpp"
#include "core/ops.hpp"
#include "io/checkpoint/parallel_file.hpp"
#include "layers/loss_scaler.hpp"
#include "layers/zoo.hpp"
#include "parallel/data/batch_split.hpp"
#include "train/deepspeed_config.hpp"

namespace po = boost::program_options;

namespace strata::train {

std::vector<int64_t> parse_int_list(const std::string& text, const std::string& flag) {
  std::vector<int64_t> values;
  std::stringstream ss(text);
  std::string item;
  while (std::getline(ss, item, ',')) {
    size_t used = 0;
    int64_t v = 0;
    try {
      v = std::stoll(item, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    STRATA_REQUIRE(used == item.size() && !item.empty() && v > 0, flag,
                   " expects a comma-separated list of positive integers (e.g. 1024,1024), found '", text, "'");
    values.push_back(v);
  }
  STRATA_REQUIRE(!values.empty(), flag, " expects at least one size, found '", text, "'");
  return values;
}

// --trace-steps FIRST:LAST, 1 <= FIRST <= LAST.
void parse_step_range(const std::string& text, int64_t& first, int64_t& last) {
  long long a = 0, b = 0;
  char end = 0;
  const bool parsed = std::sscanf(text.c_str(), "%lld:%lld%c", &a, &b, &end) == 2;
  STRATA_REQUIRE(parsed && a >= 1 && a <= b && b <= (int64_t{1} << 36),
                 "--trace-steps expects FIRST:LAST with 1 <= FIRST <= LAST (e.g. 5:8), found '", text, "'");
  first = a;
  last = b;
}

int64_t parse_bytes(const std::string& text, const std::string& flag) {
  // A number and an optional unit: 80GiB, 512MiB, 1.5GB, 4096.
  static const std::pair<const char*, double> units[] = {{"TiB", 1099511627776.0},
                                                         {"GiB", 1073741824.0},
                                                         {"MiB", 1048576.0},
                                                         {"KiB", 1024.0},
                                                         {"TB", 1e12},
                                                         {"GB", 1e9},
                                                         {"MB", 1e6},
                                                         {"KB", 1e3},
                                                         {"kB", 1e3},
                                                         {"B", 1.0}};
  size_t used = 0;
  double value = -1;
  try {
    value = std::stod(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  const std::string unit = used > 0 ? text.substr(used) : "";
  double scale = unit.empty() ? 1.0 : 0.0;
  for (const auto& [name, factor] : units)
    if (unit == name) scale = factor;
  const double bytes = value * scale;
  STRATA_REQUIRE(used > 0 && scale > 0 && std::isfinite(bytes) && bytes >= 0 && bytes < 9.2e18, flag,
                 " expects a size such as 80GiB, 512MiB, 1.5GB or a number of bytes, found '", text, "'");
  return static_cast<int64_t>(bytes);
}

namespace {

std::string any_to_string(const boost::any& v) {
  if (const auto* s = boost::any_cast<std::string>(&v)) return *s;
  if (const auto* i = boost::any_cast<int64_t>(&v)) return std::to_string(*i);
  if (const auto* i = boost::any_cast<int>(&v)) return std::to_string(*i);
  if (const auto* u = boost::any_cast<uint64_t>(&v)) return std::to_string(*u);
  if (const auto* b = boost::any_cast<bool>(&v)) return *b ? "true" : "false";
  if (const auto* f = boost::any_cast<float>(&v)) return detail::cat(*f);
  if (const auto* d = boost::any_cast<double>(&v)) return detail::cat(*d);
  return "?";
}

}  // namespace

namespace {

// The option of `desc` nearest to `name` (edit distance, or one that starts with `name`), for
// "did you mean"; "" when none is close.
std::string nearest_option(const po::options_description& desc, const std::string& name) {
  const auto distance = [](const std::string& a, const std::string& b) {
    std::vector<size_t> row(b.size() + 1);
    for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
    for (size_t i = 1; i <= a.size(); ++i) {
      size_t diagonal = row[0];
      row[0] = i;
      for (size_t j = 1; j <= b.size(); ++j)
        diagonal = std::exchange(row[j], std::min({row[j] + 1, row[j - 1] + 1, diagonal + (a[i - 1] != b[j - 1])}));
    }
    return row[b.size()];
  };
  std::string best;
  size_t best_distance = std::max<size_t>(2, name.size() / 3) + 1;
  for (const auto& option : desc.options()) {
    const std::string& candidate = option->long_name();
    const size_t d = candidate.starts_with(name) ? 1 : distance(name, candidate);
    if (d < best_distance) {
      best_distance = d;
      best = candidate;
    }
  }
  return best;
}

// "unknown option '--x'; did you mean --y?"
std::string unknown_option(const po::options_description& desc, std::string name) {
  while (name.starts_with("-")) name.erase(0, 1);
  const std::string near = nearest_option(desc, name);
  return detail::cat("unknown option '--", name, "'", near.empty() ? "" : detail::cat("; did you mean --", near, "?"));
}

// The line of `path` that sets `key` (from 1; 0 when none does), for errors in a config file.
int line_of(const std::string& path, const std::string& key, int occurrence = 1) {
  std::ifstream in(path);
  int number = 0;
  for (std::string line; std::getline(in, line);) {
    ++number;
    const size_t start = line.find_first_not_of(" \t");
    if (start != std::string::npos && line.compare(start, key.size(), key) == 0 &&
        (start + key.size() == line.size() || line.find_first_of(" \t=", start + key.size()) == start + key.size()) &&
        --occurrence == 0)
      return number;
  }
  return 0;
}

}  // namespace

std::optional<Config> parse_config(int argc, const char* const argv[], bool print_help) {
  Config c;
  std::string hidden = "1024,1024", config_file;
  int64_t seed = 0;  // read signed, so that -1 is refused rather than wrapped to 2^64 - 1
  // Enumerated options, read as text and parsed below.
  std::string schedule = "1f1b", device = "cpu", comm = "auto", precision = "fp32", device_memory = "0",
              trace_steps = "1:10", layout = "given";
  po::options_description desc("Usage: train [options]   (mpirun -np N train ... for N ranks)\nOptions");
  // clang-format off
  desc.add_options()
    ("help,h", "print this help and exit")
    ("version", "print the version and build (HDF5 parallel or serial, CUDA or CPU only) and exit")
    ("config", po::value(&config_file), "INI file of options (keys are option names); command-line flags override it")
    ("deepspeed-config", po::value(&c.deepspeed_config), "a DeepSpeed ds_config.json: its common keys as options (docs/migration.md); flags and --config override it, keys it does not map are one warning each")
    ("strict-config", po::value(&c.strict_config)->default_value(false)->implicit_value(true), "a --deepspeed-config key that is not mapped is an error, not a warning")
    ("model", po::value(&c.model.name)->default_value("cnn"), "mlp | cnn | resnet | gpt | gpt2-124m | gpt2-350m | gpt2-774m | gpt2-1.5b (GPT-2's shapes) | llama | llama3.2-1b | llama3.2-3b | llama3.1-8b | llama3.1-70b (Meta's shapes)")
    ("hidden", po::value(&hidden)->default_value("1024,1024"), "mlp hidden sizes, comma-separated")
    ("depth", po::value(&c.model.depth)->default_value(20), "resnet depth, 6n+2")
    ("width", po::value(&c.model.width)->default_value(16), "resnet channels of the first stage")
    ("dropout", po::value(&c.model.dropout)->default_value(0.0f), "dropout after hidden activations (mlp, cnn); gpt: after the embedding, on attention probabilities and after residual projections")
    ("layers", po::value(&c.model.layers)->default_value(12), "gpt: transformer blocks")
    ("heads", po::value(&c.model.heads)->default_value(12), "gpt: attention heads (must divide --embed)")
    ("embed", po::value(&c.model.embed)->default_value(768), "gpt: model width")
    ("seq-len", po::value(&c.model.seq_len)->default_value(0), "gpt: tokens per sample (context length; a preset's by default)")
    ("tie-embeddings", po::value(&c.model.tie_embeddings)->default_value(true), "gpt, llama: the LM head uses the token embedding's weights (default: GPT-2 and Llama 3.2 do, llama and Llama 3.1 do not)")
    ("kv-heads", po::value(&c.model.kv_heads)->default_value(0), "llama: key/value heads of grouped-query attention (must divide --heads; 0: --heads, 1: multi-query)")
    ("ffn-hidden", po::value(&c.model.ffn_hidden)->default_value(0), "llama: the SwiGLU MLP's hidden size (0: 8/3 --embed rounded up to 256)")
    ("rope-theta", po::value(&c.model.rope_theta)->default_value(500000), "llama: the rotary embedding's base")
    ("rope-scaling", po::value(&c.model.rope_scaling)->default_value(0), "llama: Llama 3.1's rotary frequency scaling with this factor (8; Llama 3.2: 32), for contexts beyond 8192; 0: none")
    ("vocab", po::value(&c.model.vocab)->default_value(0), "gpt: logits per position, at least the data's vocabulary (0: the data's; a preset: 50257), e.g. 50304 to pad to a multiple of 64; --dry-run without --data plans with it")
    ("attention", po::value(&c.model.attention)->default_value("flash"), "gpt: flash (memory-efficient, O(T) memory per head) | plain (materialised probabilities)")
    ("activation", po::value(&c.model.activation)->default_value("gelu"), "gpt: the MLP's activation: gelu (exact, x Phi(x)) | gelu_tanh (GPT-2's tanh approximation, Hugging Face's gelu_new)")
    ("norm-eps", po::value(&c.model.norm_eps)->default_value(1e-5f, "1e-05"), "gpt: the LayerNorms' epsilon (GPT-2: 1e-5); llama: the RMSNorms' (a preset sets Llama 3's 1e-5)")
    ("recompute", po::value(&c.model.recompute)->default_value("none"), "gpt: activation recomputation: none | block (each transformer block keeps only its input and re-runs its forward in backward) | full (also the attention and the MLP inside it); bit-identical results")
    ("data", po::value(&c.data.train), "training data: an HDF5 file, a directory of .h5 shards, or a glob")
    ("val-data", po::value(&c.data.val), "evaluation data, same forms as --data")
    ("epochs", po::value(&c.training.epochs)->default_value(0), "epochs to train from the start (0: use --steps; both: whichever ends first)")
    ("steps", po::value(&c.training.steps)->default_value(0), "optimizer steps from the start (0: use --epochs)")
    ("global-batch", po::value(&c.layout.global_batch)->default_value(64), "samples per optimizer step, all ranks together")
    ("micro-batch", po::value(&c.layout.micro_batch)->default_value(0), "samples per forward/backward (0: global batch / replicas, no accumulation); gradients accumulate over global / (micro x replicas) micro-batches")
    ("optimizer", po::value(&c.training.optimizer.name)->default_value("sgd"), "sgd | adamw")
    ("lr", po::value(&c.training.lr_schedule.lr)->default_value(0.05f, "0.05 for sgd, 0.001 for adamw"), "peak learning rate")
    ("momentum", po::value(&c.training.optimizer.momentum)->default_value(0.9f, "0.9"), "sgd momentum")
    ("nesterov", po::value(&c.training.optimizer.nesterov)->default_value(false), "sgd Nesterov momentum")
    ("weight-decay", po::value(&c.training.optimizer.weight_decay)->default_value(0.0f), "L2 (sgd) or decoupled (adamw) weight decay")
    ("beta1", po::value(&c.training.optimizer.beta1)->default_value(0.9, "0.9"), "adamw beta1")
    ("beta2", po::value(&c.training.optimizer.beta2)->default_value(0.999, "0.999"), "adamw beta2")
    ("eps", po::value(&c.training.optimizer.eps)->default_value(1e-8f, "1e-08"), "adamw epsilon")
    ("lr-schedule", po::value(&c.training.lr_schedule.kind)->default_value("constant"), "constant | step | cosine | linear (decay to --min-lr over the run after warm-up) | wsd (warmup-stable-decay: --lr until the last --lr-decay-steps, then down to --min-lr)")
    ("warmup-steps", po::value(&c.training.lr_schedule.warmup_steps)->default_value(0), "linear warm-up steps")
    ("lr-step-size", po::value(&c.training.lr_schedule.step_size)->default_value(0), "step schedule: steps between decays")
    ("lr-gamma", po::value(&c.training.lr_schedule.gamma)->default_value(0.1f, "0.1"), "step schedule: decay factor")
    ("min-lr", po::value(&c.training.lr_schedule.min_lr)->default_value(0.0f), "cosine, linear and wsd schedules: final learning rate")
    ("lr-decay-steps", po::value(&c.training.lr_schedule.decay_steps)->default_value(0), "wsd schedule: the steps of its final decay (0: the last fifth of the run)")
    ("lr-decay-shape", po::value(&c.training.lr_schedule.decay_shape)->default_value("linear"), "wsd schedule: the decay's shape: linear | sqrt (1 - sqrt of its progress) | cosine")
    ("clip-grad", po::value(&c.training.clip_grad)->default_value(0.0f), "clip the global gradient norm to this (0: off)")
    ("seed", po::value(&seed)->default_value(0), "seed of initialisation, shuffling and dropout")
    ("shuffle", po::value(&c.data.shuffle)->default_value(true), "shuffle the training data every epoch")
    ("threads", po::value(&c.runtime.threads)->default_value(0), "threads per rank (0: the cores of the rank's affinity mask, shared among the node's ranks whose masks overlap it)")
    ("checkpoint-dir", po::value(&c.checkpoint.dir), "write HDF5 checkpoints here")
    ("save-every", po::value(&c.checkpoint.save_every)->default_value(0), "checkpoint every N steps (0: only at the end)")
    ("eval-every", po::value(&c.monitor.eval_every)->default_value(0), "evaluate on --val-data every N steps (0: only at the end)")
    ("log-every", po::value(&c.monitor.log_every)->default_value(100), "progress line every N steps")
    ("metrics", po::value(&c.monitor.metrics), "append one JSON object per logged step to this file")
    ("tensorboard", po::value(&c.monitor.tensorboard), "write what --metrics holds as TensorBoard event files in this directory (events.out.tfevents.*; rank 0, flushed at every line)")
    ("init-from", po::value(&c.checkpoint.init_from), "initialise the model from this checkpoint")
    ("resume", po::value(&c.checkpoint.resume)->default_value("none"), "continue training from a checkpoint: none | auto (the newest complete one in --checkpoint-dir) | PATH; --steps/--epochs count from the very start")
    ("keep", po::value(&c.checkpoint.keep)->default_value(0), "keep only the newest K checkpoints this job wrote in --checkpoint-dir (0: all)")
    ("checkpoint-io", po::value(&c.checkpoint.io)->default_value("auto"), "who writes a checkpoint: rank0 (rank 0 gathers every tensor and writes it), parallel (every rank writes its own part of the same file: parallel HDF5 over MPI-IO) or auto (parallel when this build's HDF5 is parallel)")
    ("async-save", po::value(&c.checkpoint.async)->default_value(false)->implicit_value(true), "write checkpoints in the background while training goes on (parallel: every rank writes a host copy of its part from its own thread; rank0: rank 0 holds a host copy of the whole state until written; the next save, a stop signal and the end wait for it)")
    ("eval-only", po::value(&c.eval_only)->default_value(false)->implicit_value(true), "evaluate --init-from on --val-data (or --data) and exit")
    ("prefetch", po::value(&c.data.prefetch)->default_value(2), "batches the loader prepares ahead")
    ("log-all-ranks", po::value(&c.monitor.log_all_ranks)->default_value(false)->implicit_value(true), "every rank prints, prefixed with its rank (default: rank 0 only)")
    ("pp", po::value(&c.layout.pp)->default_value(1), "pipeline stages; the world is pp x dp x tp (dp = ranks / (pp x tp))")
    ("layout", po::value(&layout)->default_value("given"), "given (--tp, --pp, --zero, --micro-batch and --recompute as set) | auto (the planner's fastest layout that fits --device-memory on the ranks this job got, chosen at start and so at every resume; printed with the runner-up)")
    ("tp", po::value(&c.layout.tp)->default_value(1), "tensor parallelism: each layer of a gpt model split over this many consecutive ranks (whole heads, vocabulary slices; Megatron-style)")
    ("sequence-parallel", po::value(&c.layout.sequence_parallel)->default_value(false)->implicit_value(true), "with --tp: Megatron's sequence parallelism, the norms, dropouts and residual adds on T/tp of each sequence (all-gather before and reduce-scatter after each tensor-parallel region instead of all-reduces): about tp times fewer activations; no effect with --tp 1")
    ("partition", po::value(&c.layout.partition)->default_value("balanced"), "stage cuts: 'balanced' (by estimated compute) or layer indices '3,7'")
    ("schedule", po::value(&schedule)->default_value("1f1b"), "pipeline schedule: gpipe | 1f1b | interleaved (1F1B over --virtual-stages chunks per rank; Megatron's)")
    ("virtual-stages", po::value(&c.layout.virtual_stages)->default_value(1), "--schedule interleaved: chunks of layers per pipeline rank (the model is cut into pp x this many stages, rank s holding stages s, s + pp, ...)")
    ("timeline", po::value(&c.monitor.timeline), "write an SVG timeline of the last step's pipeline (and print it as text)")
    ("trace", po::value(&c.monitor.trace), "write a Chrome trace-event JSON file of every rank (open it in ui.perfetto.dev or chrome://tracing): compute per layer and micro-batch, collectives and messages in flight, waits, optimizer, data loading, checkpoints, evaluation")
    ("trace-steps", po::value(&trace_steps)->default_value("1:10"), "--trace: the steps recorded, FIRST:LAST (1-based, inclusive)")
    ("zero", po::value(&c.layout.zero)->default_value(0), "ZeRO stage: 0 (replicated) | 1 (optimizer state sharded over each data-parallel group) | 2 (gradients sharded too) | 3 (parameters sharded too)")
    ("device-memory", po::value(&device_memory)->default_value("0"), "the memory each rank may use (80GiB, 512MiB, ...; 0: no limit): a layout whose plan needs more is refused before anything is allocated, naming what does not fit; on the CPU device the allocator also holds every rank to it")
    ("dry-run", po::value(&c.plan.dry_run)->default_value(false)->implicit_value(true), "print the plan (stages, and each rank's bytes of parameters, gradients, optimizer state and activations, computed from shapes: nothing is allocated) and exit")
    ("world", po::value(&c.plan.world)->default_value(0), "--dry-run: plan for this many ranks from one process (0: the ranks launched)")
    ("plan", po::value(&c.plan.search)->default_value(false)->implicit_value(true), "--dry-run: search the layouts (tp, pp, dp, ZeRO stage, micro-batch, recomputation) that fit --device-memory on --world ranks and print the fastest by a step-time model (docs/parallelism.md), each with its train command")
    ("plan-tflops", po::value(&c.plan.tflops)->default_value(0), "compute rate per rank in TFLOP/s: --plan's step-time model and the progress lines' MFU (0: a GEMM in --precision measured at start on the CPU device; with cuda 300 for --plan and no MFU)")
    ("plan-gbps", po::value(&c.plan.gbps)->default_value(0), "--plan: bandwidth per rank for collectives and pipeline messages, GB/s; 0: on the CPU device, launched on several ranks, measured there (all-reduces between the ranks while they compute), else 25")
    ("plan-rows", po::value(&c.plan.rows)->default_value(0), "--plan: the rows (a micro-batch's tokens, or samples) of a matrix product at which a rank computes at half its rate, so that small micro-batches cost what they do (0: measured on the CPU from 8- and 512-row GEMMs; with cuda 1024, an estimate)")
    ("plan-top", po::value(&c.plan.top)->default_value(5), "--plan: how many layouts to list, fastest first")
    ("bucket-mb", po::value(&c.layout.bucket_mb)->default_value(25.0f), "MiB of gradients per all-reduce bucket (data parallelism)")
    ("device", po::value(&device)->default_value("cpu"), "cpu | cuda (one GPU per rank, chosen by the rank on its node)")
    ("comm", po::value(&comm)->default_value("auto"), "communication: auto (nccl with cuda, mpi with cpu) | nccl | mpi (GPU buffers staged through host memory; lets ranks share a GPU)")
    ("shared-memory", po::value(&c.runtime.shared_memory)->default_value(true), "on one node, all-reduce, ZeRO's reduce and all-gather and the pipeline's messages go through shared memory; false: everything through MPI")
    ("precision", po::value(&precision)->default_value("fp32"), "fp32 | bf16 | fp16: parameters and activations (fp32 master weights, gradients and optimizer state)")
    ("loss-scale", po::value(&c.training.loss_scale)->default_value("auto"), "auto (dynamic for fp16, none otherwise) | dynamic | none | a fixed number")
    ("loss-scale-init", po::value(&c.training.loss_scale_init)->default_value(65536.0), "dynamic loss scaling: initial scale")
    ("loss-scale-window", po::value(&c.training.loss_scale_window)->default_value(2000), "dynamic loss scaling: good steps before the scale doubles")
    ("tf32", po::value(&c.runtime.tf32)->default_value(false), "allow TF32 tensor cores for fp32 matrix products on the GPU")
    ("flush-denormals", po::value(&c.runtime.flush_denormals)->default_value(true), "the CPU kernels flush denormal floats to zero (x86 FTZ and DAZ): each denormal costs ~100 cycles; false: IEEE gradual underflow")
    ("debug-overflow-step", po::value(&c.debug.faults.overflow_step)->default_value(-1), "testing aid: put an inf into rank 0's gradients at this step (1 = the first)")
    ("debug-fail-step", po::value(&c.debug.faults.fail_step)->default_value(-1), "testing aid: fail on purpose at this step (1 = the first) ...")
    ("debug-fail-rank", po::value(&c.debug.faults.fail_rank)->default_value(-1), "... on this rank")
    ("debug-mismatch-step", po::value(&c.debug.faults.mismatch_step)->default_value(-1), "testing aid: at this step every rank issues one extra all-reduce, --debug-fail-rank an average where the others sum (the collective fingerprints differ)")
    ("timeout", po::value(&c.runtime.timeout)->default_value(300.0), "seconds a rank waits for a communication operation during training before it names what it waits for and aborts the job (exit 5)")
    ("run-dir", po::value(&c.run_dir), "this run's directory: its checkpoints (unless --checkpoint-dir), metrics.jsonl (unless --metrics), train.log (unless --log-file) and config.ini, every option's value (train --config DIR/config.ini repeats the run); {time} in it becomes the start time, YYYYMMDD-HHMMSS, so each run gets its own")
    ("log-file", po::value(&c.monitor.log_file)->default_value(""), "rank 0 also appends every line it logs to this file (a job's run directory: the lines of a final save reach it even when mpirun stops forwarding output at a cancel)")
    ("setup-timeout", po::value(&c.runtime.setup_timeout)->default_value(1800.0), "seconds from option parsing to the first step (devices, communicators, data, model, checkpoint) before a rank still in setup says so and the job ends (exit 5)")
    ("debug-setup-sleep", po::value(&c.debug.setup_sleep)->default_value(0.0), "testing aid: --debug-fail-rank sleeps this many seconds in setup")
    ("debug-slow-ms", po::value(&c.debug.faults.slow_ms)->default_value(0.0), "testing aid: --debug-fail-rank sleeps this many ms after every step's backward (a straggler)")
    ("bench-stage-ms", po::value(&c.debug.stage_ms)->default_value(0.0), "benchmark aid: every pipeline stage also sleeps this many ms per micro-batch forward, twice that per backward (compute that needs no core: bench/pipeline_bubble.py --sleep-ms)");
  // clang-format on

  po::variables_map vm;
  try {
    // No prefix guessing: --epoch must not quietly mean --epochs (an unknown option says which
    // one is near instead).
    const po::parsed_options parsed =
        po::command_line_parser(argc, argv)
            .options(desc)
            .style(po::command_line_style::default_style & ~po::command_line_style::allow_guessing)
            .run();
    // Boost keeps words that follow no flag and store() drops them: an unquoted glob would
    // silently train on its first file.
    for (const po::option& o : parsed.options)
      if (o.position_key >= 0)
        STRATA_THROW_INPUT("unexpected argument '", o.value.empty() ? o.string_key : o.value.front(),
                           "': every flag takes one value (quote a glob: --data 'dir/*.h5'; turn a switch off "
                           "with --dry-run=false)");
    po::store(parsed, vm);
    if (vm.count("help")) {
      if (print_help) std::cout << desc << "\n";
      return std::nullopt;
    }
    if (vm.count("version")) {
      if (print_help)
        std::cout << "strata " << STRATA_VERSION << " (HDF5 " << H5_VERS_MAJOR << "." << H5_VERS_MINOR << "."
                  << H5_VERS_RELEASE << (io::ParallelCheckpointFile::available() ? " parallel" : " serial")
                  << (STRATA_WITH_CUDA ? ", CUDA" : ", CPU only") << ", C++ compiled for "
                  << (std::string(STRATA_MARCH).empty() ? "the compiler's default target (portable)"
                                                        : "-march=" STRATA_MARCH)
                  << ", element-wise kernels " << ops::cpu_kernel_isa() << ", bf16 GEMMs "
                  << (ops::bf16_matrix_units().empty() ? "widened to f32 (no bf16 units)"
                                                       : "on " + ops::bf16_matrix_units() + " (oneDNN)")
                  << ")\n";
      return std::nullopt;
    }
    if (vm.count("config")) {
      const std::string path = vm["config"].as<std::string>();
      std::ifstream in(path);
      STRATA_REQUIRE(in.good() && !std::filesystem::is_directory(path), "--config: cannot read '", path,
                     "' (expected an INI file)");
      // Errors in the file name it and the line.
      const auto where = [&](std::string key) {
        while (key.starts_with("-")) key.erase(0, 1);
        const int line = line_of(path, key);
        return detail::cat("--config ", path, line > 0 ? detail::cat(" line ", line) : std::string(), ": ");
      };
      try {
        const po::parsed_options from_file = po::parse_config_file(in, desc);
        for (const po::option& o : from_file.options)
          STRATA_REQUIRE(o.string_key != "config", "--config: '", path,
                         "' sets config = ...; a config file cannot include another");
        po::store(from_file, vm);  // earlier (command-line) values win
      } catch (const po::unknown_option& e) {
        STRATA_THROW_INPUT(where(e.get_option_name()), unknown_option(desc, e.get_option_name()));
      } catch (const po::multiple_occurrences& e) {  // the line of the second, naming the first
        std::string key = e.get_option_name();
        while (key.starts_with("-")) key.erase(0, 1);
        STRATA_THROW_INPUT("--config ", path, " line ", line_of(path, key, 2), ": '", key,
                           "' is set again (first on line ", line_of(path, key), "); give each option once");
      } catch (const po::error_with_option_name& e) {
        STRATA_THROW_INPUT(where(e.get_option_name()), e.what());
      }
    }
    if (vm.count("deepspeed-config")) {  // below the command line and --config
      const std::string path = vm["deepspeed-config"].as<std::string>();
      const DeepSpeedOptions ds = read_deepspeed_config(path);
      std::string keys;
      for (const std::string& key : ds.unsupported) keys += (keys.empty() ? "" : ", ") + key;
      STRATA_REQUIRE(ds.unsupported.empty() || !vm["strict-config"].as<bool>(), "--deepspeed-config ", path,
                     ": not supported: ", keys, " (--strict-config; without it these are warnings)");
      std::istringstream ini(ds.ini);
      po::store(po::parse_config_file(ini, desc), vm);
      c.deepspeed_unsupported = ds.unsupported;
      c.layout.gradient_accumulation = ds.gradient_accumulation;
    }
    po::notify(vm);
  } catch (const po::unknown_option& e) {
    STRATA_THROW_INPUT(unknown_option(desc, e.get_option_name()), " (see --help)");
  } catch (const po::error& e) {
    STRATA_THROW_INPUT(e.what(), " (see --help)");
  }

  c.model.hidden = parse_int_list(hidden, "--hidden");
  // Unless given, the model's own tying: GPT-2 and Llama 3.2 tie, Llama 3.1 and --model llama do not.
  if (vm["tie-embeddings"].defaulted()) c.model.tie_embeddings = layers::ties_embeddings_by_default(c.model.name);
  // Unless given, the optimizer's own: SGD's 0.05 would make AdamW diverge; 1e-3 is PyTorch's AdamW default.
  if (vm["lr"].defaulted() && c.training.optimizer.name == "adamw") c.training.lr_schedule.lr = 1e-3f;
  STRATA_REQUIRE(seed >= 0, "--seed must be in [0, 2^63 - 1], found ", seed);
  c.training.seed = static_cast<uint64_t>(seed);
  c.checkpoint.read_only = c.eval_only;
  // The lower layers' parsers: one-line Input errors naming the flag and the accepted values.
  c.runtime.device = parallel::parse_device_kind(device);
  c.runtime.comm = parallel::parse_transport(comm, c.runtime.device);
  c.layout.schedule = parallel::parse_schedule_kind(schedule);
  STRATA_REQUIRE(c.layout.virtual_stages >= 1, "--virtual-stages must be at least 1, found ", c.layout.virtual_stages);
  STRATA_REQUIRE(c.layout.virtual_stages == 1 || c.layout.schedule == parallel::ScheduleKind::Interleaved,
                 "--virtual-stages ", c.layout.virtual_stages, " needs --schedule interleaved, found --schedule ",
                 parallel::to_string(c.layout.schedule));
  // One pipeline rank has no bubble for chunks to fill, and a tied head would share its rank with the embedding's
  // chunk.
  STRATA_REQUIRE(c.layout.virtual_stages == 1 || c.layout.pp >= 2, "--virtual-stages ", c.layout.virtual_stages,
                 " needs --pp 2 or more (one pipeline rank has no bubble to fill), found --pp ", c.layout.pp);
  STRATA_REQUIRE(layout == "given" || layout == "auto", "--layout must be given or auto, found '", layout, "'");
  c.layout.auto_layout = layout == "auto";
  if (c.layout.auto_layout)
    for (const char* flag :
         {"tp", "sequence-parallel", "pp", "zero", "micro-batch", "recompute", "schedule", "virtual-stages"})
      STRATA_REQUIRE(vm[flag].defaulted(),
                     "--layout auto chooses --tp, --sequence-parallel, --pp, --zero, --micro-batch and --recompute; ",
                     "leave out --", flag, " (or give the layout and not --layout auto)");
  c.layout.precision = parse_precision(precision);
  c.plan.device_memory = parse_bytes(device_memory, "--device-memory");
  parse_step_range(trace_steps, c.monitor.trace_first, c.monitor.trace_last);
  validate(c);

  for (const auto& [name, value] : vm)
    if (name != "help") {
      // --tie-embeddings' and --lr's defaults depend on other options (above): the values in effect.
      std::string effective = any_to_string(value.value());
      if (name == "tie-embeddings") effective = c.model.tie_embeddings ? "true" : "false";
      if (name == "lr") effective = any_to_string(boost::any(c.training.lr_schedule.lr));
      c.effective.emplace_back(name, effective);
      if (!value.defaulted()) c.given.emplace_back(name, any_to_string(value.value()));
    }
  return c;
}

namespace {

bool was_given(const Config& c, const std::string& key) {
  return std::any_of(c.given.begin(), c.given.end(), [&](const auto& kv) { return kv.first == key; });
}

void set_effective(Config& c, const std::string& key, const std::string& value) {
  for (auto& [k, v] : c.effective)
    if (k == key) v = value;
}

}  // namespace

void apply_run_dir(Config& c, std::time_t start) {
  if (c.run_dir.empty()) return;
  if (const size_t at = c.run_dir.find("{time}"); at != std::string::npos) {
    std::tm local{};
    localtime_r(&start, &local);
    char stamp[32];
    std::strftime(stamp, sizeof stamp, "%Y%m%d-%H%M%S", &local);
    c.run_dir.replace(at, 6, stamp);
  }
  set_effective(c, "run-dir", c.run_dir);
  const std::filesystem::path dir(c.run_dir);
  const auto place = [&](const std::string& key, std::string& value, const std::string& path) {
    if (was_given(c, key)) return;
    value = path;
    set_effective(c, key, path);
  };
  place("checkpoint-dir", c.checkpoint.dir, dir.string());
  place("metrics", c.monitor.metrics, (dir / "metrics.jsonl").string());
  place("log-file", c.monitor.log_file, (dir / "train.log").string());
  // checkpoint-dir and metrics have no default: add them to the effective list if absent.
  for (const char* key : {"checkpoint-dir", "metrics"})
    if (std::none_of(c.effective.begin(), c.effective.end(), [&](const auto& kv) { return kv.first == key; }))
      c.effective.emplace_back(key, key == std::string("metrics") ? c.monitor.metrics : c.checkpoint.dir);
}

std::string run_config_text(const Config& c, const std::string& run_dir_as_given) {
  std::string text = "# The configuration of the run in " + c.run_dir +
                     ": every option's value.\n# train --config THIS_FILE repeats it (in a new directory where "
                     "run-dir has {time}).\n";
  for (const auto& [key, value] : c.effective) {
    if (key == "config") continue;
    if (key == "run-dir") {
      text += "run-dir = " + run_dir_as_given + "\n";
      continue;
    }
    if ((key == "checkpoint-dir" || key == "metrics" || key == "log-file") && !was_given(c, key)) continue;
    text += key + " = " + value + "\n";
  }
  return text;
}

std::string given_options(const Config& c) {
  std::string text;
  for (const auto& [key, value] : c.given) {
    text += (text.empty() ? "--" : " --") + key + (value.empty() ? "" : " " + value);
  }
  return text;
}

parallel::Layout layout_of(const Config& config, int dp) {
  const parallel::BatchSplit batch = parallel::split_batch(config.layout.global_batch, config.layout.micro_batch, dp);
  parallel::Layout layout;
  layout.pp = config.layout.pp;
  layout.dp = dp;
  layout.tp = config.layout.tp;
  layout.sequence_parallel = config.layout.sequence_parallel;
  layout.zero = config.layout.zero;
  layout.dtype = config.layout.precision;
  layout.optimizer = config.training.optimizer;
  layout.bucket_bytes = static_cast<int64_t>(config.layout.bucket_mb * (1 << 20));
  layout.micro = batch.micro;
  layout.micro_batches = static_cast<int>(batch.count);
  layout.schedule = config.layout.schedule;
  layout.virtual_stages = config.layout.virtual_stages;
  layout.cpu = config.runtime.device == DeviceKind::CPU;
  return layout;
}

parallel::EngineSettings engine_settings(const Config& config, int dp) {
  parallel::EngineSettings settings;
  settings.layout = layout_of(config, dp);
  settings.seed = config.training.seed;
  settings.clip_grad = config.training.clip_grad;
  settings.scaler = layers::LossScaler::from_flags(config.training.loss_scale, precision_name(config.layout.precision),
                                                   config.training.loss_scale_init, config.training.loss_scale_window);
  settings.stand_in_ms = config.debug.stage_ms;
  settings.faults = config.debug.faults;
  return settings;
}

}  // namespace strata::train
