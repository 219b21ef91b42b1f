// A checkpoint directory (docs/checkpoints.md): step-NNNNNNNN.h5 files, each with its manifest,
// and a `latest` pointer. Names of step files, the setup check that the directory is writable,
// moving `latest`, pruning this job's older checkpoints (--keep), and the resume selection: the
// newest checkpoint that validates.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace strata::io {

// Creates `dir` if needed and proves a file can be written in it; an Input error naming `flag`
// otherwise (checked at setup, not at the first save hours later).
void require_writable_directory(const std::string& dir, const std::string& flag);
// DIR/step-NNNNNNNN.h5.
std::string checkpoint_path(const std::string& dir, int64_t step);
// Whether `name` (no directory) is step-NNNNNNNN.h5, a name checkpoint_path gives.
bool is_step_file_name(const std::string& name);
// The step in the step-NNNNNNNN.h5 name of `path`; -1 for other names.
int64_t step_of_name(const std::string& path);
// Points DIR/latest at `path` (a file in DIR): writes latest.tmp, fsyncs, renames, fsyncs DIR.
void update_latest(const std::string& dir, const std::string& path);
// `written`: the checkpoints this job wrote, oldest first. Keeps the newest `keep` of them and
// removes the older ones with their manifests (keep <= 0: removes nothing). No job deletes a
// file it did not write: other jobs' checkpoints (an earlier run's, before a requeue) stay.
void prune_checkpoints(std::vector<std::string>& written, int64_t keep);
// The newest checkpoint of DIR that validates: the one `latest` names, else step-*.h5 from the
// highest step down; each candidate must pass its manifest (whole-file crc32), open and give
// its run state (without a manifest: pass every tensor's crc32), and a bad one is skipped with
// a one-line warning naming it and why.
// Empty when there is none.
std::string newest_checkpoint(const std::string& dir);

}  // namespace strata::io
