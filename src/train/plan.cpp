#include "train/plan.hpp"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <iomanip>
#include <map>
#include <set>
#include <sstream>
#include <tuple>
#include <utility>
#include <vector>

#include "core/allocator.hpp"
#include "core/log.hpp"
#include "core/ops.hpp"
#include "io/checkpoint/manager.hpp"
#include "io/data_source.hpp"
#include "io/loader.hpp"
#include "layers/loss_scaler.hpp"
#include "layers/parameter_store.hpp"
#include "layers/zoo.hpp"
#include "parallel/data/batch_split.hpp"
#include "parallel/plan/layout_search.hpp"
#include "parallel/runtime/mpi.hpp"
#include "parallel/runtime/process_grid.hpp"
#include "parallel/stage/state_gather.hpp"

namespace strata::train {

namespace {

// "rank 3 (stage 1, replica 1)" or "ranks 0-2 (stage 0, replicas 0-2)"; with tensor
// parallelism the ranks of a line are a stage's replicas and their tp ranks.
std::string ranks_str(int first, int last, const parallel::GridLayout& g) {
  std::ostringstream os;
  os << (first == last ? "rank " : "ranks ") << first;
  if (last != first) os << "-" << last;
  os << " (stage " << g.stage(first) << ", replica" << (g.replica(first) != g.replica(last) ? "s " : " ")
     << g.replica(first);
  if (g.replica(first) != g.replica(last)) os << "-" << g.replica(last);
  if (g.size(parallel::Axis::Tensor) > 1)
    os << ", tp " << g.tp_rank(first) << (first != last ? detail::cat("-", g.tp_rank(last)) : "");
  os << ")";
  return os.str();
}

// The rank with the most bytes (the first of equals).
int fullest_rank(const std::vector<parallel::RankBytes>& ranks) {
  return static_cast<int>(
      std::max_element(ranks.begin(), ranks.end(), [](const auto& a, const auto& b) { return a.total() < b.total(); }) -
      ranks.begin());
}

bool same_bytes(const parallel::RankBytes& a, const parallel::RankBytes& b) {
  return a.params == b.params && a.grads == b.grads && a.optimizer == b.optimizer && a.activations == b.activations &&
         a.in_flight == b.in_flight && a.runtime == b.runtime && a.between_steps == b.between_steps;
}

const char* recompute_flag(layers::Recompute r) {
  return r == layers::Recompute::None ? "none" : r == layers::Recompute::Block ? "block" : "full";
}

// The train command of a layout: the flags given, less the planning and layout ones, plus the layout's.
std::string layout_command(const Config& config, const parallel::LayoutChoice& c, int world) {
  static const std::set<std::string> replaced{
      "dry-run",           "plan", "world", "plan-tflops", "plan-gbps", "plan-rows", "plan-top",      "tp",
      "sequence-parallel", "pp",   "zero",  "micro-batch", "recompute", "schedule",  "virtual-stages"};
  std::ostringstream os;
  os << "mpirun -np " << world << " ./build/train";
  for (const auto& [name, value] : config.given)
    if (!replaced.count(name)) os << " --" << name << " " << value;
  // What training needs but a plan from shapes did not: visible placeholders, not a line that fails.
  if (config.data.train.empty()) os << " --data DATA";
  if (config.training.steps == 0 && config.training.epochs == 0) os << " --steps STEPS";
  const parallel::Layout& l = c.layout;
  os << " --tp " << l.tp << (l.sequence_parallel ? " --sequence-parallel" : "") << " --pp " << l.pp << " --zero "
     << l.zero << " --micro-batch " << l.micro << " --recompute " << recompute_flag(c.recompute);
  return os.str();
}

// What planning needs of the data: the training sample's shape and the classes, and what the
// run holds around the model (the loader's batches of such samples, its checkpoints).
struct PlanningShapes {
  Shape input;
  int classes = 0;
  parallel::RuntimeSpec runtime;
};

// Every layout of `world_size` ranks for the configuration's model, the fitting ones fastest first.
parallel::SearchResult search(const Config& config, const PlanningShapes& shapes, int world_size,
                              const parallel::Rates& rates) {
  const Shape& input = shapes.input;
  const int classes = shapes.classes;
  parallel::SearchSpace space;
  space.runtime = shapes.runtime;
  space.world = world_size;
  space.global_batch = config.layout.global_batch;
  space.device_bytes = config.plan.device_memory;
  space.base = layout_of(config, 1);
  space.partition = config.layout.partition;
  space.can_recompute = layers::is_language_model(config.model);
  const auto model_for = [&](int, layers::Recompute recompute, layers::TensorParallelGroup* group) {
    layers::ModelSpec spec = config.model;
    spec.recompute = recompute_flag(recompute);
    return layers::build_model(spec, input, classes, group);
  };
  return parallel::search_layouts(space, rates, model_for);
}

std::string layout_text(const parallel::LayoutChoice& c) {
  const parallel::Layout& l = c.layout;
  return detail::cat("tp ", l.tp, ", pp ", l.pp, ", dp ", l.dp, ", zero ", l.zero, ", micro-batch ", l.micro,
                     ", recompute ", recompute_flag(c.recompute), l.sequence_parallel ? ", sequence-parallel" : "");
}

// From the data (or, for a language model without --data, --seq-len and --vocab: token windows).
PlanningShapes planning_shapes(const Config& config) {
  const layers::ModelSpec spec = layers::resolve_preset(config.model);
  const bool language_model = layers::is_language_model(config.model);
  const int64_t seq_len = language_model ? (config.model.seq_len > 0 ? config.model.seq_len : spec.seq_len) : 0;
  std::unique_ptr<io::DataSource> train, val;
  if (!config.data.train.empty()) train = io::open_samples(config.data.train, "--data", seq_len);
  if (!config.data.val.empty()) val = io::open_samples(config.data.val, "--val-data", seq_len);
  Shape input;
  int64_t classes = 0;
  if (const io::DataSource* data = train ? train.get() : val.get()) {
    input = data->input_shape();
    classes = data->num_classes();
  } else {
    STRATA_REQUIRE(language_model && spec.vocab > 0 && seq_len > 0, "--dry-run without --data needs a GPT with ",
                   "--vocab and --seq-len (a preset gives both), found --model ", config.model.name, ", --vocab ",
                   spec.vocab, ", --seq-len ", seq_len);
    input = {seq_len};
    classes = spec.vocab;
  }
  STRATA_REQUIRE(classes <= INT32_MAX, "the vocabulary of ", classes, " classes does not fit an int32 label");
  return {input, static_cast<int>(classes), runtime_spec(config, train.get(), val.get(), input)};
}

// --dry-run --plan: the search's table, the fastest layouts first, each with its command.
std::string plan_layouts(const Config& config, const PlanningShapes& shapes, int world_size,
                         const Bandwidth& bandwidth) {
  const parallel::Rates rates = planning_rates(config.plan, config.runtime.device, config.layout.precision, bandwidth);
  const parallel::SearchResult r = search(config, shapes, world_size, rates);
  std::ostringstream os;
  os << "--plan: " << r.tried << " layouts of " << world_size
     << " ranks tried (tp with and without sequence parallelism x pp x dp, ZeRO 0-3, micro-batch, recompute; 1F1B), "
     << r.fitting.size() << " fit "
     << (config.plan.device_memory > 0 ? log::format_bytes(config.plan.device_memory) + " per rank"
                                       : std::string("(no --device-memory)"))
     << "; step time at " << std::setprecision(3) << rates.flops_per_s / 1e12 << " TFLOP/s and "
     << bandwidth.bytes_per_s / 1e9 << " GB/s per rank (" << bandwidth.source
     << "), communication not overlapped (docs/parallelism.md, \"Will it fit?\"):";
  for (const std::string& why : r.skipped) os << "\n  skipped " << why;
  if (r.fitting.empty()) {
    const parallel::LayoutChoice& s = r.smallest;
    const parallel::Layout& l = s.layout;
    os << "\n  none fits: the smallest, tp " << l.tp << (l.sequence_parallel ? " sequence-parallel" : "") << " pp "
       << l.pp << " dp " << l.dp << " zero " << l.zero << " micro-batch " << l.micro << " recompute "
       << recompute_flag(s.recompute) << ", needs " << log::format_bytes(s.bytes)
       << " on its fullest rank; add ranks or memory";
    return os.str();
  }
  // One row per layout that differs in more than its ZeRO stage: the fastest stage of each
  // (of equally fast ones, the least memory), the others named in the row.
  std::vector<const parallel::LayoutChoice*> rows;
  std::map<std::tuple<int, bool, int, int, int64_t, int>, std::string> also;
  const auto key_of = [](const parallel::LayoutChoice& c) {
    const parallel::Layout& l = c.layout;
    return std::tuple(l.tp, l.sequence_parallel, l.pp, l.dp, l.micro, static_cast<int>(c.recompute));
  };
  for (const parallel::LayoutChoice& c : r.fitting) {
    const parallel::Layout& l = c.layout;
    const auto key = key_of(c);
    if (auto [it, first] = also.emplace(key, ""); first)
      rows.push_back(&c);
    else
      it->second += detail::cat(it->second.empty() ? "" : ",", l.zero);
  }
  os << "\n"
     << rows.size() << " distinct (ZeRO stages of one layout on one row), the fastest "
     << std::min<size_t>(rows.size(), config.plan.top)
     << " (--plan-top N for more); matrix products at half rate below " << std::setprecision(3) << rates.half_rate_rows
     << " rows (--plan-rows):";
  os << "\n     tp sp  pp  dp zero micro recompute  fullest rank  step s  (compute / bubble / dp / tp / pp)";
  const size_t shown = std::min<size_t>(rows.size(), config.plan.top);
  for (size_t k = 0; k < shown; ++k) {
    const parallel::LayoutChoice& c = *rows[k];
    char row[200];
    std::snprintf(
        row, sizeof row, "\n  %zu. %3d %-2s %3d %3d %4d %5lld %-9s %12s  %8.3g  (%.3g / %.3g / %.3g / %.3g / %.3g)",
        k + 1, c.layout.tp, c.layout.sequence_parallel ? "sp" : "", c.layout.pp, c.layout.dp, c.layout.zero,
        static_cast<long long>(c.layout.micro), recompute_flag(c.recompute), log::format_bytes(c.bytes).c_str(),
        c.time.total(), c.time.compute_s, c.time.bubble_s, c.time.dp_s, c.time.tp_s, c.time.pp_s);
    const std::string& others = also[key_of(c)];
    os << row << (others.empty() ? "" : "  (slower or larger: zero " + others + ")") << "\n     "
       << layout_command(config, c, world_size);
  }
  return os.str();
}

// --dry-run: the planner's step-time model for the layout given, the number --plan ranks it by.
std::string step_time_line(const Config& config, const layers::Model& model,
                           const std::vector<parallel::StageRange>& stages, int world_size,
                           const Bandwidth& bandwidth) {
  if (config.layout.schedule != parallel::ScheduleKind::OneFOneB || config.layout.virtual_stages > 1)
    return "  step-time model: 1F1B only (the schedule --plan assumes)";
  parallel::LayoutChoice choice;
  choice.layout = layout_of(config, world_size / (config.layout.pp * config.layout.tp));
  choice.recompute = layers::parse_recompute(config.model.recompute);
  const parallel::Rates rates = planning_rates(config.plan, config.runtime.device, config.layout.precision, bandwidth);
  const parallel::StepTime t = parallel::estimate_step_time(model, stages, choice, config.layout.global_batch, rates);
  char line[400];
  std::snprintf(line, sizeof line,
                "  step-time model: %.3g s per step (compute / bubble / dp / tp / pp: %.3g / %.3g / %.3g / %.3g / "
                "%.3g) at %.3g TFLOP/s (half that below %.3g rows) and %.3g GB/s per rank (%s), communication not "
                "overlapped",
                t.total(), t.compute_s, t.bubble_s, t.dp_s, t.tp_s, t.pp_s, rates.flops_per_s / 1e12,
                rates.half_rate_rows, bandwidth.bytes_per_s / 1e9, bandwidth.source.c_str());
  return line;
}

}  // namespace

namespace {

// FLOP/s of a (rows x 512) x (512 x 512) GEMM in `dtype` on this CPU, best of 5 (enough repeats
// that each timing is ~2^27 multiply-adds): bf16 runs at twice the f32 rate on bf16 units.
double gemm_rate(int64_t rows, DType dtype) {
  constexpr int64_t n = 512;
  const Tensor a = Tensor::zeros({rows, n}, dtype), b = Tensor::zeros({n, n}, dtype),
               c = Tensor::empty({rows, n}, dtype);
  const int64_t repeats = std::max<int64_t>(1, n / rows);
  double best = 1e30;
  for (int k = 0; k < 5; ++k) {
    const auto start = std::chrono::steady_clock::now();
    for (int64_t r = 0; r < repeats; ++r) ops::gemm(a, false, b, false, c);
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  return 2.0 * static_cast<double>(rows * n * n * repeats) / best;
}

// Bytes per second per rank, as the step-time model charges an all-reduce (2 (n - 1)/n of its
// bytes), that all-reduces of 2 MiB (tp's per block of a small GPT's micro-batch) reach between
// the world's ranks when each computes between them, as tp's do: rounds of {a 512^3 GEMM, an
// all-reduce}, the all-reduces timed. Beyond the copies and sums, that time holds the wait for
// the slowest rank, which on a CPU costs more than the copies do. A step's excess over its mean
// compute is the ranks' mean wait plus the reduction, so the mean over the ranks counts, the same
// on every rank. Through MPI on plain buffers: the training's own communicators would keep
// shared-memory buffers of this size, which the memory plan does not hold.
double all_reduce_rate_while_computing(MPI_Comm world, DType precision) {
  constexpr int64_t kElements = int64_t{1} << 19, kN = 512;
  std::vector<float> buffer(static_cast<size_t>(kElements));
  const Tensor a = Tensor::zeros({kN, kN}, precision), b = Tensor::zeros({kN, kN}, precision),
               c = Tensor::empty({kN, kN}, precision);
  const auto rounds = [&](int count) {
    MPI_Barrier(world);
    double reducing = 0;
    for (int r = 0; r < count; ++r) {
      ops::gemm(a, false, b, false, c);
      const auto start = std::chrono::steady_clock::now();
      MPI_Allreduce(MPI_IN_PLACE, buffer.data(), static_cast<int>(kElements), MPI_FLOAT, MPI_SUM, world);
      reducing += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    }
    return reducing;
  };
  rounds(3);  // warm-up: MPI's shared segments mapped, the GEMM's buffers touched
  constexpr int kRounds = 30;
  double seconds = rounds(kRounds) / kRounds;
  int size = 1;
  MPI_Comm_size(world, &size);
  MPI_Allreduce(MPI_IN_PLACE, &seconds, 1, MPI_DOUBLE, MPI_SUM, world);
  seconds /= size;
  const double n = size;
  return 2.0 * (n - 1) / n * static_cast<double>(kElements * 4) / seconds;
}

}  // namespace

double compute_rate(const PlanSettings& plan, DeviceKind device, DType precision) {
  if (plan.tflops > 0) return plan.tflops * 1e12;
  if (device != DeviceKind::CPU) return 300e12;
  return gemm_rate(512, precision);
}

Bandwidth plan_bandwidth(const PlanSettings& plan, DeviceKind device, DType precision, MPI_Comm world) {
  if (plan.gbps > 0) return {plan.gbps * 1e9, "--plan-gbps"};
  int world_size = 1;
  MPI_Comm_size(world, &world_size);
  if (device != DeviceKind::CPU || world_size == 1)
    return {25e9, device == DeviceKind::CPU ? "assumed: one rank launched, none to measure; --plan-gbps"
                                            : "assumed: 200 Gb/s InfiniBand per GPU; --plan-gbps"};
  return {all_reduce_rate_while_computing(world, precision),
          detail::cat("measured: all-reduces between the ", world_size, " ranks launched, while they compute")};
}

parallel::Rates planning_rates(const PlanSettings& plan, DeviceKind device, DType precision,
                               const Bandwidth& bandwidth) {
  parallel::Rates rates;
  rates.flops_per_s = compute_rate(plan, device, precision);
  rates.bytes_per_s = bandwidth.bytes_per_s;
  if (plan.rows > 0) {
    rates.half_rate_rows = plan.rows;
  } else if (device != DeviceKind::CPU) {
    rates.half_rate_rows = 1024;
  } else {
    // rate(rows) = peak * rows / (rows + h): the 8- and 512-row rates give h, and the 512-row
    // rate is what flops_per_s holds, so the planner's peak is it scaled to infinite rows.
    // (From large / small = 64 (8 + h) / (512 + h); a rate falling faster than that: the cap.)
    const double large = plan.tflops > 0 ? gemm_rate(512, precision) : rates.flops_per_s,
                 small = gemm_rate(8, precision);
    constexpr double kMaxRows = 4096;
    rates.half_rate_rows = small >= large        ? 0
                           : large >= 64 * small ? kMaxRows
                                                 : std::min(kMaxRows, 512 * (small - large) / (large - 64 * small));
    if (plan.tflops == 0) rates.flops_per_s *= (512 + rates.half_rate_rows) / 512;
  }
  return rates;
}

parallel::GridLayout grid_layout(const Config& config, int world_size) {
  try {
    return parallel::GridLayout::train(config.layout.pp, config.layout.tp, world_size);
  } catch (const Error& e) {
    // --dry-run plans for the ranks launched unless told: say how to plan for another world.
    if (!config.plan.dry_run || config.plan.world > 0) throw;
    const int64_t needed = int64_t{config.layout.pp} * config.layout.tp;
    STRATA_THROW_INPUT(e.message(), "; --dry-run plans for the ", world_size,
                       " rank(s) launched: add --world N to plan for N ranks (e.g. --world ", needed, ")");
  }
}

parallel::RuntimeSpec runtime_spec(const Config& config, const io::DataSource* train, const io::DataSource* val,
                                   const Shape& windows) {
  parallel::RuntimeSpec spec;
  const bool cpu = config.runtime.device == DeviceKind::CPU;
  spec.shared_memory = cpu && config.runtime.shared_memory;
  // The data's buffers are host memory: on a GPU they are not the device's.
  if (cpu) {
    const io::DataSource* shapes = train ? train : val;
    const Shape input = shapes ? shapes->input_shape() : windows, targets = shapes ? shapes->target_shape() : windows;
    const DType dtype = shapes ? shapes->input_dtype() : DType::I32;
    const int64_t kept = train ? train->kept_bytes_per_sample() : 0,
                  evaluated_kept = val ? val->kept_bytes_per_sample() : kept;
    spec.data_bytes = [=, depth = config.data.prefetch](int64_t rows, int64_t micro, bool first_stage) {
      const auto held = [](int64_t bytes) {
        return bytes > 0 ? static_cast<int64_t>(HostCachingAllocator::size_class(static_cast<size_t>(bytes))) : 0;
      };
      // Only the first stage reads inputs: the loader's x, the source's raw rows, evaluation's.
      return io::Loader::planned_bytes(input, dtype, targets, rows, depth, first_stage) +
             (first_stage ? held(rows * kept) + held(micro * evaluated_kept) : 0);
    };
  }
  const io::CheckpointSettings& c = config.checkpoint;
  if (!c.dir.empty() || !c.init_from.empty() || c.resume != "none")
    spec.checkpoints = !c.async || c.dir.empty()   ? parallel::Checkpoints::Synchronous
                       : io::writes_in_parallel(c) ? parallel::Checkpoints::AsyncParallel
                                                   : parallel::Checkpoints::AsyncRank0;
  return spec;
}

std::vector<parallel::RankBytes> plan_ranks(const Config& config, const layers::Model& model, int classes,
                                            const std::vector<parallel::StageRange>& stages, int world_size,
                                            const parallel::RuntimeSpec& runtime) {
  const parallel::GridLayout g = grid_layout(config, world_size);
  const parallel::Layout layout = layout_of(config, g.size(parallel::Axis::Data));
  // Activations from running each stage on meta tensors (once per stage: replicas and tp ranks
  // run the same shapes), on a model built for it.
  parallel::PlannedTensorParallel tp(config.layout.tp);
  tp.set_sequence_parallel(config.layout.sequence_parallel);
  layers::Model planning =
      layers::build_model(config.model, model.shape(0), classes, config.layout.tp > 1 ? &tp : nullptr);
  std::vector<parallel::ActivationBytes> activations;
  int64_t message_bytes = 0;  // the pipeline group's mailboxes take its largest message
  for (int s = 0; s < config.layout.pp; ++s) {
    activations.push_back(parallel::plan_activations(planning, stages, s, layout));
    message_bytes = std::max(message_bytes, activations.back().message_bytes);
  }
  std::vector<parallel::RankBytes> ranks;
  // Every tensor-parallel rank holds equal shards: the model built for tp rank 0 plans them all.
  for (int k = 0; k < world_size; ++k)
    ranks.push_back(parallel::plan_rank(model, stages, g.stage(k), g.replica(k), layout,
                                        activations[static_cast<size_t>(g.stage(k))], message_bytes, runtime));
  return ranks;
}

std::string plan_report(const Config& config, const layers::Model& model,
                        const std::vector<parallel::StageRange>& stages,
                        const std::vector<parallel::RankBytes>& ranks) {
  const int world_size = static_cast<int>(ranks.size());
  const parallel::GridLayout g = grid_layout(config, world_size);
  const int pp = config.layout.pp, dp = g.size(parallel::Axis::Data), tp = config.layout.tp;
  const parallel::Layout layout = layout_of(config, dp);
  const layers::LossScaler scaler =
      layers::LossScaler::from_flags(config.training.loss_scale, precision_name(config.layout.precision),
                                     config.training.loss_scale_init, config.training.loss_scale_window);
  std::ostringstream os;
  os << "plan: " << pp << " stage(s) x " << dp << " replica(s)"
     << (tp > 1 ? detail::cat(" x ", tp, " tensor-parallel ranks",
                              config.layout.sequence_parallel ? " (sequence-parallel)" : "")
                : std::string())
     << ", schedule " << parallel::to_string(config.layout.schedule)
     << (config.layout.virtual_stages > 1 ? detail::cat(" (", config.layout.virtual_stages, " chunks per rank)")
                                          : std::string())
     << ", " << layout.micro_batches << " micro-batch(es) of " << layout.micro << ", zero " << config.layout.zero
     << ", optimizer " << config.training.optimizer.name << ", " << parallel::device_kind_name(config.runtime.device)
     << " " << precision_name(config.layout.precision) << " (loss scale " << scaler.describe() << "):\n"
     << g.describe();
  if (const int64_t vocab = model.num_classes(); tp > 1 && vocab % tp != 0) {
    const int64_t rows = layers::rows_per_piece(vocab, tp);
    os << "\n  vocabulary of " << vocab << " tokens padded to " << rows * tp << " for --tp " << tp << " (" << rows
       << " rows per rank; the " << rows * tp - vocab << " padding rows' logits are -inf, not saved)";
  }
  for (size_t vs = 0; vs < stages.size(); ++vs) {
    const parallel::StageRange r = stages[vs];
    int64_t trainable = 0;
    for (const layers::ParamEntry& e : layers::ParameterStore::layout(model, r.begin, r.end))
      if (e.trainable) trainable += shape_numel(e.shape);
    os << "\n  stage " << vs % static_cast<size_t>(pp)
       << (config.layout.virtual_stages > 1 ? detail::cat(" chunk ", vs / static_cast<size_t>(pp)) : std::string())
       << ": layers " << r.begin << "-" << r.end - 1 << " (" << model.layer(r.begin).name() << " .. "
       << model.layer(r.end - 1).name() << "), " << trainable << " parameters"
       << (tp > 1 ? " per tensor-parallel rank" : "");
  }

  if (config.checkpoint.async) {
    // Where rank 0 writes alone it holds every tensor until written, a sum worth its own line.
    if (!io::writes_in_parallel(config.checkpoint)) {
      const int64_t bytes =
          parallel::StateGather::snapshot_bytes(model, config.training.optimizer, config.layout.precision, false);
      os << "\n  --async-save: rank 0 holds the checkpoint's tensors in host memory until they are written: " << bytes
         << " bytes (" << log::format_bytes(bytes) << ")";
    } else {
      os << "\n  --async-save: every rank holds a copy of its part of the checkpoint until it has written it (in "
            "runtime)";
    }
  }
  const int fullest = fullest_rank(ranks);
  os << "\n  bytes per rank (params include non-trained buffers; activations: the step's high-water mark of what "
        "the stage's layers allocate, with the micro-batches the schedule keeps in flight; runtime: the allocators' "
        "rounding, shared-memory transport, the loader's batches"
     << (config.checkpoint.async ? ", --async-save's copies" : "") << "):";
  for (int first = 0; first < world_size;) {
    int last = first;  // ranks of one stage with the same bytes share a line
    while (last + 1 < world_size && g.stage(last + 1) == g.stage(first) &&
           same_bytes(ranks[static_cast<size_t>(last + 1)], ranks[static_cast<size_t>(first)]))
      ++last;
    const parallel::RankBytes& b = ranks[static_cast<size_t>(first)];
    os << "\n  " << ranks_str(first, last, g) << ": params " << b.params << ", grads " << b.grads << ", optimizer "
       << b.optimizer << ", activations " << b.activations << " (" << b.in_flight << " in flight)"
       << (b.between_steps > b.activations ? detail::cat(", checkpoint transfers ", b.between_steps) : std::string())
       << ", runtime " << b.runtime << ", total " << b.total() << " (" << log::format_bytes(b.total()) << ")"
       << (fullest >= first && fullest <= last ? "  <- fullest" : "");
    first = last + 1;
  }
  return os.str();
}

void check_fits(const Config& config, const std::vector<parallel::RankBytes>& ranks) {
  if (config.plan.device_memory <= 0) return;
  const int world_size = static_cast<int>(ranks.size());
  const parallel::GridLayout g = grid_layout(config, world_size);
  const int fullest = fullest_rank(ranks);
  const parallel::RankBytes& worst = ranks[static_cast<size_t>(fullest)];
  if (worst.total() <= config.plan.device_memory) return;
  // The part that pushes the rank over: the largest.
  const std::pair<const char*, int64_t> parts[] = {{"parameters", worst.params},
                                                   {"gradients", worst.grads},
                                                   {"optimizer state", worst.optimizer},
                                                   {"activations", worst.activations},
                                                   {"checkpoint transfers", worst.between_steps},
                                                   {"runtime", worst.runtime}};
  const auto largest = *std::max_element(std::begin(parts), std::end(parts),
                                         [](const auto& a, const auto& b) { return a.second < b.second; });
  STRATA_THROW_INPUT(
      "--device-memory ", log::format_bytes(config.plan.device_memory),
      " is too small: ", ranks_str(fullest, fullest, g), " needs ", log::format_bytes(worst.total()),
      " by the plan (parameters ", log::format_bytes(worst.params), ", gradients ", log::format_bytes(worst.grads),
      ", optimizer state ", log::format_bytes(worst.optimizer), ", activations of stage ", g.stage(fullest), " ",
      log::format_bytes(worst.activations), " with ", worst.in_flight, " micro-batches in flight",
      worst.between_steps > worst.activations
          ? ", checkpoint transfers " + log::format_bytes(worst.between_steps) + " where they are gone"
          : std::string(),
      ", runtime ", log::format_bytes(worst.runtime), "); the largest part, ", largest.first, " (",
      log::format_bytes(largest.second),
      "), does not fit: run the same command with --dry-run --plan --world N for the layouts of N ranks that fit");
}

int planning_world(const Config& config, MPI_Comm world) {
  int world_size = 0;
  MPI_Comm_size(world, &world_size);
  return config.plan.dry_run && config.plan.world > 0 ? config.plan.world : world_size;
}

void choose_layout(Config& config, MPI_Comm world, const Bandwidth& bandwidth) {
  const int world_size = planning_world(config, world);
  int rank = 0;
  MPI_Comm_rank(world, &rank);
  // Rank 0 alone: the GEMM rates it times would differ from another rank's, and so might the choice.
  int64_t chosen[6] = {};
  parallel::agree(world, [&] {
    if (rank != 0) return;
    const parallel::Rates rates =
        planning_rates(config.plan, config.runtime.device, config.layout.precision, bandwidth);
    const parallel::SearchResult r = search(config, planning_shapes(config), world_size, rates);
    STRATA_REQUIRE(!r.fitting.empty(), "--layout auto: no layout of ", world_size, " ranks fits ",
                   log::format_bytes(config.plan.device_memory), " per rank; the smallest, ", layout_text(r.smallest),
                   ", needs ", log::format_bytes(r.smallest.bytes), " on its fullest rank: add ranks or memory");
    const parallel::LayoutChoice& best = r.fitting.front();
    const parallel::Layout& l = best.layout;
    chosen[0] = l.tp;
    chosen[1] = l.pp;
    chosen[2] = l.zero;
    chosen[3] = l.micro;
    chosen[4] = static_cast<int64_t>(best.recompute);
    chosen[5] = l.sequence_parallel ? 1 : 0;
    char times[300];
    std::snprintf(times, sizeof times,
                  "%.3g s a step by the step-time model at %.3g GB/s per rank (%s), %s on its fullest rank",
                  best.time.total(), bandwidth.bytes_per_s / 1e9, bandwidth.source.c_str(),
                  log::format_bytes(best.bytes).c_str());
    std::string runner_up = "none (the only layout that fits)";
    if (r.fitting.size() > 1) {
      const parallel::LayoutChoice& next = r.fitting[1];
      char next_times[96];
      std::snprintf(next_times, sizeof next_times, " (%.3g s, %s)", next.time.total(),
                    log::format_bytes(next.bytes).c_str());
      runner_up = layout_text(next) + next_times;
    }
    log::info("--layout auto: ", layout_text(best), " (the fastest of ", r.fitting.size(), " layouts of ", world_size,
              " ranks that fit",
              config.plan.device_memory > 0 ? " " + log::format_bytes(config.plan.device_memory) : "", ": ", times,
              "); runner-up: ", runner_up);
  });
  MPI_Bcast(chosen, 6, MPI_INT64_T, 0, world);
  config.layout.tp = static_cast<int>(chosen[0]);
  config.layout.pp = static_cast<int>(chosen[1]);
  config.layout.zero = static_cast<int>(chosen[2]);
  config.layout.micro_batch = chosen[3];
  config.model.recompute = recompute_flag(static_cast<layers::Recompute>(chosen[4]));
  config.layout.sequence_parallel = chosen[5] != 0;
  config.layout.schedule = parallel::ScheduleKind::OneFOneB;  // what the search assumes
  config.layout.virtual_stages = 1;
}

void dry_run(const Config& config, MPI_Comm world, const Bandwidth& bandwidth) {
  const int world_size = planning_world(config, world);
  // Only sizes are needed: the data's sample shape and vocabulary, or the flags'.
  const PlanningShapes shapes = planning_shapes(config);
  if (config.plan.search) {
    log::info(plan_layouts(config, shapes, world_size, bandwidth),
              "\n--dry-run: not training (planned from shapes, nothing allocated)");
    return;
  }
  // The grid's checks first (the sizes fit the world), then the model's (heads and vocabulary divide by --tp).
  grid_layout(config, world_size);
  parallel::PlannedTensorParallel tp(config.layout.tp);
  tp.set_sequence_parallel(config.layout.sequence_parallel);
  const layers::Model model =
      layers::build_model(config.model, shapes.input, shapes.classes, config.layout.tp > 1 ? &tp : nullptr);
  const std::vector<parallel::StageRange> stages =
      parallel::partition_layers(model, config.layout.pp, config.layout.partition, config.layout.virtual_stages);
  const std::vector<parallel::RankBytes> ranks =
      plan_ranks(config, model, shapes.classes, stages, world_size, shapes.runtime);
  const std::string report = plan_report(config, model, stages, ranks);
  log::info("model ", config.model.name, ", input ", shape_str(shapes.input), ", ", shapes.classes, " classes\n",
            model.summary());
  log::info(report, "\n", step_time_line(config, model, stages, world_size, bandwidth),
            "\n--dry-run: not training (planned from shapes, nothing allocated)");
  check_fits(config, ranks);
}

}  // namespace strata::train
