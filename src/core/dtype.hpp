// Element types and the 16-bit float formats, usable from host and device code.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>

#if defined(__CUDACC__)
#define STRATA_HD __host__ __device__
#else
#define STRATA_HD
#endif

namespace strata {

enum class DType : uint8_t { F32, BF16, F16, I32, U8 };

constexpr size_t dtype_size(DType t) {
  switch (t) {
    case DType::F32:
      return 4;
    case DType::BF16:
      return 2;
    case DType::F16:
      return 2;
    case DType::I32:
      return 4;
    case DType::U8:
      return 1;
  }
  return 0;
}

const char* dtype_name(DType t);

// The --precision spellings of the float dtypes, as logged and stored in checkpoints:
// "fp32" | "bf16" | "fp16" (an Input error naming `flag` and the accepted values otherwise).
DType parse_precision(const std::string& text, const std::string& flag = "--precision");
// "fp32", "bf16" or "fp16"; dtype_name() for the other dtypes.
const char* precision_name(DType t);

// bfloat16: the top half of an IEEE float32, rounded to nearest even.
struct bf16 {
  uint16_t bits = 0;
  STRATA_HD static bf16 from_float(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    bf16 r;
    if ((u & 0x7fffffffu) > 0x7f800000u) {  // NaN stays NaN
      r.bits = static_cast<uint16_t>((u >> 16) | 0x40u);
    } else {
      r.bits = static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
    }
    return r;
  }
  STRATA_HD float to_float() const {
    uint32_t u = static_cast<uint32_t>(bits) << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
  }
};

// IEEE half precision, rounded to nearest even, with subnormals and infinities.
struct f16 {
  uint16_t bits = 0;
  STRATA_HD static f16 from_float(float f) {
    uint32_t x;
    memcpy(&x, &f, 4);
    const uint32_t sign = (x >> 16) & 0x8000u;
    const uint32_t abs = x & 0x7fffffffu;
    f16 r;
    if (abs >= 0x7f800000u) {  // inf or NaN
      r.bits = static_cast<uint16_t>(sign | 0x7c00u | (abs > 0x7f800000u ? 0x200u : 0u));
    } else if (abs >= 0x477ff000u) {  // rounds to >= 65520: overflow to inf
      r.bits = static_cast<uint16_t>(sign | 0x7c00u);
    } else if (abs < 0x38800000u) {  // below the smallest normal half: subnormal or zero
      float af;
      memcpy(&af, &abs, 4);
      // Adding 0.5 puts the half subnormal bits at the bottom of the float mantissa.
      float shifted = af + 0.5f;
      uint32_t s;
      memcpy(&s, &shifted, 4);
      r.bits = static_cast<uint16_t>(sign | (s - 0x3f000000u));
    } else {
      const uint32_t mant_odd = (abs >> 13) & 1u;
      uint32_t v = abs + 0xc8000fffu + mant_odd;  // rebias exponent (-112 << 23) and round
      r.bits = static_cast<uint16_t>(sign | (v >> 13));
    }
    return r;
  }
  STRATA_HD float to_float() const {
    const uint32_t sign = static_cast<uint32_t>(bits & 0x8000u) << 16;
    const uint32_t exp = (bits >> 10) & 0x1fu;
    const uint32_t mant = bits & 0x3ffu;
    uint32_t u;
    if (exp == 0x1f) {
      u = sign | 0x7f800000u | (mant << 13);
    } else if (exp == 0) {
      float m = static_cast<float>(mant) * (1.0f / 16777216.0f);  // mant * 2^-24
      memcpy(&u, &m, 4);
      u |= sign;
    } else {
      u = sign | ((exp + 112u) << 23) | (mant << 13);
    }
    float f;
    memcpy(&f, &u, 4);
    return f;
  }
};

template <class T>
constexpr DType dtype_of();
template <>
constexpr DType dtype_of<float>() {
  return DType::F32;
}
template <>
constexpr DType dtype_of<bf16>() {
  return DType::BF16;
}
template <>
constexpr DType dtype_of<f16>() {
  return DType::F16;
}
template <>
constexpr DType dtype_of<int32_t>() {
  return DType::I32;
}
template <>
constexpr DType dtype_of<uint8_t>() {
  return DType::U8;
}

// Where a tensor's memory lives. Meta tensors have shapes and no memory: ops on them do nothing,
// and the meta allocator only counts the bytes a real device would hand out (memory planning).
enum class DeviceKind : uint8_t { CPU, CUDA, Meta };

struct Device {
  DeviceKind kind = DeviceKind::CPU;
  int index = 0;

  static Device cpu() { return {}; }
  static Device cuda(int index) { return {DeviceKind::CUDA, index}; }
  static Device meta() { return {DeviceKind::Meta, 0}; }
  bool is_cpu() const { return kind == DeviceKind::CPU; }
  bool is_cuda() const { return kind == DeviceKind::CUDA; }
  bool is_meta() const { return kind == DeviceKind::Meta; }
  std::string str() const;
  friend bool operator==(const Device&, const Device&) = default;
};

}  // namespace strata
