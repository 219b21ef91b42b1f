#include "core/log.hpp"

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <mutex>

namespace strata::log {

namespace {
std::atomic<int> g_level{static_cast<int>(Level::Info)};
std::atomic<bool> g_all_ranks{false};
std::mutex g_mutex;
FILE* g_tee = nullptr;    // leaked on purpose: lines may be logged until the process ends
bool g_tee_lost = false;  // a write to it failed (said once)
}  // namespace

void set_level(Level level) { g_level = static_cast<int>(level); }
void set_all_ranks(bool all) { g_all_ranks = all; }

bool enabled(Level level) {
  if (static_cast<int>(level) < g_level) return false;
  // Warnings and errors from any rank matter; progress only from rank 0.
  return process_rank() == 0 || g_all_ranks || level >= Level::Warn;
}

void write(Level level, const std::string& line) {
  std::lock_guard lock(g_mutex);
  FILE* out = level >= Level::Warn ? stderr : stdout;
  const char* tag = level == Level::Warn ? "warning: " : level == Level::Error ? "error: " : "";
  for (FILE* f : {out, g_tee}) {
    if (f == nullptr) continue;
    if (g_all_ranks || process_rank() != 0)
      std::fprintf(f, "[rank %d] %s%s\n", process_rank(), tag, line.c_str());
    else
      std::fprintf(f, "%s%s\n", tag, line.c_str());
    if (std::fflush(f) != 0 && f == g_tee && !g_tee_lost) {  // the log file's lines are lost, not the run
      g_tee_lost = true;
      std::fprintf(stderr, "warning: --log-file: writing failed (%s): its lines are being lost\n",
                   std::strerror(errno));
    }
  }
}

void tee_to(const std::string& path) {
  std::lock_guard lock(g_mutex);
  FILE* f = std::fopen(path.c_str(), "a");
  STRATA_REQUIRE(f != nullptr, "--log-file: cannot open '", path, "' for appending: ", std::strerror(errno));
  if (g_tee) std::fclose(g_tee);
  g_tee = f;
  g_tee_lost = false;
}

std::string format_bytes(int64_t bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  auto value = static_cast<double>(bytes);
  int unit = 0;
  while (value >= 1024 && unit < 4) {
    value /= 1024;
    ++unit;
  }
  char text[32];
  std::snprintf(text, sizeof text, unit ? "%.2f %s" : "%.0f %s", value, units[unit]);
  return text;
}

}  // namespace strata::log
