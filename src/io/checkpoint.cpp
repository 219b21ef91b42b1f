// Checkpoint files: atomic write (tmp + fsync + rename + directory fsync), crc32-checked reads.
#include "io/checkpoint.hpp"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <type_traits>

#include "core/log.hpp"
#include "io/training_state.hpp"

namespace strata::io {

namespace fs = std::filesystem;

void fsync_path(const std::string& path, int flags) {
  int fd = ::open(path.c_str(), flags);
  STRATA_CHECK(fd >= 0, "cannot open '", path, "' to sync it: ", std::strerror(errno));
  const int rc = ::fsync(fd);
  const int err = errno;
  ::close(fd);
  STRATA_CHECK(rc == 0, "fsync of '", path, "' failed: ", std::strerror(err));
}

namespace {

uint32_t crc32_of(const Tensor& t) {
  return static_cast<uint32_t>(
      crc32_z(crc32_z(0L, Z_NULL, 0), static_cast<const Bytef*>(t.raw()), static_cast<z_size_t>(t.nbytes())));
}

// "model/conv1/weight" from a visit of group "/model" reporting "conv1/weight".
std::string join(const std::string& group, const char* name) {
  std::string g = group;
  while (!g.empty() && g.front() == '/') g.erase(0, 1);
  while (!g.empty() && g.back() == '/') g.pop_back();
  return g.empty() ? std::string(name) : g + "/" + name;
}

// step-NNNNNNNN.h5, the names checkpoint_path gives.
bool is_step_file_name(const std::string& name) {
  return name.size() == 16 && name.starts_with("step-") && name.ends_with(".h5") &&
         std::all_of(name.begin() + 5, name.begin() + 13, [](char c) { return c >= '0' && c <= '9'; });
}

constexpr int kManifestVersion = 1;

// The position lines of a manifest; their crc32 is stored too, so an edited value is seen.
std::string position_text(const Position& p) {
  return detail::cat("step ", p.step, "\nepoch ", p.epoch, "\nstep_in_epoch ", p.step_in_epoch, "\nseed ", p.seed,
                     "\n");
}

uint32_t crc32_of_text(const std::string& text) {
  return static_cast<uint32_t>(
      crc32_z(crc32_z(0L, Z_NULL, 0), reinterpret_cast<const Bytef*>(text.data()), static_cast<z_size_t>(text.size())));
}

// Text from a damaged manifest as it may appear inside an error line: bytes outside printable
// ASCII (a CR, a form feed) as \xNN, so that the line stays one line on any terminal.
std::string printable(const std::string& text) {
  std::string out;
  for (const unsigned char c : text) {
    if (c >= 0x20 && c < 0x7f) {
      out += static_cast<char>(c);
    } else {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\x%02x", c);
      out += buf;
    }
  }
  return out;
}

std::string hex32(uint32_t v) {
  char buf[16];
  std::snprintf(buf, sizeof buf, "%08x", v);
  return buf;
}

// Steps count from 0; an epoch and a step within it take at least one step each.
void check_position_range(const std::string& path, const Position& p) {
  STRATA_REQUIRE(p.step >= 0 && p.epoch >= 0 && p.epoch <= p.step && p.step_in_epoch >= 0 && p.step_in_epoch <= p.step,
                 "checkpoint '", path, "' has an impossible position: step ", p.step, ", epoch ", p.epoch,
                 ", step_in_epoch ", p.step_in_epoch, " (expected 0 <= epoch, step_in_epoch <= step)");
}

// The step in a step-NNNNNNNN.h5 name; -1 for other names.
int64_t step_of_name(const std::string& path) {
  const std::string name = fs::path(path).filename().string();
  return is_step_file_name(name) ? std::stoll(name.substr(5, 8)) : -1;
}

// Writes `text` to `path` durably: path.tmp, fsync, rename (the caller fsyncs the directory).
void write_file_durably(const std::string& path, const std::string& text) {
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::trunc);
    out << text;
    out.flush();
    if (!out.good()) {
      const std::string why = std::strerror(errno);
      out.close();
      std::remove(tmp.c_str());
      STRATA_THROW("cannot write '", tmp, "': ", why);
    }
  }
  fsync_path(tmp, O_RDONLY);
  STRATA_CHECK(std::rename(tmp.c_str(), path.c_str()) == 0, "cannot rename '", tmp, "' to '", path,
               "': ", std::strerror(errno));
}

}  // namespace

// ---- manifest --------------------------------------------------------------------------------

std::string manifest_path(const std::string& checkpoint) { return checkpoint + ".manifest"; }

