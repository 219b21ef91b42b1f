// Loader: a producer thread and a ring of batch buffers coordinated by one mutex and one
// condition variable.
#include "io/loader.hpp"

#include <numeric>

#include "core/allocator.hpp"
#include "core/trace.hpp"

namespace strata::io {

namespace {

// (rows, sample...)
Shape rows_of(int64_t rows, const Shape& sample) {
  Shape shape{rows};
  shape.insert(shape.end(), sample.begin(), sample.end());
  return shape;
}

}  // namespace

Loader::Loader(const DataSource& dataset, const BatchOrder& sampler, int64_t slice_begin, int64_t slice_size, int depth,
               bool read_inputs)
    : dataset_(dataset),
      sampler_(sampler),
      slice_begin_(slice_begin),
      slice_size_(slice_size),
      indices_(static_cast<size_t>(slice_size)) {
  STRATA_CHECK(depth >= 1, "loader depth must be >= 1; got ", depth);
  STRATA_CHECK(slice_size >= 1 && slice_begin >= 0 && slice_begin + slice_size <= sampler.global_batch(), "slice [",
               slice_begin, ", ", slice_begin + slice_size, ") outside a global batch of ", sampler.global_batch());
  STRATA_CHECK(dataset.size() == sampler.num_samples(), "sampler for ", sampler.num_samples(), " samples, dataset has ",
               dataset.size());
  const Shape x_shape = rows_of(slice_size, dataset.input_shape()),
              y_shape = rows_of(slice_size, dataset.target_shape());
  slots_.resize(static_cast<size_t>(depth));
  for (Batch& b : slots_) {
    if (read_inputs) b.x = Tensor::empty(x_shape, dataset.input_dtype());
    b.y = Tensor::empty(y_shape, DType::I32);
  }
  thread_ = std::thread([this] { run(); });
}

int64_t Loader::planned_bytes(const Shape& input_shape, DType input_dtype, const Shape& target_shape, int64_t rows,
                              int depth, bool read_inputs) {
  const auto held = [](const Shape& shape, DType dtype) {
    return static_cast<int64_t>(
        HostCachingAllocator::size_class(static_cast<size_t>(shape_numel(shape)) * dtype_size(dtype)));
  };
  return depth * ((read_inputs ? held(rows_of(rows, input_shape), input_dtype) : 0) +
                  held(rows_of(rows, target_shape), DType::I32));
}

Loader::~Loader() {
  {
    std::lock_guard lock(mutex_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

void Loader::start(int64_t epoch, int64_t step_in_epoch) {
  STRATA_CHECK(epoch >= 0 && step_in_epoch >= 0 && step_in_epoch < sampler_.steps_per_epoch(), "start(epoch ", epoch,
               ", step ", step_in_epoch, ") outside an epoch of ", sampler_.steps_per_epoch(), " steps");
  {
    std::lock_guard lock(mutex_);
    ++generation_;
    read_ = ready_ = 0;
    held_ = false;
    error_ = nullptr;
    next_epoch_ = epoch;
    next_step_ = step_in_epoch;
    started_ = true;
  }
  cv_.notify_all();
}

const Batch& Loader::next() {
  std::unique_lock lock(mutex_);
  STRATA_CHECK(started_, "Loader::next() before start()");
  held_ = false;  // the previous batch goes back to the producer
  cv_.notify_all();
  cv_.wait(lock, [&] { return ready_ > 0 || error_; });
  // Batches read before the failure are still handed out in order; then the error.
  if (ready_ == 0) std::rethrow_exception(error_);
  const Batch& b = slots_[static_cast<size_t>(read_)];
  read_ = (read_ + 1) % static_cast<int>(slots_.size());
  --ready_;
  held_ = true;
  cv_.notify_all();
  return b;
}

void Loader::run() {
  const int depth = static_cast<int>(slots_.size());
  std::unique_lock lock(mutex_);
  while (true) {
    cv_.wait(lock, [&] { return stop_ || (started_ && !error_ && ready_ + int{held_} < depth); });
    if (stop_) return;
    // Claim the next free slot and position, then read without holding the lock.
    const uint64_t generation = generation_;
    Batch& b = slots_[static_cast<size_t>((read_ + ready_) % depth)];
    b.epoch = next_epoch_;
    b.step_in_epoch = next_step_;
    b.first_sample = (next_epoch_ * sampler_.steps_per_epoch() + next_step_) * sampler_.global_batch() + slice_begin_;
    if (++next_step_ == sampler_.steps_per_epoch()) {
      next_step_ = 0;
      ++next_epoch_;
    }
    lock.unlock();
    std::exception_ptr error;
    try {
      trace::Span span(trace::Track::Loader, "read batch");
      span.arg("epoch", b.epoch).arg("step_in_epoch", b.step_in_epoch);
      sampler_.slice(b.epoch, b.step_in_epoch, slice_begin_, indices_);
      dataset_.read(indices_, b.x, b.y);
    } catch (...) {
      error = std::current_exception();
    }
    lock.lock();
    if (generation != generation_) continue;  // start() was called meanwhile: discard
    if (error)
      error_ = error;
    else
      ++ready_;
    cv_.notify_all();
  }
}

void read_range(const DataSource& dataset, int64_t begin, int64_t end, const Tensor& x, const Tensor& y) {
  STRATA_CHECK(begin >= 0 && begin <= end && end <= dataset.size(), "read_range [", begin, ", ", end,
               ") outside a dataset of ", dataset.size());
  std::vector<int64_t> indices(static_cast<size_t>(end - begin));
  std::iota(indices.begin(), indices.end(), begin);
  dataset.read(indices, x, y);
}

}  // namespace strata::io
