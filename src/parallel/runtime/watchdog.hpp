// The watchdog: every wait for a communication operation runs under a deadline, and past it the
// rank prints one line (itself, the operation, how long, the ranks it waits for), dumps its
// flight recorder and aborts the job (kExitTimeout), instead of hanging. Also keeps per
// communicator fingerprints of the collectives so that ranks that disagree about what to do
// next are reported, not left waiting (docs/reliability.md, "Deadlines and the watchdog").
//
// - Flight recorder: the last kRecorderSize operations of this rank (sequence number,
//   communicator, operation, bytes, dtype, peer or root, step, start time, completed or not).
// - Heartbeats: every rank on a node writes, into a small shared-memory table indexed by world
//   rank, when it last showed a sign of life (started an operation or polled a wait) and what it
//   last started; the rank whose deadline passed names the peers of the communicator whose
//   heartbeat is stale. Peers on other nodes are "unknown (not on this node)".
// - Fingerprints: each communicator (Channel) hashes its collectives in order (operation,
//   bytes, dtype, root); fingerprint_row()/check_fingerprints() compare them over the world on
//   the all-gather the trainer does every step anyway.
// Only the thread that calls MPI uses this (MPI_THREAD_FUNNELED), so nothing here locks.
#pragma once

#include <mpi.h>

#include <array>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/dtype.hpp"

namespace strata::parallel {

class Communicator;

namespace watchdog {

// The deadline before the trainer sets --timeout (setup: communicators, first collectives).
constexpr double kSetupTimeoutS = 600;
// Waits inside checkpoint saves and loads (rank 0 may write gigabytes while the others wait).
constexpr double kCheckpointTimeoutS = 3600;
constexpr int kRecorderSize = 64;

using Clock = std::chrono::steady_clock;

// The deadline of every wait from now on, in seconds (> 0).
void set_timeout(double seconds);
double timeout();
// While alive, waits run under at least `seconds` (checkpoint I/O).
class AtLeast {
 public:
  explicit AtLeast(double seconds);
  ~AtLeast();
  AtLeast(const AtLeast&) = delete;
  AtLeast& operator=(const AtLeast&) = delete;

 private:
  double saved_;
};
// The training step that operations belong to (context for reports; -1: none).
void set_step(int64_t step);
// While alive, operations started belong to gradient bucket `bucket` (1 = the first reduced).
class InBucket {
 public:
  explicit InBucket(int bucket);
  ~InBucket();
  InBucket(const InBucket&) = delete;
  InBucket& operator=(const InBucket&) = delete;
};

// Per-communicator identity and fingerprint; the communicator owns it.
struct Channel {
  std::string name;
  std::vector<int> world_ranks;  // world rank of each rank of the communicator
  uint64_t key = 0;              // the same on every member, different for other groups
  uint64_t hash = 0;             // of the collectives so far, in order
  uint64_t collectives = 0;      // how many
  double waited_s = 0;           // this rank's time blocked in waits on it (outermost waits only)
};
// Registers a communicator's channel (collective over its group: members register in the same order).
std::shared_ptr<Channel> open_channel(MPI_Comm comm, const std::string& name);

struct Record {
  uint64_t seq = 0;         // this rank's operation number, from 1
  uint64_t collective = 0;  // for collectives, its number on its channel (from 1); 0 for messages
  char comm[16] = {};
  char op[24] = {};  // e.g. "all_reduce sum"
  int64_t bytes = 0;
  DType dtype = DType::F32;
  int peer = -1;  // peer of a message, root of a reduce or broadcast, else -1
  int64_t step = -1;
  int bucket = -1;     // gradient bucket (BucketReducer, GradientRing), -1: none
  double start_s = 0;  // since the recorder's origin
  bool done = false;
  int tag = -1;          // of a message
  uint64_t flow = 0;     // of a message: the same on its send and its receive (below); 0 otherwise
  int64_t trace_ns = 0;  // its start for --trace (trace::now_ns), 0 when not recording
  std::shared_ptr<Channel> channel;
};
// One line: "#812 all_reduce sum of 4.0 MiB f32 on dp (collective 406 there, bucket 3 of step 14)".
std::string describe(const Record& r);
uint64_t fingerprint_mix(uint64_t h, const Record& r);

// The ring itself (a class so tests can use their own).
class FlightRecorder {
 public:
  Record& start(std::shared_ptr<Channel> channel, const char* op, int64_t bytes, DType dtype, int peer,
                bool collective);
  void complete(uint64_t seq);
  // The record of `seq` if the ring still holds it.
  const Record* find(uint64_t seq) const;
  // Oldest first.
  std::vector<Record> entries() const;
  std::string dump() const;
  uint64_t last_seq() const { return next_ - 1; }

