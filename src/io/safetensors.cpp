// safetensors reading and writing, one tensor at a time (format in safetensors.hpp).
#include "io/safetensors.hpp"

#include <algorithm>
#include <bit>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "core/dtype.hpp"
#include "core/error.hpp"

namespace strata::io {

namespace {

static_assert(std::endian::native == std::endian::little, "safetensors data is little-endian; so is this reader");

// safetensors' own limit on the header (its Rust reader refuses larger ones): a damaged length
// is refused before anything that size is allocated.
constexpr uint64_t kMaxHeaderBytes = 100'000'000;
// Conversions go through a buffer of this many elements, not a second copy of the tensor.
constexpr int64_t kChunk = int64_t{1} << 20;

void read_exact(std::FILE* f, uint64_t offset, void* out, uint64_t bytes, const std::string& path) {
  STRATA_REQUIRE(fseeko(f, static_cast<off_t>(offset), SEEK_SET) == 0 && std::fread(out, 1, bytes, f) == bytes,
                 "safetensors file '", path, "': cannot read ", bytes, " bytes at offset ", offset, " (truncated?)");
}

}  // namespace

size_t safetensors_dtype_size(const std::string& dtype) {
  static const std::map<std::string, size_t> sizes{{"F64", 8}, {"F32", 4}, {"F16", 2}, {"BF16", 2}, {"I64", 8},
                                                   {"I32", 4}, {"I16", 2}, {"I8", 1},  {"U8", 1},   {"BOOL", 1}};
  const auto it = sizes.find(dtype);
  return it == sizes.end() ? 0 : it->second;
}

// ---- reading ---------------------------------------------------------------------------------

SafetensorsReader::SafetensorsReader(std::string path) : path_(std::move(path)) {
  std::error_code ec;
  const uintmax_t file_size = std::filesystem::file_size(path_, ec);
  STRATA_REQUIRE(!ec, "safetensors file '", path_, "' cannot be read (", ec.message(), ")");
  file_ = std::fopen(path_.c_str(), "rb");
  STRATA_REQUIRE(file_ != nullptr, "safetensors file '", path_, "' cannot be opened (", std::strerror(errno), ")");
  STRATA_REQUIRE(file_size >= 8, "safetensors file '", path_, "' is ", file_size,
                 " bytes, shorter than its 8-byte header length (truncated)");
  uint64_t n = 0;
  read_exact(file_, 0, &n, 8, path_);
  STRATA_REQUIRE(n <= file_size - 8, "safetensors file '", path_, "' declares a header of ", n,
                 " bytes but holds only ", file_size - 8, " after its length (truncated or not safetensors)");
  STRATA_REQUIRE(n <= kMaxHeaderBytes, "safetensors file '", path_, "' declares a header of ", n,
                 " bytes, beyond safetensors' limit of ", kMaxHeaderBytes);
  std::string text(n, '\0');
  read_exact(file_, 8, text.data(), n, path_);
  data_start_ = 8 + n;
  const uint64_t data_bytes = file_size - data_start_;

  const nlohmann::json header = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  STRATA_REQUIRE(header.is_object(), "safetensors file '", path_, "': its header is not a JSON object");
  for (const auto& [name, entry] : header.items()) {
    if (name == "__metadata__") {
      STRATA_REQUIRE(entry.is_object(), "safetensors file '", path_, "': __metadata__ is not an object");
      for (const auto& [key, value] : entry.items())
        metadata_[key] = value.is_string() ? value.get<std::string>() : value.dump();
      continue;
    }
    const auto bad = [&](const char* what) {
      STRATA_THROW_INPUT("safetensors file '", path_, "': tensor '", name, "' has ", what);
    };
    if (!entry.is_object() || !entry.contains("dtype") || !entry.contains("shape") || !entry.contains("data_offsets"))
      bad("no dtype, shape or data_offsets");
    SafetensorInfo t;
    t.name = name;
    if (!entry["dtype"].is_string()) bad("a dtype that is not a string");
    t.dtype = entry["dtype"].get<std::string>();
    const size_t element = safetensors_dtype_size(t.dtype);
    if (element == 0) bad(("an unknown dtype " + t.dtype).c_str());
    if (!entry["shape"].is_array()) bad("a shape that is not a list");
    uint64_t numel = 1;
    for (const auto& d : entry["shape"]) {
      if (!d.is_number_unsigned()) bad("a shape with a negative or non-integer dimension");
      const uint64_t v = d.get<uint64_t>();
      if (v != 0 && numel > (uint64_t{1} << 62) / v) bad("a shape whose size overflows");
      numel *= v;
      t.shape.push_back(static_cast<int64_t>(v));
    }
    const nlohmann::json& off = entry["data_offsets"];
    if (!off.is_array() || off.size() != 2 || !off[0].is_number_unsigned() || !off[1].is_number_unsigned())
      bad("data_offsets that are not two non-negative integers");
    t.begin = off[0].get<uint64_t>();
    t.end = off[1].get<uint64_t>();
    if (t.end < t.begin || t.end - t.begin != numel * element)
      STRATA_THROW_INPUT("safetensors file '", path_, "': tensor '", name, "' has data_offsets [", t.begin, ", ", t.end,
                         "] for ", numel * element, " bytes of ", t.dtype, " ", shape_str(t.shape));
    STRATA_REQUIRE(t.end <= data_bytes, "safetensors file '", path_, "': tensor '", name, "' ends at byte ", t.end,
                   " of the data but the file holds ", data_bytes, " (truncated)");
    tensors_.push_back(std::move(t));
  }
  std::sort(tensors_.begin(), tensors_.end(), [](const auto& a, const auto& b) { return a.begin < b.begin; });
  for (size_t i = 1; i < tensors_.size(); ++i)
    STRATA_REQUIRE(tensors_[i].begin >= tensors_[i - 1].end, "safetensors file '", path_, "': tensors '",
                   tensors_[i - 1].name, "' and '", tensors_[i].name, "' overlap");
}

SafetensorsReader::~SafetensorsReader() {
  if (file_ != nullptr) std::fclose(file_);
}

const SafetensorInfo* SafetensorsReader::find(const std::string& name) const {
  for (const SafetensorInfo& t : tensors_)
    if (t.name == name) return &t;
  return nullptr;
}

Tensor SafetensorsReader::read_f32(const SafetensorInfo& t) const {
  Tensor out = Tensor::empty(t.shape, DType::F32);
  const int64_t n = out.numel();
  float* dst = out.data<float>();
  if (t.dtype == "F32") {
    read_exact(file_, data_start_ + t.begin, dst, t.end - t.begin, path_);
    return out;
  }
  STRATA_REQUIRE(t.dtype == "BF16" || t.dtype == "F16", "safetensors file '", path_, "': tensor '", t.name, "' is ",
                 t.dtype, "; expected F32, BF16 or F16");
  std::vector<uint16_t> buf(static_cast<size_t>(std::min(n, kChunk)));
  for (int64_t i = 0; i < n; i += kChunk) {
    const int64_t m = std::min(kChunk, n - i);
    read_exact(file_, data_start_ + t.begin + static_cast<uint64_t>(i) * 2, buf.data(), static_cast<uint64_t>(m) * 2,
               path_);
    for (int64_t j = 0; j < m; ++j)
      dst[i + j] = t.dtype == "BF16" ? bf16{buf[static_cast<size_t>(j)]}.to_float()
                                     : f16{buf[static_cast<size_t>(j)]}.to_float();
  }
  return out;
}

// ---- writing ---------------------------------------------------------------------------------

SafetensorsWriter::SafetensorsWriter(std::string path, std::vector<SafetensorInfo> tensors,
                                     const std::map<std::string, std::string>& metadata)
    : path_(std::move(path)), tensors_(std::move(tensors)) {
  // nlohmann's ordered_json keeps the insertion order: the header lists tensors as written.
  nlohmann::ordered_json header;
  if (!metadata.empty()) header["__metadata__"] = metadata;
  uint64_t offset = 0;
  for (SafetensorInfo& t : tensors_) {
    const size_t element = safetensors_dtype_size(t.dtype);
    STRATA_CHECK(t.dtype == "F32" || t.dtype == "BF16" || t.dtype == "F16", "cannot write dtype ", t.dtype);
    t.begin = offset;
    t.end = offset + static_cast<uint64_t>(shape_numel(t.shape)) * element;
    offset = t.end;
    header[t.name] = {{"dtype", t.dtype}, {"shape", t.shape}, {"data_offsets", {t.begin, t.end}}};
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');  // as the reference writer: data starts 8-byte aligned
  file_ = std::fopen(path_.c_str(), "wb");
  STRATA_REQUIRE(file_ != nullptr, "cannot create '", path_, "' (", std::strerror(errno), ")");
  const uint64_t n = text.size();
  STRATA_REQUIRE(std::fwrite(&n, 1, 8, file_) == 8 && std::fwrite(text.data(), 1, n, file_) == n, "cannot write '",
                 path_, "' (", std::strerror(errno), ")");
}

SafetensorsWriter::~SafetensorsWriter() {
  if (file_ != nullptr) std::fclose(file_);
}

void SafetensorsWriter::write(const Tensor& t) {
  STRATA_CHECK(next_ < tensors_.size(), "'", path_, "': more tensors written than declared");
  const SafetensorInfo& info = tensors_[next_++];
  STRATA_CHECK(t.dtype() == DType::F32 && t.device().is_cpu() && t.shape() == info.shape, "'", path_, "': tensor '",
               info.name, "' written as ", t.str(), ", declared ", shape_str(info.shape));
  const float* src = t.data<float>();
  const int64_t n = t.numel();
  bool ok = true;
  if (info.dtype == "F32") {
    ok = std::fwrite(src, 4, static_cast<size_t>(n), file_) == static_cast<size_t>(n);
  } else {
    std::vector<uint16_t> buf(static_cast<size_t>(std::min(n, kChunk)));
    for (int64_t i = 0; i < n && ok; i += kChunk) {
      const int64_t m = std::min(kChunk, n - i);
      for (int64_t j = 0; j < m; ++j)
        buf[static_cast<size_t>(j)] =
            info.dtype == "BF16" ? bf16::from_float(src[i + j]).bits : f16::from_float(src[i + j]).bits;
      ok = std::fwrite(buf.data(), 2, static_cast<size_t>(m), file_) == static_cast<size_t>(m);
    }
  }
  STRATA_REQUIRE(ok, "cannot write '", path_, "' (", std::strerror(errno), ")");
}

void SafetensorsWriter::close() {
  STRATA_CHECK(next_ == tensors_.size(), "'", path_, "': ", next_, " of ", tensors_.size(), " tensors written");
  const bool ok = std::fflush(file_) == 0;
  const bool closed = std::fclose(file_) == 0;
  file_ = nullptr;
  STRATA_REQUIRE(ok && closed, "cannot write '", path_, "' (", std::strerror(errno), ")");
}

}  // namespace strata::io
