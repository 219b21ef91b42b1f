// HDF5 helpers: error handling, paths, shapes and attributes.
#include "io/hdf5.hpp"

#include <algorithm>

namespace strata::io::h5 {

void quiet_errors() {
  thread_local bool done = false;
  if (!done) {
    H5Eset_auto2(H5E_DEFAULT, nullptr, nullptr);
    done = true;
  }
}

std::string last_error() {
  std::string msg;
  // Walking upward visits the innermost (most specific) entry first.
  H5Ewalk2(
      H5E_DEFAULT, H5E_WALK_UPWARD,
      [](unsigned, const H5E_error2_t* e, void* out) -> herr_t {
        auto* s = static_cast<std::string*>(out);
        if (s->empty() && e->desc && *e->desc) *s = e->desc;
        return 0;
      },
      &msg);
  // Some descriptions embed a ctime() with its newline: errors are one line.
  std::replace(msg.begin(), msg.end(), '\n', ' ');
  return msg;
}

namespace detail {
void fail(const char* expr, const char* file, int line, const std::string& msg) {
  std::string reason = last_error();
  H5Eclear2(H5E_DEFAULT);
  throw Error(ErrorKind::Internal,
              strata::detail::cat(msg, " (", expr, " failed", reason.empty() ? "" : ": ", reason, ")"), file, line);
}
}  // namespace detail

bool exists(hid_t loc, const std::string& path) {
  if (path.empty() || path == "/") return true;
  size_t pos = 0;
  while (true) {
    size_t slash = path.find('/', pos + 1);
    std::string prefix = path.substr(0, slash);
    if (!prefix.empty() && prefix != "/" && H5Lexists(loc, prefix.c_str(), H5P_DEFAULT) <= 0) return false;
    if (slash == std::string::npos) return true;
    pos = slash;
  }
}

Shape dims(hid_t space) {
  int rank = H5_CHECK(H5Sget_simple_extent_ndims(space), "reading a dataspace rank");
  std::vector<hsize_t> d(static_cast<size_t>(rank));
  H5_CHECK(H5Sget_simple_extent_dims(space, d.data(), nullptr), "reading dataspace dims");
  return Shape(d.begin(), d.end());
}

hid_t native_type(DType dtype) {
  switch (dtype) {
    case DType::F32:
      return H5T_NATIVE_FLOAT;
    case DType::I32:
      return H5T_NATIVE_INT32;
    case DType::U8:
      return H5T_NATIVE_UINT8;
    default:
      STRATA_THROW("no HDF5 type for dtype ", dtype_name(dtype));
  }
}

std::string type_name(hid_t type) {
  const size_t bits = H5Tget_size(type) * 8;
  switch (H5Tget_class(type)) {
    case H5T_INTEGER:
      return (H5Tget_sign(type) == H5T_SGN_NONE ? "uint" : "int") + std::to_string(bits);
    case H5T_FLOAT:
      return "float" + std::to_string(bits);
    case H5T_STRING:
      return "string";
    case H5T_COMPOUND:
      return "compound";
    default:
      return "an unsupported type";
  }
}

bool has_attr(hid_t obj, const std::string& name) { return H5Aexists(obj, name.c_str()) > 0; }

std::vector<double> read_attr_numbers(hid_t obj, const std::string& name) {
  Attr attr(H5_CHECK(H5Aopen(obj, name.c_str(), H5P_DEFAULT), "opening attribute ", name));
  Type type(H5_CHECK(H5Aget_type(attr), "attribute type of ", name));
  H5T_class_t cls = H5Tget_class(type);
  STRATA_REQUIRE(cls == H5T_INTEGER || cls == H5T_FLOAT, "attribute '", name,
                 "' should hold numbers but holds another type");
  Space space(H5_CHECK(H5Aget_space(attr), "attribute space of ", name));
  hssize_t n = H5_CHECK(H5Sget_simple_extent_npoints(space), "attribute size of ", name);
  std::vector<double> values(static_cast<size_t>(n));
  H5_CHECK(H5Aread(attr, H5T_NATIVE_DOUBLE, values.data()), "reading attribute ", name);
  return values;
}

std::string read_attr_string(hid_t obj, const std::string& name) {
  Attr attr(H5_CHECK(H5Aopen(obj, name.c_str(), H5P_DEFAULT), "opening attribute ", name));
  Type type(H5_CHECK(H5Aget_type(attr), "attribute type of ", name));
  STRATA_REQUIRE(H5Tget_class(type) == H5T_STRING, "attribute '", name,
                 "' should hold a string but holds another type");
  if (H5Tis_variable_str(type) > 0) {
    Type mem(H5_CHECK(H5Tcopy(H5T_C_S1), "copying a string type"));
    H5_CHECK(H5Tset_size(mem, H5T_VARIABLE), "sizing a string type");
    H5_CHECK(H5Tset_cset(mem, H5Tget_cset(type)), "setting a string charset");  // no ASCII<->UTF-8 conversion
    char* s = nullptr;
    H5_CHECK(H5Aread(attr, mem, &s), "reading attribute ", name);
    std::string out = s ? s : "";
    H5free_memory(s);
    return out;
  }
  std::string out(H5Tget_size(type), '\0');
  H5_CHECK(H5Aread(attr, type, out.data()), "reading attribute ", name);
  return out.substr(0, out.find('\0'));
}

namespace {
// Creates `name` on `obj` (replacing an existing one) and writes `data` of memory type `mem`.
void put_attr(hid_t obj, const std::string& name, hid_t file_type, hid_t mem_type, hid_t space, const void* data) {
  if (has_attr(obj, name)) H5_CHECK(H5Adelete(obj, name.c_str()), "replacing attribute ", name);
  Attr attr(
      H5_CHECK(H5Acreate2(obj, name.c_str(), file_type, space, H5P_DEFAULT, H5P_DEFAULT), "creating attribute ", name));
  H5_CHECK(H5Awrite(attr, mem_type, data), "writing attribute ", name);
}

Space scalar_space() { return Space(H5_CHECK(H5Screate(H5S_SCALAR), "creating a scalar dataspace")); }
}  // namespace

void write_attr(hid_t obj, const std::string& name, int64_t value) {
  put_attr(obj, name, H5T_STD_I64LE, H5T_NATIVE_INT64, scalar_space(), &value);
}

void write_attr(hid_t obj, const std::string& name, double value) {
  put_attr(obj, name, H5T_IEEE_F64LE, H5T_NATIVE_DOUBLE, scalar_space(), &value);
}

void write_attr_u32(hid_t obj, const std::string& name, uint32_t value) {
  put_attr(obj, name, H5T_STD_U32LE, H5T_NATIVE_UINT32, scalar_space(), &value);
}

void write_attr(hid_t obj, const std::string& name, const std::vector<float>& values) {
  hsize_t n = values.size();
  Space space(H5_CHECK(H5Screate_simple(1, &n, nullptr), "creating an attribute dataspace"));
  put_attr(obj, name, H5T_IEEE_F32LE, H5T_NATIVE_FLOAT, space, values.data());
}

void write_attr(hid_t obj, const std::string& name, const std::string& value) {
  // Variable-length UTF-8, so h5py reads it back as str rather than bytes.
  Type type(H5_CHECK(H5Tcopy(H5T_C_S1), "copying a string type"));
  H5_CHECK(H5Tset_size(type, H5T_VARIABLE), "sizing a string type");
  H5_CHECK(H5Tset_cset(type, H5T_CSET_UTF8), "setting a string charset");
  const char* s = value.c_str();
  put_attr(obj, name, type, type, scalar_space(), &s);
}

File open_readonly(const std::string& path, const std::string& what) {
  const htri_t is_h5 = H5Fis_hdf5(path.c_str());
  STRATA_REQUIRE(is_h5 >= 0, what, "cannot be read (", last_error(), ")");
  STRATA_REQUIRE(is_h5 > 0, what, "is not an HDF5 file");
  File file(H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT));
  STRATA_REQUIRE(file.valid(), what, "cannot be opened (", last_error(), ")");
  return file;
}

}  // namespace strata::io::h5
