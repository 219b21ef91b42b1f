// What training and evaluation read, whatever the data: samples by global index, each an input
// and its targets. A classification Dataset gives a normalised f32 input and one label; a token
// dataset gives T token ids and the T tokens that follow each of them.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include "core/tensor.hpp"

namespace strata::io {

// The most classes a dataset, or tokens a vocabulary, may have (labels and ids in [0, 2^24)):
// the count sizes the output layer (2^24 x 1024 features = 64 GiB of f32 weights), and public
// label sets and vocabularies stay far below it (ImageNet-21k: 21,841 classes; Amazon-3M: 2.8 M;
// Gemma: 256,000 tokens). A flipped high bit in one label (e.g. 134 M) or a num_classes
// attribute of 3e9 is refused at open instead of allocated.
constexpr int64_t kMaxClasses = int64_t{1} << 24;

class DataSource {
 public:
  virtual ~DataSource() = default;
  virtual int64_t size() const = 0;
  // Per-sample input shape and dtype (F32 normalised values, or I32 token ids).
  virtual const Shape& input_shape() const = 0;
  virtual DType input_dtype() const = 0;
  // Per-sample target shape: {} (one class label) or {T} (one per position); always I32.
  virtual Shape target_shape() const { return {}; }
  // Bytes per sample of the buffer the source keeps between reads of inputs (0: none), for
  // the memory plan.
  virtual int64_t kept_bytes_per_sample() const { return 0; }
  // The model's output width: classes, or the vocabulary.
  virtual int64_t num_classes() const = 0;
  // Reads global samples `indices` (any order, duplicates allowed) into x (B, input...) and y
  // (B, target...); an undefined x reads targets only.
  virtual void read(std::span<const int64_t> indices, const Tensor& x, const Tensor& y) const = 0;
};

// Opens `spec` (a file, a directory of shards or a glob; `flag` names it in errors) as a
// token dataset (windows of `seq_len`: an Input error when it is 0, i.e. the model is not a
// language model) or as a classification Dataset, whichever the files hold.
std::unique_ptr<DataSource> open_samples(const std::string& spec, const std::string& flag, int64_t seq_len);

// Checks that --val-data `val` can evaluate a model trained on --data `train` (the same kind,
// sample shape, classes or vocabulary): an Input error otherwise. Returns a warning, or "",
// when the two are normalised differently.
std::string check_evaluation_data(const DataSource& train, const DataSource& val);

}  // namespace strata::io
