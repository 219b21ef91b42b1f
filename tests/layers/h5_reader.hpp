// A minimal read-only view of the reference file written by tests/layers/torch_reference.py,
// on the HDF5 C API directly (the tests must not depend on src/io). Every handle is owned by
// an RAII wrapper; any failure throws std::runtime_error naming the object.
#pragma once

#include <hdf5.h>

#include <cstdlib>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "core/tensor.hpp"

namespace strata::testing {

class H5Handle {
 public:
  H5Handle() = default;
  H5Handle(hid_t id, herr_t (*close)(hid_t)) : id_(id), close_(close) {}
  ~H5Handle() {
    if (id_ >= 0 && close_) close_(id_);
  }
  H5Handle(H5Handle&& o) noexcept : id_(std::exchange(o.id_, -1)), close_(o.close_) {}
  H5Handle& operator=(H5Handle&& o) noexcept {
    std::swap(id_, o.id_);
    std::swap(close_, o.close_);
    return *this;
  }
  hid_t get() const { return id_; }

 private:
  hid_t id_ = -1;
  herr_t (*close_)(hid_t) = nullptr;
};

// The path of the reference file: $STRATA_TORCH_REF, else the build-tree default.
inline std::string torch_ref_path() {
  if (const char* p = std::getenv("STRATA_TORCH_REF")) return p;
#ifdef STRATA_TORCH_REF_DEFAULT
  return STRATA_TORCH_REF_DEFAULT;
#else
  return "torch_ref.h5";
#endif
}

class H5Group {
 public:
  H5Group(H5Handle h, std::string path) : h_(std::move(h)), path_(std::move(path)) {}

  const std::string& path() const { return path_; }

  bool has(const std::string& name) const {
    // H5Lexists on "a/b" needs "a" to exist; check each component.
    std::string prefix;
    size_t start = 0;
    while (true) {
      const size_t slash = name.find('/', start);
      prefix = name.substr(0, slash);
      if (H5Lexists(h_.get(), prefix.c_str(), H5P_DEFAULT) <= 0) return false;
      if (slash == std::string::npos) return true;
      start = slash + 1;
    }
  }

  H5Group group(const std::string& name) const {
    hid_t id = H5Gopen2(h_.get(), name.c_str(), H5P_DEFAULT);
    if (id < 0) throw std::runtime_error("no group " + path_ + "/" + name);
    return H5Group(H5Handle(id, H5Gclose), path_ + "/" + name);
  }

  // Names of the direct children, in the file's (alphabetical) order.
  std::vector<std::string> children() const {
    std::vector<std::string> names;
    H5Literate(
        h_.get(), H5_INDEX_NAME, H5_ITER_INC, nullptr,
        [](hid_t, const char* name, const H5L_info_t*, void* out) -> herr_t {
          static_cast<std::vector<std::string>*>(out)->push_back(name);
          return 0;
        },
        &names);
    return names;
  }

  // A float32 dataset as a tensor of its stored shape.
  Tensor tensor(const std::string& name) const { return read(name, DType::F32); }
  Tensor int_tensor(const std::string& name) const { return read(name, DType::I32); }
  double scalar(const std::string& name) const {
    H5Handle ds(H5Dopen2(h_.get(), name.c_str(), H5P_DEFAULT), H5Dclose);
    if (ds.get() < 0) throw std::runtime_error("no dataset " + path_ + "/" + name);
    double v = 0;
    if (H5Dread(ds.get(), H5T_NATIVE_DOUBLE, H5S_ALL, H5S_ALL, H5P_DEFAULT, &v) < 0)
      throw std::runtime_error("cannot read " + path_ + "/" + name);
    return v;
  }
  std::vector<double> doubles(const std::string& name) const {
    Tensor t = read(name, DType::F32);  // for the shape
    std::vector<double> v(static_cast<size_t>(t.numel()));
    H5Handle ds(H5Dopen2(h_.get(), name.c_str(), H5P_DEFAULT), H5Dclose);
    if (H5Dread(ds.get(), H5T_NATIVE_DOUBLE, H5S_ALL, H5S_ALL, H5P_DEFAULT, v.data()) < 0)
      throw std::runtime_error("cannot read " + path_ + "/" + name);
    return v;
  }

  // True when `name` is a group (false for a dataset or nothing).
  bool is_group(const std::string& name) const {
    if (!has(name)) return false;
    H5Handle obj(H5Oopen(h_.get(), name.c_str(), H5P_DEFAULT), H5Oclose);
    return obj.get() >= 0 && H5Iget_type(obj.get()) == H5I_GROUP;
  }

