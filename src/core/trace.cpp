#include "core/trace.hpp"

#include <atomic>
#include <chrono>
#include <cstdio>
#include <mutex>
#include <utility>

namespace strata::trace {

namespace {

std::atomic<bool> g_recording{false};
std::mutex g_mutex;
std::vector<Event> g_events;  // guarded by g_mutex
bool g_cut = false;           // guarded by g_mutex
thread_local int64_t t_step = -1;

// Thread ids of the tracks in the viewer (the order of the enum is the order of the rows).
int tid(Track track) { return 1 + static_cast<int>(track); }

void append_number(std::string& out, double microseconds) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.3f", microseconds);
  out += buf;
}

}  // namespace

const char* track_name(Track track) {
  switch (track) {
    case Track::Step:
      return "step";
    case Track::Compute:
      return "compute";
    case Track::Wait:
      return "waits";
    case Track::Optimizer:
      return "optimizer";
    case Track::Data:
      return "data wait";
    case Track::Evaluation:
      return "evaluation";
    case Track::Checkpoint:
      return "checkpoint";
    case Track::Communication:
      return "communication";
    case Track::Loader:
      return "loader thread";
    case Track::Writer:
      return "checkpoint writer thread";
  }
  return "?";
}

bool recording() { return g_recording.load(std::memory_order_relaxed); }
void set_recording(bool on) { g_recording.store(on, std::memory_order_relaxed); }
void set_step(int64_t step) { t_step = step; }

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

void record(Event event) {
  if (event.step < 0) event.step = t_step;
  const std::lock_guard lock(g_mutex);
  if (g_events.size() >= kMaxEvents) {
    g_cut = true;
    set_recording(false);
    return;
  }
  g_events.push_back(std::move(event));
}

std::vector<Event> take(bool* cut) {
  const std::lock_guard lock(g_mutex);
  if (cut) *cut = g_cut;
  g_cut = false;
  return std::exchange(g_events, {});
}

Span::Span(Track track, std::string_view name) : active_(recording()) {
  if (!active_) return;
  event_.track = track;
  event_.name = name;
  event_.begin_ns = now_ns();
}

Span::~Span() {
  if (!active_) return;
  event_.end_ns = now_ns();
  record(std::move(event_));
}

Span& Span::arg(std::string_view key, int64_t value) {
  if (active_) {
    if (!event_.args.empty()) event_.args += ',';
    event_.args += json_string(key) + ':' + std::to_string(value);
  }
  return *this;
}

Span& Span::arg(std::string_view key, std::string_view value) {
  if (active_) {
    if (!event_.args.empty()) event_.args += ',';
    event_.args += json_string(key) + ':' + json_string(value);
  }
  return *this;
}

std::string json_string(std::string_view s) {
  std::string out = "\"";
  for (const char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\u%04x", c);
      out += buf;
    } else {
      out += c;
    }
  }
  return out + '"';
}

std::string trace_json(const std::vector<Event>& events, int pid, int64_t origin_ns, int64_t offset_ns) {
  std::string out;
  const std::string process = std::to_string(pid);
  const auto time = [&](int64_t ns) { return static_cast<double>(ns - offset_ns - origin_ns) / 1e3; };
  const auto common = [&](const Event& e, const char* phase, int64_t ns) {
    if (!out.empty()) out += ",\n";
    out += "{\"ph\":\"";
    out += phase;
    out += "\",\"pid\":" + process + ",\"ts\":";
    append_number(out, time(ns));
    out += ",\"cat\":\"";
    out += track_name(e.track);
    out += "\",\"name\":" + json_string(e.name);
  };
  const auto args = [&](const Event& e) {
    out += ",\"args\":{\"step\":" + std::to_string(e.step);
    if (!e.args.empty()) out += "," + e.args;
    out += "}}";
  };
  uint64_t async_id = 0;
  for (const Event& e : events) {
    if (e.track == Track::Communication) {
      // In flight from start to the completion this rank saw: overlapping operations, so async
      // events (their own rows); id2.local keeps the ids per process.
      const std::string id = ",\"id2\":{\"local\":\"" + std::to_string(++async_id) + "\"}";
      common(e, "b", e.begin_ns);
      out += id;
      args(e);
      common(e, "e", e.end_ns);
      out += id + "}";
      if (e.flow == 0) continue;
      // A message: a zero-length slice on the messages row where the send starts or the
      // receive is seen complete, and the flow arrow between the two ranks' slices.
      const int64_t at = e.flow_out ? e.begin_ns : e.end_ns;
      common(e, "X", at);
      out += ",\"dur\":0,\"tid\":" + std::to_string(tid(e.track));
      args(e);
      common(e, e.flow_out ? "s" : "f", at);
      out += ",\"tid\":" + std::to_string(tid(e.track)) + ",\"id\":" + std::to_string(e.flow);
      out += e.flow_out ? "}" : ",\"bp\":\"e\"}";
      continue;
    }
    common(e, "X", e.begin_ns);
    out += ",\"dur\":";
    append_number(out, static_cast<double>(e.end_ns - e.begin_ns) / 1e3);
    out += ",\"tid\":" + std::to_string(tid(e.track));
    args(e);
  }
  return out;
}

std::string trace_metadata_json(int pid, const std::string& process_name) {
  const std::string process = std::to_string(pid);
  std::string out = "{\"ph\":\"M\",\"pid\":" + process +
                    ",\"name\":\"process_name\",\"args\":{\"name\":" + json_string(process_name) +
                    "}},\n{\"ph\":\"M\",\"pid\":" + process +
                    ",\"name\":\"process_sort_index\",\"args\":{\"sort_index\":" + process + "}}";
  for (int t = 0; t <= static_cast<int>(Track::Writer); ++t) {
    const auto track = static_cast<Track>(t);
    const std::string thread = ",\"tid\":" + std::to_string(tid(track));
    out += ",\n{\"ph\":\"M\",\"pid\":" + process + thread + ",\"name\":\"thread_name\",\"args\":{\"name\":\"" +
           track_name(track) + "\"}},\n{\"ph\":\"M\",\"pid\":" + process + thread +
           ",\"name\":\"thread_sort_index\",\"args\":{\"sort_index\":" + std::to_string(t) + "}}";
  }
  return out;
}

}  // namespace strata::trace
