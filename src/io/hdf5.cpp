// HDF5 helpers: error handling, paths, shapes and attributes.
#include "io/hdf5.hpp"

#include <algorithm>
#include <limits>
#include <optional>

namespace strata::io::h5 {

std::recursive_mutex& api_mutex() {
  static std::recursive_mutex mutex;
  return mutex;
}

void quiet_errors() {
  const Guard guard;
  thread_local bool done = false;
  if (!done) {
    H5Eset_auto2(H5E_DEFAULT, nullptr, nullptr);
    done = true;
  }
}

std::string last_error() {
  const Guard guard;
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
void fail(ErrorKind kind, const char* expr, const char* file, int line, const std::string& msg) {
  const Guard guard;
  std::string reason = last_error();
  H5Eclear2(H5E_DEFAULT);
  // Users read input errors: HDF5's reason, not our call.
  throw Error(kind,
              kind == ErrorKind::Input
                  ? strata::detail::cat(msg, reason.empty() ? "" : " (", reason, reason.empty() ? "" : ")")
                  : strata::detail::cat(msg, " (", expr, " failed", reason.empty() ? "" : ": ", reason, ")"),
              file, line);
}
}  // namespace detail

bool exists(hid_t loc, const std::string& path) {
  const Guard guard;
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

Space space_of(const Shape& shape, const std::string& name) {
  const Guard guard;
  const std::vector<hsize_t> d(shape.begin(), shape.end());
  return Space(d.empty()
                   ? H5_CHECK(H5Screate(H5S_SCALAR), "scalar space")
                   : H5_CHECK(H5Screate_simple(static_cast<int>(d.size()), d.data(), nullptr), "space for ", name));
}

DataSet create_dataset(hid_t file, const std::string& name, hid_t file_type, hid_t space) {
  const Guard guard;
  PList lcpl(H5_CHECK(H5Pcreate(H5P_LINK_CREATE), "link property list"));
  H5_CHECK(H5Pset_create_intermediate_group(lcpl, 1), "intermediate groups");
  return DataSet(H5_CHECK(H5Dcreate2(file, name.c_str(), file_type, space, lcpl, H5P_DEFAULT, H5P_DEFAULT),
                          "creating dataset ", name));
}

Shape dims(hid_t space, const std::string& what) {
  const Guard guard;
  // Dataspaces come from files: a damaged one is bad input.
  int rank = H5_REQUIRE(H5Sget_simple_extent_ndims(space), what, "has an unreadable dataspace");
  std::vector<hsize_t> d(static_cast<size_t>(rank)), max(static_cast<size_t>(rank));
  H5_REQUIRE(H5Sget_simple_extent_dims(space, d.data(), max.data()), what, "has unreadable dimensions");
  Shape out;
  for (size_t i = 0; i < d.size(); ++i) {
    const hsize_t v = d[i];
    // A well-formed file never grows a dimension past its maximum: a damaged dataspace.
    STRATA_REQUIRE(max[i] == H5S_UNLIMITED || v <= max[i], what, "has dimension ", i, " of ", v,
                   " beyond its declared maximum ", max[i]);
    // hsize_t is unsigned 64-bit: a dimension past int64 would turn negative.
    STRATA_REQUIRE(v <= static_cast<hsize_t>(std::numeric_limits<int64_t>::max()), what, "has a dimension of ", v,
                   "; expected at most 2^63 - 1");
    out.push_back(static_cast<int64_t>(v));
  }
  return out;
}

void require_stored(hid_t dataset, const Shape& dims, const std::string& name) {
  const Guard guard;
  Type type(H5_REQUIRE(H5Dget_type(dataset), "'", name, "' have an unreadable type"));
  const std::optional<int64_t> bytes = checked_numel(dims, static_cast<int64_t>(H5Tget_size(type)));
  STRATA_REQUIRE(bytes.has_value(), "'", name, "' declare shape ", shape_str(dims),
                 " whose size in bytes overflows 64 bits");
  PList create(H5_REQUIRE(H5Dget_create_plist(dataset), "'", name, "' have unreadable creation properties"));
  const H5D_layout_t layout = H5Pget_layout(create);
  if (layout == H5D_CONTIGUOUS && H5Pget_external_count(create) == 0) {  // external files: HDF5 checks at read
    // Storage is allocated whole or not at all; its address must leave room for every byte.
    const haddr_t offset = H5Dget_offset(dataset);
    hsize_t file_size = 0;
    {
      const hid_t file = H5Iget_file_id(dataset);
      const herr_t got = H5Fget_filesize(file, &file_size);
      H5Fclose(file);
      H5_REQUIRE(got, "'", name, "': the file's size cannot be read");
    }
    STRATA_REQUIRE(*bytes == 0 || offset != HADDR_UNDEF, "'", name, "' declare shape ", shape_str(dims), " (", *bytes,
                   " bytes) but the file holds none of them");
    STRATA_REQUIRE(*bytes == 0 || (offset <= file_size && static_cast<hsize_t>(*bytes) <= file_size - offset), "'",
                   name, "' declare shape ", shape_str(dims), " (", *bytes, " bytes) at address ", offset,
                   " but the file ends at ", file_size);
  } else if (layout == H5D_CHUNKED) {
    const int rank = static_cast<int>(dims.size());
    std::vector<hsize_t> chunk(static_cast<size_t>(rank));
    H5_REQUIRE(H5Pget_chunk(create, rank, chunk.data()), "'", name, "' have unreadable chunk dimensions");
    std::optional<int64_t> expected = 1;
    for (int d = 0; d < rank; ++d) {
      STRATA_REQUIRE(chunk[static_cast<size_t>(d)] > 0, "'", name, "' have a chunk dimension of 0");
      const auto c = static_cast<int64_t>(chunk[static_cast<size_t>(d)]);
      const int64_t n = dims[static_cast<size_t>(d)];
      if (expected) expected = checked_mul(*expected, n / c + (n % c != 0));
    }
    Space space(H5_REQUIRE(H5Dget_space(dataset), "'", name, "' have an unreadable dataspace"));
    hsize_t stored = 0;
    H5_REQUIRE(H5Dget_num_chunks(dataset, space, &stored), "'", name, "' have an unreadable chunk index");
    // Unwritten chunks read as fill values: data that was never there.
    STRATA_REQUIRE(expected && static_cast<hsize_t>(*expected) == stored, "'", name, "' declare shape ",
                   shape_str(dims), " in chunks of ", shape_str(Shape(chunk.begin(), chunk.end())),
                   " but the file holds ", stored, " of its ",
                   expected ? std::to_string(*expected) : std::string("more than 2^63"), " chunks");
  }
  // Compact: the data lives in the object header, already read whole by H5Dopen.
}

hid_t native_type(DType dtype) {
  const Guard guard;
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
  const Guard guard;
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

namespace {
// "attribute 'scale' of '/inputs'": which object's attribute, for messages.
std::string attr_str(hid_t obj, const std::string& name) {
  const Guard guard;
  char path[256] = "";
  if (H5Iget_name(obj, path, sizeof path) <= 0) return "attribute '" + name + "'";
  return "attribute '" + name + "' of '" + path + "'";
}
}  // namespace

bool has_attr(hid_t obj, const std::string& name) {
  const Guard guard;  // the background checkpoint writer calls HDF5 at the same time
  return H5Aexists(obj, name.c_str()) > 0;
}

std::vector<double> read_attr_numbers(hid_t obj, const std::string& name) {
  const Guard guard;
  Attr attr(H5_REQUIRE(H5Aopen(obj, name.c_str(), H5P_DEFAULT), attr_str(obj, name), " cannot be opened"));
  Type type(H5_REQUIRE(H5Aget_type(attr), attr_str(obj, name), " has an unreadable type"));
  H5T_class_t cls = H5Tget_class(type);
  STRATA_REQUIRE(cls == H5T_INTEGER || cls == H5T_FLOAT, attr_str(obj, name),
                 " should hold numbers but holds another type");
  Space space(H5_REQUIRE(H5Aget_space(attr), attr_str(obj, name), " has an unreadable dataspace"));
  // An empty (null dataspace) attribute has no value to read.
  STRATA_REQUIRE(H5Sget_simple_extent_type(space) != H5S_NULL, attr_str(obj, name), " is empty; expected a value");
  hssize_t n = H5_REQUIRE(H5Sget_simple_extent_npoints(space), attr_str(obj, name), " has an unreadable size");
  std::vector<double> values(static_cast<size_t>(n));
  H5_REQUIRE(H5Aread(attr, H5T_NATIVE_DOUBLE, values.data()), attr_str(obj, name), " cannot be read");
  return values;
}

std::string read_attr_string(hid_t obj, const std::string& name) {
  const Guard guard;
  Attr attr(H5_REQUIRE(H5Aopen(obj, name.c_str(), H5P_DEFAULT), attr_str(obj, name), " cannot be opened"));
  Type type(H5_REQUIRE(H5Aget_type(attr), attr_str(obj, name), " has an unreadable type"));
  STRATA_REQUIRE(H5Tget_class(type) == H5T_STRING, attr_str(obj, name), " should hold a string but holds another type");
  Space space(H5_REQUIRE(H5Aget_space(attr), attr_str(obj, name), " has an unreadable dataspace"));
  STRATA_REQUIRE(H5Sget_simple_extent_type(space) != H5S_NULL, attr_str(obj, name), " is empty; expected a string");
  if (H5Tis_variable_str(type) > 0) {
    Type mem(H5_CHECK(H5Tcopy(H5T_C_S1), "copying a string type"));
    H5_CHECK(H5Tset_size(mem, H5T_VARIABLE), "sizing a string type");
    H5_CHECK(H5Tset_cset(mem, H5Tget_cset(type)), "setting a string charset");  // no ASCII<->UTF-8 conversion
    char* s = nullptr;
    H5_REQUIRE(H5Aread(attr, mem, &s), attr_str(obj, name), " cannot be read");
    std::string out = s ? s : "";
    H5free_memory(s);
    return out;
  }
  std::string out(H5Tget_size(type), '\0');
  H5_REQUIRE(H5Aread(attr, type, out.data()), attr_str(obj, name), " cannot be read");
  return out.substr(0, out.find('\0'));
}

namespace {
// Creates `name` on `obj` (replacing an existing one) and writes `data` of memory type `mem`.
void put_attr(hid_t obj, const std::string& name, hid_t file_type, hid_t mem_type, hid_t space, const void* data) {
  const Guard guard;
  if (has_attr(obj, name)) H5_CHECK(H5Adelete(obj, name.c_str()), "replacing attribute ", name);
  Attr attr(
      H5_CHECK(H5Acreate2(obj, name.c_str(), file_type, space, H5P_DEFAULT, H5P_DEFAULT), "creating attribute ", name));
  H5_CHECK(H5Awrite(attr, mem_type, data), "writing attribute ", name);
}

Space scalar_space() {
  const Guard guard;
  return Space(H5_CHECK(H5Screate(H5S_SCALAR), "creating a scalar dataspace"));
}
}  // namespace

void write_attr(hid_t obj, const std::string& name, int64_t value) {
  const Guard guard;
  put_attr(obj, name, H5T_STD_I64LE, H5T_NATIVE_INT64, scalar_space(), &value);
}

void write_attr(hid_t obj, const std::string& name, double value) {
  const Guard guard;
  put_attr(obj, name, H5T_IEEE_F64LE, H5T_NATIVE_DOUBLE, scalar_space(), &value);
}

void write_attr_u32(hid_t obj, const std::string& name, uint32_t value) {
  const Guard guard;
  put_attr(obj, name, H5T_STD_U32LE, H5T_NATIVE_UINT32, scalar_space(), &value);
}

void write_attr(hid_t obj, const std::string& name, const std::vector<float>& values) {
  const Guard guard;
  hsize_t n = values.size();
  Space space(H5_CHECK(H5Screate_simple(1, &n, nullptr), "creating an attribute dataspace"));
  put_attr(obj, name, H5T_IEEE_F32LE, H5T_NATIVE_FLOAT, space, values.data());
}

void write_attr(hid_t obj, const std::string& name, const std::string& value) {
  const Guard guard;
  // Variable-length UTF-8, so h5py reads it back as str rather than bytes.
  Type type(H5_CHECK(H5Tcopy(H5T_C_S1), "copying a string type"));
  H5_CHECK(H5Tset_size(type, H5T_VARIABLE), "sizing a string type");
  H5_CHECK(H5Tset_cset(type, H5T_CSET_UTF8), "setting a string charset");
  const char* s = value.c_str();
  put_attr(obj, name, type, type, scalar_space(), &s);
}

File open_readonly(const std::string& path, const std::string& what) {
  const Guard guard;
  const htri_t is_h5 = H5Fis_hdf5(path.c_str());
  STRATA_REQUIRE(is_h5 >= 0, what, "cannot be read (", last_error(), ")");
  STRATA_REQUIRE(is_h5 > 0, what, "is not an HDF5 file");
  File file(H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT));
  STRATA_REQUIRE(file.valid(), what, "cannot be opened (", last_error(), ")");
  return file;
}

}  // namespace strata::io::h5
