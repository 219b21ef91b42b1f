// Thin RAII layer over the HDF5 C API: move-only owners for ids whose destructors never throw,
// H5_CHECK for calls that must succeed, and a few helpers (paths, shapes, attributes) shared
// by the dataset reader, the checkpoint files and strata-data.
#pragma once

#include <hdf5.h>

#include <cstdint>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "core/error.hpp"
#include "core/tensor.hpp"

namespace strata::io::h5 {

// The HDF5 library is not thread-safe in every build (Debian's parallel one is built without
// it), and Strata calls it from three threads: the main one, the loader's and the background
// checkpoint writer's. Every function that calls HDF5 holds this process-wide lock (recursive:
// helpers that take it call each other); a collective parallel write holds it on the main
// thread, so the loader waits for it rather than entering the library beside it.
std::recursive_mutex& api_mutex();
class Guard {
 public:
  Guard() : lock_(api_mutex()) {}

 private:
  std::lock_guard<std::recursive_mutex> lock_;
};

// Turns off HDF5's automatic error-stack printing for the calling thread (the setting is
// per thread in thread-safe builds), so bad input is reported once, by us. Cheap to repeat.
void quiet_errors();

// The innermost message on this thread's HDF5 error stack ("" when empty).
std::string last_error();

// Owns one HDF5 id; `Close` is the matching H5?close. Closing errors are ignored: destructors
// run during unwinding and must not throw.
template <herr_t (*Close)(hid_t)>
class Id {
 public:
  Id() = default;
  explicit Id(hid_t id) : id_(id) {}
  ~Id() { reset(); }
  Id(const Id&) = delete;
  Id& operator=(const Id&) = delete;
  Id(Id&& o) noexcept : id_(std::exchange(o.id_, H5I_INVALID_HID)) {}
  Id& operator=(Id&& o) noexcept {
    if (this != &o) {
      reset();
      id_ = std::exchange(o.id_, H5I_INVALID_HID);
    }
    return *this;
  }

  hid_t get() const { return id_; }
  operator hid_t() const { return id_; }  // so owners pass straight to H5 calls
  bool valid() const { return id_ >= 0; }
  // Gives up ownership (e.g. to close explicitly and check the result).
  hid_t release() noexcept { return std::exchange(id_, H5I_INVALID_HID); }
  void reset() noexcept {
    const Guard guard;
    if (id_ >= 0) Close(id_);
    id_ = H5I_INVALID_HID;
  }

 private:
  hid_t id_ = H5I_INVALID_HID;
};

using File = Id<H5Fclose>;

// Opens an existing HDF5 file read-only; an Input error "<what>cannot be read (...)", "<what>is
// not an HDF5 file" or "<what>cannot be opened (...)" otherwise (`what` names it, e.g.
// "checkpoint 'x.h5' ", or "" where the caller prefixes the file).
File open_readonly(const std::string& path, const std::string& what = "");
using DataSet = Id<H5Dclose>;
using Space = Id<H5Sclose>;
using Type = Id<H5Tclose>;
using Attr = Id<H5Aclose>;
using Group = Id<H5Gclose>;
using PList = Id<H5Pclose>;

namespace detail {
[[noreturn]] void fail(ErrorKind kind, const char* expr, const char* file, int line, const std::string& msg);
}

// Returns `value` (an id or herr_t) when it is non-negative; otherwise throws a strata::Error
// of `kind` carrying `make_msg()` and HDF5's own message.
template <class T, class MakeMsg>
T checked(ErrorKind kind, T value, const char* expr, const char* file, int line, MakeMsg&& make_msg) {
  if (value < 0) [[unlikely]]
    detail::fail(kind, expr, file, line, make_msg());
  return value;
}

// Checks, before anything is allocated for it, that dataset `name` of `dims` holds all its
// bytes in the file: the size (dims x element size) fits int64, a contiguous dataset has its
// storage allocated inside the file, a chunked one has every chunk written. Input error
// otherwise ("'<name>' declare ..."): a flipped bit in a dimension or a truncated file must
// not become an allocation of exabytes or a dataset of fill values.
void require_stored(hid_t dataset, const Shape& dims, const std::string& name);

// True when `path` (e.g. "model/conv1/weight") names a link under `loc`, checking each
// component so that a missing group is not an error.
bool exists(hid_t loc, const std::string& path);

// Dimensions of a dataspace (empty for a scalar). Input errors, prefixed by `what` (e.g.
// "'inputs' "), for a damaged one: unreadable, a dimension past int64 or past its maximum.
Shape dims(hid_t space, const std::string& what = "");

// The HDF5 memory type for a tensor dtype (F32, I32, U8).
hid_t native_type(DType dtype);

// The dataspace of a tensor of `shape` (a scalar for {}).
Space space_of(const Shape& shape, const std::string& name);
// A new dataset `name` in `file`, its parent groups created as needed ("model/h0/attn/...").
DataSet create_dataset(hid_t file, const std::string& name, hid_t file_type, hid_t space);

// A readable name for an HDF5 type ("uint16", "float32", "string", ...), for error messages.
std::string type_name(hid_t type);

// Attributes: read converts to the requested type; numeric arrays come back flat.
bool has_attr(hid_t obj, const std::string& name);
std::vector<double> read_attr_numbers(hid_t obj, const std::string& name);
std::string read_attr_string(hid_t obj, const std::string& name);
// Creates or replaces a scalar (one value) or 1-D attribute.
void write_attr(hid_t obj, const std::string& name, int64_t value);
void write_attr(hid_t obj, const std::string& name, double value);
void write_attr(hid_t obj, const std::string& name, const std::vector<float>& values);
void write_attr(hid_t obj, const std::string& name, const std::string& value);
void write_attr_u32(hid_t obj, const std::string& name, uint32_t value);

}  // namespace strata::io::h5

// H5_CHECK(expr, msg...): evaluates an HDF5 call and returns its result, throwing
// strata::Error (internal) with the message and HDF5's own reason when it is negative.
#define H5_CHECK(expr, ...)                                                                   \
  ::strata::io::h5::checked(::strata::ErrorKind::Internal, (expr), #expr, __FILE__, __LINE__, \
                            [&] { return ::strata::detail::cat(__VA_ARGS__); })
// H5_REQUIRE(expr, msg...): the same for reads of a user's file (dataset shards, token files),
// where a failure is damage in that file (a failed fletcher32 checksum, a corrupt address, an
// unreadable attribute): an Input error (exit 2); the caller prefixes the file's name.
#define H5_REQUIRE(expr, ...)                                                              \
  ::strata::io::h5::checked(::strata::ErrorKind::Input, (expr), #expr, __FILE__, __LINE__, \
                            [&] { return ::strata::detail::cat(__VA_ARGS__); })
