// The manifest beside each checkpoint (PATH.manifest, format in docs/checkpoints.md) and what
// validates a checkpoint before HDF5 reads a byte of it: the run's position and its ranges, the
// whole-file size and crc32. Also the durable-write primitives the checkpoint files share (fsync
// of a file or directory, write to a temporary then rename).
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>

namespace strata::io {

// A training run's position, stored both as root attributes (step, epoch, step_in_epoch, seed)
// and in the manifest, whose checksum covers it.
struct Position {
  int64_t step = 0, epoch = 0, step_in_epoch = 0;
  uint64_t seed = 0;
  bool operator==(const Position&) const = default;
};
// Input error naming `path` unless `p` is possible: steps count from 0; an epoch and a step
// within it take at least one step each.
void check_position_range(const std::string& path, const Position& p);

// The manifest beside each checkpoint, PATH.manifest (format in docs/checkpoints.md): read and
// checked before HDF5 parses the file, so that a damaged file (which may make libhdf5 loop
// forever) is refused by its size and whole-file crc32 without being opened.
struct Manifest {
  std::string file;  // the checkpoint's file name (no directory)
  int64_t size = 0;
  uint32_t crc32 = 0;
  std::optional<Position> position;  // training checkpoints only
};
std::string manifest_path(const std::string& checkpoint);
// The text of the manifest of checkpoint file `file` (a name, no directory) of `size` bytes and
// whole-file `crc32`, with the position lines and their checksum when there is one.
std::string manifest_text(const std::string& file, int64_t size, uint32_t crc32,
                          const std::optional<Position>& position);
// Checks `checkpoint` against its manifest: the manifest when it holds (file name, size, crc32,
// position checksum and ranges), nullopt when there is none (a checkpoint from before
// manifests); an Input error naming the file and the mismatch otherwise. Without `whole_file`
// the crc32 of the file is not computed (everything else is checked): for a file this job has
// checked already.
std::optional<Manifest> check_manifest(const std::string& checkpoint, bool whole_file = true);

// zlib crc32 of `bytes` bytes at `data`.
uint32_t crc32_of(const void* data, size_t bytes);
// Size and zlib crc32 of a whole file, read in 1 MiB blocks.
std::pair<int64_t, uint32_t> file_size_and_crc32(const std::string& path);

// fsync of a file (flags O_RDONLY) or directory (O_RDONLY | O_DIRECTORY); throws with the
// system's reason.
void fsync_path(const std::string& path, int flags);
// Writes `text` to `path` durably: path.tmp, fsync, rename (the caller fsyncs the directory).
void write_file_durably(const std::string& path, const std::string& text);

}  // namespace strata::io
