// TokenDataset: validates token shards at open (attributes, tokenizer, a scan of every id),
// then serves windows of the token stream from memory or with hyperslab reads per shard.
#include "io/tokens.hpp"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <optional>

#include "io/hdf5.hpp"
#include "io/shard_files.hpp"

namespace strata::io {

namespace {

constexpr int64_t kScanChunk = int64_t{1} << 20;  // tokens per read while scanning at open

// One integer attribute of the root group.
int64_t int_attr(hid_t file, const char* name) {
  STRATA_REQUIRE(h5::has_attr(file, name), "has no root attribute '", name, "'");
  std::vector<double> v = h5::read_attr_numbers(file, name);
  STRATA_REQUIRE(v.size() == 1 && v[0] == std::floor(v[0]) && std::abs(v[0]) < 9e15, "root attribute '", name,
                 "' should be one integer");
  return static_cast<int64_t>(v[0]);
}

struct Shard {
  std::string path;
  h5::File file;
  h5::DataSet tokens;
  int64_t count = 0;
  std::string dtype;  // uint16 or uint32
};

// Opens and checks one shard's structure and attributes; the ids are scanned later. `first`: the
// first shard's tokenizer (null for the first), reused when this shard stores the same hf one.
Shard open_shard(const std::string& path, std::unique_ptr<Tokenizer>& tokenizer, const Tokenizer* first) {
  const h5::Guard guard;
  Shard s;
  s.path = path;
  s.file = h5::open_readonly(path);
  if (h5::has_attr(s.file, "kind")) {
    const std::string kind = h5::read_attr_string(s.file, "kind");
    STRATA_REQUIRE(kind == "tokens", "has kind '", kind, "'; expected 'tokens' (a token dataset)");
  }
  STRATA_REQUIRE(h5::exists(s.file, "tokens"), "has no dataset 'tokens' (expected a 1-D uint16/uint32 token array)");
  s.tokens = h5::DataSet(H5Dopen2(s.file, "tokens", H5P_DEFAULT));
  STRATA_REQUIRE(s.tokens.valid(), "'tokens' is not a dataset");
  h5::Type type(H5_REQUIRE(H5Dget_type(s.tokens), "'tokens' have an unreadable type"));
  const bool unsigned_int = H5Tget_class(type) == H5T_INTEGER && H5Tget_sign(type) == H5T_SGN_NONE;
  STRATA_REQUIRE(unsigned_int && (H5Tget_size(type) == 2 || H5Tget_size(type) == 4), "'tokens' have type ",
                 h5::type_name(type), "; expected uint16 or uint32");
  s.dtype = h5::type_name(type);
  h5::Space space(H5_REQUIRE(H5Dget_space(s.tokens), "'tokens' have an unreadable dataspace"));
  const Shape dims = h5::dims(space, "'tokens' ");
  STRATA_REQUIRE(dims.size() == 1, "'tokens' have shape ", shape_str(dims), "; expected 1-D [num_tokens]");
  h5::require_stored(s.tokens, dims, "tokens");
  s.count = dims[0];
  STRATA_REQUIRE(s.count > 0, "is empty: 'tokens' holds 0 tokens");
  if (h5::has_attr(s.file, "num_tokens")) {
    const int64_t n = int_attr(s.file, "num_tokens");
    STRATA_REQUIRE(n == s.count, "has num_tokens ", n, " but 'tokens' holds ", s.count);
  }

  const int64_t vocab = int_attr(s.file, "vocab_size");
  STRATA_REQUIRE(vocab >= 1 && vocab <= kMaxClasses, "has vocab_size ", vocab, "; expected 1..", kMaxClasses);
  const int64_t eot = int_attr(s.file, "eot");
  STRATA_REQUIRE(eot >= 0 && eot < vocab, "has eot ", eot, " outside the vocabulary [0, ", vocab, ")");
  STRATA_REQUIRE(h5::has_attr(s.file, "tokenizer"), "has no root attribute 'tokenizer' (byte, bpe, hf or external)");
  const std::string name = h5::read_attr_string(s.file, "tokenizer");
  std::unique_ptr<Tokenizer> tok;
  if (name == "byte") {
    STRATA_REQUIRE(vocab == 257 && eot == 256, "has tokenizer 'byte' with vocab_size ", vocab, " and eot ", eot,
                   "; expected 257 and 256");
    tok = std::make_unique<Tokenizer>(Tokenizer::byte_level());
  } else if (name == "bpe") {
    STRATA_REQUIRE(h5::exists(s.file, "tokenizer/merges"),
                   "has tokenizer 'bpe' but no dataset 'tokenizer/merges' (int32 [M, 2])");
    h5::DataSet merges(H5Dopen2(s.file, "tokenizer/merges", H5P_DEFAULT));
    STRATA_REQUIRE(merges.valid(), "'tokenizer/merges' is not a dataset");
    h5::Type mtype(H5_REQUIRE(H5Dget_type(merges), "'tokenizer/merges' have an unreadable type"));
    h5::Space mspace(H5_REQUIRE(H5Dget_space(merges), "'tokenizer/merges' have an unreadable dataspace"));
    const Shape mdims = h5::dims(mspace, "'tokenizer/merges' ");
    STRATA_REQUIRE(H5Tget_class(mtype) == H5T_INTEGER && mdims.size() == 2 && mdims[1] == 2, "'tokenizer/merges' is ",
                   h5::type_name(mtype), " ", shape_str(mdims), "; expected int32 [M, 2]");
    h5::require_stored(merges, mdims, "tokenizer/merges");
    std::vector<Merge> m(static_cast<size_t>(mdims[0]));
    if (!m.empty())
      H5_REQUIRE(H5Dread(merges, H5T_NATIVE_INT32, H5S_ALL, H5S_ALL, H5P_DEFAULT, m.data()),
                 "'tokenizer/merges' cannot be read");
    tok = std::make_unique<Tokenizer>(Tokenizer::bpe(std::move(m)));
    STRATA_REQUIRE(vocab == tok->vocab_size() && eot == tok->eot(), "has tokenizer 'bpe' with ", mdims[0],
                   " merges, vocab_size ", vocab, " and eot ", eot, "; expected vocab_size ", tok->vocab_size(),
                   " (257 + merges) and eot ", tok->eot(), " (256 + merges)");
  } else if (name == "hf") {
    STRATA_REQUIRE(h5::exists(s.file, "tokenizer/json"),
                   "has tokenizer 'hf' but no dataset 'tokenizer/json' (uint8 [N], the tokenizer.json text)");
    h5::DataSet json(H5Dopen2(s.file, "tokenizer/json", H5P_DEFAULT));
    STRATA_REQUIRE(json.valid(), "'tokenizer/json' is not a dataset");
    h5::Type jtype(H5_REQUIRE(H5Dget_type(json), "'tokenizer/json' has an unreadable type"));
    h5::Space jspace(H5_REQUIRE(H5Dget_space(json), "'tokenizer/json' has an unreadable dataspace"));
    const Shape jdims = h5::dims(jspace, "'tokenizer/json' ");
    STRATA_REQUIRE(H5Tget_class(jtype) == H5T_INTEGER && H5Tget_size(jtype) == 1 && jdims.size() == 1,
                   "'tokenizer/json' is ", h5::type_name(jtype), " ", shape_str(jdims), "; expected uint8 [N]");
    h5::require_stored(json, jdims, "tokenizer/json");
    std::string text(static_cast<size_t>(jdims[0]), '\0');
    if (!text.empty())
      H5_REQUIRE(H5Dread(json, H5T_NATIVE_UCHAR, H5S_ALL, H5S_ALL, H5P_DEFAULT, text.data()),
                 "'tokenizer/json' cannot be read");
    try {  // a large tokenizer.json (Llama 3's: 9 MB) is parsed once per dataset, not per shard
      const bool same = first && first->hf_json() == text && first->eot() == eot;
      tok = std::make_unique<Tokenizer>(same ? *first : Tokenizer::hf_with_eot(std::move(text), eot));
    } catch (const Error& e) {
      if (e.kind() != ErrorKind::Input) throw;
      STRATA_THROW_INPUT("has a 'tokenizer/json' that ", e.message());
    }
    STRATA_REQUIRE(vocab == tok->vocab_size(), "has tokenizer 'hf' with vocab_size ", vocab,
                   " but its tokenizer.json has ", tok->vocab_size(), " ids");
  } else if (name == "external") {
    tok = std::make_unique<Tokenizer>(Tokenizer::external(vocab, static_cast<int32_t>(eot)));
  } else {
    STRATA_THROW_INPUT("has tokenizer '", name, "'; expected byte, bpe, hf or external");
  }
  tokenizer = std::move(tok);
  return s;
}

bool same_tokenizer(const Tokenizer& a, const Tokenizer& b) {
  return a.name() == b.name() && a.vocab_size() == b.vocab_size() && a.eot() == b.eot() && a.merges() == b.merges() &&
         a.hf_json() == b.hf_json();
}

}  // namespace

struct TokenDataset::Impl {
  std::string flag, spec;
  std::unique_ptr<Tokenizer> tokenizer;
  std::vector<std::string> files, dtypes;
  std::vector<int64_t> counts;
  std::vector<int64_t> begin;  // stream offset of each shard's first token
  std::vector<Shard> shards;
  int64_t num_tokens = 0;
  bool in_memory = false;
  std::vector<uint16_t> mem16;  // the stream, when in memory and vocab_size <= 65536
  std::vector<int32_t> mem32;   // the stream, when in memory and larger