std::pair<int64_t, uint32_t> file_size_and_crc32(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  STRATA_REQUIRE(in.good(), "cannot read '", path, "': ", std::strerror(errno));
  std::vector<char> block(1 << 20);
  uLong crc = crc32_z(0L, Z_NULL, 0);
  int64_t size = 0;
  while (in) {
    in.read(block.data(), static_cast<std::streamsize>(block.size()));
    const auto n = static_cast<size_t>(in.gcount());
    crc = crc32_z(crc, reinterpret_cast<const Bytef*>(block.data()), n);
    size += static_cast<int64_t>(n);
  }
  STRATA_REQUIRE(in.eof(), "cannot read '", path, "': ", std::strerror(errno));
  return {size, static_cast<uint32_t>(crc)};
}

std::optional<Manifest> check_manifest(const std::string& checkpoint, bool whole_file) {
  const std::string mpath = manifest_path(checkpoint);
  std::ifstream in(mpath);
  if (!in) return std::nullopt;
  // "key value" lines; every key of version 1 is required (position: all or none).
  std::vector<std::pair<std::string, std::string>> lines;
  for (std::string line; std::getline(in, line);) {
    std::istringstream fields(line);
    std::string key, value, extra;
    STRATA_REQUIRE(fields >> key >> value && !(fields >> extra), "manifest '", mpath, "' has a malformed line '",
                   printable(line.substr(0, 80)), "'; expected 'key value'");
    lines.emplace_back(key, value);
  }
  const auto get = [&](const std::string& key, bool required) -> std::optional<std::string> {
    for (const auto& [k, v] : lines)
      if (k == key) return v;
    STRATA_REQUIRE(!required, "manifest '", mpath, "' has no '", key, "' line");
    return std::nullopt;
  };
  // strtoll for every key but the seed, whose whole uint64 range is valid: strtoull, and no
  // sign (strtoull would wrap "-1"). std::stoull would throw std::invalid_argument: exit 1.
  const auto parse = [&](const std::string& key, int base, auto strto) {
    const std::string text = *get(key, true);
    char* end = nullptr;
    errno = 0;
    const auto v = strto(text.c_str(), &end, base);
    const bool sign_ok = std::is_signed_v<decltype(v)> || text[0] != '-';
    STRATA_REQUIRE(errno == 0 && end != text.c_str() && *end == '\0' && sign_ok, "manifest '", mpath, "': '", key,
                   "' is not a number (found '", printable(text.substr(0, 40)), "')");
    return v;
  };
  const auto number = [&](const std::string& key, int base = 10) {
    return static_cast<int64_t>(parse(key, base, std::strtoll));
  };
  STRATA_REQUIRE(get("strata-checkpoint-manifest", true) == std::to_string(kManifestVersion), "manifest '", mpath,
                 "' has version ", printable(*get("strata-checkpoint-manifest", true)), "; this build reads version ",
                 kManifestVersion);
  Manifest m;
  m.file = *get("file", true);
  m.size = number("size");
  m.crc32 = static_cast<uint32_t>(number("crc32", 16));
  const std::string name = fs::path(checkpoint).filename().string();
  STRATA_REQUIRE(m.file == name, "checkpoint '", checkpoint, "': its manifest describes '", printable(m.file),
                 "', not '", name, "'");
  if (get("step", false)) {
    Position p;
    p.step = number("step");
    p.epoch = number("epoch");
    p.step_in_epoch = number("step_in_epoch");
    p.seed = static_cast<uint64_t>(parse("seed", 10, std::strtoull));
    STRATA_REQUIRE(static_cast<uint32_t>(number("position_crc32", 16)) == crc32_of_text(position_text(p)),
                   "checkpoint '", checkpoint, "': its manifest's position fails its checksum (edited?)");
    check_position_range(checkpoint, p);
    const int64_t named = step_of_name(checkpoint);
    STRATA_REQUIRE(named < 0 || named == p.step, "checkpoint '", checkpoint, "': its manifest says step ", p.step,
                   ", its name step ", named);
    m.position = p;
  }
  // The whole file, before HDF5 reads any of it.
  std::error_code ec;
  const auto size = static_cast<int64_t>(fs::file_size(checkpoint, ec));
  STRATA_REQUIRE(!ec && size == m.size, "checkpoint '", checkpoint, "' has ", ec ? -1 : size,
                 " bytes, its manifest says ", m.size, " (truncated or replaced?)");
  if (!whole_file) return m;
  const uint32_t crc = file_size_and_crc32(checkpoint).second;
  STRATA_REQUIRE(crc == m.crc32, "checkpoint '", checkpoint, "' is corrupt: whole-file crc32 ", hex32(crc),
                 ", its manifest says ", hex32(m.crc32));
  return m;
}

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
  h5::write_attr_u32(ds, "crc32", crc32_of(t));
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
  std::string text = detail::cat("strata-checkpoint-manifest ", kManifestVersion, "\nfile ",
                                 fs::path(path_).filename().string(), "\nsize ", size, "\ncrc32 ", hex32(crc), "\n");
  if (position_)
    text += position_text(*position_) + "position_crc32 " + hex32(crc32_of_text(position_text(*position_))) + "\n";
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
  const uint32_t actual = crc32_of(out);
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
  if (n == 0) return;
  h5::DataSet ds = open_tensor(name);
  STRATA_REQUIRE(dtype(name) == DType::F32, "checkpoint '", path_, "': tensor '", name, "' holds ",
                 dtype_name(dtype(name)), " but the model expects float32");
  h5::Space space(H5_CHECK(H5Dget_space(ds), "space of ", name));
  select_part(space, local, split, begin, end);
  const auto size = static_cast<hsize_t>(n);
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
  // On failure `latest` still names the previous checkpoint.
  write_file_durably((fs::path(dir) / "latest").string(), fs::path(path).filename().string() + "\n");
  fsync_path(dir, O_RDONLY | O_DIRECTORY);
}

