// train: the Strata training program. `mpirun -np N train --config FILE [flags]`.
// Setup errors are agreed on by all ranks and reported once (exit 2 for bad input); an error
// during training is reported by the rank that hit it and ends the whole job. SIGTERM, SIGUSR1
// or SIGINT during training: checkpoint at the next step boundary, exit 3 (kExitPreempted); a
// second SIGTERM or SIGINT before that: exit 4 at once (kExitSecondSignal). A communication wait
// past --timeout, a rank still in setup after --setup-timeout, or ranks whose collectives
// differ: exit 5 (parallel/runtime/watchdog.hpp, parallel/runtime/blocking_deadline.hpp).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "core/log.hpp"
#include "core/ops.hpp"
#include "io/checkpoint/file.hpp"
#include "parallel/runtime/blocking_deadline.hpp"
#include "parallel/runtime/mpi.hpp"
#include "train/config.hpp"
#include "train/plan.hpp"
#include "train/signals.hpp"
#include "train/trainer.hpp"

using namespace strata;

namespace {

// The options that shape a model: what --init-from takes from the checkpoint when not given.
constexpr const char* kModelOptions[] = {
    "model", "hidden",         "depth",      "width",    "layers",   "heads",      "embed",      "seq-len",
    "vocab", "tie-embeddings", "activation", "norm-eps", "kv-heads", "ffn-hidden", "rope-theta", "rope-scaling"};

// --init-from (fine-tuning, --eval-only) without --model: the model options the checkpoint
// recorded (its `config` attribute), as if given after the others; with a --model other than the
// checkpoint's, one line saying so. Rank 0 reads them, after checking the file whole (a damaged
// file is refused before HDF5 parses it), and sends them to every rank.
std::optional<train::Config> with_model_of_checkpoint(const train::Config& config, int argc, char** argv, int rank) {
  const auto given = [&](const std::string& key) {
    return std::any_of(config.given.begin(), config.given.end(), [&](const auto& kv) { return kv.first == key; });
  };
  std::string recorded;
  parallel::agree(MPI_COMM_WORLD, [&] {
    if (rank != 0) return;
    const io::CheckpointReader reader(config.checkpoint.init_from);
    if (reader.has_attr("config")) recorded = reader.attr_string("config");
  });
  int64_t size = static_cast<int64_t>(recorded.size());
  MPI_Bcast(&size, 1, MPI_INT64_T, 0, MPI_COMM_WORLD);
  recorded.resize(static_cast<size_t>(size));
  MPI_Bcast(recorded.data(), static_cast<int>(size), MPI_CHAR, 0, MPI_COMM_WORLD);
  std::vector<std::string> extra;
  for (const auto& [key, value] : io::config_entries(recorded)) {
    if (std::find(std::begin(kModelOptions), std::end(kModelOptions), key) == std::end(kModelOptions)) continue;
    if (key == "model" && given("model") && value != config.model.name)
      STRATA_THROW_INPUT("--init-from ", config.checkpoint.init_from, " holds a --model ", value,
                         " but this run has --model ", config.model.name,
                         " (leave --model and its shape out to take the checkpoint's)");
    if (!given("model") && !given(key)) extra.insert(extra.end(), {"--" + key, value});  // a flag given wins
  }
  if (extra.empty()) return config;
  log::info("--init-from: the model of ", config.checkpoint.init_from, ":", [&] {
    std::string flags;
    for (const std::string& e : extra) flags += " " + e;
    return flags;
  }());
  std::vector<char*> args(argv, argv + argc);
  for (std::string& e : extra) args.push_back(e.data());
  return train::parse_config(static_cast<int>(args.size()), args.data(), false);
}

}  // namespace

