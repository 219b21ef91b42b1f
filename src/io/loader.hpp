// Loader: reads one rank's slice of each global batch ahead of the training loop, on a
// background thread, into a ring of reused buffers. Also read_range for evaluation passes.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

#include "core/tensor.hpp"
#include "io/batch_order.hpp"
#include "io/dataset.hpp"

namespace strata::io {

struct Batch {
  Tensor x;  // (slice_size, input...): f32 normalised, or i32 tokens
  Tensor y;  // i32 (slice_size, target...)
  int64_t epoch = 0, step_in_epoch = 0;
  // Global position of this slice's first sample: global step * global_batch + slice_begin.
  // Epoch-independent and rank-independent, so dropout keys built from it are too.
  int64_t first_sample = 0;
};

class Loader {
 public:
  // Reads positions [slice_begin, slice_begin + slice_size) of each global batch. `depth`
  // buffers are allocated once: the one the caller holds plus depth - 1 being prefetched.
  // The dataset and sampler must outlive the loader.
  // read_inputs = false: batches carry labels only (x undefined), for stages that need no inputs.
  Loader(const DataSource& dataset, const BatchOrder& sampler, int64_t slice_begin, int64_t slice_size, int depth = 2,
         bool read_inputs = true);
  ~Loader();
  // The bytes its buffers take for slices of `rows` samples of `dataset` (the host allocator's
  // size classes), for the memory plan.
  static int64_t planned_bytes(const Shape& input_shape, DType input_dtype, const Shape& target_shape, int64_t rows,
                               int depth, bool read_inputs);
  Loader(const Loader&) = delete;
  Loader& operator=(const Loader&) = delete;

  // (Re)positions the loader: the next next() returns (epoch, step_in_epoch). Discards
  // prefetched batches and invalidates the batch last returned.
  void start(int64_t epoch, int64_t step_in_epoch);
  // The next batch, valid until the following next() or start(); crosses epoch boundaries by
  // itself. Rethrows an exception raised while reading.
  const Batch& next();

 private:
  void run();

  const DataSource& dataset_;
  const BatchOrder& sampler_;
  const int64_t slice_begin_, slice_size_;
  std::vector<Batch> slots_;
  std::vector<int64_t> indices_;  // used by the reader thread only

  // Ring state, guarded by mutex_. Slots [read_, read_ + ready_) are filled; the slot before
  // read_ is the caller's while held_. The producer fills slot read_ + ready_ when free.
  std::mutex mutex_;
  std::condition_variable cv_;
  int read_ = 0, ready_ = 0;
  bool held_ = false;
  bool started_ = false, stop_ = false;
  uint64_t generation_ = 0;                 // bumped by start(): a fill begun earlier is discarded
  int64_t next_epoch_ = 0, next_step_ = 0;  // what the producer reads next
  std::exception_ptr error_;
  std::thread thread_;
};

// Reads samples [begin, end) in order (every sample, no drop-last) into x (end - begin,
// input...) and y (end - begin, target...): the simple path for evaluation.
void read_range(const DataSource& dataset, int64_t begin, int64_t end, const Tensor& x, const Tensor& y);

}  // namespace strata::io
