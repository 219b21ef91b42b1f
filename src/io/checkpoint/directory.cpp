// Checkpoint directories: step file names, `latest`, --keep pruning and the newest valid checkpoint.
#include "io/checkpoint/directory.hpp"

#include <fcntl.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>

#include "core/error.hpp"
#include "core/log.hpp"
#include "io/checkpoint/file.hpp"
#include "io/checkpoint/manifest.hpp"
#include "io/checkpoint/run_state.hpp"

namespace strata::io {

namespace fs = std::filesystem;

bool is_step_file_name(const std::string& name) {
  return name.size() == 16 && name.starts_with("step-") && name.ends_with(".h5") &&
         std::all_of(name.begin() + 5, name.begin() + 13, [](char c) { return c >= '0' && c <= '9'; });
}

int64_t step_of_name(const std::string& path) {
  const std::string name = fs::path(path).filename().string();
  return is_step_file_name(name) ? std::stoll(name.substr(5, 8)) : -1;
}

void require_writable_directory(const std::string& dir, const std::string& flag) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  STRATA_REQUIRE(!ec, flag, ": cannot create '", dir, "': ", ec.message());
  const fs::path probe = fs::path(dir) / ".strata-write-test";
  STRATA_REQUIRE(std::ofstream(probe).good(), flag, ": cannot write in '", dir, "': ", std::strerror(errno));
  fs::remove(probe, ec);
}

std::string checkpoint_path(const std::string& dir, int64_t step) {
  char name[64];
  std::snprintf(name, sizeof name, "step-%08lld.h5", static_cast<long long>(step));
  return (fs::path(dir) / name).string();
}

namespace {

// step-*.h5 files of `dir`, newest (highest step) first.
std::vector<fs::path> step_files(const std::string& dir) {
  std::vector<fs::path> files;
  std::error_code ec;
  for (const fs::directory_entry& d : fs::directory_iterator(dir, ec))
    if (is_step_file_name(d.path().filename().string())) files.push_back(d.path());
  std::sort(files.rbegin(), files.rend());  // zero-padded steps sort by name
  return files;
}

}  // namespace

void update_latest(const std::string& dir, const std::string& path) {
  // On failure `latest` still names the previous checkpoint.
  write_file_durably((fs::path(dir) / "latest").string(), fs::path(path).filename().string() + "\n");
  fsync_path(dir, O_RDONLY | O_DIRECTORY);
}

void prune_checkpoints(std::vector<std::string>& written, int64_t keep) {
  if (keep <= 0 || static_cast<int64_t>(written.size()) <= keep) return;
  const auto old_end = written.end() - keep;
  for (auto it = written.begin(); it != old_end; ++it)
    for (const std::string& file : {manifest_path(*it), *it}) {  // the manifest first: no orphan file stays checked
      std::error_code ec;
      fs::remove(file, ec);
      if (ec) log::warn("cannot remove old checkpoint ", file, ": ", ec.message());
    }
  written.erase(written.begin(), old_end);
}

std::string newest_checkpoint(const std::string& dir) {
  std::vector<std::string> candidates;
  std::ifstream latest(fs::path(dir) / "latest");
  std::string name;
  if (latest >> name) {
    if (is_step_file_name(name)) {
      candidates.push_back((fs::path(dir) / name).string());
    } else {  // e.g. a path written by hand: the step files of the directory decide
      std::replace_if(
          name.begin(), name.end(), [](unsigned char c) { return c < 32 || c > 126; }, '?');
      log::warn("ignoring ", (fs::path(dir) / "latest").string(), ": it holds '", name.substr(0, 80),
                "', expected the name of a step-NNNNNNNN.h5 file in that directory");
    }
  }
  for (const fs::path& p : step_files(dir))
    if (candidates.empty() || p.string() != candidates.front()) candidates.push_back(p.string());
  for (const std::string& path : candidates) {
    try {
      CheckpointReader reader(path);  // the manifest first: a damaged file is never parsed
      STRATA_REQUIRE(reader.attr_int("format_version") >= 2, "checkpoint '", path,
                     "' holds no training state (format_version 1)");
      read_run_state(reader);
      if (!reader.has_manifest()) reader.verify();  // else the whole-file crc32 has covered every byte
      return path;
    } catch (const std::exception& e) {  // whatever the damage, the next older one may be good
      log::warn("skipping checkpoint ", path, ": ", e.what());
    }
  }
  return {};
}

}  // namespace strata::io
