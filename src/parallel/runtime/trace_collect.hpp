// `train --trace FILE`: the owner of a run's trace. At setup it measures every rank's clock
// against world rank 0's (ping-pong, the round trip with the least delay: offset = this rank's
// clock at the middle of the round trip minus rank 0's reply, within ± half that round trip);
// during the run it switches recording (core/trace.hpp) on for the steps of --trace-steps; at
// the end every rank's events go, in rank 0's time, to rank 0, which writes one Chrome
// trace-event JSON file (Perfetto, chrome://tracing): one process per rank, its tracks as
// threads (docs/tracing.md).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "parallel/comm/mpi_communicator.hpp"

namespace strata::parallel {

struct ClockOffset {
  int64_t offset_ns = 0;  // this rank's clock minus world rank 0's
  int64_t rtt_ns = 0;     // of the round trip it was measured over: the offset is within ± rtt / 2
};

// Collective over `world`: each rank's clock against rank 0's, best of `rounds` round trips.
ClockOffset measure_clock_offset(MpiCommunicator& world, int rounds = 32);

class TraceSession {
 public:
  // Collective over `world` (measures the clock offsets). Records steps first..last (1-based,
  // inclusive); `process_name` labels this rank's row ("rank 3: stage 1, replica 0").
  TraceSession(MpiCommunicator& world, std::string path, int64_t first, int64_t last, std::string process_name);
  ~TraceSession();
  // Before step `step` (1-based) runs: recording on inside the window, off outside it (what
  // follows a step inside it, an evaluation or a checkpoint, is recorded with it).
  void begin_step(int64_t step);
  // Collective: stops recording and writes the file (rank 0; replaced atomically); returns rank
  // 0's one-line summary (empty elsewhere).
  std::string write();

 private:
  MpiCommunicator& world_;
  std::string path_, process_name_;
  int64_t first_, last_;
  ClockOffset clock_;
  int64_t origin_ns_ = 0;  // rank 0's clock at setup: time 0 of the file
};

}  // namespace strata::parallel
