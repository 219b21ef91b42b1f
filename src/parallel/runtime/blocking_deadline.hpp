// The deadline of a phase of blocking calls that cannot be polled the way waits on requests are
// (watchdog.hpp): setup's (device choice, communicator creation, the agreements of
// run_collectively, broadcasts of data and checkpoint checks) and libhdf5's own MPI calls in a
// parallel checkpoint write. A thread holds it: if the rank is still in the phase `seconds` after
// it was armed, it writes one line (its rank, what did not finish, what to suspect) and _exits
// with kExitTimeout; mpirun then ends the other ranks. A stopped or lost rank, or a cut link,
// thus ends the job instead of leaving every other rank blocked forever.
#pragma once

#include <condition_variable>
#include <mutex>
#include <string>
#include <thread>

namespace strata::parallel {

class BlockingDeadline {
 public:
  // The line reads "error on rank RANK: WHAT did not finish within SECONDS s (FLAG): WHY; exiting (code 5)".
  BlockingDeadline(int rank, double seconds, std::string what, std::string flag, std::string why);
  ~BlockingDeadline();  // disarms
  BlockingDeadline(const BlockingDeadline&) = delete;
  BlockingDeadline& operator=(const BlockingDeadline&) = delete;

 private:
  std::mutex mutex_;
  std::condition_variable disarmed_;
  bool done_ = false;
  std::thread thread_;
};

}  // namespace strata::parallel
