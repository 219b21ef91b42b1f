#include "core/tensor.hpp"

#include <cstring>
#include <sstream>

#include "core/error.hpp"
#include "core/ops.hpp"
#if STRATA_WITH_CUDA
#include "core/cuda/check.hpp"
#include "core/cuda/runtime.hpp"
#endif

namespace strata {

const char* dtype_name(DType t) {
  switch (t) {
    case DType::F32:
      return "f32";
    case DType::BF16:
      return "bf16";
    case DType::F16:
      return "f16";
    case DType::I32:
      return "i32";
    case DType::U8:
      return "u8";
  }
  return "?";
}

DType parse_precision(const std::string& text, const std::string& flag) {
  if (text == "fp32") return DType::F32;
  if (text == "bf16") return DType::BF16;
  if (text == "fp16") return DType::F16;
  STRATA_THROW_INPUT(flag, " must be fp32, bf16 or fp16, found '", text, "'");
}

const char* precision_name(DType t) {
  switch (t) {
    case DType::F32:
      return "fp32";
    case DType::BF16:
      return "bf16";
    case DType::F16:
      return "fp16";
    default:
      return dtype_name(t);
  }
}

std::string Device::str() const { return is_cpu() ? "cpu" : is_meta() ? "meta" : "cuda:" + std::to_string(index); }

std::optional<int64_t> checked_mul(int64_t a, int64_t b) {
  int64_t out = 0;
  if (a < 0 || b < 0 || __builtin_mul_overflow(a, b, &out)) return std::nullopt;
  return out;
}

std::optional<int64_t> checked_numel(const Shape& shape, int64_t element_bytes) {
  std::optional<int64_t> n = element_bytes >= 0 ? std::optional<int64_t>(element_bytes) : std::nullopt;
  for (int64_t d : shape)
    if (n) n = checked_mul(*n, d);
  return n;
}

int64_t shape_numel(const Shape& shape) {
  const std::optional<int64_t> n = checked_numel(shape);
  STRATA_CHECK(n.has_value(), "shape ", shape_str(shape), " has a negative dimension or more than 2^63 elements");
  return *n;
}

std::string shape_str(const Shape& shape) {
  std::ostringstream os;
  os << "[";
  for (size_t i = 0; i < shape.size(); ++i) os << (i ? ", " : "") << shape[i];
  os << "]";
  return os.str();
}

Storage::Storage(size_t bytes, Device device)
    : data_(nullptr), bytes_(bytes), device_(device), allocator_(&allocator_for(device)) {
  data_ = allocator_->allocate(bytes);
}

Storage::Storage(void* data, size_t bytes, Device device, Allocator& owner)
    : data_(data), bytes_(bytes), device_(device), allocator_(&owner) {}

Storage::~Storage() { allocator_->deallocate(data_, bytes_); }

Tensor Tensor::empty(Shape shape, DType dtype, Device device) {
  Tensor t;
  t.numel_ = shape_numel(shape);
  STRATA_CHECK(checked_mul(t.numel_, static_cast<int64_t>(dtype_size(dtype))), "a ", dtype_name(dtype),
               shape_str(shape), " tensor needs more than 2^63 bytes");
  t.shape_ = std::move(shape);
  t.dtype_ = dtype;
  t.storage_ = std::make_shared<Storage>(t.nbytes(), device);
  return t;
}

Tensor Tensor::over(std::shared_ptr<Storage> storage, Shape shape, DType dtype) {
  Tensor t;
  t.numel_ = shape_numel(shape);
  t.shape_ = std::move(shape);
  t.dtype_ = dtype;
  STRATA_CHECK(storage && t.nbytes() <= storage->bytes(), "a ", t.str(), " tensor does not fit its storage");
  t.storage_ = std::move(storage);
  return t;
}

Tensor Tensor::zeros(Shape shape, DType dtype, Device device) {
  Tensor t = empty(std::move(shape), dtype, device);
  t.fill_zero();
  return t;
}

int64_t Tensor::dim(int i) const {
  const int n = ndim();
  if (i < 0) i += n;
  STRATA_CHECK(i >= 0 && i < n, "dimension ", i, " out of range for ", str());
  return shape_[static_cast<size_t>(i)];
}

void* Tensor::raw() const {
  STRATA_CHECK(defined(), "access to an undefined tensor");
  return static_cast<char*>(storage_->data()) + offset_;
}

Tensor Tensor::reshape(Shape shape) const {
  STRATA_CHECK(shape_numel(shape) == numel_, "cannot reshape ", str(), " to ", shape_str(shape));
  Tensor t = *this;
  t.shape_ = std::move(shape);
  return t;
}

Tensor Tensor::slice(int64_t begin, int64_t end) const {
  STRATA_CHECK(ndim() >= 1 && 0 <= begin && begin <= end && end <= shape_[0], "slice [", begin, ", ", end,
               ") out of range for ", str());
  Shape s = shape_;
  s[0] = end - begin;
  return view(begin * (shape_[0] ? numel_ / shape_[0] : 0), std::move(s));
}

Tensor Tensor::view(int64_t offset, Shape shape) const {
  const int64_t n = shape_numel(shape);
  STRATA_CHECK(offset >= 0 && offset + n <= numel_, "view of ", n, " elements at ", offset, " out of range for ",
               str());
  Tensor t = *this;
  t.offset_ = offset_ + static_cast<size_t>(offset) * dtype_size(dtype_);
  t.shape_ = std::move(shape);
  t.numel_ = n;
  return t;
}

Tensor Tensor::clone() const {
  Tensor t = empty(shape_, dtype_, device());
  t.copy_from(*this);
  return t;
}

void Tensor::copy_from(const Tensor& src) const {
  STRATA_CHECK(src.numel() == numel_ && src.dtype() == dtype_, "copy from ", src.str(), " into ", str());
  if (!device().is_cpu() || !src.device().is_cpu()) return ops::copy(src, *this);
  if (numel_ > 0) std::memmove(raw(), src.raw(), nbytes());
}

void Tensor::fill_zero() const {
  if (numel_ == 0 || device().is_meta()) return;
  if (device().is_cpu()) {
    std::memset(raw(), 0, nbytes());
    return;
  }
#if STRATA_WITH_CUDA
  // Ordered with every other kernel on this GPU: no synchronisation.
  CUDA_CHECK(cudaMemsetAsync(raw(), 0, nbytes(), cuda::compute_stream(device().index)));
#endif
}

std::string Tensor::str() const { return std::string(dtype_name(dtype_)) + shape_str(shape_); }

}  // namespace strata
