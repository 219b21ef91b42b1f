// Token datasets for language models (format in docs/formats.md, "Token datasets"): HDF5
// shards, each a 1-D `tokens` array (uint16 when the vocabulary fits, else uint32) with the
// tokenizer in root attributes. The shards form one token stream in shard order. Opening
// validates every shard once (including a scan for ids >= vocab_size); reads return int32 ids.
//
// Samples: with sequence length T there are num_windows(T) = (num_tokens - 1) / T
// non-overlapping windows; window i has inputs tokens[i*T, i*T + T) and targets
// tokens[i*T + 1, i*T + T + 1) (the last window's targets may end at the stream's last token).
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "io/data_source.hpp"
#include "io/tokenizer.hpp"

namespace strata::io {

struct TokenDatasetOptions {
  // A dataset whose tokens take at most this many bytes (2 per token when vocab_size <= 65536,
  // else 4) is held in memory after the scan at open; larger ones are read from HDF5 per call.
  int64_t in_memory_limit_bytes = int64_t{256} << 20;
};

class TokenDataset {
 public:
  // spec: a file, a directory (all *.h5 inside, sorted by name), or a glob pattern. `flag`
  // (e.g. "--data") names the source in error messages.
  static TokenDataset open(const std::string& spec, const std::string& flag, const TokenDatasetOptions& options = {});

  TokenDataset(TokenDataset&&) noexcept;
  TokenDataset& operator=(TokenDataset&&) noexcept;
  ~TokenDataset();

  int64_t num_tokens() const;
  int64_t vocab_size() const;
  // The tokenizer stored with the data (name, eot, merges); decodes unless "external".
  const Tokenizer& tokenizer() const;
  const std::vector<std::string>& files() const;
  // Tokens per shard, in file order.
  const std::vector<int64_t>& shard_tokens() const;
  // "uint16" or "uint32" per shard.
  const std::vector<std::string>& shard_dtypes() const;
  bool in_memory() const;

  // (num_tokens - 1) / T; an Input error (naming the flag and the data) when T < 1 or the data
  // holds fewer than T + 1 tokens.
  int64_t num_windows(int64_t seq_len) const;
  // Tokens [start, start + length) of the stream, across shard boundaries, as int32. Thread
  // safe. `start`/`length` outside the stream is a bug (internal error).
  void read_window(int64_t start, int64_t length, int32_t* out) const;
  // Window i of length T (see above): inputs and targets, T ids each.
  void read_sample(int64_t index, int64_t seq_len, int32_t* inputs, int32_t* targets) const;

 private:
  struct Impl;
  explicit TokenDataset(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// A token dataset as training samples of sequence length T: sample i is window i (inputs and
// the targets one token later), read as i32 (B, T) each. Holds the dataset.
class TokenWindows final : public DataSource {
 public:
  // An Input error (naming the data's flag) when it holds fewer than T + 1 tokens.
  TokenWindows(TokenDataset data, int64_t seq_len);
  const TokenDataset& data() const { return data_; }
  int64_t size() const override { return windows_; }
  const Shape& input_shape() const override { return shape_; }
  DType input_dtype() const override { return DType::I32; }
  Shape target_shape() const override { return shape_; }
  int64_t num_classes() const override { return data_.vocab_size(); }
  void read(std::span<const int64_t> indices, const Tensor& x, const Tensor& y) const override;

 private:
  TokenDataset data_;
  int64_t windows_;
  Shape shape_;  // {T}
};

// True when the first file `spec` names is a token dataset (root attribute kind = "tokens" or
// a `tokens` dataset); false for other or unreadable files. Spec errors throw (as open would).
bool is_token_dataset(const std::string& spec, const std::string& flag);

// Writes one token shard, streaming: the length is fixed up front, write() appends ids (each
// checked against the vocabulary: an Input error naming the file and index) and close()
// checks that all were written. The tokens dataset is uint16 when vocab_size <= 65536, else
// uint32; attributes and merges follow the tokenizer. A writer destroyed before close()
// removes its file.
class TokenShardWriter {
 public:
  TokenShardWriter(const std::string& path, int64_t num_tokens, const Tokenizer& tokenizer);
  ~TokenShardWriter();
  TokenShardWriter(const TokenShardWriter&) = delete;
  TokenShardWriter& operator=(const TokenShardWriter&) = delete;

  void write(std::span<const int32_t> tokens);
  void close();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// A whole shard at once.
void write_token_shard(const std::string& path, std::span<const int32_t> tokens, const Tokenizer& tokenizer);

}  // namespace strata::io
