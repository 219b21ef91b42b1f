// Checkpoint files: atomic write (tmp + fsync + rename + directory fsync), crc32-checked reads.
#include "io/checkpoint.hpp"

#include <fcntl.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "core/log.hpp"

namespace strata::io {

namespace fs = std::filesystem;

namespace {

uint32_t crc32_of(const Tensor& t) {
  return static_cast<uint32_t>(
      crc32_z(crc32_z(0L, Z_NULL, 0), static_cast<const Bytef*>(t.raw()), static_cast<z_size_t>(t.nbytes())));
}

// fsync of a file or directory; throws with the system's reason.
void fsync_path(const std::string& path, int flags) {
  int fd = ::open(path.c_str(), flags);
  STRATA_CHECK(fd >= 0, "cannot open '", path, "' to sync it: ", std::strerror(errno));
  const int rc = ::fsync(fd);
  const int err = errno;
  ::close(fd);
  STRATA_CHECK(rc == 0, "fsync of '", path, "' failed: ", std::strerror(err));
}

// "model/conv1/weight" from a visit of group "/model" reporting "conv1/weight".
std::string join(const std::string& group, const char* name) {
  std::string g = group;
  while (!g.empty() && g.front() == '/') g.erase(0, 1);
  while (!g.empty() && g.back() == '/') g.pop_back();
  return g.empty() ? std::string(name) : g + "/" + name;
}

}  // namespace

// ---- writer ----------------------------------------------------------------------------------

CheckpointWriter::CheckpointWriter(std::string path) : path_(std::move(path)), tmp_path_(path_ + ".tmp") {
  h5::quiet_errors();
  file_ = h5::File(H5Fcreate(tmp_path_.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT));
  if (!file_.valid()) {  // e.g. a full disk: no half-made file stays behind (the destructor won't run)
    const std::string why = h5::last_error();
    std::remove(tmp_path_.c_str());
    STRATA_THROW("cannot create checkpoint '", tmp_path_, "' (", why, ")");
  }
  h5::write_attr(file_, "format_version", kCheckpointFormatVersion);
}

CheckpointWriter::~CheckpointWriter() {
  if (committed_) return;
  file_.reset();
  std::remove(tmp_path_.c_str());  // never throws; a missing file is fine
}

void CheckpointWriter::write_tensor(const std::string& name, const Tensor& t) {
  STRATA_CHECK(!committed_, "write_tensor after commit");
  STRATA_CHECK(t.device().is_cpu(), "checkpoint tensors must be on the host; '", name, "' is on ", t.device().str());
  STRATA_CHECK(t.dtype() == DType::F32 || t.dtype() == DType::I32 || t.dtype() == DType::U8, "checkpoint tensor '",
               name, "' has unsupported dtype ", dtype_name(t.dtype()));
  STRATA_CHECK(!h5::exists(file_, name), "checkpoint tensor '", name, "' written twice");
  std::vector<hsize_t> dims(t.shape().begin(), t.shape().end());
  h5::Space space(dims.empty() ? H5_CHECK(H5Screate(H5S_SCALAR), "scalar space")
                               : H5_CHECK(H5Screate_simple(static_cast<int>(dims.size()), dims.data(), nullptr),
                                          "space for ", name));
  h5::PList lcpl(H5_CHECK(H5Pcreate(H5P_LINK_CREATE), "link property list"));
  H5_CHECK(H5Pset_create_intermediate_group(lcpl, 1), "intermediate groups");
  const hid_t file_type = t.dtype() == DType::F32   ? H5T_IEEE_F32LE
                          : t.dtype() == DType::I32 ? H5T_STD_I32LE
                                                    : H5T_STD_U8LE;
  h5::DataSet ds(H5_CHECK(H5Dcreate2(file_, name.c_str(), file_type, space, lcpl, H5P_DEFAULT, H5P_DEFAULT),
                          "creating checkpoint tensor ", name));
  H5_CHECK(H5Dwrite(ds, h5::native_type(t.dtype()), H5S_ALL, H5S_ALL, H5P_DEFAULT, t.raw()), "writing ", name, " to ",
           tmp_path_);
  h5::write_attr_u32(ds, "crc32", crc32_of(t));
}

void CheckpointWriter::set_attr(const std::string& name, int64_t value) { h5::write_attr(file_, name, value); }
void CheckpointWriter::set_attr(const std::string& name, double value) { h5::write_attr(file_, name, value); }
void CheckpointWriter::set_attr(const std::string& name, const std::string& value) {
  h5::write_attr(file_, name, value);
}

void CheckpointWriter::commit() {
  STRATA_CHECK(!committed_, "checkpoint '", path_, "' committed twice");
  H5_CHECK(H5Fflush(file_, H5F_SCOPE_GLOBAL), "flushing ", tmp_path_);
  H5_CHECK(H5Fclose(file_.release()), "closing ", tmp_path_);
  fsync_path(tmp_path_, O_RDONLY);
  STRATA_CHECK(std::rename(tmp_path_.c_str(), path_.c_str()) == 0, "cannot rename '", tmp_path_, "' to '", path_,
               "': ", std::strerror(errno));
  committed_ = true;
  // The rename is durable only once the directory entry is.
  fs::path dir = fs::path(path_).parent_path();
  fsync_path(dir.empty() ? "." : dir.string(), O_RDONLY | O_DIRECTORY);
}

// ---- reader ----------------------------------------------------------------------------------

CheckpointReader::CheckpointReader(std::string path) : path_(std::move(path)) {
  h5::quiet_errors();
  std::error_code ec;
  STRATA_REQUIRE(fs::exists(path_, ec), "checkpoint '", path_, "' does not exist");
  STRATA_REQUIRE(!fs::is_directory(path_, ec), "checkpoint '", path_,
                 "' is a directory; expected a step-NNNNNNNN.h5 file (or --resume auto with --checkpoint-dir)");
  file_ = h5::open_readonly(path_, "checkpoint '" + path_ + "' ");
  STRATA_REQUIRE(h5::has_attr(file_, "format_version"), "'", path_,
                 "' is not a Strata checkpoint (no format_version attribute)");
  const int64_t version = attr_int("format_version");
  STRATA_REQUIRE(version >= kOldestReadableVersion && version <= kCheckpointFormatVersion, "checkpoint '", path_,
                 "' has format_version ", version, "; this build reads versions ", kOldestReadableVersion, " to ",
                 kCheckpointFormatVersion);
}

bool CheckpointReader::has(const std::string& name) const {
  if (!h5::exists(file_, name)) return false;
  H5O_info_t info;
  return H5Oget_info_by_name2(file_, name.c_str(), &info, H5O_INFO_BASIC, H5P_DEFAULT) >= 0 &&
         info.type == H5O_TYPE_DATASET;
}

h5::DataSet CheckpointReader::open_tensor(const std::string& name) const {
  STRATA_REQUIRE(has(name), "checkpoint '", path_, "' has no tensor '", name, "'");
  return h5::DataSet(H5_CHECK(H5Dopen2(file_, name.c_str(), H5P_DEFAULT), "opening ", name, " in ", path_));
}

Shape CheckpointReader::shape(const std::string& name) const {
  h5::DataSet ds = open_tensor(name);
  h5::Space space(H5_CHECK(H5Dget_space(ds), "space of ", name));
  return h5::dims(space);
}

DType CheckpointReader::dtype(const std::string& name) const {
  h5::DataSet ds = open_tensor(name);
  h5::Type type(H5_CHECK(H5Dget_type(ds), "type of ", name));
  if (H5Tget_class(type) == H5T_FLOAT) return DType::F32;
  if (H5Tget_size(type) == 1) return DType::U8;
  return DType::I32;
}

void CheckpointReader::require_shape(const std::string& name, const Shape& expected) const {
  const Shape found = shape(name);
  STRATA_REQUIRE(found == expected, "checkpoint '", path_, "': tensor '", name, "' has shape ", shape_str(found),
                 " but the model expects ", shape_str(expected));
}

void CheckpointReader::read_tensor(const std::string& name, const Tensor& out) const {
  STRATA_CHECK(out.device().is_cpu(), "read_tensor needs a host tensor for '", name, "'");
  require_shape(name, out.shape());
  h5::DataSet ds = open_tensor(name);
  STRATA_REQUIRE(dtype(name) == out.dtype(), "checkpoint '", path_, "': tensor '", name, "' holds ",
                 dtype_name(dtype(name)), " but the model expects ", dtype_name(out.dtype()));
  H5_CHECK(H5Dread(ds, h5::native_type(out.dtype()), H5S_ALL, H5S_ALL, H5P_DEFAULT, out.raw()), "reading ", name,
           " from ", path_);
  STRATA_REQUIRE(h5::has_attr(ds, "crc32"), "checkpoint '", path_, "': tensor '", name, "' has no crc32 attribute");
  const auto expected = static_cast<uint32_t>(h5::read_attr_numbers(ds, "crc32").at(0));
  const uint32_t actual = crc32_of(out);
  STRATA_REQUIRE(expected == actual, "checkpoint '", path_, "': tensor '", name, "' is corrupt (crc32 ", actual,
                 ", expected ", expected, ")");
}

bool CheckpointReader::has_attr(const std::string& name) const { return h5::has_attr(file_, name); }

void CheckpointReader::require_attr(const std::string& name) const {
  STRATA_REQUIRE(has_attr(name), "checkpoint '", path_, "' has no attribute '", name, "'");
}

int64_t CheckpointReader::attr_int(const std::string& name) const {
  require_attr(name);
  return static_cast<int64_t>(h5::read_attr_numbers(file_, name).at(0));
}

double CheckpointReader::attr_double(const std::string& name) const {
  require_attr(name);
  return h5::read_attr_numbers(file_, name).at(0);
}

std::string CheckpointReader::attr_string(const std::string& name) const {
  require_attr(name);
  return h5::read_attr_string(file_, name);
}

std::vector<std::string> CheckpointReader::list_tensors(const std::string& group) const {
  STRATA_REQUIRE(h5::exists(file_, group), "checkpoint '", path_, "' has no group '", group, "'");
  h5::Group g(H5_CHECK(H5Gopen2(file_, group.c_str(), H5P_DEFAULT), "opening group ", group));
  struct Visit {
    std::string group;
    std::vector<std::string> names;
  } visit{group, {}};
  H5_CHECK(H5Ovisit2(
               g, H5_INDEX_NAME, H5_ITER_INC,
               [](hid_t, const char* name, const H5O_info_t* info, void* data) -> herr_t {
                 auto* v = static_cast<Visit*>(data);
                 if (info->type == H5O_TYPE_DATASET) v->names.push_back(join(v->group, name));
                 return 0;
               },
               &visit, H5O_INFO_BASIC),
           "listing ", group, " in ", path_);
  std::sort(visit.names.begin(), visit.names.end());
  return visit.names;
}

void CheckpointReader::verify() const {
  for (const std::string& name : list_tensors("/")) {
    const Tensor t = Tensor::empty(shape(name), dtype(name));
    read_tensor(name, t);
  }
}

// ---- checkpoint directories ------------------------------------------------------------------

void require_writable_directory(const std::string& dir, const std::string& flag) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  STRATA_REQUIRE(!ec, flag, ": cannot create '", dir, "': ", ec.message());
  const fs::path probe = fs::path(dir) / ".strata-write-test";
  STRATA_REQUIRE(std::ofstream(probe).good(), flag, ": cannot write in '", dir, "': ", std::strerror(errno));
  fs::remove(probe, ec);
}

