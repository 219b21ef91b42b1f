// Errors: strata::Error carries file, line, the MPI rank that raised it, and whether it was
// caused by bad input (exit code 2) or by a failure inside Strata (exit code 1).
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

namespace strata {

// Input: the user gave something wrong (flag, data, checkpoint); Internal: everything else.
enum class ErrorKind { Internal, Input };

class Error : public std::runtime_error {
 public:
  Error(ErrorKind kind, std::string message, const char* file, int line);

  ErrorKind kind() const { return kind_; }
  // The message without location, as shown to users for input errors.
  const std::string& message() const { return message_; }
  const char* file() const { return file_; }
  int line() const { return line_; }
  int rank() const { return rank_; }

 private:
  ErrorKind kind_;
  std::string message_;
  const char* file_;
  int line_;
  int rank_;
};

// The rank of this process in the world; set once by the MPI bootstrap (0 before that).
int process_rank();
void set_process_rank(int rank);

namespace detail {
template <class... Args>
std::string cat(const Args&... args) {
  std::ostringstream os;
  (os << ... << args);
  return os.str();
}
}  // namespace detail

}  // namespace strata

// An internal invariant: failing means a bug or a failed system call.
#define STRATA_CHECK(cond, ...)                                                                                    \
  do {                                                                                                             \
    if (!(cond)) [[unlikely]]                                                                                      \
      throw ::strata::Error(::strata::ErrorKind::Internal,                                                         \
                            ::strata::detail::cat("check failed (" #cond "): ", __VA_ARGS__), __FILE__, __LINE__); \
  } while (0)

// A condition on user input; the message says what was expected and what was found.
#define STRATA_REQUIRE(cond, ...)                                                                                \
  do {                                                                                                           \
    if (!(cond)) [[unlikely]]                                                                                    \
      throw ::strata::Error(::strata::ErrorKind::Input, ::strata::detail::cat(__VA_ARGS__), __FILE__, __LINE__); \
  } while (0)

#define STRATA_THROW_INPUT(...) \
  throw ::strata::Error(::strata::ErrorKind::Input, ::strata::detail::cat(__VA_ARGS__), __FILE__, __LINE__)
#define STRATA_THROW(...) \
  throw ::strata::Error(::strata::ErrorKind::Internal, ::strata::detail::cat(__VA_ARGS__), __FILE__, __LINE__)
