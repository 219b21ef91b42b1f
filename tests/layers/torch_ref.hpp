// Reading the reference file written by tests/layers/torch_reference.py through src/io's HDF5
// wrappers (io/hdf5.hpp: owned ids, H5_CHECK, exists, dims, attributes). The few reads the
// parity tests need beyond those (groups, their children, whole datasets) are here.
#pragma once

#include <cstdlib>
#include <string>
#include <vector>

#include "core/tensor.hpp"
#include "io/hdf5.hpp"

namespace strata::testing {

// The path of the reference file: $STRATA_TORCH_REF, else the build-tree default.
inline std::string torch_ref_path() {
  if (const char* p = std::getenv("STRATA_TORCH_REF")) return p;
#ifdef STRATA_TORCH_REF_DEFAULT
  return STRATA_TORCH_REF_DEFAULT;
#else
  return "torch_ref.h5";
#endif
}

inline io::h5::File open_torch_ref() {
  io::h5::quiet_errors();  // failures are reported by our exceptions
  const std::string path = torch_ref_path();
  return io::h5::File(H5_CHECK(H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT), "cannot open ", path,
                               " (written by tests/layers/torch_reference.py; run ctest, whose fixture "
                               "torch_ref generates it)"));
}

// `name` may be a path ("layers/relu").
inline io::h5::Group open_group(hid_t loc, const std::string& name) {
  return io::h5::Group(H5_CHECK(H5Gopen2(loc, name.c_str(), H5P_DEFAULT), "no group ", name));
}

// Names of the direct children, in the file's (alphabetical) order.
inline std::vector<std::string> children(hid_t group) {
  std::vector<std::string> names;
  H5_CHECK(H5Literate(
               group, H5_INDEX_NAME, H5_ITER_INC, nullptr,
               [](hid_t, const char* name, const H5L_info_t*, void* out) -> herr_t {
                 static_cast<std::vector<std::string>*>(out)->push_back(name);
                 return 0;
               },
               &names),
           "listing a group");
  return names;
}

// How many datasets lie below `group`, at any depth.
inline size_t count_datasets(hid_t group) {
  size_t n = 0;
  for (const std::string& c : children(group)) {
    io::h5::Id<H5Oclose> obj(H5_CHECK(H5Oopen(group, c.c_str(), H5P_DEFAULT), "opening ", c));
    n += H5Iget_type(obj) == H5I_GROUP ? count_datasets(obj) : 1;
  }
  return n;
}

// A dataset as a tensor of its stored shape (a scalar as one element).
inline Tensor read_tensor(hid_t loc, const std::string& name, DType dtype = DType::F32) {
  io::h5::DataSet ds(H5_CHECK(H5Dopen2(loc, name.c_str(), H5P_DEFAULT), "no dataset ", name));
  io::h5::Space space(H5_CHECK(H5Dget_space(ds), "dataspace of ", name));
  Shape shape = io::h5::dims(space);
  if (shape.empty()) shape = {1};
  Tensor t = Tensor::zeros(shape, dtype);
  H5_CHECK(H5Dread(ds, io::h5::native_type(dtype), H5S_ALL, H5S_ALL, H5P_DEFAULT, t.raw()), "cannot read ", name);
  return t;
}

// A dataset's values as doubles, flat.
inline std::vector<double> read_doubles(hid_t loc, const std::string& name) {
  io::h5::DataSet ds(H5_CHECK(H5Dopen2(loc, name.c_str(), H5P_DEFAULT), "no dataset ", name));
  io::h5::Space space(H5_CHECK(H5Dget_space(ds), "dataspace of ", name));
  std::vector<double> v(static_cast<size_t>(H5_CHECK(H5Sget_simple_extent_npoints(space), "size of ", name)));
  H5_CHECK(H5Dread(ds, H5T_NATIVE_DOUBLE, H5S_ALL, H5S_ALL, H5P_DEFAULT, v.data()), "cannot read ", name);
  return v;
}

// A scalar numeric attribute.
inline double num_attr(hid_t obj, const std::string& name) {
  const std::vector<double> v = io::h5::read_attr_numbers(obj, name);
  STRATA_REQUIRE(v.size() == 1, "attribute ", name, " holds ", v.size(), " values, not one");
  return v[0];
}
inline int64_t int_attr(hid_t obj, const std::string& name) { return static_cast<int64_t>(num_attr(obj, name)); }

}  // namespace strata::testing
