// DirectoryLock: flock of DIR/.lock, its holder's line, the note on unfinished *.tmp writes.
#include "io/checkpoint/lock.hpp"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>

#include "core/error.hpp"
#include "core/log.hpp"

namespace strata::io {

namespace fs = std::filesystem;

DirectoryLock::DirectoryLock(const std::string& dir) : dir_(dir) {
  std::error_code ec;
  created_ = !fs::exists(dir, ec);
  fs::create_directories(dir, ec);
  STRATA_REQUIRE(!ec, "--checkpoint-dir: cannot create '", dir, "': ", ec.message());
  const std::string path = (fs::path(dir) / ".lock").string();
  fd_ = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  STRATA_REQUIRE(fd_ >= 0, "--checkpoint-dir: cannot open '", path, "': ", std::strerror(errno));
  if (::flock(fd_, LOCK_EX | LOCK_NB) != 0) {
    const int err = errno;
    std::ifstream in(path);
    std::string holder;
    std::getline(in, holder);
    ::close(fd_);
    fd_ = -1;
    STRATA_REQUIRE(err != EWOULDBLOCK, "--checkpoint-dir ", dir, " is in use by another job (",
                   holder.empty() ? "holder unknown" : holder, "); one job per checkpoint directory");
    STRATA_THROW_INPUT("--checkpoint-dir: cannot lock '", path, "': ", std::strerror(err));
  }
  char host[256] = "?";
  ::gethostname(host, sizeof host - 1);
  const char* job = std::getenv("SLURM_JOB_ID");
  const std::string text =
      detail::cat("host ", host, " pid ", ::getpid(), job ? detail::cat(" slurm_job ", job) : std::string(), "\n");
  // The holder's name is informative only: the lock is the flock, not the content.
  if (::ftruncate(fd_, 0) != 0 || ::pwrite(fd_, text.data(), text.size(), 0) != static_cast<ssize_t>(text.size()))
    log::warn("cannot write the holder into ", path, ": ", std::strerror(errno));
  // A *.tmp here is a write that a killed job (SIGKILL, a second signal) never finished. No job
  // deletes a file it did not create, so the user hears of it, once, with its size.
  for (const fs::directory_entry& entry : fs::directory_iterator(dir, ec)) {
    if (entry.path().extension() != ".tmp" || !entry.is_regular_file(ec)) continue;
    log::info("note: ", entry.path().string(), " (", entry.file_size(ec),
              " bytes) is an unfinished write of an earlier job; it is never read, and may be removed");
  }
}

DirectoryLock::~DirectoryLock() {
  if (fd_ < 0) return;
  // Ours alone and still empty: removed while the flock is held, so no other job can hold it in
  // between. Otherwise the file stays (removing it after the release would race a new holder).
  if (created_) {
    std::error_code ec;
    const fs::directory_iterator entries(dir_, ec);
    const bool only_lock = !ec && std::distance(entries, fs::directory_iterator{}) == 1;
    if (only_lock && fs::remove(fs::path(dir_) / ".lock", ec)) fs::remove(dir_, ec);
  }
  ::close(fd_);  // releases the flock
}

}  // namespace strata::io