std::string checkpoint_path(const std::string& dir, int64_t step) {
  char name[64];
  std::snprintf(name, sizeof name, "step-%08lld.h5", static_cast<long long>(step));
  return (fs::path(dir) / name).string();
}

namespace {

// step-NNNNNNNN.h5, the names checkpoint_path gives.
bool is_step_file_name(const std::string& name) {
  return name.size() == 16 && name.starts_with("step-") && name.ends_with(".h5") &&
         std::all_of(name.begin() + 5, name.begin() + 13, [](char c) { return c >= '0' && c <= '9'; });
}

// step-*.h5 files of `dir`, newest (highest step) first.
std::vector<fs::path> step_files(const std::string& dir) {
  std::vector<fs::path> files;
  std::error_code ec;
  for (const fs::directory_entry& d : fs::directory_iterator(dir, ec))
    if (is_step_file_name(d.path().filename().string())) files.push_back(d.path());
  std::sort(files.rbegin(), files.rend());  // zero-padded steps sort by name
  return files;
}

}  // namespace

void update_latest(const std::string& dir, const std::string& path) {
  const std::string tmp = (fs::path(dir) / "latest.tmp").string(), latest = (fs::path(dir) / "latest").string();
  {
    std::ofstream out(tmp, std::ios::trunc);
    out << fs::path(path).filename().string() << "\n";
    out.flush();
    if (!out.good()) {  // `latest` still names the previous checkpoint
      const std::string why = std::strerror(errno);
      out.close();
      std::remove(tmp.c_str());
      STRATA_THROW("cannot write '", tmp, "': ", why);
    }
  }
  fsync_path(tmp, O_RDONLY);
  STRATA_CHECK(std::rename(tmp.c_str(), latest.c_str()) == 0, "cannot rename '", tmp, "' to '", latest,
               "': ", std::strerror(errno));
  fsync_path(dir, O_RDONLY | O_DIRECTORY);
}

