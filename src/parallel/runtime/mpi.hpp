// The MPI runtime: initialisation and finalisation (RAII), the world and node-local ranks,
// the default thread count per rank, and how errors end the job on every rank.
#pragma once

#include <mpi.h>

#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

#include "core/error.hpp"

#define MPI_CHECK(expr)                                                                                       \
  do {                                                                                                        \
    const int strata_mpi_rc_ = (expr);                                                                        \
    if (strata_mpi_rc_ != MPI_SUCCESS) [[unlikely]]                                                           \
      throw ::strata::Error(::strata::ErrorKind::Internal,                                                    \
                            ::strata::parallel::mpi_error_string(#expr, strata_mpi_rc_), __FILE__, __LINE__); \
  } while (0)

namespace strata::parallel {

std::string mpi_error_string(const char* call, int code);

// Exit codes of every Strata program, the same on every rank. Preempted: a stop signal's
// checkpoint was saved (a batch script requeues the job, which continues with --resume auto);
// SecondSignal: a second stop signal before that save was done (nothing saved after the last
// checkpoint); Timeout: a deadline passed or the ranks' collectives disagreed (watchdog.hpp).
enum ExitCode : int {
  kExitOk = 0,
  kExitFailure = 1,
  kExitBadInput = 2,
  kExitPreempted = 3,
  kExitSecondSignal = 4,
  kExitTimeout = 5
};

// What a process must undo when it exits at once from a signal handler (names in /dev/shm, say):
// async-signal-safe functions, registered by the part of the runtime that made the thing.
using ExitCleanup = void (*)() noexcept;
void register_exit_cleanup(ExitCleanup cleanup);
// Runs them (async-signal-safe).
void run_exit_cleanups() noexcept;

class MpiRuntime {
 public:
  // MPI_Init_thread with MPI_THREAD_FUNNELED: only the main thread calls MPI.
  MpiRuntime(int& argc, char**& argv);
  ~MpiRuntime();
  MpiRuntime(const MpiRuntime&) = delete;
  MpiRuntime& operator=(const MpiRuntime&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  // Rank and count of ranks on this node (MPI_COMM_TYPE_SHARED).
  int local_rank() const { return local_rank_; }
  int local_size() const { return local_size_; }
  // The CPUs of this rank's affinity mask divided among the node's ranks whose masks overlap
  // it, at least 1 (cpu_threads.hpp): mpirun's or Slurm's binding decides, never more.
  int default_threads() const { return default_threads_; }
  // Collective over the node: warns (each node's first rank, one line per group of ranks) when
  // the ranks' `threads` outnumber the cores their masks allow.
  void warn_if_oversubscribed(int threads) const;
  // The world's ranks grouped by node, e.g. "2 node(s): [0 1] [2 3]".
  const std::string& nodes() const { return nodes_; }

 private:
  int rank_ = 0, size_ = 1, local_rank_ = 0, local_size_ = 1;
  MPI_Comm node_ = MPI_COMM_NULL;
  std::vector<int> node_ranks_;              // world rank of each local rank
  std::vector<std::vector<int>> node_cpus_;  // affinity mask of each local rank
  int default_threads_ = 1;
  std::string nodes_;
};

// Every rank's host name (MPI_Get_processor_name), indexed by rank of `comm`: collective over it.
std::vector<std::string> host_names(MPI_Comm comm);

// The ranks of `comm` that share a node, as a new communicator (the caller frees it): MPI's
// MPI_COMM_TYPE_SHARED, or, with STRATA_RANKS_PER_NODE=k in the environment, every k consecutive
// world ranks, so that one machine runs a cluster's code paths (no shared memory between the
// simulated nodes, node-local devices and threads): tests and docs/parallelism.md.
MPI_Comm split_by_node(MPI_Comm comm);
// STRATA_RANKS_PER_NODE: 0 when unset, -1 when set to anything but a positive integer.
int ranks_per_node_override();

// Runs a phase that every rank runs identically (setup: config, data, model, checkpoint).
// If it throws on any rank, all ranks learn it through one all-reduce; the lowest failing
// rank prints its one-line message and every rank returns the exit code (2 for bad input, 1
// otherwise). Returns kExitOk when the phase succeeded everywhere.
int run_collectively(MPI_Comm comm, const std::function<void()>& phase);

// Inside such a phase, a part that may fail on some ranks only (a checkpoint tensor only one
// stage reads, a directory only rank 0 creates) while the others would go on into the next
// collective and wait there forever: every rank learns whether any failed. The lowest failing
// rank rethrows its error, so that one line reports it (several ranks often fail alike: a full
// disk); every other rank throws PeerFailed, which run_collectively does not report and `train`
// meets with await_abort.
void agree(MPI_Comm comm, const std::function<void()>& part);
struct PeerFailed : std::runtime_error {
  PeerFailed() : std::runtime_error("another rank failed") {}
};
// For a rank that learnt of another's failure (PeerFailed) outside a collective phase: the
// failing rank ends the job (abort_world) with its one line; this one waits for that, and after
// `seconds` ends the job itself, saying so.
[[noreturn]] void await_abort(int seconds = 60);

// Reports an error raised where the other ranks may be inside a collective, then ends the
// whole job: the message names the rank and MPI_Abort stops every process.
[[noreturn]] void abort_world(const std::string& message, int code);

// Prints an error the way users see it: one line, "error: ..." for input errors.
std::string format_error(const std::exception& e);

}  // namespace strata::parallel
