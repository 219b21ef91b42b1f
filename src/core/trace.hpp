// The trace recorder behind `train --trace`: spans of time on named tracks (compute, waits, the
// optimizer, the loader thread, ...) and operations in flight (collectives, messages), kept in
// memory per process while recording is on, and turned into Chrome trace-event JSON (Perfetto,
// chrome://tracing) by trace_json(). Collecting every rank's events into one file is
// parallel/runtime/trace_collect.hpp's job. Off (the default) it costs one relaxed atomic load per span.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace strata::trace {

// The rows of a rank's process in the viewer, in this order. Span tracks hold properly nested
// spans of one thread; Communication holds operations in flight, which overlap.
enum class Track : uint8_t {
  Step,
  Compute,
  Wait,
  Optimizer,
  Data,
  Evaluation,
  Checkpoint,
  Communication,
  Loader,
  Writer
};
const char* track_name(Track track);

struct Event {
  int64_t begin_ns = 0, end_ns = 0;  // CLOCK_MONOTONIC (steady_clock): one clock per node
  Track track = Track::Compute;
  std::string name;
  std::string args;   // JSON object members without braces: "\"micro\":3,\"bytes\":4096"
  int64_t step = -1;  // the training step (1-based) whose span holds it; -1: none (other threads, between steps)
  // A message's flow: the same id on the send and its receive (0: none); `flow_out` on the send.
  uint64_t flow = 0;
  bool flow_out = false;
};

// Most events a process keeps; past it recording stops (and the file says it was cut).
constexpr size_t kMaxEvents = 2'000'000;

bool recording();
void set_recording(bool on);
// The step of events the calling thread records from now on (1-based; -1: none).
void set_step(int64_t step);
int64_t now_ns();
// Thread-safe (the loader and checkpoint threads record too); dropped past kMaxEvents.
void record(Event event);
// Every event recorded so far, oldest first, and whether some were dropped; clears them.
std::vector<Event> take(bool* cut = nullptr);

// Records [construction, destruction) on `track` when recording at construction.
class Span {
 public:
  Span(Track track, std::string_view name);
  ~Span();
  Span(const Span&) = delete;
  Span& operator=(const Span&) = delete;
  bool active() const { return active_; }
  // Adds "key":value to the event's args (when active).
  Span& arg(std::string_view key, int64_t value);
  Span& arg(std::string_view key, std::string_view value);

 private:
  bool active_;
  Event event_;
};

// A JSON string literal of `s` (quotes included, control characters escaped).
std::string json_string(std::string_view s);
// The events as Chrome trace-event objects of process `pid`, joined by ",\n": times in µs since
// `origin_ns` after subtracting `offset_ns` (this clock minus the reference clock); spans as
// complete events (X) on their track's thread, operations in flight as async events (b/e), a
// message's flow as s/f events bound to them.
std::string trace_json(const std::vector<Event>& events, int pid, int64_t origin_ns, int64_t offset_ns);
// The metadata events naming process `pid` and its tracks, sorted by pid.
std::string trace_metadata_json(int pid, const std::string& process_name);

}  // namespace strata::trace