int main(int argc, char** argv) {
  parallel::MpiRuntime mpi(argc, argv);
  std::optional<train::Config> config;
  std::unique_ptr<train::Trainer> trainer;
  std::optional<parallel::BlockingDeadline> setup_deadline;  // from the options to the agreement on setup's end

  train::install_preemption_handlers();  // a stop signal during setup exits at once
  const int setup = parallel::run_collectively(MPI_COMM_WORLD, [&] {
    config = train::parse_config(argc, argv, mpi.rank() == 0);
    if (!config) return;  // --help
    if (!config->checkpoint.init_from.empty()) config = with_model_of_checkpoint(*config, argc, argv, mpi.rank());
    setup_deadline.emplace(mpi.rank(), config->runtime.setup_timeout, "setup", "--setup-timeout",
                           "a rank stopped, lost or much slower before the first step");
    log::set_all_ranks(config->monitor.log_all_ranks);
    for (const std::string& key : config->deepspeed_unsupported)
      if (mpi.rank() == 0)
        log::warn("--deepspeed-config ", config->deepspeed_config, ": '", key, "' is not supported; ignored");
    // --run-dir: one name on every rank (rank 0's clock), the directory and its config.ini
    // written before anything else goes there.
    const std::string run_dir_as_given = config->run_dir;
    int64_t start = std::time(nullptr);
    MPI_Bcast(&start, 1, MPI_INT64_T, 0, MPI_COMM_WORLD);
    train::apply_run_dir(*config, static_cast<std::time_t>(start));
    parallel::agree(MPI_COMM_WORLD, [&] {
      if (mpi.rank() != 0 || config->run_dir.empty()) return;
      std::error_code error;
      std::filesystem::create_directories(config->run_dir, error);
      const std::string path = config->run_dir + "/config.ini",
                        text = train::run_config_text(*config, run_dir_as_given);
      // An earlier run's different configuration (a fixed --run-dir reused) is kept, and said.
      std::ifstream earlier(path);
      if (earlier.good() && std::string(std::istreambuf_iterator<char>(earlier), {}) != text) {
        int n = 1;
        while (std::filesystem::exists(path + "." + std::to_string(n), error)) ++n;
        std::filesystem::rename(path, path + "." + std::to_string(n), error);
        log::info("note: --run-dir ", config->run_dir, " held an earlier run's config.ini: kept as config.ini.", n);
      }
      std::ofstream out(path);
      out << text;
      STRATA_REQUIRE(!error && out.good(), "--run-dir ", config->run_dir, ": cannot write its config.ini there",
                     error ? " (" + error.message() + ")" : "");
    });
    parallel::agree(MPI_COMM_WORLD, [&] {
      if (mpi.rank() == 0 && !config->monitor.log_file.empty()) log::tee_to(config->monitor.log_file);
    });
    const int threads = config->runtime.threads > 0 ? config->runtime.threads : mpi.default_threads();
    ops::set_num_threads(threads);
    ops::set_flush_denormals(config->runtime.flush_denormals);
    mpi.warn_if_oversubscribed(threads);
    // A short summary: what was given; every option's value is in the run directory's config.ini.
    log::info("options: ", train::given_options(*config), "\n  (", mpi.size(), " rank(s) on ", mpi.nodes(), ", ",
              threads, " thread(s) per rank)");
    if (!config->run_dir.empty())
      log::info("run directory: ", config->run_dir, " (every option's value in its config.ini)");
    if (mpi.rank() == config->debug.faults.fail_rank && config->debug.setup_sleep > 0)
      std::this_thread::sleep_for(std::chrono::duration<double>(config->debug.setup_sleep));
    // The planner's bandwidth, measured once (collective), so --layout auto's choice and the dry
    // run's model use the same.
    const bool plans = config->layout.auto_layout || config->plan.dry_run;
    const train::Bandwidth bandwidth =
        plans ? train::plan_bandwidth(config->plan, config->runtime.device, config->layout.precision, MPI_COMM_WORLD)
              : train::Bandwidth{};
    if (config->layout.auto_layout && !config->plan.search) train::choose_layout(*config, MPI_COMM_WORLD, bandwidth);
    if (config->plan.dry_run)
      train::dry_run(*config, MPI_COMM_WORLD, bandwidth);  // plans from shapes: nothing is allocated
    else
      trainer = std::make_unique<train::Trainer>(*config, MPI_COMM_WORLD);
  });
  setup_deadline.reset();
  if (setup != parallel::kExitOk) train::end_after_failed_setup(setup);
  if (setup != parallel::kExitOk || !config) return setup;
  if (config->plan.dry_run) return parallel::kExitOk;  // the plan is printed
  // Only where training runs: a run rejected above says one line, the error.
  if (const std::string slow = ops::blas_kernel_warning(); !slow.empty()) log::warn(slow);

  try {
    if (!config->eval_only) {
      train::begin_training();
      const train::TrainEnd end = trainer->train();
      if (end != train::TrainEnd::Finished) trainer->write_trace();            // what was recorded up to the stop
      if (end == train::TrainEnd::Preempted) return parallel::kExitPreempted;  // saved; the batch script requeues
      if (end == train::TrainEnd::Diverged) return parallel::kExitFailure;     // rank 0 said why
    }
    if (const io::DataSource* data = trainer->eval_data()) {
      const train::EvalResult r = trainer->evaluate(*data);
      // Without --val-data the data evaluated is the training data: the line says so.
      const char* what = config->eval_only          ? "evaluation"
                         : config->data.val.empty() ? "final evaluation of the training data (no --val-data)"
                                                    : "final test";
      log::info(what, ": ", train::evaluation_text(r));
      trainer->record_evaluation(config->eval_only          ? "eval-only"
                                 : config->data.val.empty() ? "final-train"
                                                            : "final",
                                 r);
    }
    trainer->write_trace();
  } catch (const parallel::PeerFailed&) {
    parallel::await_abort();  // the failing rank reports and ends the job
  } catch (const Error& e) {
    parallel::abort_world(parallel::format_error(e),
                          e.kind() == ErrorKind::Input ? parallel::kExitBadInput : parallel::kExitFailure);
  } catch (const std::exception& e) {
    parallel::abort_world(parallel::format_error(e), parallel::kExitFailure);
  }
  return parallel::kExitOk;
}
