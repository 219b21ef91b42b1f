#include "io/tensorboard.hpp"

#include <unistd.h>

#include <array>
#include <bit>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>

#include "core/error.hpp"
#include "core/log.hpp"

namespace strata::io {

namespace {

// One table of the reflected CRC, a byte at a time: event files are small, speed is no concern.
constexpr std::array<uint32_t, 256> kCrcTable = [] {
  std::array<uint32_t, 256> table{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ 0x82F63B78u : c >> 1;
    table[i] = c;
  }
  return table;
}();

// Protobuf wire format (little-endian): a field's key is (number << 3 | wire type); type 0 a
// varint, 1 eight bytes, 2 a varint length and that many bytes, 5 four bytes.
void put_varint(std::string& out, uint64_t v) {
  for (; v >= 0x80; v >>= 7) out += static_cast<char>((v & 0x7f) | 0x80);
  out += static_cast<char>(v);
}
template <typename T>
void put_fixed(std::string& out, T v) {
  const auto bits = std::bit_cast<std::array<char, sizeof(T)>>(v);
  static_assert(std::endian::native == std::endian::little, "the format is little-endian, as this host must be");
  out.append(bits.data(), bits.size());
}
void put_bytes(std::string& out, int field, std::string_view bytes) {
  put_varint(out, static_cast<uint64_t>(field) << 3 | 2);
  put_varint(out, bytes.size());
  out += bytes;
}

// A protobuf message being read: its fields one by one.
class Fields {
 public:
  Fields(std::string_view bytes, const std::string& where) : rest_(bytes), where_(where) {}
  // The next field's number and wire type; false at the end.
  bool next(int& field, int& type) {
    if (rest_.empty()) return false;
    const uint64_t key = varint();
    field = static_cast<int>(key >> 3);
    type = static_cast<int>(key & 7);
    return true;
  }
  uint64_t varint() {
    uint64_t v = 0;
    for (int shift = 0; shift < 64; shift += 7) {
      STRATA_REQUIRE(!rest_.empty(), where_, ": a varint runs past its message");
      const auto byte = static_cast<uint8_t>(rest_.front());
      rest_.remove_prefix(1);
      v |= static_cast<uint64_t>(byte & 0x7f) << shift;
      if (!(byte & 0x80)) return v;
    }
    STRATA_REQUIRE(false, where_, ": a varint longer than 10 bytes");
    return 0;
  }
  std::string_view bytes(size_t n) {
    STRATA_REQUIRE(n <= rest_.size(), where_, ": a field of ", n, " bytes runs past its message");
    const std::string_view b = rest_.substr(0, n);
    rest_.remove_prefix(n);
    return b;
  }
  std::string_view length_delimited() { return bytes(varint()); }
  template <typename T>
  T fixed() {
    std::array<char, sizeof(T)> b;
    std::memcpy(b.data(), bytes(sizeof(T)).data(), sizeof(T));
    return std::bit_cast<T>(b);
  }
  // Skips a field this reader does not know.
  void skip(int type) {
    STRATA_REQUIRE(type == 0 || type == 1 || type == 2 || type == 5, where_, ": wire type ", type,
                   " (a group) in an Event");
    if (type == 0)
      varint();
    else if (type == 2)
      length_delimited();
    else
      bytes(type == 1 ? 8 : 4);
  }

