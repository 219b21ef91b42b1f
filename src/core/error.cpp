#include "core/error.hpp"

#include <atomic>

namespace strata {

namespace {
std::atomic<int> g_rank{0};

std::string format_what(ErrorKind kind, const std::string& message, const char* file, int line, int rank) {
  if (kind == ErrorKind::Input) return message;
  return detail::cat(file, ":", line, " [rank ", rank, "] ", message);
}
}  // namespace

int process_rank() { return g_rank.load(std::memory_order_relaxed); }
void set_process_rank(int rank) { g_rank.store(rank, std::memory_order_relaxed); }

Error::Error(ErrorKind kind, std::string message, const char* file, int line)
    : std::runtime_error(format_what(kind, message, file, line, process_rank())),
      kind_(kind),
      message_(std::move(message)),
      file_(file),
      line_(line),
      rank_(process_rank()) {}

}  // namespace strata