void prune_checkpoints(std::vector<std::string>& written, int64_t keep) {
  if (keep <= 0 || static_cast<int64_t>(written.size()) <= keep) return;
  const auto old_end = written.end() - keep;
  for (auto it = written.begin(); it != old_end; ++it)
    for (const std::string& file : {manifest_path(*it), *it}) {  // the manifest first: no orphan file stays checked
      std::error_code ec;
      fs::remove(file, ec);
      if (ec) log::warn("cannot remove old checkpoint ", file, ": ", ec.message());
    }
  written.erase(written.begin(), old_end);
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
      CheckpointReader reader(path);  // the manifest first: a damaged file is never parsed
      STRATA_REQUIRE(reader.attr_int("format_version") >= 2, "checkpoint '", path,
                     "' holds no training state (format_version 1)");
      read_run_state(reader);
      if (!reader.has_manifest()) reader.verify();  // else the whole-file crc32 has covered every byte
      return path;
    } catch (const std::exception& e) {  // whatever the damage, the next older one may be good
      log::warn("skipping checkpoint ", path, ": ", e.what());
    }
  }
  return {};
}

// ---- directory lock --------------------------------------------------------------------------

DirectoryLock::DirectoryLock(const std::string& dir) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  STRATA_REQUIRE(!ec, "--checkpoint-dir: cannot create '", dir, "': ", ec.message());
  const std::string path = (fs::path(dir) / ".lock").string();
  fd_ = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  STRATA_REQUIRE(fd_ >= 0, "--checkpoint-dir: cannot open '", path, "': ", std::strerror(errno));
  if (::flock(fd_, LOCK_EX | LOCK_NB) != 0) {
    const int err = errno;
    std::ifstream in(path);
    std::string holder;
    std::getline(in, holder);
    ::close(fd_);
    fd_ = -1;
    STRATA_REQUIRE(err != EWOULDBLOCK, "--checkpoint-dir ", dir, " is in use by another job (",
                   holder.empty() ? "holder unknown" : holder, "); one job per checkpoint directory");
    STRATA_THROW_INPUT("--checkpoint-dir: cannot lock '", path, "': ", std::strerror(err));
  }
  char host[256] = "?";
  ::gethostname(host, sizeof host - 1);
  const char* job = std::getenv("SLURM_JOB_ID");
  const std::string text =
      detail::cat("host ", host, " pid ", ::getpid(), job ? detail::cat(" slurm_job ", job) : std::string(), "\n");
  // The holder's name is informative only: the lock is the flock, not the content.
  if (::ftruncate(fd_, 0) != 0 || ::pwrite(fd_, text.data(), text.size(), 0) != static_cast<ssize_t>(text.size()))
    log::warn("cannot write the holder into ", path, ": ", std::strerror(errno));
  // A *.tmp here is a write that a killed job (SIGKILL, a second signal) never finished. No job
  // deletes a file it did not create (#19), so the user hears of it, once, with its size.
  for (const fs::directory_entry& entry : fs::directory_iterator(dir, ec)) {
    if (entry.path().extension() != ".tmp" || !entry.is_regular_file(ec)) continue;
    log::info("note: ", entry.path().string(), " (", entry.file_size(ec),
              " bytes) is an unfinished write of an earlier job; it is never read, and may be removed");
  }
}

DirectoryLock::~DirectoryLock() {
  if (fd_ >= 0) ::close(fd_);  // releases the flock; the file stays (removing it would race a new holder)
}

}  // namespace strata::io
