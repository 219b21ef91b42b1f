#include "train/signals.hpp"

#include <unistd.h>

#include <csignal>
#include <cstddef>

#include "parallel/runtime/mpi.hpp"

namespace strata::train {

namespace {

// Set by the handlers; read at step boundaries. sig_atomic_t: async-signal-safe.
volatile std::sig_atomic_t g_stop_signal = 0;
// Until training starts there is nothing to save, and setup (parsing, loading data or a
// checkpoint, building a model) reads no flag: a stop signal then exits at once.
volatile std::sig_atomic_t g_training = 0;
// Non-zero: setup failed with this agreed exit code, already reported.
volatile std::sig_atomic_t g_failed_setup = 0;

// One line by write(2), the exit cleanups (e.g. shared-memory names still in setup's
// create-and-map window) and _exit: the async-signal-safe way out.
template <size_t N>
[[noreturn]] void exit_from_handler(const char (&line)[N], int code) {
  parallel::run_exit_cleanups();
  [[maybe_unused]] const ssize_t ignored = write(STDERR_FILENO, line, N - 1);
  _exit(code);
}

// A second SIGINT or SIGTERM while a stop is pending means the graceful stop takes too long (a
// save stuck in I/O, a rank that never reaches the step boundary): leave at once, with one line
// by write(2) and _exit, the async-signal-safe calls. The last committed checkpoint stays intact
// (saves are atomic). A repeated SIGUSR1 (Slurm's warning) keeps waiting for the save.
extern "C" void on_preemption_signal(int signal) {
  if (g_failed_setup != 0) {  // the job is ending with its one line said
    parallel::run_exit_cleanups();
    _exit(g_failed_setup);
  }
  if (g_training == 0)
    exit_from_handler("error: a stop signal during setup: exiting at once, nothing to save (exit code 3)\n",
                      parallel::kExitPreempted);
  if (g_stop_signal != 0 && signal != SIGUSR1)
    exit_from_handler("error: a second stop signal: exiting at once, without saving (exit code 4)\n",
                      parallel::kExitSecondSignal);
  g_stop_signal = signal;
}

}  // namespace

void install_preemption_handlers() {
  struct sigaction action {};
  action.sa_handler = on_preemption_signal;
  sigemptyset(&action.sa_mask);
  action.sa_flags = SA_RESTART;  // MPI and file I/O in progress are not interrupted
  for (int signal : {SIGTERM, SIGUSR1, SIGINT}) sigaction(signal, &action, nullptr);
}

void begin_training() { g_training = 1; }

void end_after_failed_setup(int code) { g_failed_setup = code; }

bool stop_requested() { return g_stop_signal != 0; }

}  // namespace strata::train
