// The sharded HDF5 dataset (format in docs/formats.md): one or more files, each holding
// `inputs` (N, ...) u8/f32 and `labels` (N) integers, plus normalisation attributes. Opening
// validates everything once, so bad data is reported before training starts; reading returns
// normalised f32 samples in any order.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "core/tensor.hpp"
#include "io/data_source.hpp"

namespace strata::io {

struct DatasetInfo {
  Shape sample_shape;              // e.g. {1, 28, 28} or {F}
  DType input_dtype;               // U8 or F32, as stored
  int64_t num_samples;             // over all shards
  int num_classes;                 // `num_classes` attribute, else max label + 1
  float scale;                     // x = (raw * scale - mean[c]) / std[c]
  std::vector<float> mean, std;    // 1 or C (= sample_shape[0]) values each
  std::vector<std::string> files;  // the shards, in global index order
};

struct DatasetOptions {
  // Datasets whose inputs take at most this many bytes are loaded into memory at open (see
  // docs/formats.md for the measurement behind the default); larger ones are read per batch.
  int64_t in_memory_limit_bytes = int64_t{256} << 20;
};

class Dataset final : public DataSource {
 public:
  // spec: a file, a directory (all *.h5 inside, sorted by name), or a glob pattern. `flag`
  // (e.g. "--data") names the source in error messages.
  static Dataset open(const std::string& spec, const std::string& flag, const DatasetOptions& options = {});

  Dataset(Dataset&&) noexcept;
  Dataset& operator=(Dataset&&) noexcept;
  ~Dataset();

  const DatasetInfo& info() const;
  int64_t size() const override;
  const Shape& input_shape() const override { return info().sample_shape; }
  // The raw samples of the last read (their stored dtype), before normalisation into x.
  int64_t kept_bytes_per_sample() const override;
  DType input_dtype() const override { return DType::F32; }  // normalised
  int64_t num_classes() const override { return info().num_classes; }
  // All labels, read and validated at open.
  const std::vector<int32_t>& labels() const;
  // True when the inputs were loaded into memory at open.
  bool in_memory() const;

  // Reads global sample `indices` (any order, duplicates allowed) into x: f32 (B, sample...)
  // normalised (undefined x: labels only), and y: i32 (B). Serialised per object by an internal mutex; different
  // objects read in parallel (HDF5 itself is the thread-safe build).
  void read(std::span<const int64_t> indices, const Tensor& x, const Tensor& y) const override;

 private:
  struct Impl;
  explicit Dataset(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// What write_shard stores besides the data; unset fields are not written (readers default).
struct ShardAttrs {
  float scale = 0.0f;            // 0: not written
  std::vector<float> mean, std;  // empty: not written
  int num_classes = 0;           // 0: not written
};

// Writes one shard: inputs u8 or f32 (N, ...) contiguous, labels (N) as int32. For strata-data
// and tests.
void write_shard(const std::string& path, const Tensor& inputs, std::span<const int32_t> labels,
                 const ShardAttrs& attrs);

// "PREFIX.h5" for one shard, else "PREFIX-00003-of-00008.h5".
std::string shard_path(const std::string& prefix, int shard, int num_shards);

// Per-channel mean and population std of raw * scale over inputs (N, C, ...) with C =
// `channels` (for (N, F) inputs, C = F gives per-feature statistics). A constant channel gets
// std 1.
void channel_stats(const Tensor& inputs, float scale, int64_t channels, std::vector<float>& mean,
                   std::vector<float>& std);
// "[a, b, ...]": normalisation values in messages.
std::string values_str(const std::vector<float>& v);

}  // namespace strata::io
