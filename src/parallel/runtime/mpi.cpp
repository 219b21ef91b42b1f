#include "parallel/runtime/mpi.hpp"

#include <sched.h>
#include <stdlib.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <map>
#include <sstream>
#include <thread>

#include "parallel/runtime/cpu_threads.hpp"
#include "parallel/runtime/watchdog.hpp"

namespace strata::parallel {

namespace {

// Collective over the node communicator: every local rank's CPU mask (index = local rank).
std::vector<CpuSet> gather_cpus(MPI_Comm node) {
  // As bitmaps of CPU_SETSIZE bits: one fixed-size all-gather.
  constexpr int kWords = CPU_SETSIZE / 64;
  int size = 1;
  MPI_CHECK(MPI_Comm_size(node, &size));
  std::vector<uint64_t> mine(kWords, 0), all(static_cast<size_t>(kWords) * static_cast<size_t>(size));
  for (int c : own_cpus()) mine[static_cast<size_t>(c / 64)] |= uint64_t{1} << (c % 64);
  MPI_CHECK(MPI_Allgather(mine.data(), kWords, MPI_UINT64_T, all.data(), kWords, MPI_UINT64_T, node));
  std::vector<CpuSet> masks(static_cast<size_t>(size));
  for (int r = 0; r < size; ++r)
    for (int c = 0; c < CPU_SETSIZE; ++c)
      if (all[static_cast<size_t>(r * kWords + c / 64)] >> (c % 64) & 1) masks[static_cast<size_t>(r)].push_back(c);
  return masks;
}

}  // namespace

std::vector<std::string> host_names(MPI_Comm comm) {
  int size = 1;
  MPI_CHECK(MPI_Comm_size(comm, &size));
  char host[MPI_MAX_PROCESSOR_NAME] = {};
  int length = 0;
  MPI_CHECK(MPI_Get_processor_name(host, &length));
  std::vector<char> all(static_cast<size_t>(size) * MPI_MAX_PROCESSOR_NAME);
  MPI_CHECK(MPI_Allgather(host, MPI_MAX_PROCESSOR_NAME, MPI_CHAR, all.data(), MPI_MAX_PROCESSOR_NAME, MPI_CHAR, comm));
  std::vector<std::string> names;
  for (int r = 0; r < size; ++r) names.emplace_back(&all[static_cast<size_t>(r) * MPI_MAX_PROCESSOR_NAME]);
  return names;
}

std::string mpi_error_string(const char* call, int code) {
  char text[MPI_MAX_ERROR_STRING];
  int length = 0;
  MPI_Error_string(code, text, &length);
  return detail::cat(call, " failed: ", std::string(text, static_cast<size_t>(length)));
}

MpiRuntime::MpiRuntime(int& argc, char**& argv) {
  // Open MPI's default non-blocking all-reduce (libnbc) is 1.4-3.8x slower than its ring
  // algorithm for gradient-sized buffers on 2 ranks (bench_collectives); pick ring unless the
  // user chose otherwise.
  setenv("OMPI_MCA_coll_libnbc_iallreduce_algorithm", "1", /*overwrite=*/0);
  // Open MPI 4.1's `lockedfile` shared-file-pointer component formats the file's name into a
  // fixed buffer when MPI-IO opens a file, and a path past ~250 characters aborts the process
  // (glibc: "buffer overflow detected"; seen with a deep checkpoint directory). Strata never
  // uses shared file pointers: leave that component out unless the user chose.
  setenv("OMPI_MCA_sharedfp", "^lockedfile", /*overwrite=*/0);
  int provided = 0;
  MPI_CHECK(MPI_Init_thread(&argc, &argv, MPI_THREAD_FUNNELED, &provided));
  // Errors come back as codes and become strata::Error instead of aborting silently.
  MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
  MPI_CHECK(MPI_Comm_rank(MPI_COMM_WORLD, &rank_));
  MPI_CHECK(MPI_Comm_size(MPI_COMM_WORLD, &size_));
  set_process_rank(rank_);
  if (ranks_per_node_override() < 0) {  // the same environment on every rank: each exits alike
    if (rank_ == 0)
      std::fprintf(stderr, "error: STRATA_RANKS_PER_NODE must be a positive integer, found '%s'\n",
                   std::getenv("STRATA_RANKS_PER_NODE"));
    MPI_Finalize();
    std::exit(kExitBadInput);
  }
  node_ = split_by_node(MPI_COMM_WORLD);
  MPI_CHECK(MPI_Comm_rank(node_, &local_rank_));
  MPI_CHECK(MPI_Comm_size(node_, &local_size_));
  node_ranks_.resize(static_cast<size_t>(local_size_));
  MPI_CHECK(MPI_Allgather(&rank_, 1, MPI_INT, node_ranks_.data(), 1, MPI_INT, node_));
  node_cpus_ = gather_cpus(node_);
  default_threads_ = parallel::default_threads(node_cpus_, local_rank_);
  watchdog::open_heartbeats(MPI_COMM_WORLD, node_);
  // Each rank's node, named by its first world rank; the first kListed nodes are listed.
  constexpr size_t kListed = 8;
  std::vector<int> first(static_cast<size_t>(size_));
  MPI_CHECK(MPI_Allgather(&node_ranks_[0], 1, MPI_INT, first.data(), 1, MPI_INT, MPI_COMM_WORLD));
  std::map<int, std::vector<int>> nodes;
  for (int r = 0; r < size_; ++r) nodes[first[static_cast<size_t>(r)]].push_back(r);
  std::string groups;
  size_t listed = 0;
  for (auto it = nodes.begin(); it != nodes.end() && listed < kListed; ++it, ++listed) {
    groups += " [";
    for (int r : it->second) groups += detail::cat(r == it->first ? "" : " ", r);
    groups += "]";
  }
  if (nodes.size() > kListed) groups += detail::cat(" ... (", nodes.size() - kListed, " more)");
  nodes_ = detail::cat(nodes.size(), " node(s):", groups);
}

int ranks_per_node_override() {
  static const int k = [] {
    const char* text = std::getenv("STRATA_RANKS_PER_NODE");
    if (text == nullptr) return 0;
    char* end = nullptr;
    errno = 0;
    const long value = std::strtol(text, &end, 10);
    return *text != '\0' && *end == '\0' && errno == 0 && value > 0 && value <= (1 << 20) ? static_cast<int>(value)
                                                                                          : -1;
  }();
  return k;
}

MPI_Comm split_by_node(MPI_Comm comm) {
  int rank = 0, world_rank = 0;
  MPI_CHECK(MPI_Comm_rank(comm, &rank));
  MPI_CHECK(MPI_Comm_rank(MPI_COMM_WORLD, &world_rank));
  MPI_Comm node = MPI_COMM_NULL;
  if (const int k = ranks_per_node_override(); k > 0)
    MPI_CHECK(MPI_Comm_split(comm, world_rank / k, rank, &node));
  else
    MPI_CHECK(MPI_Comm_split_type(comm, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &node));
  return node;
}

MpiRuntime::~MpiRuntime() {
  watchdog::close_heartbeats();
  MPI_Comm_free(&node_);
  MPI_Finalize();
}

void MpiRuntime::warn_if_oversubscribed(int threads) const {
  std::vector<int> all(static_cast<size_t>(local_size_));
  MPI_CHECK(MPI_Allgather(&threads, 1, MPI_INT, all.data(), 1, MPI_INT, node_));
  const std::string lines = oversubscription(node_ranks_, node_cpus_, all);
  if (local_rank_ != 0 || lines.empty()) return;
  std::istringstream each(lines);
  for (std::string line; std::getline(each, line);) std::fprintf(stderr, "warning: %s\n", line.c_str());
}

std::string format_error(const std::exception& e) {
  const auto* se = dynamic_cast<const Error*>(&e);
  if (se && se->kind() == ErrorKind::Input) return "error: " + se->message();
  if (se) {
    const std::string file = std::filesystem::path(se->file()).filename().string();
    return detail::cat("error on rank ", se->rank(), ": ", se->message(), " (", file, ":", se->line(), ")");
  }
  return detail::cat("error on rank ", process_rank(), ": ", e.what());
}

int run_collectively(MPI_Comm comm, const std::function<void()>& phase) {
  int code = kExitOk;
  std::string message;
  try {
    phase();
  } catch (const PeerFailed&) {
    // the failing rank reports
  } catch (const Error& e) {
    code = e.kind() == ErrorKind::Input ? kExitBadInput : kExitFailure;
    message = format_error(e);
  } catch (const std::exception& e) {
    code = kExitFailure;
    message = format_error(e);
  }
  int size = 1;
  MPI_Comm_size(comm, &size);
  // The lowest failing rank reports; everyone agrees on its exit code.
  int rank = 0;
  MPI_Comm_rank(comm, &rank);
  const int mine = code != kExitOk ? rank : size;
  int lowest = size;
  MPI_Allreduce(&mine, &lowest, 1, MPI_INT, MPI_MIN, comm);
  if (lowest == size) return kExitOk;
  int agreed = code;
  MPI_Bcast(&agreed, 1, MPI_INT, lowest, comm);
  if (rank == lowest) {
    std::fprintf(stderr, "%s\n", message.c_str());
    std::fflush(stderr);
  }
  return agreed;
}

void agree(MPI_Comm comm, const std::function<void()>& part) {
  std::exception_ptr error;
  try {
    part();
  } catch (...) {
    error = std::current_exception();
  }
  int rank = 0, size = 1;
  MPI_Comm_rank(comm, &rank);
  MPI_Comm_size(comm, &size);
  const int mine = error ? rank : size;
  int lowest = size;
  MPI_Allreduce(&mine, &lowest, 1, MPI_INT, MPI_MIN, comm);
  if (lowest == size) return;
  if (rank == lowest) std::rethrow_exception(error);
  throw PeerFailed();
}

namespace {

// A fixed array: a signal handler may read it while nothing allocates.
constexpr int kMaxExitCleanups = 8;
std::atomic<ExitCleanup> g_exit_cleanups[kMaxExitCleanups];

}  // namespace

void register_exit_cleanup(ExitCleanup cleanup) {
  for (auto& slot : g_exit_cleanups) {
    ExitCleanup expected = nullptr;
    if (slot.load() == cleanup || slot.compare_exchange_strong(expected, cleanup)) return;
  }
  STRATA_THROW("more than ", kMaxExitCleanups, " exit cleanups registered");
}

void run_exit_cleanups() noexcept {
  for (auto& slot : g_exit_cleanups)
    if (const ExitCleanup cleanup = slot.load()) cleanup();
}

void await_abort(int seconds) {
  std::this_thread::sleep_for(std::chrono::seconds(seconds));
  abort_world(detail::cat("error on rank ", process_rank(), ": another rank failed but did not end the job within ",
                          seconds, " s"),
              kExitFailure);
}

void abort_world(const std::string& message, int code) {
  std::fprintf(stderr, "%s\n", message.c_str());
  std::fflush(stderr);
  int size = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  if (size == 1) _exit(code);  // nothing to tear down; avoid MPI_Abort's banner
  MPI_Abort(MPI_COMM_WORLD, code);
  _exit(code);
}

}  // namespace strata::parallel
