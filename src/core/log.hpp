// Rank-aware logging: by default only rank 0 prints; `set_log_all_ranks(true)` prefixes every
// line with its rank and lets all ranks print.
#pragma once

#include <cstdint>
#include <string>

#include "core/error.hpp"

namespace strata::log {

enum class Level { Debug = 0, Info = 1, Warn = 2, Error = 3 };

void set_level(Level level);
void set_all_ranks(bool all);
bool enabled(Level level);
void write(Level level, const std::string& line);
// From now on every line this process prints is also appended to `path` (flushed line by line):
// a job's log that does not depend on the launcher forwarding output (mpirun stops at a
// cancel). An Input error if it cannot be opened.
void tee_to(const std::string& path);

// 208 B, 72.31 KiB, 5.69 GiB: a byte count for reading (exact counts stand beside it where they
// matter).
std::string format_bytes(int64_t bytes);

template <class... Args>
void info(const Args&... args) {
  if (enabled(Level::Info)) write(Level::Info, detail::cat(args...));
}
template <class... Args>
void warn(const Args&... args) {
  if (enabled(Level::Warn)) write(Level::Warn, detail::cat(args...));
}
template <class... Args>
void error(const Args&... args) {
  if (enabled(Level::Error)) write(Level::Error, detail::cat(args...));
}
template <class... Args>
void debug(const Args&... args) {
  if (enabled(Level::Debug)) write(Level::Debug, detail::cat(args...));
}

}  // namespace strata::log
