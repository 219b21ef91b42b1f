// strata-data's token commands: tokenize text files, import llm.c / nanoGPT .bin shards, and
// describe a token dataset (formats in docs/formats.md, "Token datasets").
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <limits>
#include <optional>
#include <sstream>

#include "core/error.hpp"
#include "data_tool.hpp"
#include "io/dataset.hpp"
#include "io/hf_bpe.hpp"
#include "io/tokenizer.hpp"
#include "io/tokens.hpp"

namespace strata::data_tool {

// ---- token datasets --------------------------------------------------------------------------

namespace {

// The files --input names, in order: a file itself; a directory, its regular files directly
// inside (only those ending in `ext` when given), sorted by name.
std::vector<std::string> list_inputs(const std::vector<std::string>& inputs, const std::string& ext) {
  namespace fs = std::filesystem;
  std::vector<std::string> files;
  for (const std::string& in : inputs) {
    std::error_code ec;
    if (fs::is_directory(in, ec)) {
      std::vector<std::string> found;
      for (const auto& e : fs::directory_iterator(in, ec))
        if (e.is_regular_file(ec) && (ext.empty() || e.path().extension() == ext)) found.push_back(e.path().string());
      STRATA_REQUIRE(!found.empty(), "--input: directory '", in, "' holds no regular ", ext.empty() ? "" : ext + " ",
                     "files");
      std::sort(found.begin(), found.end());
      files.insert(files.end(), found.begin(), found.end());
    } else {
      STRATA_REQUIRE(fs::is_regular_file(in, ec), "--input: '", in,
                     fs::exists(in, ec) ? "' is not a regular file or directory" : "' does not exist");
      files.push_back(in);
    }
  }
  return files;
}

std::string read_text_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  STRATA_REQUIRE(in.good(), "--input: cannot open '", path, "'");
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  STRATA_REQUIRE(!in.bad(), "--input: cannot read '", path, "'");
  return text;
}

// `--tokenizer hf:PATH`: a Hugging Face tokenizer.json; eot_token names the end-of-text token
// ("" for <|endoftext|> or <|end_of_text|>).
io::Tokenizer load_hf(const std::string& spec, const std::string& eot_token) {
  namespace fs = std::filesystem;
  const std::string path = spec.substr(3);
  std::error_code ec;
  STRATA_REQUIRE(fs::is_regular_file(path, ec), "--tokenizer: '", path,
                 fs::exists(path, ec) ? "' is not a regular file" : "' does not exist");
  std::ifstream in(path, std::ios::binary);
  std::string json((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  STRATA_REQUIRE(in.good() || in.eof(), "--tokenizer: cannot read '", path, "'");
  try {
    return io::Tokenizer::hf(std::move(json), eot_token);
  } catch (const Error& e) {
    if (e.kind() != ErrorKind::Input) throw;
    STRATA_THROW_INPUT("--tokenizer: '", path, "' ", e.message());
  }
}

bool is_hf(const std::string& spec) { return spec.rfind("hf:", 0) == 0; }

}  // namespace

int tokenize(const std::vector<std::string>& args) {
  std::vector<std::string> inputs;
  std::string out, kind, eot_token;
  int64_t vocab = 0;
  double val_fraction = 0.1;
  int shards = 1;
  po::options_description desc("tokenize options");
  desc.add_options()("input", po::value(&inputs)->multitoken()->required(),
                     "text files, or directories (every regular file inside, sorted); each file is one document")(
      "out", po::value(&out)->required(), "output prefix: PREFIX-train*.h5 and PREFIX-val.h5")(
      "tokenizer", po::value(&kind)->required(),
      "byte, bpe, or hf:PATH (a Hugging Face byte-level BPE tokenizer.json)")(
      "vocab-size", po::value(&vocab), "bpe: ids in all, 257 + merges (byte: 257)")(
      "eot-token", po::value(&eot_token),
      "hf: the token that ends each document (<|endoftext|>, else <|end_of_text|>)")(
      "val-fraction", po::value(&val_fraction), "the last F of the token stream becomes PREFIX-val.h5 (0.1)")(
      "shards", po::value(&shards), "training shards (1)");
  parse(args, desc);
  STRATA_REQUIRE(kind == "byte" || kind == "bpe" || is_hf(kind), "--tokenizer: expected byte, bpe or hf:PATH, found '",
                 kind, "'");
  STRATA_REQUIRE(eot_token.empty() || is_hf(kind), "--eot-token: only for --tokenizer hf:PATH");
  STRATA_REQUIRE(val_fraction >= 0 && val_fraction < 1, "--val-fraction: expected 0 <= F < 1, found ", val_fraction);
  STRATA_REQUIRE(shards >= 1, "--shards: expected >= 1, found ", shards);
  if (kind == "byte")
    STRATA_REQUIRE(vocab == 0 || vocab == 257,
                   "--vocab-size: the byte tokenizer has 257 ids (256 bytes and end-of-text), found ", vocab);
  else if (is_hf(kind))
    STRATA_REQUIRE(vocab == 0, "--vocab-size: an hf tokenizer's vocabulary is its tokenizer.json's, found ", vocab);
  else
    STRATA_REQUIRE(vocab >= 257,
                   "--vocab-size: --tokenizer bpe needs N >= 257 (256 bytes, N - 257 merges, "
                   "end-of-text), found ",
                   vocab);
  io::Tokenizer tok = is_hf(kind) ? load_hf(kind, eot_token) : io::Tokenizer::byte_level();
  prepare_prefix(out);

  const std::vector<std::string> files = list_inputs(inputs, "");
  std::vector<std::string> outputs;
  for (int s = 0; s < shards; ++s) outputs.push_back(io::shard_path(out + "-train", s, shards));
  if (val_fraction > 0) outputs.push_back(out + "-val.h5");
  check_inputs(files, outputs);
  std::vector<std::string> docs;
  int64_t bytes = 0;
  for (const auto& f : files) {
    docs.push_back(read_text_file(f));
    bytes += static_cast<int64_t>(docs.back().size());
  }
  STRATA_REQUIRE(bytes > 0, "--input: the ", files.size(), " file(s) hold no text (0 bytes)");

  if (kind == "bpe") {
    // Merges are learned from the first (1 - F) of the bytes, so the validation split (the
    // last F of the tokens) is text the tokenizer has not seen, up to rounding at the cut.
    int64_t budget = bytes - static_cast<int64_t>(std::floor(static_cast<double>(bytes) * val_fraction));
    std::vector<std::string_view> train_text;
    for (const auto& d : docs) {
      if (budget <= 0) break;
      train_text.emplace_back(d.data(), static_cast<size_t>(std::min<int64_t>(budget, std::ssize(d))));
      budget -= static_cast<int64_t>(train_text.back().size());
    }
    io::BpeTrainStats st;
    tok = io::Tokenizer::train_bpe(train_text, vocab, &st);
    std::printf("bpe: %lld merges learned from %lld bytes in %.2f s%s; vocab_size %lld, eot %d\n",
                static_cast<long long>(st.merges), static_cast<long long>(st.bytes), st.seconds,
                st.merges < vocab - 257 ? " (no pair occurs twice beyond that)" : "",
                static_cast<long long>(tok.vocab_size()), tok.eot());
  }

  // Every document is followed by eot.
  std::vector<int32_t> stream;
  stream.reserve(static_cast<size_t>(bytes) + docs.size());
  const auto t0 = std::chrono::steady_clock::now();
  for (const auto& d : docs) {
    tok.encode_append(d, stream);
    stream.push_back(tok.eot());
  }
  const double encode_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  docs.clear();
  const auto n = static_cast<int64_t>(stream.size());
  const auto n_val = static_cast<int64_t>(std::floor(static_cast<double>(n) * val_fraction));
  const int64_t n_train = n - n_val;
  STRATA_REQUIRE(val_fraction == 0 || n_val >= 1, "--val-fraction: ", val_fraction, " of ", n,
                 " tokens is less than one token (use 0 for no validation split)");
  STRATA_REQUIRE(n_train >= shards, "--shards: ", shards, " shards need a token each but the training split holds ",
                 n_train);
  int64_t begin = 0;
  const auto sizes = shard_sizes(n_train, shards);
  OutputFiles written;
  for (int s = 0; s < shards; ++s) {
    const int64_t size = sizes[static_cast<size_t>(s)];
    const std::string path = written.add(outputs[static_cast<size_t>(s)]);
    io::write_token_shard(path, std::span(stream).subspan(static_cast<size_t>(begin), static_cast<size_t>(size)), tok);
    std::cout << path << ": " << size << " tokens\n";
    begin += size;
  }
  if (n_val > 0) {
    const std::string path = written.add(outputs.back());
    io::write_token_shard(path, std::span(stream).subspan(static_cast<size_t>(n_train)), tok);
    std::cout << path << ": " << n_val << " tokens\n";
  }
  written.commit();
  std::printf(
      "%zu documents, %lld bytes -> %lld tokens (train %lld, val %lld), %.3f bytes/token, tokenizer %s, encoded in "
      "%.3f s (%.2f MB/s, one thread)\n",
      files.size(), static_cast<long long>(bytes), static_cast<long long>(n), static_cast<long long>(n_train),
      static_cast<long long>(n_val), static_cast<double>(bytes) / static_cast<double>(n), tok.name().c_str(), encode_s,
      static_cast<double>(bytes) / 1e6 / std::max(encode_s, 1e-9));
  return 0;
}

// llm.c's token files: 256 little-endian int32 (magic, version, token count, unused), then the
// tokens: uint16 (version 1, GPT-2) or uint32 (version 2, LLaMA 3).
constexpr int32_t kLlmcMagic = 20240520;
constexpr int64_t kLlmcHeaderBytes = 256 * 4;

int import_bin(const std::vector<std::string>& args) {
  std::vector<std::string> inputs;
  std::string out, hf, eot_token;
  int64_t vocab = 50257, eot = -1;
  bool raw = false;
  po::options_description desc("import-bin options");
  desc.add_options()("input", po::value(&inputs)->multitoken()->required(),
                     ".bin files, or directories (their *.bin files, sorted); one output shard each")(
      "out", po::value(&out)->required(), "output prefix")("vocab-size", po::value(&vocab),
                                                           "ids in the vocabulary (50257, GPT-2)")(
      "eot", po::value(&eot), "the end-of-text id (vocab-size - 1: GPT-2's 50256)")(
      "raw", po::bool_switch(&raw), "headerless uint16 tokens (nanoGPT's train.bin / val.bin)")(
      "tokenizer", po::value(&hf), "hf:PATH: the tokenizer.json that made the ids (stored, so they decode)")(
      "eot-token", po::value(&eot_token), "with --tokenizer: the end-of-text token (<|endoftext|>)");
  const po::variables_map vm = parse(args, desc);
  STRATA_REQUIRE(hf.empty() || is_hf(hf), "--tokenizer: expected hf:PATH (a tokenizer.json), found '", hf, "'");
  STRATA_REQUIRE(eot_token.empty() || !hf.empty(), "--eot-token: only with --tokenizer hf:PATH");
  std::optional<io::Tokenizer> hf_tok;
  if (!hf.empty()) {  // the vocabulary and eot are the tokenizer's; flags that say otherwise are wrong
    hf_tok = load_hf(hf, eot_token);
    STRATA_REQUIRE(!vm.count("vocab-size") || vocab == hf_tok->vocab_size(), "--vocab-size: ", vocab, " but ", hf,
                   " has ", hf_tok->vocab_size(), " ids");
    STRATA_REQUIRE(!vm.count("eot") || eot == hf_tok->eot(), "--eot: ", eot, " but ", hf, " ends documents with id ",
                   hf_tok->eot());
    vocab = hf_tok->vocab_size();
    eot = hf_tok->eot();
  }
  STRATA_REQUIRE(vocab >= 1 && vocab <= std::numeric_limits<int32_t>::max(), "--vocab-size: expected 1..",
                 std::numeric_limits<int32_t>::max(), ", found ", vocab);
  if (!vm.count("eot") && !hf_tok) eot = vocab - 1;
  STRATA_REQUIRE(eot >= 0 && eot < vocab, "--eot: ", eot, " is outside the vocabulary [0, ", vocab, ")");
  const io::Tokenizer tok = hf_tok ? *hf_tok : io::Tokenizer::external(vocab, static_cast<int32_t>(eot));
  prepare_prefix(out);
  const std::vector<std::string> files = list_inputs(inputs, ".bin");
  std::vector<std::string> outputs;
  for (size_t i = 0; i < files.size(); ++i)
    outputs.push_back(io::shard_path(out, static_cast<int>(i), static_cast<int>(files.size())));
  check_inputs(files, outputs);

  OutputFiles written;
  int64_t total = 0;
  for (size_t i = 0; i < files.size(); ++i) {
    const std::string& path = files[i];
    std::error_code ec;
    const auto size = static_cast<int64_t>(std::filesystem::file_size(path, ec));
    STRATA_REQUIRE(!ec, "--input: cannot read the size of '", path, "'");
    std::ifstream in(path, std::ios::binary);
    STRATA_REQUIRE(in.good(), "--input: cannot open '", path, "'");
    int64_t count = 0;
    int width = 2;
    if (raw) {
      STRATA_REQUIRE(size % 2 == 0, "--input: '", path, "' has ", size,
                     " bytes, an odd number: not headerless uint16 tokens");
      count = size / 2;
    } else {
      STRATA_REQUIRE(size >= kLlmcHeaderBytes, "--input: '", path, "' has ", size,
                     " bytes, too few for llm.c's 1024-byte header (headerless nanoGPT files need --raw)");
      int32_t header[256];
      in.read(reinterpret_cast<char*>(header), sizeof header);
      STRATA_REQUIRE(in.good(), "--input: cannot read the header of '", path, "'");
      STRATA_REQUIRE(header[0] == kLlmcMagic, "--input: '", path, "' is not an llm.c token file: expected magic ",
                     kLlmcMagic, ", found ", header[0], " (headerless nanoGPT files need --raw)");
      STRATA_REQUIRE(header[1] == 1 || header[1] == 2, "--input: '", path, "' has llm.c version ", header[1],
                     "; expected 1 (uint16 tokens) or 2 (uint32 tokens)");
      width = header[1] == 1 ? 2 : 4;
      count = header[2];
      STRATA_REQUIRE(count >= 0, "--input: '", path, "' has a negative token count ", count);
      const int64_t need = kLlmcHeaderBytes + count * width;
      STRATA_REQUIRE(need <= size, "--input: '", path, "' header counts ", count, " tokens (", need,
                     " bytes with the header) but the file has only ", size, " bytes");
      STRATA_REQUIRE(need == size, "--input: '", path, "' has ", size - need, " bytes beyond the ", count,
                     " tokens its header counts");
    }
    STRATA_REQUIRE(count > 0, "--input: '", path, "' holds no tokens");
    const std::string dest = written.add(outputs[i]);
    io::TokenShardWriter writer(dest, count, tok);
    constexpr int64_t kChunk = int64_t{1} << 22;
    std::vector<char> raw_buf;
    std::vector<int32_t> ids;
    for (int64_t done = 0; done < count; done += kChunk) {
      const int64_t n = std::min(kChunk, count - done);
      raw_buf.resize(static_cast<size_t>(n * width));
      in.read(raw_buf.data(), static_cast<std::streamsize>(raw_buf.size()));
      STRATA_REQUIRE(in.good(), "--input: '", path, "' ended early at token ", done);
      ids.resize(static_cast<size_t>(n));
      for (int64_t k = 0; k < n; ++k) {
        uint32_t v = 0;
        if (width == 2) {
          uint16_t u;
          std::memcpy(&u, raw_buf.data() + 2 * k, 2);
          v = u;
        } else {
          std::memcpy(&v, raw_buf.data() + 4 * k, 4);
        }
        STRATA_REQUIRE(v < static_cast<uint64_t>(vocab), "--input: '", path, "' holds token ", v, " at index ",
                       done + k, ", >= --vocab-size ", vocab);
        ids[static_cast<size_t>(k)] = static_cast<int32_t>(v);
      }
      writer.write(ids);
    }
    writer.close();
    std::cout << dest << ": " << count << " tokens from " << path << "\n";
    total += count;
  }
  written.commit();
  std::cout << files.size() << " file(s), " << total << " tokens, tokenizer " << tok.name() << " (vocab_size " << vocab
            << ", eot " << eot << ")\n";
  return 0;
}

namespace {

// `s` for one terminal line: valid UTF-8 kept, control characters and invalid bytes escaped.
std::string escape_text(const std::string& s) {
  std::string out;
  char buf[8];
  for (size_t i = 0; i < s.size();) {
    const auto c = static_cast<unsigned char>(s[i]);
    const char* named = c == '\n'   ? "\\n"
                        : c == '\t' ? "\\t"
                        : c == '\r' ? "\\r"
                        : c == '\\' ? "\\\\"
                        : c == '"'  ? "\\\""
                                    : nullptr;
    if (named) {
      out += named;
      ++i;
      continue;
    }
    size_t len = c < 0x80 ? 1 : (c >> 5) == 0x6 ? 2 : (c >> 4) == 0xe ? 3 : (c >> 3) == 0x1e ? 4 : 0;
    bool valid = len > 0 && i + len <= s.size() && (len == 1 || c >= 0xc2);
    for (size_t k = 1; valid && k < len; ++k) valid = (static_cast<unsigned char>(s[i + k]) >> 6) == 0x2;
    if (!valid || (len == 1 && (c < 0x20 || c == 0x7f))) {
      std::snprintf(buf, sizeof buf, "\\x%02x", c);
      out += buf;
      ++i;
    } else {
      out.append(s, i, len);
      i += len;
    }
  }
  return out;
}

// The first `chars` UTF-8 characters of `s` (bytes that start no character count as one).
std::string first_chars(const std::string& s, size_t chars) {
  size_t i = 0;
  for (size_t n = 0; i < s.size() && n < chars; ++n) {
    ++i;
    while (i < s.size() && (static_cast<unsigned char>(s[i]) >> 6) == 0x2) ++i;
  }
  return s.substr(0, i);
}

}  // namespace

int inspect_tokens(const std::string& spec) {
  io::TokenDataset ds = io::TokenDataset::open(spec, "inspect");
  const io::Tokenizer& tok = ds.tokenizer();
  std::cout << "kind:          tokens\n"
            << "files:         " << ds.files().size() << "\n";
  for (size_t i = 0; i < ds.files().size(); ++i)
    std::cout << "  " << ds.files()[i] << ": " << ds.shard_tokens()[i] << " tokens (" << ds.shard_dtypes()[i] << ")\n";
  std::cout << "tokens:        " << ds.num_tokens() << "\n"
            << "vocabulary:    " << ds.vocab_size() << " ids, eot = " << tok.eot() << "\n"
            << "tokenizer:     " << tok.name();
  if (tok.kind() == io::Tokenizer::Kind::Bpe)
    std::cout << " (" << tok.merges().size() << " merges: ids 0..255 bytes, merge i makes id 256 + i)";
  if (tok.kind() == io::Tokenizer::Kind::Byte) std::cout << " (ids 0..255 bytes)";
  if (const io::HfBpe* hf = tok.hf_model())
    std::cout << " (Hugging Face byte-level BPE, tokenizer.json stored: " << hf->num_merges() << " merges, "
              << hf->num_added() << " added tokens, eot '" << escape_text(std::string(tok.piece(tok.eot()))) << "')";
  std::cout << "\n";
  const int64_t n = std::min<int64_t>(ds.num_tokens(), 200);
  std::vector<int32_t> first(static_cast<size_t>(n));
  ds.read_window(0, n, first.data());
  if (tok.can_decode()) {
    std::cout << "excerpt:       \"" << escape_text(first_chars(tok.decode(first), 200)) << "\"\n";
  } else {
    std::cout << "excerpt:       not available: tokenizer 'external' stores no vocabulary (imported ids); first ids:";
    for (int64_t i = 0; i < std::min<int64_t>(n, 16); ++i) std::cout << " " << first[static_cast<size_t>(i)];
    std::cout << "\n";
  }
  return 0;
}

}  // namespace strata::data_tool
