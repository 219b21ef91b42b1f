// Tensor: a dense, contiguous, row-major array of one dtype on one device. A tensor is a
// handle: copies share storage, and views (reshape, slices along the first dimension, flat
// sub-ranges) point into the same storage. Layers hold views into the flat parameter and
// gradient buffers of their stage.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "core/allocator.hpp"
#include "core/dtype.hpp"
#include "core/error.hpp"

namespace strata {

using Shape = std::vector<int64_t>;

// Checked size arithmetic. The product of `shape` (times `element_bytes`), or nullopt when a
// dimension is negative or the product exceeds int64: for sizes declared by input (dataset
// files, checkpoints), where the caller names the file in an Input error.
std::optional<int64_t> checked_numel(const Shape& shape, int64_t element_bytes = 1);
// a * b for a, b >= 0, or nullopt on overflow (or a negative factor).
std::optional<int64_t> checked_mul(int64_t a, int64_t b);
// The number of elements of a shape built by code: an overflow or a negative dimension here is
// a bug (input shapes are checked with checked_numel where they are read), so an Internal error.
int64_t shape_numel(const Shape& shape);
std::string shape_str(const Shape& shape);

// One allocation; returned to its allocator when the last tensor viewing it goes away.
class Storage {
 public:
  Storage(size_t bytes, Device device);
  // Adopts `bytes` at `data`, which `owner` handed out: they go back to owner.deallocate()
  // (e.g. shared-memory segments mapped by a communicator).
  Storage(void* data, size_t bytes, Device device, Allocator& owner);
  ~Storage();
  Storage(const Storage&) = delete;
  Storage& operator=(const Storage&) = delete;

  void* data() const { return data_; }
  size_t bytes() const { return bytes_; }
  Device device() const { return device_; }

 private:
  void* data_;
  size_t bytes_;
  Device device_;
  Allocator* allocator_;
};

class Tensor {
 public:
  Tensor() = default;

  // Uninitialised memory (from the caching allocator: usually reused blocks).
  static Tensor empty(Shape shape, DType dtype = DType::F32, Device device = Device::cpu());
  static Tensor zeros(Shape shape, DType dtype = DType::F32, Device device = Device::cpu());
  // A tensor over all of `storage` (its bytes must hold the shape).
  static Tensor over(std::shared_ptr<Storage> storage, Shape shape, DType dtype);

  bool defined() const { return storage_ != nullptr; }
  const Shape& shape() const { return shape_; }
  int ndim() const { return static_cast<int>(shape_.size()); }
  // Size of dimension i; negative i counts from the end.
  int64_t dim(int i) const;
  int64_t numel() const { return numel_; }
  size_t nbytes() const { return static_cast<size_t>(numel_) * dtype_size(dtype_); }
  DType dtype() const { return dtype_; }
  Device device() const { return storage_ ? storage_->device() : Device::cpu(); }

  // Typed pointer to the first element; checks the dtype.
  template <class T>
  T* data() const {
    STRATA_CHECK(dtype_of<T>() == dtype_, "tensor holds ", dtype_name(dtype_), ", accessed as ",
                 dtype_name(dtype_of<T>()));
    return static_cast<T*>(raw());
  }
  void* raw() const;

  // Same elements, another shape with the same number of elements.
  Tensor reshape(Shape shape) const;
  // Rows [begin, end) along the first dimension.
  Tensor slice(int64_t begin, int64_t end) const;
  // `numel(shape)` elements starting at flat element `offset`.
  Tensor view(int64_t offset, Shape shape) const;
  // A new tensor (own storage) with the same contents.
  Tensor clone() const;
  // Copies `src` (same numel and dtype) into this tensor's memory.
  void copy_from(const Tensor& src) const;
  void fill_zero() const;

  bool same_storage(const Tensor& other) const { return storage_ == other.storage_; }
  std::string str() const;  // e.g. "f32[64, 1, 28, 28]"

 private:
  std::shared_ptr<Storage> storage_;
  size_t offset_ = 0;  // bytes
  Shape shape_;
  int64_t numel_ = 0;
  DType dtype_ = DType::F32;
};

}  // namespace strata
