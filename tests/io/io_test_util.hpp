// Helpers for the io tests: temporary directories, raw HDF5 files (including malformed ones
// that write_shard would refuse to make) and an input-error matcher.
#pragma once

#include <gtest/gtest.h>
#include <hdf5.h>

#include <cstdlib>
#include <filesystem>
#include <string>
#include <utility>
#include <vector>

#include "core/error.hpp"
#include "core/tensor.hpp"
#include "expect_error.hpp"
#include "io/hdf5.hpp"

namespace strata::io::test {

// A fresh directory, removed with its contents at the end of the test.
class TempDir {
 public:
  TempDir() {
    std::string tmpl = (std::filesystem::temp_directory_path() / "strata_io_XXXXXX").string();
    path_ = mkdtemp(tmpl.data());
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  std::string operator/(const std::string& name) const { return (path_ / name).string(); }
  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
};

// A host f32 tensor of `shape` holding start, start + 0.5, start + 1, ... in row-major order.
inline Tensor arange(Shape shape, float start) {
  Tensor t = Tensor::empty(std::move(shape));
  for (int64_t i = 0; i < t.numel(); ++i) t.data<float>()[i] = start + 0.5f * static_cast<float>(i);
  return t;
}

// Creates (or opens) `path` and writes dataset `name` of file type `type` with `dims`, from
// `data` in memory type `mem_type`.
inline void write_raw(const std::string& path, const std::string& name, hid_t type, hid_t mem_type,
                      const std::vector<hsize_t>& dims, const void* data) {
  h5::quiet_errors();
  h5::File f(std::filesystem::exists(path) ? H5Fopen(path.c_str(), H5F_ACC_RDWR, H5P_DEFAULT)
                                           : H5Fcreate(path.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT));
  ASSERT_TRUE(f.valid()) << path;
  h5::Space space(H5Screate_simple(static_cast<int>(dims.size()), dims.data(), nullptr));
  h5::DataSet ds(H5Dcreate2(f, name.c_str(), type, space, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT));
  ASSERT_TRUE(ds.valid()) << name;
  if (data) {
    ASSERT_GE(H5Dwrite(ds, mem_type, H5S_ALL, H5S_ALL, H5P_DEFAULT, data), 0);
  }
}

using ::strata::test::expect_input_error;

}  // namespace strata::io::test
