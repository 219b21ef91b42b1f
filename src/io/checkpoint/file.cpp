// Checkpoint files: atomic write (tmp + fsync + rename + directory fsync), crc32-checked reads.
#include "io/checkpoint/file.hpp"

#include <fcntl.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <sstream>

#include "core/ops.hpp"
#include "io/checkpoint/directory.hpp"

namespace strata::io {

namespace fs = std::filesystem;

namespace {

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
  const h5::Guard guard;
  h5::quiet_errors();
  file_ = h5::File(H5Fcreate(tmp_path_.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT));
  if (!file_.valid()) {  // e.g. a full disk: no half-made file stays behind (the destructor won't run)
    const std::string why = h5::last_error();
    std::remove(tmp_path_.c_str());
    STRATA_THROW("cannot create checkpoint '", tmp_path_, "' (", why, ")");
  }
  h5::write_attr(file_, "format_version", kCheckpointFormatVersion);
}

CheckpointWriter::CheckpointWriter(std::string path, Reopen) : path_(std::move(path)), tmp_path_(path_ + ".tmp") {
  const h5::Guard guard;
  h5::quiet_errors();
  file_ = h5::File(H5Fopen(tmp_path_.c_str(), H5F_ACC_RDWR, H5P_DEFAULT));
  if (!file_.valid()) {
    const std::string why = h5::last_error();
    std::remove(tmp_path_.c_str());
    STRATA_THROW("cannot reopen checkpoint '", tmp_path_, "' (", why, ")");
  }
  h5::write_attr(file_, "format_version", kCheckpointFormatVersion);
}

void CheckpointWriter::set_crc32(const std::string& name, uint32_t crc) {
  const h5::Guard guard;
  STRATA_CHECK(!committed_ && h5::exists(file_, name), "checkpoint '", tmp_path_, "' has no tensor '", name, "'");
  h5::DataSet ds(H5_CHECK(H5Dopen2(file_, name.c_str(), H5P_DEFAULT), "opening ", name));
  h5::write_attr_u32(ds, "crc32", crc);
}

CheckpointWriter::~CheckpointWriter() {
  if (committed_) return;
  file_.reset();
  std::remove(tmp_path_.c_str());  // never throws; a missing file is fine
}

void CheckpointWriter::write_tensor(const std::string& name, const Tensor& t) {
  const h5::Guard guard;
  STRATA_CHECK(!committed_, "write_tensor after commit");
  STRATA_CHECK(t.device().is_cpu(), "checkpoint tensors must be on the host; '", name, "' is on ", t.device().str());
  STRATA_CHECK(t.dtype() == DType::F32 || t.dtype() == DType::I32 || t.dtype() == DType::U8, "checkpoint tensor '",
               name, "' has unsupported dtype ", dtype_name(t.dtype()));
  STRATA_CHECK(!h5::exists(file_, name), "checkpoint tensor '", name, "' written twice");
  const hid_t file_type = t.dtype() == DType::F32   ? H5T_IEEE_F32LE
                          : t.dtype() == DType::I32 ? H5T_STD_I32LE
                                                    : H5T_STD_U8LE;
  const h5::DataSet ds = h5::create_dataset(file_, name, file_type, h5::space_of(t.shape(), name));
  H5_CHECK(H5Dwrite(ds, h5::native_type(t.dtype()), H5S_ALL, H5S_ALL, H5P_DEFAULT, t.raw()), "writing ", name, " to ",
           tmp_path_);
  h5::write_attr_u32(ds, "crc32", crc32_of(t.raw(), t.nbytes()));
}

void CheckpointWriter::set_position(const Position& p) {
  set_attr("step", p.step);
  set_attr("epoch", p.epoch);
  set_attr("step_in_epoch", p.step_in_epoch);
  set_attr("seed", p.seed);
  position_ = p;
}

void CheckpointWriter::set_attr(const std::string& name, int64_t value) { h5::write_attr(file_, name, value); }
void CheckpointWriter::set_attr(const std::string& name, double value) { h5::write_attr(file_, name, value); }
void CheckpointWriter::set_attr(const std::string& name, const std::string& value) {
  h5::write_attr(file_, name, value);
}

void CheckpointWriter::commit() {
  const h5::Guard guard;
  STRATA_CHECK(!committed_, "checkpoint '", path_, "' committed twice");
  H5_CHECK(H5Fflush(file_, H5F_SCOPE_GLOBAL), "flushing ", tmp_path_);
  H5_CHECK(H5Fclose(file_.release()), "closing ", tmp_path_);
  fsync_path(tmp_path_, O_RDONLY);
  // The manifest describes the bytes just synced; it goes into place after the file, so a crash
  // in between leaves a complete file without a manifest (loaded as an older checkpoint).
  const auto [size, crc] = file_size_and_crc32(tmp_path_);
  const std::string text = manifest_text(fs::path(path_).filename().string(), size, crc, position_);
  // A manifest of an earlier save of this step (this name is ours to write) would not describe
  // the new file: it goes first.
  std::remove(manifest_path(path_).c_str());
  STRATA_CHECK(std::rename(tmp_path_.c_str(), path_.c_str()) == 0, "cannot rename '", tmp_path_, "' to '", path_,
               "': ", std::strerror(errno));
  committed_ = true;
  write_file_durably(manifest_path(path_), text);
  // The rename is durable only once the directory entry is.
  fs::path dir = fs::path(path_).parent_path();
  fsync_path(dir.empty() ? "." : dir.string(), O_RDONLY | O_DIRECTORY);
}

// ---- reader ----------------------------------------------------------------------------------

CheckpointReader::CheckpointReader(std::string path, bool whole_file) : path_(std::move(path)) {
  h5::quiet_errors();
  std::error_code ec;
  STRATA_REQUIRE(fs::exists(path_, ec), "checkpoint '", path_, "' does not exist");
  STRATA_REQUIRE(!fs::is_directory(path_, ec), "checkpoint '", path_,
                 "' is a directory; expected a step-NNNNNNNN.h5 file (or --resume auto with --checkpoint-dir)");
  const std::optional<Manifest> manifest = check_manifest(path_, whole_file);  // before HDF5 reads a byte
  has_manifest_ = manifest.has_value();
  file_ = h5::open_readonly(path_, "checkpoint '" + path_ + "' ");
  STRATA_REQUIRE(h5::has_attr(file_, "format_version"), "'", path_,
                 "' is not a Strata checkpoint (no format_version attribute)");
  const int64_t version = attr_int("format_version");
  STRATA_REQUIRE(version >= kOldestReadableVersion && version <= kCheckpointFormatVersion, "checkpoint '", path_,
                 "' has format_version ", version, "; this build reads versions ", kOldestReadableVersion, " to ",
                 kCheckpointFormatVersion);
  if (!has_attr("step")) {
    STRATA_REQUIRE(!manifest || !manifest->position, "checkpoint '", path_,
                   "' has no step attribute but its manifest has a position");
    return;
  }
  // The position attributes: in range, the name's step, and the manifest's (which its checksum covers).
  Position p;
  p.step = attr_int("step");
  if (has_attr("epoch")) p.epoch = attr_int("epoch");
  if (has_attr("step_in_epoch")) p.step_in_epoch = attr_int("step_in_epoch");
  if (has_attr("seed")) p.seed = static_cast<uint64_t>(attr_int("seed"));
  const int64_t named = step_of_name(path_);
  STRATA_REQUIRE(named < 0 || named == p.step, "checkpoint '", path_, "' holds step ", p.step,
                 " but its name says step ", named);
  check_position_range(path_, p);
  if (manifest && manifest->position)
    STRATA_REQUIRE(p == *manifest->position, "checkpoint '", path_, "': its position attributes (step ", p.step,
                   ", epoch ", p.epoch, ", step_in_epoch ", p.step_in_epoch, ", seed ", p.seed,
                   ") differ from its manifest's (step ", manifest->position->step, ", epoch ",
                   manifest->position->epoch, ", step_in_epoch ", manifest->position->step_in_epoch, ", seed ",
                   manifest->position->seed, ")");
}

bool CheckpointReader::has(const std::string& name) const {
  const h5::Guard guard;
  if (!h5::exists(file_, name)) return false;
  H5O_info_t info;
  return H5Oget_info_by_name2(file_, name.c_str(), &info, H5O_INFO_BASIC, H5P_DEFAULT) >= 0 &&
         info.type == H5O_TYPE_DATASET;
}

h5::DataSet CheckpointReader::open_tensor(const std::string& name) const {
  const h5::Guard guard;
  STRATA_REQUIRE(has(name), "checkpoint '", path_, "' has no tensor '", name, "'");
  return h5::DataSet(H5_CHECK(H5Dopen2(file_, name.c_str(), H5P_DEFAULT), "opening ", name, " in ", path_));
}

Shape CheckpointReader::shape(const std::string& name) const {
  const h5::Guard guard;
  h5::DataSet ds = open_tensor(name);
  h5::Space space(H5_CHECK(H5Dget_space(ds), "space of ", name));
  return h5::dims(space);
}

DType CheckpointReader::dtype(const std::string& name) const {
  const h5::Guard guard;
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
  const h5::Guard guard;
  STRATA_CHECK(out.device().is_cpu(), "read_tensor needs a host tensor for '", name, "'");
  require_shape(name, out.shape());
  h5::DataSet ds = open_tensor(name);
  STRATA_REQUIRE(dtype(name) == out.dtype(), "checkpoint '", path_, "': tensor '", name, "' holds ",
                 dtype_name(dtype(name)), " but the model expects ", dtype_name(out.dtype()));
  H5_CHECK(H5Dread(ds, h5::native_type(out.dtype()), H5S_ALL, H5S_ALL, H5P_DEFAULT, out.raw()), "reading ", name,
           " from ", path_);
  STRATA_REQUIRE(h5::has_attr(ds, "crc32"), "checkpoint '", path_, "': tensor '", name, "' has no crc32 attribute");
  const auto expected = static_cast<uint32_t>(h5::read_attr_numbers(ds, "crc32").at(0));
  const uint32_t actual = crc32_of(out.raw(), out.nbytes());
  STRATA_REQUIRE(expected == actual, "checkpoint '", path_, "': tensor '", name, "' is corrupt (crc32 ", actual,
                 ", expected ", expected, ")");
}

void CheckpointReader::read_part(const std::string& name, const Shape& local, const layers::TensorSplit& split,
                                 int64_t begin, int64_t end, const Tensor& out) const {
  const h5::Guard guard;
  const Shape full = layers::full_shape(local, split);
  const int64_t n = end - begin;
  STRATA_CHECK(out.device().is_cpu() && out.dtype() == DType::F32 && out.numel() == n, "read_part of '", name,
               "' into ", out.str(), " for ", n, " elements");
  require_shape(name, full);
  if (!has_manifest_) {
    const Tensor whole = Tensor::empty(full);
    read_tensor(name, whole);
    Tensor shard = whole;
    if (split.split()) {
      shard = Tensor::empty(local);
      layers::take_shard(whole, split, shard);
    }
    if (n > 0) out.copy_from(shard.view(begin, {n}));
    return;
  }
  // A padded shard's rows past the full tensor (its tail) are not in the file: zeros.
  const int64_t stored = layers::stored_part(local, split, begin, end);
  if (stored < n) ops::fill(out.view(stored, {n - stored}), 0.0f);
  if (stored == 0) return;
  h5::DataSet ds = open_tensor(name);
  STRATA_REQUIRE(dtype(name) == DType::F32, "checkpoint '", path_, "': tensor '", name, "' holds ",
                 dtype_name(dtype(name)), " but the model expects float32");
  h5::Space space(H5_CHECK(H5Dget_space(ds), "space of ", name));
  select_part(space, local, split, begin, end);
  const auto size = static_cast<hsize_t>(stored);
  h5::Space mem(H5_CHECK(H5Screate_simple(1, &size, nullptr), "memory space"));
  H5_CHECK(H5Dread(ds, H5T_NATIVE_FLOAT, mem, space, H5P_DEFAULT, out.raw()), "reading part of ", name, " from ",
           path_);
}

void select_part(hid_t space, const Shape& local, const layers::TensorSplit& split, int64_t begin, int64_t end) {
  const h5::Guard guard;
  if (local.empty()) return;  // a scalar: its one element, selected as a whole
  H5_CHECK(H5Sselect_none(space), "empty selection");
  for (const layers::Box& box : layers::shard_boxes(local, split, begin, end)) {
    const std::vector<hsize_t> start(box.start.begin(), box.start.end()), count(box.count.begin(), box.count.end());
    H5_CHECK(H5Sselect_hyperslab(space, H5S_SELECT_OR, start.data(), nullptr, count.data(), nullptr), "selection");
  }
}

bool CheckpointReader::has_attr(const std::string& name) const { return h5::has_attr(file_, name); }

void CheckpointReader::require_attr(const std::string& name) const {
  STRATA_REQUIRE(has_attr(name), "checkpoint '", path_, "' has no attribute '", name, "'");
}

int64_t CheckpointReader::attr_int(const std::string& name) const {
  const double v = attr_double(name);
  // 2^63 is the first double past int64's range; NaN fails every comparison.
  STRATA_REQUIRE(v >= -0x1p63 && v < 0x1p63 && v == std::floor(v), "checkpoint '", path_, "': attribute '", name,
                 "' is not an integer (found ", v, ")");
  return static_cast<int64_t>(v);
}

namespace {

// An attribute HDF5 cannot read (an empty one, a damaged heap) is bad input, named as such.
template <class Read>
auto read_attr(const std::string& path, const std::string& name, Read read) {
  try {
    return read();
  } catch (const Error& e) {
    if (e.kind() == ErrorKind::Input) throw;
    STRATA_THROW_INPUT("checkpoint '", path, "': attribute '", name, "' cannot be read (", e.message(), ")");
  }
}

}  // namespace

double CheckpointReader::attr_double(const std::string& name) const {
  require_attr(name);
  const std::vector<double> values = read_attr(path_, name, [&] { return h5::read_attr_numbers(file_, name); });
  STRATA_REQUIRE(values.size() == 1, "checkpoint '", path_, "': attribute '", name, "' holds ", values.size(),
                 " values, expected one");
  return values[0];
}

std::string CheckpointReader::attr_string(const std::string& name) const {
  require_attr(name);
  return read_attr(path_, name, [&] { return h5::read_attr_string(file_, name); });
}

std::vector<std::string> CheckpointReader::list_tensors(const std::string& group) const {
  const h5::Guard guard;
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

std::vector<std::pair<std::string, std::string>> config_entries(const std::string& text) {
  std::vector<std::pair<std::string, std::string>> out;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);)
    if (const size_t eq = line.find(" = "); eq != std::string::npos)
      out.emplace_back(line.substr(0, eq), line.substr(eq + 3));
  return out;
}

}  // namespace strata::io
