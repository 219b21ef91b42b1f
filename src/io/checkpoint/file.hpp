// A checkpoint file (layout in docs/formats.md): full tensors under stable names such as
// "model/conv1/weight", each with a crc32 attribute, plus root attributes (format_version,
// step, ...). CheckpointWriter writes to PATH.tmp, which becomes PATH only on commit(), after an
// fsync and beside its manifest, so a crash never leaves a broken checkpoint at PATH;
// CheckpointReader checks the manifest before HDF5 opens the file, and every crc32 it reads.
#pragma once

#include <concepts>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "core/tensor.hpp"
#include "io/checkpoint/manifest.hpp"
#include "io/hdf5.hpp"
#include "layers/tensor_parallel.hpp"

namespace strata::io {

// Version 2 adds the optimizer state (/optimizer/<state>/<param>) and the data position;
// version 1 files (model only) still load with --init-from.
constexpr int64_t kCheckpointFormatVersion = 2;
constexpr int64_t kOldestReadableVersion = 1;

class CheckpointWriter {
 public:
  // Creates `path + ".tmp"` (replacing a stale one) and writes format_version.
  explicit CheckpointWriter(std::string path);
  // Opens `path + ".tmp"` as ParallelCheckpointFile left it (every tensor written, none with its
  // crc32 yet) to finish it like any other: set_crc32 for each tensor, attributes, commit().
  struct Reopen {};
  CheckpointWriter(std::string path, Reopen);
  // Without commit(), removes the temporary file.
  ~CheckpointWriter();
  CheckpointWriter(const CheckpointWriter&) = delete;
  CheckpointWriter& operator=(const CheckpointWriter&) = delete;

  // Stores a host tensor (f32, i32 or u8) under `name`, creating intermediate groups, with a
  // `crc32` attribute (zlib) of its raw bytes.
  void write_tensor(const std::string& name, const Tensor& t);
  // The `crc32` attribute of tensor `name`, written by other means (a reopened file).
  void set_crc32(const std::string& name, uint32_t crc);

  // Root attributes; a second call with the same name replaces the value.
  void set_attr(const std::string& name, int64_t value);
  void set_attr(const std::string& name, double value);
  void set_attr(const std::string& name, const std::string& value);
  void set_attr(const std::string& name, const char* value) { set_attr(name, std::string(value)); }
  template <std::integral T>
  void set_attr(const std::string& name, T value) {  // any integer, without ambiguity
    set_attr(name, static_cast<int64_t>(value));
  }
  // Writes the position's root attributes and records it for the manifest.
  void set_position(const Position& position);

  // Flushes and closes the file, fsyncs it, writes and fsyncs its manifest (size, crc32 and the
  // position, if set), renames both into place and fsyncs the directory.
  void commit();

  const std::string& path() const { return path_; }

 private:
  std::string path_, tmp_path_;
  h5::File file_;
  std::optional<Position> position_;
  bool committed_ = false;
};

class CheckpointReader {
 public:
  // Input error (one line) when `path` is missing, unreadable, not a Strata checkpoint, fails
  // its manifest (checked before HDF5 opens it), or holds a position that is out of range, does
  // not match the manifest's or, for a step-NNNNNNNN.h5 file, not the step of its name. A file
  // without a manifest (older) loads: has_manifest() says so. `whole_file` false skips the
  // manifest's whole-file crc32 (a read of the whole file) when one rank has checked it for the
  // job: the others open the file unchecked only after that (Trainer: rank 0 checks first).
  explicit CheckpointReader(std::string path, bool whole_file = true);

  const std::string& path() const { return path_; }
  // False for a checkpoint from before manifests (loaded unchecked by them; callers note it).
  bool has_manifest() const { return has_manifest_; }
  bool has(const std::string& name) const;
  Shape shape(const std::string& name) const;
  DType dtype(const std::string& name) const;
  // Input error naming expected and found when `name` does not have shape `expected`.
  void require_shape(const std::string& name, const Shape& expected) const;
  // Reads `name` into `out` (a host tensor of the stored shape and dtype); Input error naming
  // expected and found on a shape mismatch, or when the data fails its crc32.
  void read_tensor(const std::string& name, const Tensor& out) const;
  // Reads part of f32 tensor `name` into `out` (host f32, end - begin elements): elements
  // [begin, end) of the tensor-parallel shard `local` split as `split` (layers::shard_boxes),
  // and only those (each rank its own, on resume). The part has no crc32 of its own: a file with
  // a manifest has had its whole-file crc32 checked before (by this rank or rank 0, see the
  // constructor); one without is read whole, its crc32 checked, and cut.
  void read_part(const std::string& name, const Shape& local, const layers::TensorSplit& split, int64_t begin,
                 int64_t end, const Tensor& out) const;

  bool has_attr(const std::string& name) const;
  // Input error unless the attribute holds one finite integer.
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
  bool has_manifest_ = false;
};

// The root `config` attribute's "key = value" lines (the run's options), in their order.
std::vector<std::pair<std::string, std::string>> config_entries(const std::string& text);

// Selects elements [begin, end) of the shard `local` split as `split` in `space`, the dataspace
// of the full tensor (a union of hyperslabs; all of a scalar).
void select_part(hid_t space, const Shape& local, const layers::TensorSplit& split, int64_t begin, int64_t end);

}  // namespace strata::io
