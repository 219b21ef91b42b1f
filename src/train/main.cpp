// train: the Strata training program. `mpirun -np N train --config FILE [flags]`.
// Setup errors are agreed on by all ranks and reported once (exit 2 for bad input); an error
// during training is reported by the rank that hit it and ends the whole job. SIGTERM, SIGUSR1
// or SIGINT during training: checkpoint at the next step boundary, exit 3 (kExitPreempted); a
// second SIGTERM or SIGINT before that: exit 4 at once (kExitSecondSignal). A communication wait
// past --timeout, a rank still in setup after --setup-timeout, or ranks whose collectives
// differ: exit 5 (parallel/watchdog.hpp, parallel/setup_deadline.hpp).
#include <chrono>
#include <cmath>
#include <memory>
#include <optional>
#include <string>
#include <thread>

#include "core/log.hpp"
#include "core/ops.hpp"
#include "parallel/mpi.hpp"
#include "parallel/setup_deadline.hpp"
#include "train/config.hpp"
#include "train/plan.hpp"
#include "train/trainer.hpp"

using namespace strata;

int main(int argc, char** argv) {
  parallel::MpiRuntime mpi(argc, argv);
  std::optional<train::Config> config;
  std::unique_ptr<train::Trainer> trainer;
  std::optional<parallel::SetupDeadline> setup_deadline;  // from the options to the agreement on setup's end

  const int setup = parallel::run_collectively(MPI_COMM_WORLD, [&] {
    config = train::parse_config(argc, argv, mpi.rank() == 0);
    if (!config) return;  // --help
    setup_deadline.emplace(mpi.rank(), config->setup_timeout);
    if (mpi.rank() == config->debug_fail_rank && config->debug_setup_sleep > 0)
      std::this_thread::sleep_for(std::chrono::duration<double>(config->debug_setup_sleep));
    // From here: a signal while loading data or a checkpoint stops after the first step (saved).
    if (!config->eval_only && !config->dry_run) train::install_preemption_handlers();
    log::set_all_ranks(config->log_all_ranks);
    for (const std::string& key : config->deepspeed_unsupported)
      if (mpi.rank() == 0)
        log::warn("--deepspeed-config ", config->deepspeed_config, ": '", key, "' is not supported; ignored");
    parallel::agree(MPI_COMM_WORLD, [&] {
      if (mpi.rank() == 0 && !config->log_file.empty()) log::tee_to(config->log_file);
    });
    const int threads = config->threads > 0 ? config->threads : mpi.default_threads();
    ops::set_num_threads(threads);
    mpi.warn_if_oversubscribed(threads);
    std::string effective = "configuration:";
    for (const auto& [key, value] : config->effective) effective += "\n  " + key + " = " + value;
    log::info(effective, "\n  (", mpi.size(), " rank(s) on ", mpi.nodes(), ", ", threads, " thread(s) per rank)");
    if (config->dry_run)
      train::dry_run(*config, MPI_COMM_WORLD);  // plans from shapes: nothing is allocated
    else
      trainer = std::make_unique<train::Trainer>(*config, MPI_COMM_WORLD);
  });
  setup_deadline.reset();
  if (setup != parallel::kExitOk || !config) return setup;
  if (config->dry_run) return parallel::kExitOk;  // the plan is printed
  // Only where training runs: a run rejected above says one line, the error.
  if (const std::string slow = ops::blas_kernel_warning(); !slow.empty()) log::warn(slow);

  try {
    if (!config->eval_only) {
      const train::TrainEnd end = trainer->train();
      if (end == train::TrainEnd::Preempted) return train::kExitPreempted;  // saved; the batch script requeues
      if (end == train::TrainEnd::Diverged) return parallel::kExitFailure;  // rank 0 said why
    }
    if (const io::Samples* data = trainer->eval_data()) {
      const train::EvalResult r = trainer->evaluate(*data);
      // Without --val-data the data evaluated is the training data: the line says so.
      const char* what = config->eval_only          ? "evaluation"
                         : config->val_data.empty() ? "final evaluation of the training data (no --val-data)"
                                                    : "final test";
      char line[240];
      if (r.tokens)  // a language model: per-token loss, its perplexity and next-token accuracy
        std::snprintf(line, sizeof line, "%s: loss %.6f  perplexity %.3f  next-token accuracy %.2f%%  (%lld windows)",
                      what, r.loss, std::exp(r.loss), 100.0 * r.accuracy, static_cast<long long>(r.samples));
      else
        std::snprintf(line, sizeof line, "%s: loss %.6f  accuracy %.2f%%  (%lld samples)", what, r.loss,
                      100.0 * r.accuracy, static_cast<long long>(r.samples));
      log::info(line);
      trainer->record_evaluation(config->eval_only          ? "eval-only"
                                 : config->val_data.empty() ? "final-train"
                                                            : "final",
                                 r);
    }
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
