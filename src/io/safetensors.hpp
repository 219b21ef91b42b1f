// safetensors files (Hugging Face's weight format): an 8-byte little-endian header length N, N
// bytes of JSON ({name: {"dtype", "shape", "data_offsets": [begin, end]}, optional
// "__metadata__": {string: string}}), then the tensors' raw little-endian bytes, offsets relative
// to the end of the header. Both sides stream: SafetensorsReader reads one tensor at a time,
// SafetensorsWriter writes the header first (every shape is known beforehand) and then each
// tensor in header order, so neither holds more than the tensor at hand.
#pragma once

#include <cstdint>
#include <cstdio>
#include <map>
#include <string>
#include <vector>

#include "core/tensor.hpp"

namespace strata::io {

// One tensor of a safetensors file; begin/end are byte offsets into the data section.
struct SafetensorInfo {
  std::string name;
  std::string dtype;  // "F32", "BF16", "F16", ... as the file says
  Shape shape;
  uint64_t begin = 0, end = 0;
};

// The bytes of one element of a safetensors dtype ("F32": 4, "BF16": 2, ...); 0 when unknown.
size_t safetensors_dtype_size(const std::string& dtype);

class SafetensorsReader {
 public:
  // Opens `path` and checks the whole header before any tensor is read: the length fits the
  // file, the JSON parses, every entry has a known dtype, a shape and offsets that match its
  // size and lie inside the file, without overlaps. Input error (one line naming the file) else.
  explicit SafetensorsReader(std::string path);
  ~SafetensorsReader();
  SafetensorsReader(const SafetensorsReader&) = delete;
  SafetensorsReader& operator=(const SafetensorsReader&) = delete;

  const std::string& path() const { return path_; }
  // The tensors in file order (by data offset).
  const std::vector<SafetensorInfo>& tensors() const { return tensors_; }
  const SafetensorInfo* find(const std::string& name) const;
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  // Reads tensor `t` into a new host f32 tensor of its shape, widening BF16 and F16 (exact);
  // Input error for other dtypes.
  Tensor read_f32(const SafetensorInfo& t) const;

 private:
  std::string path_;
  std::FILE* file_ = nullptr;
  uint64_t data_start_ = 0;
  std::vector<SafetensorInfo> tensors_;
  std::map<std::string, std::string> metadata_;
};

class SafetensorsWriter {
 public:
  // Creates `path` and writes its header: `tensors` (name, dtype, shape; offsets are assigned
  // here, in this order) and `metadata`. The data follows with write() in the same order.
  SafetensorsWriter(std::string path, std::vector<SafetensorInfo> tensors,
                    const std::map<std::string, std::string>& metadata);
  ~SafetensorsWriter();
  SafetensorsWriter(const SafetensorsWriter&) = delete;
  SafetensorsWriter& operator=(const SafetensorsWriter&) = delete;

  // The next tensor's data: a host f32 tensor of its shape, narrowed to the tensor's dtype
  // (F32, BF16 or F16; rounded to nearest even).
  void write(const Tensor& t);
  // Flushes and closes; an error unless every tensor was written.
  void close();
  // The bytes of the file's data section.
  uint64_t data_bytes() const { return tensors_.empty() ? 0 : tensors_.back().end; }

 private:
  std::string path_;
  std::FILE* file_ = nullptr;
  std::vector<SafetensorInfo> tensors_;
  size_t next_ = 0;
};

}  // namespace strata::io