 private:
  std::array<Record, kRecorderSize> ring_;
  uint64_t next_ = 1;
};
FlightRecorder& recorder();

// Starts recording an operation (updates its channel's fingerprint for collectives); returns its seq.
// A message's `tag` (sends and receives) gives it a flow id: a hash of (channel, sender, receiver,
// tag, how many such messages came before), which its send and its receive compute alike, since
// MPI matches them in order. While trace::recording(), completed() adds the operation to the trace.
uint64_t started(const std::shared_ptr<Channel>& channel, const char* op, int64_t bytes, DType dtype, int peer,
                 bool collective, int tag = -1);
void completed(uint64_t seq);
// Seconds this rank spent blocked in waits, per communicator name (summed over channels of the
// same name), since the process started: the step-time split of the progress lines.
std::vector<std::pair<std::string, double>> waited_seconds();

// Deadline bookkeeping of one wait. poll() is cheap; past the deadline it reports and aborts
// (the `expired` hook replaces that in tests).
class Wait {
 public:
  explicit Wait(uint64_t seq);
  ~Wait();
  Wait(const Wait&) = delete;
  Wait& operator=(const Wait&) = delete;
  void poll() {
    if (++polls_ % 64 == 0) check();
  }
  void check();

 private:
  uint64_t seq_;
  uint64_t polls_ = 0;
  Clock::time_point start_, deadline_;
  Wait* outer_;
};
// The innermost wait on this thread (inner loops such as shared-memory spins poll it), or nullptr.
Wait* current_wait();
inline void poll() {
  if (Wait* w = current_wait()) w->poll();
}
// Tests: called instead of aborting when a deadline passes, with the report line.
void set_expired_hook(void (*hook)(const std::string& line));

// The report line for a wait on `seq` that lasted `waited_s` (who is waited for, from the heartbeats).
std::string report(uint64_t seq, double waited_s);

// Heartbeats: collective over the world, once (MpiRuntime). Without it nobody is named.
void open_heartbeats(MPI_Comm world, MPI_Comm node);
void close_heartbeats();

// Fingerprints: this rank's channels as kFingerprintValues doubles (a 52-bit key and hash and a
// count per channel: exact in a double), to ride on an all-gather.
constexpr int kMaxChannels = 8;
constexpr int kFingerprintValues = 3 * kMaxChannels;
std::vector<double> fingerprint_row();
// Over every rank's row (row r = world rank r): the key of the first channel whose members
// disagree and two such ranks, or false (pure: unit-tested).
bool compare_fingerprints(const std::vector<double>& rows, int ranks, uint64_t& key, int& rank_a, int& rank_b);
// The report of two ranks' records of one channel: the first collective number where they differ.
std::string first_difference(const std::vector<Record>& a, int rank_a, const std::vector<Record>& b, int rank_b);
// all_reduce_sum (communicator.hpp) of `values` over `world` whose all-gather also carries every
// rank's fingerprints. If members of a communicator disagree, the ranks exchange their flight
// recorders, world rank 0 prints the first differing collective of both sides and the job
// aborts (kExitTimeout) instead of hanging later.
void sum_checking_fingerprints(Communicator& world, std::vector<double>& values);

}  // namespace watchdog
}  // namespace strata::parallel
