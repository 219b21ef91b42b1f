// The deadline of setup. Setup's MPI calls (device choice, communicator creation, the
// agreements of run_collectively, broadcasts of data and checkpoint checks) are blocking calls
// that cannot be polled the way waits on requests are (watchdog.hpp), so a thread holds their
// deadline: if a rank is still in setup `seconds` after it was armed, it writes one line (its
// rank, how long, what to suspect) and _exits with kExitTimeout; mpirun then ends
// the other ranks. A stopped or lost rank before the first step thus ends the job instead of
// leaving every other rank blocked forever.
#pragma once

#include <condition_variable>
#include <mutex>
#include <thread>

namespace strata::parallel {

class SetupDeadline {
 public:
  SetupDeadline(int rank, double seconds);
  ~SetupDeadline();  // disarms
  SetupDeadline(const SetupDeadline&) = delete;
  SetupDeadline& operator=(const SetupDeadline&) = delete;

 private:
  std::mutex mutex_;
  std::condition_variable disarmed_;
  bool done_ = false;
  std::thread thread_;
};

}  // namespace strata::parallel
