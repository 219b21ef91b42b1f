#include "parallel/runtime/blocking_deadline.hpp"

#include <unistd.h>

#include <chrono>

#include "core/error.hpp"
#include "parallel/runtime/mpi.hpp"
#include "parallel/runtime/watchdog.hpp"

namespace strata::parallel {

BlockingDeadline::BlockingDeadline(int rank, double seconds, std::string what, std::string flag, std::string why) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  // Formatted now: past the deadline the main thread is blocked in MPI (or still working), and
  // this thread only writes and exits.
  const std::string line = detail::cat("error on rank ", rank, ": ", what, " did not finish within ", seconds, " s (",
                                       flag, "): ", why, "; exiting (code ", kExitTimeout, ")\n");
  thread_ = std::thread([this, deadline, line] {
    std::unique_lock lock(mutex_);
    if (disarmed_.wait_until(lock, deadline, [this] { return done_; })) return;
    (void)!write(2, line.data(), line.size());
    _exit(kExitTimeout);
  });
}

BlockingDeadline::~BlockingDeadline() {
  {
    std::lock_guard lock(mutex_);
    done_ = true;
  }
  disarmed_.notify_one();
  thread_.join();
}

}  // namespace strata::parallel