 private:
  std::string_view rest_;
  const std::string& where_;
};

TensorBoardEvent decode_event(std::string_view data, const std::string& where) {
  TensorBoardEvent event;
  Fields f(data, where);
  for (int field, type; f.next(field, type);) {
    if (field == 1 && type == 1) {
      event.wall_time = f.fixed<double>();
    } else if (field == 2 && type == 0) {
      event.step = static_cast<int64_t>(f.varint());
    } else if (field == 3 && type == 2) {
      event.file_version = f.length_delimited();
    } else if (field == 5 && type == 2) {  // Summary: repeated Value value = 1
      Fields summary(f.length_delimited(), where);
      for (int sf, st; summary.next(sf, st);) {
        if (sf != 1 || st != 2) {
          summary.skip(st);
          continue;
        }
        TensorBoardScalar scalar;
        Fields value(summary.length_delimited(), where);
        for (int vf, vt; value.next(vf, vt);) {
          if (vf == 1 && vt == 2)
            scalar.tag = value.length_delimited();
          else if (vf == 2 && vt == 5)
            scalar.value = value.fixed<float>();
          else
            value.skip(vt);  // images, histograms, tensors, metadata: not scalars
        }
        event.scalars.push_back(std::move(scalar));
      }
    } else if (field == 7 && type == 2) {  // SessionLog: status = 1
      Fields log(f.length_delimited(), where);
      for (int lf, lt; log.next(lf, lt);) {
        if (lf == 1 && lt == 0)
          event.session_status = static_cast<int>(log.varint());
        else
          log.skip(lt);
      }
    } else if (field == 10 && type == 2) {  // SourceMetadata: writer = 1
      Fields source(f.length_delimited(), where);
      for (int sf, st; source.next(sf, st);) {
        if (sf == 1 && st == 2)
          event.writer = source.length_delimited();
        else
          source.skip(st);
      }
    } else {
      f.skip(type);
    }
  }
  return event;
}

std::string hostname() {
  char name[256] = "localhost";
  gethostname(name, sizeof name - 1);
  return name;
}

}  // namespace

uint32_t crc32c(const void* data, size_t size, uint32_t crc) {
  const auto* p = static_cast<const uint8_t*>(data);
  crc = ~crc;
  for (size_t i = 0; i < size; ++i) crc = kCrcTable[(crc ^ p[i]) & 0xff] ^ (crc >> 8);
  return ~crc;
}

uint32_t masked_crc32c(const void* data, size_t size) {
  const uint32_t crc = crc32c(data, size);
  return ((crc >> 15) | (crc << 17)) + 0xa282ead8u;
}

std::string encode_event(const TensorBoardEvent& e) {
  // proto3: a wall_time or step of 0 is not written; the member of the `what` oneof always is.
  std::string out;
  if (e.wall_time != 0) {
    put_varint(out, 1 << 3 | 1);
    put_fixed(out, e.wall_time);
  }
  if (e.step != 0) {
    put_varint(out, 2 << 3 | 0);
    put_varint(out, static_cast<uint64_t>(e.step));
  }
  if (!e.file_version.empty()) {
    put_bytes(out, 3, e.file_version);
  } else if (e.session_status != 0) {
    std::string log;
    put_varint(log, 1 << 3 | 0);
    put_varint(log, static_cast<uint64_t>(e.session_status));
    put_bytes(out, 7, log);
  } else {
    std::string summary;
    for (const TensorBoardScalar& s : e.scalars) {
      std::string value;
      put_bytes(value, 1, s.tag);
      put_varint(value, 2 << 3 | 5);  // simple_value, in a oneof: written even when 0
      put_fixed(value, s.value);
      put_bytes(summary, 1, value);
    }
    put_bytes(out, 5, summary);
  }
  if (!e.writer.empty()) {  // SourceMetadata: writer = 1
    std::string source;
    put_bytes(source, 1, e.writer);
    put_bytes(out, 10, source);
  }
  return out;
}

std::string tf_record(std::string_view data) {
  std::string out;
  put_fixed<uint64_t>(out, data.size());
  put_fixed(out, masked_crc32c(out.data(), 8));
  out += data;
  put_fixed(out, masked_crc32c(data.data(), data.size()));
  return out;
}

std::vector<TensorBoardEvent> read_tensorboard_events(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  STRATA_REQUIRE(in.good(), "cannot read '", path, "': ", std::strerror(errno));
  const std::string bytes{std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
  std::vector<TensorBoardEvent> events;
  for (size_t at = 0; at < bytes.size();) {
    const std::string where = path + " at byte " + std::to_string(at);
    const size_t left = bytes.size() - at;
    STRATA_REQUIRE(left >= 12, where, ": a truncated record (", left, " bytes)");
    Fields record(std::string_view(bytes).substr(at), where);
    const std::string_view header = record.bytes(8);
    STRATA_REQUIRE(record.fixed<uint32_t>() == masked_crc32c(header.data(), 8), where,
                   ": the record's length fails its CRC");
    uint64_t length = 0;
    std::memcpy(&length, header.data(), 8);
    STRATA_REQUIRE(left >= 16 && length <= left - 16, where, ": a record of ", length, " bytes is truncated (", left,
                   " bytes left)");
    const std::string_view data = record.bytes(length);
    STRATA_REQUIRE(record.fixed<uint32_t>() == masked_crc32c(data.data(), data.size()), where,
                   ": the record's data fails its CRC");
    events.push_back(decode_event(data, where));
    at += 16 + length;
  }
  return events;
}

TensorBoardWriter::TensorBoardWriter(const std::string& dir, std::optional<int64_t> continues_from) {
  namespace fs = std::filesystem;
  std::error_code ec;
  fs::create_directories(dir, ec);
  STRATA_REQUIRE(!ec, "--tensorboard: cannot create the directory '", dir, "': ", ec.message());
  const auto now = std::chrono::system_clock::now().time_since_epoch();
  char name[64];
  std::snprintf(name, sizeof name, "events.out.tfevents.%010lld.",
                static_cast<long long>(std::chrono::duration_cast<std::chrono::seconds>(now).count()));
  const std::string base = (fs::path(dir) / name).string() + hostname() + "." + std::to_string(getpid());
  for (int n = 0; !file_; ++n) {
    path_ = n == 0 ? base : base + "." + std::to_string(n);
    file_.reset(std::fopen(path_.c_str(), "wbx"));  // x: never another writer's file
    STRATA_REQUIRE(file_ || errno == EEXIST, "--tensorboard: cannot write '", path_, "': ", std::strerror(errno));
  }
  std::setvbuf(file_.get(), nullptr, _IONBF, 0);  // a record goes to the OS whole, or what failed of it is dropped
  TensorBoardEvent version;
  version.file_version = "brain.Event:2";
  version.writer = "strata";
  // TensorBoard's readers take a directory's first START for the start of its first run, and
  // each later one for a restart: every run writes one, so a resumed run's counts as a restart.
  TensorBoardEvent start;
  start.session_status = kSessionStart;
  if (continues_from) start.step = *continues_from + 1;
  STRATA_REQUIRE(put(version) && (!continues_from || put(start)), "--tensorboard: cannot write '", path_,
                 "': ", std::strerror(errno));
}

void TensorBoardWriter::write(const TensorBoardEvent& event) {
  // After a failed write the file may end in part of a record, which readers take for the end:
  // what follows would never be read.
  if (lost_) return;
  if (!put(event)) {  // the curves are lost, not the training: warn once, go on
    lost_ = true;
    log::warn("--tensorboard: cannot write '", path_, "' (", std::strerror(errno), "): its events are being lost");
  }
}

bool TensorBoardWriter::put(TensorBoardEvent event) {
  if (event.wall_time == 0)
    event.wall_time = std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
  // Unbuffered: the whole record goes to the OS now, so a reader never waits on our buffer.
  const std::string record = tf_record(encode_event(event));
  return std::fwrite(record.data(), 1, record.size(), file_.get()) == record.size();
}

}  // namespace strata::io
