#include "parallel/runtime/setup_deadline.hpp"

#include <unistd.h>

#include <chrono>
#include <cstdio>

#include "parallel/runtime/mpi.hpp"
#include "parallel/runtime/watchdog.hpp"

namespace strata::parallel {

SetupDeadline::SetupDeadline(int rank, double seconds) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  thread_ = std::thread([this, rank, seconds, deadline] {
    std::unique_lock lock(mutex_);
    if (disarmed_.wait_until(lock, deadline, [this] { return done_; })) return;
    // The main thread is blocked in MPI (or still loading): only this thread's own calls here.
    char line[256];
    const int n = std::snprintf(line, sizeof line,
                                "error on rank %d: setup did not finish within %g s (--setup-timeout): a rank "
                                "stopped, lost or much slower before the first step; exiting (code %d)\n",
                                rank, seconds, kExitTimeout);
    if (n > 0) (void)!write(2, line, static_cast<size_t>(n));
    _exit(kExitTimeout);
  });
}

SetupDeadline::~SetupDeadline() {
  {
    std::lock_guard lock(mutex_);
    done_ = true;
  }
  disarmed_.notify_one();
  thread_.join();
}

}  // namespace strata::parallel
