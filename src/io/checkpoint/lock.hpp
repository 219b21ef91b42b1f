// DirectoryLock: one job at a time writes a checkpoint directory (an flock on DIR/.lock that
// names its holder), and the unfinished writes of a killed job are named once.
#pragma once

#include <string>

namespace strata::io {

// Creates DIR if needed and takes an advisory lock (flock) on DIR/.lock held while the object lives, so that one job at
// a time writes a checkpoint directory. The file names the holder ("host H pid P slurm_job J"); a second job gets an
// Input error naming it. The kernel drops the lock when the process dies, so a requeued job gets it back. Once held,
// the *.tmp files of writes a killed job left unfinished are named in a note (never deleted: not this job's). A
// directory this lock created and nothing else wrote to (a run refused during setup) is removed again.
class DirectoryLock {
 public:
  explicit DirectoryLock(const std::string& dir);
  ~DirectoryLock();
  DirectoryLock(const DirectoryLock&) = delete;
  DirectoryLock& operator=(const DirectoryLock&) = delete;

 private:
  int fd_ = -1;
  std::string dir_;
  bool created_ = false;  // the directory did not exist before
};

}  // namespace strata::io