  std::string describe() const {
    return files.size() == 1 ? "'" + files[0] + "'" : std::to_string(files.size()) + " shards of '" + spec + "'";
  }
};

TokenDataset::TokenDataset(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
TokenDataset::TokenDataset(TokenDataset&&) noexcept = default;
TokenDataset& TokenDataset::operator=(TokenDataset&&) noexcept = default;
TokenDataset::~TokenDataset() = default;

int64_t TokenDataset::num_tokens() const { return impl_->num_tokens; }
int64_t TokenDataset::vocab_size() const { return impl_->tokenizer->vocab_size(); }
const Tokenizer& TokenDataset::tokenizer() const { return *impl_->tokenizer; }
const std::vector<std::string>& TokenDataset::files() const { return impl_->files; }
const std::vector<int64_t>& TokenDataset::shard_tokens() const { return impl_->counts; }
const std::vector<std::string>& TokenDataset::shard_dtypes() const { return impl_->dtypes; }
bool TokenDataset::in_memory() const { return impl_->in_memory; }

TokenDataset TokenDataset::open(const std::string& spec, const std::string& flag, const TokenDatasetOptions& options) {
  const h5::Guard guard;
  h5::quiet_errors();
  auto impl = std::make_unique<Impl>();
  impl->flag = flag;
  impl->spec = spec;
  impl->files = list_shards(spec, flag);
  for (const std::string& path : impl->files) {
    std::unique_ptr<Tokenizer> tok;
    Shard s;
    try {
      s = open_shard(path, tok, impl->tokenizer.get());
    } catch (const Error& e) {
      if (e.kind() != ErrorKind::Input) throw;
      STRATA_THROW_INPUT(flag, ": '", path, "' ", e.message());
    }
    if (!impl->tokenizer) {
      impl->tokenizer = std::move(tok);
    } else {
      const Tokenizer& t = *impl->tokenizer;
      STRATA_REQUIRE(same_tokenizer(t, *tok), flag, ": '", path, "' has tokenizer '", tok->name(), "' (vocab_size ",
                     tok->vocab_size(), ", eot ", tok->eot(), ", ", tok->merges().size(), " merges) but '",
                     impl->files[0], "' has '", t.name(), "' (vocab_size ", t.vocab_size(), ", eot ", t.eot(), ", ",
                     t.merges().size(), " merges); all shards must agree");
    }
    impl->begin.push_back(impl->num_tokens);
    const std::optional<int64_t> total = checked_mul(impl->num_tokens + s.count, 4);  // all shards, as int32
    STRATA_REQUIRE(total.has_value(), flag, ": '", path, "' brings the token count past 2^61");
    impl->num_tokens += s.count;
    impl->counts.push_back(s.count);
    impl->dtypes.push_back(s.dtype);
    impl->shards.push_back(std::move(s));
  }

  const int64_t vocab = impl->tokenizer->vocab_size();
  const bool narrow = vocab <= 65536;
  impl->in_memory = impl->num_tokens * (narrow ? 2 : 4) <= options.in_memory_limit_bytes;
  if (impl->in_memory && narrow) impl->mem16.resize(static_cast<size_t>(impl->num_tokens));
  if (impl->in_memory && !narrow) impl->mem32.resize(static_cast<size_t>(impl->num_tokens));
  // Every id is checked once here, so reads never return one outside the vocabulary.
  std::vector<uint32_t> buf;
  for (size_t k = 0; k < impl->shards.size(); ++k) {
    Shard& s = impl->shards[k];
    h5::Space fspace(
        H5_REQUIRE(H5Dget_space(s.tokens), flag, ": '", s.path, "' 'tokens' have an unreadable dataspace"));
    for (int64_t off = 0; off < s.count; off += kScanChunk) {
      const auto n = static_cast<hsize_t>(std::min(kScanChunk, s.count - off));
      const auto start = static_cast<hsize_t>(off);
      H5_CHECK(H5Sselect_hyperslab(fspace, H5S_SELECT_SET, &start, nullptr, &n, nullptr), "selecting tokens");
      h5::Space mspace(H5_CHECK(H5Screate_simple(1, &n, nullptr), "creating a dataspace"));
      buf.resize(n);
      H5_REQUIRE(H5Dread(s.tokens, H5T_NATIVE_UINT32, mspace, fspace, H5P_DEFAULT, buf.data()), flag, ": '", s.path,
                 "' 'tokens' cannot be read");
      for (size_t i = 0; i < buf.size(); ++i)
        STRATA_REQUIRE(buf[i] < static_cast<uint64_t>(vocab), flag, ": '", s.path, "' holds token ", buf[i],
                       " at index ", off + static_cast<int64_t>(i), ", >= vocab_size ", vocab);
      if (impl->in_memory) {
        const size_t at = static_cast<size_t>(impl->begin[k] + off);
        if (narrow)
          std::transform(buf.begin(), buf.end(), impl->mem16.begin() + at, [](uint32_t v) { return uint16_t(v); });
        else
          std::transform(buf.begin(), buf.end(), impl->mem32.begin() + at, [](uint32_t v) { return int32_t(v); });
      }
    }
    if (impl->in_memory) {  // the files are no longer needed
      s.tokens.reset();
      s.file.reset();
    }
  }
  return TokenDataset(std::move(impl));
}

int64_t TokenDataset::num_windows(int64_t seq_len) const {
  const Impl& d = *impl_;
  STRATA_REQUIRE(seq_len >= 1, d.flag, ": sequence length ", seq_len, " must be >= 1");
  STRATA_REQUIRE(d.num_tokens >= seq_len + 1, d.flag, ": sequence length ", seq_len, " needs at least ", seq_len + 1,
                 " tokens (inputs plus the next-token target) but ", d.describe(), " holds only ", d.num_tokens);
  return (d.num_tokens - 1) / seq_len;
}

void TokenDataset::read_window(int64_t start, int64_t length, int32_t* out) const {
  const h5::Guard guard;
  const Impl& d = *impl_;
  STRATA_CHECK(start >= 0 && length >= 0 && start + length <= d.num_tokens, "read_window [", start, ", ",
               start + length, ") outside the token stream [0, ", d.num_tokens, ")");
  if (length == 0) return;
  if (d.in_memory) {
    if (!d.mem16.empty())
      std::copy_n(d.mem16.begin() + start, length, out);
    else
      std::copy_n(d.mem32.begin() + start, length, out);
    return;
  }
  h5::quiet_errors();
  auto k = static_cast<size_t>(std::upper_bound(d.begin.begin(), d.begin.end(), start) - d.begin.begin() - 1);
  int64_t done = 0;
  while (done < length) {
    const Shard& s = d.shards[k];
    const int64_t off = start + done - d.begin[k];
    const auto n = static_cast<hsize_t>(std::min(length - done, s.count - off));
    const auto first = static_cast<hsize_t>(off);
    h5::Space fspace(
        H5_REQUIRE(H5Dget_space(s.tokens), d.flag, ": '", s.path, "' 'tokens' have an unreadable dataspace"));
    H5_CHECK(H5Sselect_hyperslab(fspace, H5S_SELECT_SET, &first, nullptr, &n, nullptr), "selecting tokens");
    h5::Space mspace(H5_CHECK(H5Screate_simple(1, &n, nullptr), "creating a dataspace"));
    H5_REQUIRE(H5Dread(s.tokens, H5T_NATIVE_INT32, mspace, fspace, H5P_DEFAULT, out + done), d.flag, ": '", s.path,
               "' 'tokens' cannot be read");
    done += static_cast<int64_t>(n);
    ++k;
  }
}

void TokenDataset::read_sample(int64_t index, int64_t seq_len, int32_t* inputs, int32_t* targets) const {
  const int64_t windows = num_windows(seq_len);
  STRATA_CHECK(index >= 0 && index < windows, "window ", index, " outside [0, ", windows, ")");
  read_window(index * seq_len, seq_len, inputs);
  read_window(index * seq_len + 1, seq_len, targets);
}

TokenWindows::TokenWindows(TokenDataset data, int64_t seq_len)
    : data_(std::move(data)), windows_(data_.num_windows(seq_len)), shape_{seq_len} {}

void TokenWindows::read(std::span<const int64_t> indices, const Tensor& x, const Tensor& y) const {
  const int64_t t = shape_[0];
  std::vector<int32_t> inputs(static_cast<size_t>(t));
  for (size_t k = 0; k < indices.size(); ++k) {
    STRATA_CHECK(indices[k] >= 0 && indices[k] < windows_, "token window ", indices[k], " outside ", windows_);
    int32_t* targets = y.data<int32_t>() + static_cast<int64_t>(k) * t;
    int32_t* in = x.defined() ? x.data<int32_t>() + static_cast<int64_t>(k) * t : inputs.data();
    data_.read_sample(indices[k], t, in, targets);
  }
}

bool is_token_dataset(const std::string& spec, const std::string& flag) {
  const h5::Guard guard;
  h5::quiet_errors();
  const std::string path = list_shards(spec, flag).front();
  if (H5Fis_hdf5(path.c_str()) <= 0) return false;
  h5::File f(H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT));
  if (!f.valid()) return false;
  if (h5::has_attr(f, "kind")) {
    try {
      return h5::read_attr_string(f, "kind") == "tokens";
    } catch (const Error&) {
      return false;
    }
  }
  return h5::exists(f, "tokens");
}

// ---- writing -------------------------------------------------------------------------------

struct TokenShardWriter::Impl {
  std::string path;
  h5::File file;
  h5::DataSet tokens;
  int64_t num_tokens = 0, written = 0, vocab = 0;
  bool closed = false;
};

TokenShardWriter::TokenShardWriter(const std::string& path, int64_t num_tokens, const Tokenizer& tokenizer)
    : impl_(std::make_unique<Impl>()) {
  const h5::Guard guard;
  h5::quiet_errors();
  STRATA_CHECK(num_tokens > 0, "TokenShardWriter: a shard needs at least one token, got ", num_tokens);
  Impl& w = *impl_;
  w.path = path;
  w.num_tokens = num_tokens;
  w.vocab = tokenizer.vocab_size();
  w.file = h5::File(H5Fcreate(path.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT));
  STRATA_REQUIRE(w.file.valid(), "cannot create '", path, "' (", h5::last_error(), ")");
  const hid_t file_type = w.vocab <= 65536 ? H5T_STD_U16LE : H5T_STD_U32LE;
  w.tokens = h5::create_dataset(w.file, "tokens", file_type, h5::space_of({num_tokens}, "tokens"));
  h5::write_attr(w.file, "kind", std::string("tokens"));
  h5::write_attr(w.file, "vocab_size", w.vocab);
  h5::write_attr(w.file, "num_tokens", num_tokens);
  h5::write_attr(w.file, "tokenizer", tokenizer.name());
  h5::write_attr(w.file, "eot", int64_t{tokenizer.eot()});
  if (tokenizer.kind() == Tokenizer::Kind::Bpe) {
    const Shape merges{static_cast<int64_t>(tokenizer.merges().size()), 2};
    const h5::DataSet m =
        h5::create_dataset(w.file, "tokenizer/merges", H5T_STD_I32LE, h5::space_of(merges, "tokenizer/merges"));
    if (!tokenizer.merges().empty())
      H5_CHECK(H5Dwrite(m, H5T_NATIVE_INT32, H5S_ALL, H5S_ALL, H5P_DEFAULT, tokenizer.merges().data()),
               "writing merges to ", path);
  }
  if (tokenizer.kind() == Tokenizer::Kind::Hf) {  // the tokenizer.json text, compressed (~4x)
    const std::string& json = tokenizer.hf_json();
    const auto n = static_cast<hsize_t>(json.size());
    h5::Space space(H5_CHECK(H5Screate_simple(1, &n, nullptr), "creating a dataspace"));
    h5::PList dcpl(H5_CHECK(H5Pcreate(H5P_DATASET_CREATE), "creating dataset properties"));
    const hsize_t chunk = std::min<hsize_t>(n, hsize_t{1} << 20);
    H5_CHECK(H5Pset_chunk(dcpl, 1, &chunk), "chunking tokenizer/json");
    H5_CHECK(H5Pset_deflate(dcpl, 6), "compressing tokenizer/json");
    h5::PList lcpl(H5_CHECK(H5Pcreate(H5P_LINK_CREATE), "creating link properties"));
    H5_CHECK(H5Pset_create_intermediate_group(lcpl, 1), "link properties");
    h5::DataSet d(H5Dcreate2(w.file, "tokenizer/json", H5T_STD_U8LE, space, lcpl, dcpl, H5P_DEFAULT));
    STRATA_CHECK(d.valid(), "creating tokenizer/json in ", path, " (", h5::last_error(), ")");
    H5_CHECK(H5Dwrite(d, H5T_NATIVE_UCHAR, H5S_ALL, H5S_ALL, H5P_DEFAULT, json.data()), "writing tokenizer/json to ",
             path);
  }
}

TokenShardWriter::~TokenShardWriter() {
  if (impl_->closed) return;
  impl_->tokens.reset();
  impl_->file.reset();
  std::error_code ec;
  std::filesystem::remove(impl_->path, ec);
}

void TokenShardWriter::write(std::span<const int32_t> tokens) {
  const h5::Guard guard;
  Impl& w = *impl_;
  STRATA_CHECK(!w.closed && w.written + static_cast<int64_t>(tokens.size()) <= w.num_tokens,
               "TokenShardWriter: ", w.written + static_cast<int64_t>(tokens.size()), " tokens written to '", w.path,
               "', sized for ", w.num_tokens);
  if (tokens.empty()) return;
  for (size_t i = 0; i < tokens.size(); ++i)
    STRATA_REQUIRE(tokens[i] >= 0 && tokens[i] < w.vocab, "token ", tokens[i], " at index ",
                   w.written + static_cast<int64_t>(i), " of '", w.path, "' is outside the vocabulary [0, ", w.vocab,
                   ")");
  const auto first = static_cast<hsize_t>(w.written), n = static_cast<hsize_t>(tokens.size());
  h5::Space fspace(H5_CHECK(H5Dget_space(w.tokens), "space of tokens in ", w.path));
  H5_CHECK(H5Sselect_hyperslab(fspace, H5S_SELECT_SET, &first, nullptr, &n, nullptr), "selecting tokens");
  h5::Space mspace(H5_CHECK(H5Screate_simple(1, &n, nullptr), "creating a dataspace"));
  H5_CHECK(H5Dwrite(w.tokens, H5T_NATIVE_INT32, mspace, fspace, H5P_DEFAULT, tokens.data()), "writing tokens to ",
           w.path);
  w.written += static_cast<int64_t>(n);
}

void TokenShardWriter::close() {
  const h5::Guard guard;
  Impl& w = *impl_;
  STRATA_CHECK(w.written == w.num_tokens, "TokenShardWriter: ", w.written, " of ", w.num_tokens, " tokens written to '",
               w.path, "'");
  w.tokens.reset();
  H5_CHECK(H5Fclose(w.file.release()), "closing ", w.path);
  w.closed = true;
}

void write_token_shard(const std::string& path, std::span<const int32_t> tokens, const Tokenizer& tokenizer) {
  TokenShardWriter w(path, static_cast<int64_t>(tokens.size()), tokenizer);
  w.write(tokens);
  w.close();
}

}  // namespace strata::io
