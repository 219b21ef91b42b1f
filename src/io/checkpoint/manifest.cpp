// Manifests: their text, their parsing and checks (position checksum and ranges, size, whole-file
// crc32), and the durable writes (fsync, tmp + rename) the checkpoint files share.
#include "io/checkpoint/manifest.hpp"

#include <fcntl.h>
#include <unistd.h>
#include <zlib.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <type_traits>
#include <vector>

#include "core/error.hpp"
#include "io/checkpoint/directory.hpp"

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

uint32_t crc32_of(const void* data, size_t bytes) {
  return static_cast<uint32_t>(
      crc32_z(crc32_z(0L, Z_NULL, 0), static_cast<const Bytef*>(data), static_cast<z_size_t>(bytes)));
}

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

void check_position_range(const std::string& path, const Position& p) {
  STRATA_REQUIRE(p.step >= 0 && p.epoch >= 0 && p.epoch <= p.step && p.step_in_epoch >= 0 && p.step_in_epoch <= p.step,
                 "checkpoint '", path, "' has an impossible position: step ", p.step, ", epoch ", p.epoch,
                 ", step_in_epoch ", p.step_in_epoch, " (expected 0 <= epoch, step_in_epoch <= step)");
}

namespace {

constexpr int kManifestVersion = 1;

// The position lines of a manifest; their crc32 is stored too, so an edited value is seen.
std::string position_text(const Position& p) {
  return detail::cat("step ", p.step, "\nepoch ", p.epoch, "\nstep_in_epoch ", p.step_in_epoch, "\nseed ", p.seed,
                     "\n");
}

uint32_t crc32_of_text(const std::string& text) { return crc32_of(text.data(), text.size()); }

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

}  // namespace

std::string manifest_path(const std::string& checkpoint) { return checkpoint + ".manifest"; }

std::string manifest_text(const std::string& file, int64_t size, uint32_t crc32,
                          const std::optional<Position>& position) {
  std::string text = detail::cat("strata-checkpoint-manifest ", kManifestVersion, "\nfile ", file, "\nsize ", size,
                                 "\ncrc32 ", hex32(crc32), "\n");
  if (position)
    text += position_text(*position) + "position_crc32 " + hex32(crc32_of_text(position_text(*position))) + "\n";
  return text;
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

}  // namespace strata::io
