#include "parallel/runtime/trace_collect.hpp"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>

#include "core/error.hpp"
#include "core/trace.hpp"
#include "parallel/runtime/host_values.hpp"

namespace strata::parallel {

namespace {
constexpr int kPingTag = 32001, kEventsTag = 32002;
}

ClockOffset measure_clock_offset(MpiCommunicator& world, int rounds) {
  ClockOffset best{0, -1};
  // Rank 0 answers every other rank's pings in turn with its own clock's time.
  if (world.rank() == 0) {
    for (int peer = 1; peer < world.size(); ++peer)
      for (int k = 0; k < rounds; ++k) {
        recv_values(world, peer, kPingTag);
        send_values(world, {static_cast<double>(trace::now_ns())}, peer, kPingTag);
      }
    return {0, 0};
  }
  for (int k = 0; k < rounds; ++k) {
    const int64_t sent = trace::now_ns();
    send_values(world, {0.0}, 0, kPingTag);
    const double reply = recv_values(world, 0, kPingTag).at(0);  // ns: exact in a double for 104 days of uptime
    const int64_t received = trace::now_ns();
    const int64_t rtt = received - sent;
    if (best.rtt_ns < 0 || rtt < best.rtt_ns) best = {sent + rtt / 2 - static_cast<int64_t>(reply), rtt};
  }
  return best;
}

TraceSession::TraceSession(MpiCommunicator& world, std::string path, int64_t first, int64_t last,
                           std::string process_name)
    : world_(world), path_(std::move(path)), process_name_(std::move(process_name)), first_(first), last_(last) {
  clock_ = measure_clock_offset(world_);
  origin_ns_ = broadcast_value(world_, trace::now_ns(), 0);
}

TraceSession::~TraceSession() { trace::set_recording(false); }

void TraceSession::begin_step(int64_t step) { trace::set_recording(step >= first_ && step <= last_); }

std::string TraceSession::write() {
  trace::set_recording(false);
  bool cut = false;
  const std::vector<trace::Event> events = trace::take(&cut);
  const int rank = world_.rank(), size = world_.size();
  std::string mine = trace::trace_metadata_json(rank, process_name_);
  if (const std::string json = trace::trace_json(events, rank, origin_ns_, clock_.offset_ns); !json.empty())
    mine += ",\n" + json;
  const std::vector<int64_t> facts =
      all_gather_values(world_, {clock_.offset_ns, clock_.rtt_ns, static_cast<int64_t>(events.size()), cut ? 1 : 0});
  if (rank != 0) {
    send_bytes(world_, mine, 0, kEventsTag);
    return "";
  }
  // Rank 0 writes its own part, then each rank's as it arrives (one rank's events in memory at a time).
  const std::string tmp = path_ + ".tmp";
  std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
  STRATA_REQUIRE(out.good(), "--trace: cannot write ", tmp);
  out << "{\"traceEvents\":[\n" << mine;
  for (int r = 1; r < size; ++r) out << ",\n" << recv_bytes(world_, r, kEventsTag);
  int64_t total = 0, worst_offset = 0, worst_rtt = 0;
  std::string offsets, rtts, cut_ranks;
  for (int r = 0; r < size; ++r) {
    const int64_t* f = facts.data() + 4 * r;
    offsets += detail::cat(r ? "," : "", f[0] / 1e3);
    rtts += detail::cat(r ? "," : "", f[1] / 1e3);
    if (f[3]) cut_ranks += detail::cat(cut_ranks.empty() ? "" : ",", r);
    total += f[2];
    worst_offset = std::max(worst_offset, std::abs(f[0]));
    worst_rtt = std::max(worst_rtt, f[1]);
  }
  out << "\n],\n\"displayTimeUnit\":\"ms\",\n\"otherData\":{\"producer\":\"strata train --trace\",\"steps\":\""
      << first_ << ":" << last_ << "\",\"ranks\":" << size << ",\"clock_offset_us\":[" << offsets
      << "],\"clock_rtt_us\":[" << rtts << "],\"cut_ranks\":[" << cut_ranks << "]}}\n";
  out.close();
  STRATA_REQUIRE(!out.fail(), "--trace: writing ", tmp, " failed (disk full?)");
  std::filesystem::rename(tmp, path_);
  char line[256];
  std::snprintf(line, sizeof line,
                "trace: %s (%lld events of %d ranks, steps %lld-%lld; clock offsets at most %.1f us, measured "
                "within +-%.1f us)",
                path_.c_str(), static_cast<long long>(total), size, static_cast<long long>(first_),
                static_cast<long long>(last_), static_cast<double>(worst_offset) / 1e3,
                static_cast<double>(worst_rtt) / 2e3);
  std::string summary = line;
  if (!cut_ranks.empty())
    summary += detail::cat("; ranks ", cut_ranks, " stopped recording at ", trace::kMaxEvents,
                           " events: narrow --trace-steps");
  return summary;
}

}  // namespace strata::parallel
