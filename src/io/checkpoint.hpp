// HDF5 checkpoints (layout in docs/formats.md): full tensors under stable names such as
// "model/conv1/weight", each with a crc32 attribute, plus root attributes (format_version,
// step, ...). Writes go to PATH.tmp and become PATH only on commit(), after an fsync, so a
// crash never leaves a broken checkpoint at PATH. A checkpoint directory holds step-NNNNNNNN.h5
// files and a `latest` pointer (docs/checkpoints.md); the helpers below maintain and search it.
#pragma once

#include <concepts>
#include <cstdint>
#include <string>
#include <vector>

#include "core/tensor.hpp"
#include "io/hdf5.hpp"

namespace strata::io {

// Version 2 adds the optimizer state (/optimizer/<state>/<param>) and the data position;
// version 1 files (model only) still load with --init-from.
constexpr int64_t kCheckpointFormatVersion = 2;
constexpr int64_t kOldestReadableVersion = 1;

class CheckpointWriter {
 public:
  // Creates `path + ".tmp"` (replacing a stale one) and writes format_version.
  explicit CheckpointWriter(std::string path);
  // Without commit(), removes the temporary file.
  ~CheckpointWriter();
  CheckpointWriter(const CheckpointWriter&) = delete;
  CheckpointWriter& operator=(const CheckpointWriter&) = delete;

  // Stores a host tensor (f32, i32 or u8) under `name`, creating intermediate groups, with a
  // `crc32` attribute (zlib) of its raw bytes.
  void write_tensor(const std::string& name, const Tensor& t);

  // Root attributes; a second call with the same name replaces the value.
  void set_attr(const std::string& name, int64_t value);
  void set_attr(const std::string& name, double value);
  void set_attr(const std::string& name, const std::string& value);
  void set_attr(const std::string& name, const char* value) { set_attr(name, std::string(value)); }
  template <std::integral T>
  void set_attr(const std::string& name, T value) {  // any integer, without ambiguity
    set_attr(name, static_cast<int64_t>(value));
  }

  // Flushes and closes the file, fsyncs it, renames it to `path` and fsyncs the directory.
  void commit();

  const std::string& path() const { return path_; }

 private:
  std::string path_, tmp_path_;
  h5::File file_;
  bool committed_ = false;
};

class CheckpointReader {
 public:
  // Input error (one line) when `path` is missing, unreadable or not a Strata checkpoint.
  explicit CheckpointReader(std::string path);

  const std::string& path() const { return path_; }
  bool has(const std::string& name) const;
  Shape shape(const std::string& name) const;
  DType dtype(const std::string& name) const;
  // Input error naming expected and found when `name` does not have shape `expected`.
  void require_shape(const std::string& name, const Shape& expected) const;
  // Reads `name` into `out` (a host tensor of the stored shape and dtype); Input error naming
  // expected and found on a shape mismatch, or when the data fails its crc32.
  void read_tensor(const std::string& name, const Tensor& out) const;

  bool has_attr(const std::string& name) const;
  int64_t attr_int(const std::string& name) const;
  double attr_double(const std::string& name) const;
  std::string attr_string(const std::string& name) const;

  // Every tensor under `group` (recursively), as full names like "model/conv1/weight", sorted.
  std::vector<std::string> list_tensors(const std::string& group = "/") const;
  // Reads every tensor once, one at a time, checking its crc32 (Input error on the first bad one).
  void verify() const;

 private:
  h5::DataSet open_tensor(const std::string& name) const;
  void require_attr(const std::string& name) const;

  std::string path_;
  h5::File file_;
};

// ---- checkpoint directories ------------------------------------------------------------------

// Creates `dir` if needed and proves a file can be written in it; an Input error naming `flag`
// otherwise (checked at setup, not at the first save hours later).
void require_writable_directory(const std::string& dir, const std::string& flag);
// DIR/step-NNNNNNNN.h5.
std::string checkpoint_path(const std::string& dir, int64_t step);
// Points DIR/latest at `path` (a file in DIR): writes latest.tmp, fsyncs, renames, fsyncs DIR.
void update_latest(const std::string& dir, const std::string& path);
// Keeps `newest` (the checkpoint just written, a file in DIR) and the keep - 1 step-*.h5 files
// of DIR before it, and removes the older ones (keep <= 0: removes nothing). Files of higher
// steps, another run's, are left alone: they are not this run's to delete.
void prune_checkpoints(const std::string& dir, int64_t keep, const std::string& newest);
// The newest complete checkpoint of DIR: the one `latest` names, else step-*.h5 from the
// highest step down; each candidate is opened and verified, and a bad one is skipped with a
// one-line warning. Empty when there is none.
std::string newest_checkpoint(const std::string& dir);

}  // namespace strata::io