void prune_checkpoints(const std::string& dir, int64_t keep, const std::string& newest) {
  if (keep <= 0) return;
  const std::string name = fs::path(newest).filename().string();
  int64_t kept = 0;  // of the files up to and including `newest`, newest first
  for (const fs::path& file : step_files(dir)) {
    if (file.filename().string() > name || ++kept <= keep) continue;  // zero-padded: names sort by step
    std::error_code ec;
    fs::remove(file, ec);
    if (ec) log::warn("cannot remove old checkpoint ", file.string(), ": ", ec.message());
  }
}

std::string newest_checkpoint(const std::string& dir) {
  std::vector<std::string> candidates;
  std::ifstream latest(fs::path(dir) / "latest");
  std::string name;
  if (latest >> name) {
    if (is_step_file_name(name)) {
      candidates.push_back((fs::path(dir) / name).string());
    } else {  // e.g. a path written by hand: the step files of the directory decide
      std::replace_if(
          name.begin(), name.end(), [](unsigned char c) { return c < 32 || c > 126; }, '?');
      log::warn("ignoring ", (fs::path(dir) / "latest").string(), ": it holds '", name.substr(0, 80),
                "', expected the name of a step-NNNNNNNN.h5 file in that directory");
    }
  }
  for (const fs::path& p : step_files(dir))
    if (candidates.empty() || p.string() != candidates.front()) candidates.push_back(p.string());
  for (const std::string& path : candidates) {
    try {
      CheckpointReader reader(path);
      STRATA_REQUIRE(reader.attr_int("format_version") >= 2, "checkpoint '", path,
                     "' holds no training state (format_version 1)");
      reader.verify();
      return path;
    } catch (const Error& e) {
      log::warn("skipping checkpoint: ", e.what());
    }
  }
  return {};
}

}  // namespace strata::io