  // Paths of every dataset below this group, relative to it ("conv1/weight").
  std::vector<std::string> dataset_paths(const std::string& prefix = "") const {
    std::vector<std::string> out;
    for (const std::string& c : children()) {
      if (is_group(c)) {
        for (const std::string& d : group(c).dataset_paths()) out.push_back(c + "/" + d);
      } else {
        out.push_back(c);
      }
    }
    return out;
  }

  bool has_attr(const std::string& name) const { return H5Aexists(h_.get(), name.c_str()) > 0; }
  double num_attr(const std::string& name) const {
    H5Handle a(attr(name));
    double v = 0;
    if (H5Aread(a.get(), H5T_NATIVE_DOUBLE, &v) < 0) throw std::runtime_error("cannot read attribute " + name);
    return v;
  }
  int64_t int_attr(const std::string& name) const { return static_cast<int64_t>(num_attr(name)); }
  std::string str_attr(const std::string& name) const {
    H5Handle a(attr(name));
    H5Handle type(H5Aget_type(a.get()), H5Tclose);
    if (H5Tis_variable_str(type.get()) > 0) {
      char* s = nullptr;
      H5Handle mem(H5Tcopy(H5T_C_S1), H5Tclose);
      H5Tset_size(mem.get(), H5T_VARIABLE);
      if (H5Aread(a.get(), mem.get(), &s) < 0) throw std::runtime_error("cannot read attribute " + name);
      std::string out(s ? s : "");
      H5free_memory(s);
      return out;
    }
    // Fixed length (h5py writes numpy bytes NULLPAD): read into n + 1 bytes, null-terminated.
    const size_t n = H5Tget_size(type.get());
    std::string out(n + 1, '\0');
    H5Handle mem(H5Tcopy(H5T_C_S1), H5Tclose);
    H5Tset_size(mem.get(), n + 1);
    H5Tset_strpad(mem.get(), H5T_STR_NULLTERM);
    if (H5Aread(a.get(), mem.get(), out.data()) < 0) throw std::runtime_error("cannot read attribute " + name);
    out.resize(std::min(n, out.find('\0')));
    return out;
  }

 private:
  H5Handle attr(const std::string& name) const {
    hid_t id = H5Aopen(h_.get(), name.c_str(), H5P_DEFAULT);
    if (id < 0) throw std::runtime_error("no attribute " + name + " on " + path_);
    return H5Handle(id, H5Aclose);
  }

  Tensor read(const std::string& name, DType dtype) const {
    H5Handle ds(H5Dopen2(h_.get(), name.c_str(), H5P_DEFAULT), H5Dclose);
    if (ds.get() < 0) throw std::runtime_error("no dataset " + path_ + "/" + name);
    H5Handle space(H5Dget_space(ds.get()), H5Sclose);
    const int rank = H5Sget_simple_extent_ndims(space.get());
    std::vector<hsize_t> dims(static_cast<size_t>(std::max(rank, 0)));
    H5Sget_simple_extent_dims(space.get(), dims.data(), nullptr);
    Shape shape;
    for (hsize_t d : dims) shape.push_back(static_cast<int64_t>(d));
    if (shape.empty()) shape = {1};  // scalars as one element
    Tensor t = Tensor::zeros(shape, dtype);
    const hid_t mem = dtype == DType::F32 ? H5T_NATIVE_FLOAT : H5T_NATIVE_INT32;
    if (H5Dread(ds.get(), mem, H5S_ALL, H5S_ALL, H5P_DEFAULT, t.raw()) < 0)
      throw std::runtime_error("cannot read " + path_ + "/" + name);
    return t;
  }

  H5Handle h_;
  std::string path_;
};

class H5File {
 public:
  explicit H5File(const std::string& path) : path_(path) {
    H5Eset_auto2(H5E_DEFAULT, nullptr, nullptr);  // failures are reported by our exceptions
    hid_t id = H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT);
    if (id < 0)
      throw std::runtime_error("cannot open " + path +
                               " (written by tests/layers/torch_reference.py; run ctest, whose fixture "
                               "torch_ref generates it)");
    file_ = H5Handle(id, H5Fclose);
  }
  H5Group root() const {
    hid_t id = H5Gopen2(file_.get(), "/", H5P_DEFAULT);
    return H5Group(H5Handle(id, H5Gclose), "");
  }

 private:
  std::string path_;
  H5Handle file_;
};

}  // namespace strata::testing
