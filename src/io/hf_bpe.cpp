// HfBpe: tokenizer.json parsed with nlohmann::json, pre-tokenizer regexes run by PCRE2 (JIT),
// merges applied per pre-token as the `tokenizers` library's BPE does (a min-heap of (rank,
// position) over a linked list of symbols; stale entries skipped). Vocabulary strings are mapped
// back to bytes once (GPT-2's bytes_to_unicode inverse), so encoding works on raw bytes and never
// builds the byte-level unicode text.
#include "io/hf_bpe.hpp"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#include <unicode/bytestream.h>
#include <unicode/normalizer2.h>

#include <algorithm>
#include <array>
#include <deque>
#include <mutex>
#include <nlohmann/json.hpp>
#include <queue>
#include <unordered_map>

#include "core/error.hpp"
#include "io/data_source.hpp"
#include "io/utf8.hpp"

namespace strata::io {

namespace {

using Json = nlohmann::json;

// GPT-2's split, which ByteLevel applies when use_regex is true (tokenizers' byte_level.rs).
constexpr const char* kGpt2Pattern = R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

constexpr uint64_t pair_key(int32_t a, int32_t b) {
  return (uint64_t{static_cast<uint32_t>(a)} << 32) | static_cast<uint32_t>(b);
}

struct CodeFree {
  void operator()(pcre2_code* c) const { pcre2_code_free(c); }
};

// A compiled pre-tokenizer pattern: UTF + UCP (\p{L}, \s by Unicode), invalid UTF-8 in the text
// is never matched, JIT when available.
std::unique_ptr<pcre2_code, CodeFree> compile(const std::string& pattern, bool literal, const std::string& where) {
  int err = 0;
  PCRE2_SIZE at = 0;
  const uint32_t options = PCRE2_UTF | PCRE2_UCP | PCRE2_MATCH_INVALID_UTF | (literal ? PCRE2_LITERAL : 0);
  pcre2_code* code =
      pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(), options, &err, &at, nullptr);
  if (!code) {
    PCRE2_UCHAR msg[256];
    pcre2_get_error_message(err, msg, sizeof msg);
    STRATA_THROW_INPUT("has a ", where, " regex that PCRE2 cannot compile at offset ", at, ": ",
                       reinterpret_cast<const char*>(msg));
  }
  pcre2_jit_compile(code, PCRE2_JIT_COMPLETE);  // falls back to the interpreter when unavailable
  return std::unique_ptr<pcre2_code, CodeFree>(code);
}

// One pre-tokenizer step, applied to every piece in turn: an optional leading space (ByteLevel's
// add_prefix_space), then an optional isolated split (each match and each stretch between
// matches becomes a piece).
struct Step {
  std::unique_ptr<pcre2_code, CodeFree> regex;
  bool prefix_space = false;
};

struct Added {
  std::string content;
  int32_t id = 0;
  bool lstrip = false, rstrip = false;
};

// Added tokens matched leftmost-longest, as the library's Aho-Corasick (LeftmostLongest) does.
struct AddedSet {
  std::vector<Added> tokens;                   // longest first
  std::array<std::vector<size_t>, 256> first;  // by first byte: indices into tokens

  void build() {
    std::stable_sort(tokens.begin(), tokens.end(),
                     [](const Added& a, const Added& b) { return a.content.size() > b.content.size(); });
    for (size_t i = 0; i < tokens.size(); ++i) first[static_cast<unsigned char>(tokens[i].content[0])].push_back(i);
  }
  // The leftmost-longest match at or after `from`: its begin and token; tokens.size() if none.
  std::pair<size_t, size_t> find(std::string_view s, size_t from) const {
    for (size_t i = from; i < s.size(); ++i)
      for (size_t k : first[static_cast<unsigned char>(s[i])])
        if (s.compare(i, tokens[k].content.size(), tokens[k].content) == 0) return {i, k};
    return {s.size(), tokens.size()};
  }
};

// A string field of `j`, or "" when absent or null.
std::string str_or_empty(const Json& j, const char* key) {
  const auto it = j.find(key);
  return it == j.end() || it->is_null() ? std::string() : it->get<std::string>();
}

std::string type_of(const Json& j) { return j.is_object() ? str_or_empty(j, "type") : std::string(); }

}  // namespace

// Hashes std::string keys and looks them up by std::string_view (no copy per lookup).
struct TextHash {
  using is_transparent = void;
  size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
};

// Encoding scratch: regex match data, the pre-token cache and the merge heap. One caller at a
// time uses a state; HfBpe keeps one between calls so the cache outlives a document.
struct EncodeState {
  struct MatchFree {
    void operator()(pcre2_match_data* m) const { pcre2_match_data_free(m); }
  };
  struct ContextFree {
    void operator()(pcre2_match_context* m) const { pcre2_match_context_free(m); }
  };
  struct StackFree {
    void operator()(pcre2_jit_stack* s) const { pcre2_jit_stack_free(s); }
  };
  std::unique_ptr<pcre2_match_data, MatchFree> match{pcre2_match_data_create(1, nullptr)};
  // A long whitespace run backtracks through `\s+(?!\S)`: more than the default 32 KiB JIT stack.
  std::unique_ptr<pcre2_jit_stack, StackFree> stack{pcre2_jit_stack_create(32 << 10, 64 << 20, nullptr)};
  std::unique_ptr<pcre2_match_context, ContextFree> context{pcre2_match_context_create(nullptr)};
  std::deque<std::string> held;  // this call's normalized text and pieces with a prefix space
  std::vector<std::string_view> pieces, next;
  std::unordered_map<std::string, std::pair<uint32_t, uint32_t>, TextHash, std::equal_to<>> cache;  // -> ids in store
  std::vector<int32_t> store;
  struct Sym {
    int32_t id, prev, next;
  };
  std::vector<Sym> syms;
  struct Entry {
    int32_t rank, pos, id;
    bool operator<(const Entry& o) const { return rank != o.rank ? rank > o.rank : pos > o.pos; }  // min first
  };
  std::vector<Entry> heap;

  EncodeState() { pcre2_jit_stack_assign(context.get(), nullptr, stack.get()); }
};

struct HfBpe::Impl {
  std::string json;
  const icu::Normalizer2* normalizer = nullptr;  // NFC (Qwen 2), NFD, NFKC or NFKD; null: none
  int64_t vocab_size = 0;
  std::vector<std::string> pieces;  // id -> bytes
  std::vector<uint8_t> has_piece;   // ids no token has are holes
  std::array<int32_t, 256> byte_id{};
  std::unordered_map<uint64_t, std::pair<int32_t, int32_t>> merges;  // (left, right) -> (rank, new id)
  int64_t num_merges = 0;
  std::unordered_map<std::string, int32_t> token_id;                                // tokenizer.json spelling -> id
  std::unordered_map<std::string, int32_t, TextHash, std::equal_to<>> vocab_bytes;  // bytes -> id (ignore_merges)
  bool ignore_merges = false;
  std::vector<Step> steps;
  std::array<AddedSet, 2> added;  // [0]: normalized = false (split first), [1]: normalized = true
  int64_t num_added = 0;
  mutable std::mutex spare_mutex;
  mutable std::unique_ptr<EncodeState> spare;  // the last call's state (its cache), for the next

  void parse_normalizer(const Json& normalizer);
  void parse_model(const Json& model);
  void parse_pre_tokenizer(const Json& pre);
  void parse_added(const Json& list);

  void merge_word(std::string_view word, EncodeState& st, std::vector<int32_t>& out) const;
  void encode_word(std::string_view word, EncodeState& st, std::vector<int32_t>& out) const;
  void encode_plain(std::string_view text, EncodeState& st, std::vector<int32_t>& out) const;
  void encode_group(std::string_view text, size_t group, EncodeState& st, std::vector<int32_t>& out) const;
  std::string_view normalize(std::string_view text, EncodeState& st) const;
};

namespace {

// Appends the isolated split of `s` by `code` to `out`.
void split_isolated(const pcre2_code* code, std::string_view s, EncodeState& st, std::vector<std::string_view>& out) {
  size_t last = 0, at = 0;
  while (at < s.size()) {
    const int rc =
        pcre2_match(code, reinterpret_cast<PCRE2_SPTR>(s.data()), s.size(), at, 0, st.match.get(), st.context.get());
    if (rc == PCRE2_ERROR_NOMATCH) break;
    if (rc < 0) {
      PCRE2_UCHAR msg[256];
      pcre2_get_error_message(rc, msg, sizeof msg);
      STRATA_THROW_INPUT("the pre-tokenizer regex failed on ", s.size(),
                         " bytes of text: ", reinterpret_cast<const char*>(msg));
    }
    const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(st.match.get());
    const size_t b = ov[0], e = ov[1];
    if (e == b) {  // an empty match makes no piece: search again from the next character
      at = b + utf8::next_char(s, b).second;
      continue;
    }
    if (b > last) out.push_back(s.substr(last, b - last));
    out.push_back(s.substr(b, e - b));
    last = at = e;
  }
  if (last < s.size()) out.push_back(s.substr(last));
}

}  // namespace

HfBpe::HfBpe(std::string json) : impl_(std::make_unique<Impl>()) {
  Impl& m = *impl_;
  m.json = std::move(json);
  Json root;
  try {
    root = Json::parse(m.json);
  } catch (const Json::parse_error& e) {
    STRATA_THROW_INPUT("is not valid JSON: ", e.what());
  }
  try {
    STRATA_REQUIRE(root.is_object() && root.contains("model"),
                   "is not a tokenizer.json: expected an object with a 'model'");
    m.parse_normalizer(root.value("normalizer", Json()));
    const Json& decoder = root.value("decoder", Json());
    STRATA_REQUIRE(decoder.is_null() || type_of(decoder) == "ByteLevel", "has decoder '", type_of(decoder),
                   "'; expected ByteLevel (byte-level BPE)");
    m.parse_model(root["model"]);
    m.parse_pre_tokenizer(root.value("pre_tokenizer", Json()));
    m.parse_added(root.value("added_tokens", Json::array()));
  } catch (const Json::exception& e) {
    STRATA_THROW_INPUT("has an unexpected structure: ", e.what());
  }
}

HfBpe::~HfBpe() = default;

void HfBpe::Impl::parse_normalizer(const Json& n) {
  if (n.is_null()) return;
  if (type_of(n) == "Sequence") {  // DeepSeek's empty one, or one normalizer wrapped
    const Json& list = n.at("normalizers");
    STRATA_REQUIRE(list.size() <= 1, "has ", list.size(), " normalizers in a Sequence; supported: at most one");
    if (list.size() == 1) parse_normalizer(list[0]);
    return;
  }
  const std::string type = type_of(n);
  UErrorCode err = U_ZERO_ERROR;
  normalizer = type == "NFC"    ? icu::Normalizer2::getNFCInstance(err)
               : type == "NFD"  ? icu::Normalizer2::getNFDInstance(err)
               : type == "NFKC" ? icu::Normalizer2::getNFKCInstance(err)
               : type == "NFKD" ? icu::Normalizer2::getNFKDInstance(err)
                                : nullptr;
  STRATA_REQUIRE(normalizer, "has normalizer '", type.empty() ? n.dump().substr(0, 40) : type,
                 "'; supported: none, NFC, NFD, NFKC, NFKD");
  STRATA_CHECK(U_SUCCESS(err), "ICU's ", type, " normalizer: ", u_errorName(err));
}

void HfBpe::Impl::parse_model(const Json& model) {
  STRATA_REQUIRE(type_of(model) == "BPE", "is not byte-level BPE: its model is '", type_of(model), "', not 'BPE'");
  for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"})
    STRATA_REQUIRE(str_or_empty(model, key).empty(), "has model.", key, " '", str_or_empty(model, key),
                   "'; byte-level BPE has none");
  const Json& dropout = model.value("dropout", Json());
  STRATA_REQUIRE(dropout.is_null() || dropout.get<double>() == 0.0, "has BPE dropout ", dropout.dump(),
                 "; encoding would be random");
  ignore_merges = model.value("ignore_merges", false);
  const Json& vocab = model.at("vocab");
  STRATA_REQUIRE(vocab.is_object(), "has a model.vocab that is not an object of token -> id");

  // Ids: the vocabulary's and the added tokens'; the highest + 1 is the vocabulary size.
  int64_t max_id = -1;
  for (const auto& [token, id_json] : vocab.items()) {
    const auto id = id_json.get<int64_t>();
    STRATA_REQUIRE(id >= 0 && id < kMaxClasses, "has vocabulary id ", id, " for '", token, "'; expected 0..",
                   kMaxClasses - 1, " (token shards hold at most 2^24 ids)");
    max_id = std::max(max_id, id);
    token_id.emplace(token, static_cast<int32_t>(id));
  }
  pieces.resize(static_cast<size_t>(max_id + 1));
  has_piece.assign(pieces.size(), 0);
  std::array<int, 0x150> byte_of;  // code point -> byte (bytes_to_unicode inverse), -1 elsewhere
  byte_of.fill(-1);
  const std::array<uint32_t, 256> cp = utf8::bytes_to_unicode();
  for (int b = 0; b < 256; ++b) byte_of[cp[static_cast<size_t>(b)]] = b;
  for (const auto& [token, id] : token_id) {
    auto& piece = pieces[static_cast<size_t>(id)];
    STRATA_REQUIRE(!has_piece[static_cast<size_t>(id)], "gives id ", id, " to two vocabulary tokens");
    has_piece[static_cast<size_t>(id)] = 1;
    bool bytes = true;
    for (size_t i = 0; i < token.size() && bytes;) {
      const auto [c, len] = utf8::next_char(token, i);
      bytes = c < byte_of.size() && byte_of[c] >= 0;
      if (bytes) piece += static_cast<char>(byte_of[c]);
      i += len;
    }
    if (!bytes) piece = token;  // not byte-level text (never produced by merges): shown as written
  }
  for (int b = 0; b < 256; ++b) {
    const auto it = token_id.find(utf8::encode(cp[static_cast<size_t>(b)]));
    STRATA_REQUIRE(it != token_id.end(), "is not byte-level BPE: the vocabulary has no token for byte ", b, " ('",
                   utf8::encode(cp[static_cast<size_t>(b)]), "')");
    byte_id[static_cast<size_t>(b)] = it->second;
  }
  if (ignore_merges)
    for (const auto& [token, id] : token_id) vocab_bytes.emplace(pieces[static_cast<size_t>(id)], id);

  // Merges: "left right" strings (older files) or [left, right] pairs; rank = position. A pair
  // listed twice keeps its last rank, as the library's HashMap does.
  const Json& list = model.at("merges");
  STRATA_REQUIRE(list.is_array(), "has a model.merges that is not a list");
  for (size_t rank = 0; rank < list.size(); ++rank) {
    const Json& e = list[rank];
    std::string left, right;
    if (e.is_string()) {
      const auto s = e.get<std::string>();
      const size_t sp = s.find(' ');
      STRATA_REQUIRE(sp != std::string::npos && s.find(' ', sp + 1) == std::string::npos, "has merge ", rank, " '", s,
                     "'; expected two tokens separated by one space");
      left = s.substr(0, sp);
      right = s.substr(sp + 1);
    } else {
      STRATA_REQUIRE(e.is_array() && e.size() == 2, "has merge ", rank, " ", e.dump(), "; expected [left, right]");
      left = e[0].get<std::string>();
      right = e[1].get<std::string>();
    }
    int32_t ids[3];
    const std::string parts[3] = {left, right, left + right};
    for (int k = 0; k < 3; ++k) {
      const auto it = token_id.find(parts[k]);
      STRATA_REQUIRE(it != token_id.end(), "has merge ", rank, " ('", left, "', '", right, "') whose ",
                     k == 2 ? "result" : "token", " '", parts[k], "' is not in the vocabulary");
      ids[k] = it->second;
    }
    merges[pair_key(ids[0], ids[1])] = {static_cast<int32_t>(rank), ids[2]};
  }
  num_merges = static_cast<int64_t>(list.size());
}

void HfBpe::Impl::parse_pre_tokenizer(const Json& pre) {
  std::vector<const Json*> list;
  if (type_of(pre) == "Sequence")
    for (const Json& p : pre.at("pretokenizers")) list.push_back(&p);
  else
    list.push_back(&pre);
  bool byte_level = false;
  for (const Json* p : list) {
    const std::string type = type_of(*p);
    STRATA_REQUIRE(!byte_level, "has pre-tokenizer '", type, "' after ByteLevel; expected Split ... then ByteLevel");
    Step step;
    if (type == "ByteLevel") {
      byte_level = true;
      step.prefix_space = p->value("add_prefix_space", false);
      if (p->value("use_regex", true)) step.regex = compile(kGpt2Pattern, false, "ByteLevel");
    } else if (type == "Split") {
      const std::string behavior = p->value("behavior", std::string());
      STRATA_REQUIRE(behavior == "Isolated" && !p->value("invert", false), "has a Split pre-tokenizer with behavior '",
                     behavior, "'", p->value("invert", false) ? " inverted" : "",
                     "; only Isolated (not inverted) is supported");
      const Json& pattern = p->at("pattern");
      const bool regex = pattern.contains("Regex");
      STRATA_REQUIRE(regex || pattern.contains("String"), "has a Split pattern ", pattern.dump(),
                     "; expected {\"Regex\": ...} or {\"String\": ...}");
      step.regex = compile(pattern.at(regex ? "Regex" : "String").get<std::string>(), !regex, "Split");
    } else {
      STRATA_THROW_INPUT("is not byte-level BPE: pre-tokenizer '", type.empty() ? pre.dump().substr(0, 40) : type,
                         "' (expected ByteLevel, or Split ... then ByteLevel)");
    }
    steps.push_back(std::move(step));
  }
  STRATA_REQUIRE(byte_level, "is not byte-level BPE: its pre-tokenizer has no ByteLevel step");
}

void HfBpe::Impl::parse_added(const Json& list) {
  for (const Json& t : list) {
    Added a;
    a.content = t.at("content").get<std::string>();
    const auto id = t.at("id").get<int64_t>();
    a.lstrip = t.value("lstrip", false);
    a.rstrip = t.value("rstrip", false);
    STRATA_REQUIRE(!a.content.empty(), "has an added token (id ", id, ") with empty content");
    STRATA_REQUIRE(id >= 0 && id < kMaxClasses, "has added token '", a.content, "' with id ", id, "; expected 0..",
                   kMaxClasses - 1);
    STRATA_REQUIRE(!t.value("single_word", false), "has added token '", a.content,
                   "' with single_word = true, which is not supported");
    a.id = static_cast<int32_t>(id);
    if (a.id >= static_cast<int64_t>(pieces.size())) {
      pieces.resize(static_cast<size_t>(a.id) + 1);
      has_piece.resize(pieces.size(), 0);
    }
    pieces[static_cast<size_t>(a.id)] = a.content;  // decodes as written, as the library does
    has_piece[static_cast<size_t>(a.id)] = 1;
    token_id.emplace(a.content, a.id);
    added[t.value("normalized", false) ? 1 : 0].tokens.push_back(std::move(a));
    ++num_added;
  }
  for (AddedSet& s : added) s.build();
  vocab_size = static_cast<int64_t>(pieces.size());
}

const std::string& HfBpe::json() const { return impl_->json; }
int64_t HfBpe::vocab_size() const { return impl_->vocab_size; }
int64_t HfBpe::num_merges() const { return impl_->num_merges; }
int64_t HfBpe::num_added() const { return impl_->num_added; }

int32_t HfBpe::find(std::string_view content) const {
  for (const AddedSet& s : impl_->added)
    for (const Added& a : s.tokens)
      if (a.content == content) return a.id;
  const auto it = impl_->token_id.find(std::string(content));
  return it == impl_->token_id.end() ? -1 : it->second;
}

int32_t HfBpe::end_of_text(std::string_view name) const {
  if (!name.empty()) {
    const int32_t id = find(name);
    STRATA_REQUIRE(id >= 0, "has no token '", name, "' to end documents with");
    return id;
  }
  for (const char* known : {"<|endoftext|>", "<|end_of_text|>"})
    if (const int32_t id = find(known); id >= 0) return id;
  STRATA_THROW_INPUT("has neither <|endoftext|> nor <|end_of_text|>: name the end-of-text token (--eot-token)");
}

std::string_view HfBpe::piece(int32_t id) const {
  const Impl& m = *impl_;
  STRATA_REQUIRE(id >= 0 && id < m.vocab_size, "token id ", id, " is outside the vocabulary [0, ", m.vocab_size, ")");
  STRATA_REQUIRE(m.has_piece[static_cast<size_t>(id)], "token id ", id, " is not in the tokenizer.json");
  return m.pieces[static_cast<size_t>(id)];
}

// Merges one pre-token's bytes as tokenizers' Word::merge_all: repeatedly the pair of lowest
// rank, leftmost first (a heap of (rank, position); entries whose pair changed are skipped).
void HfBpe::Impl::merge_word(std::string_view word, EncodeState& st, std::vector<int32_t>& out) const {
  const Impl& m = *this;
  auto& syms = st.syms;
  auto& heap = st.heap;
  syms.clear();
  heap.clear();
  const auto n = static_cast<int32_t>(word.size());
  for (int32_t i = 0; i < n; ++i)
    syms.push_back(
        {m.byte_id[static_cast<unsigned char>(word[static_cast<size_t>(i)])], i - 1, i + 1 < n ? i + 1 : -1});
  auto push = [&](int32_t pos) {
    const auto& s = syms[static_cast<size_t>(pos)];
    if (s.next < 0) return;
    const auto it = m.merges.find(pair_key(s.id, syms[static_cast<size_t>(s.next)].id));
    if (it == m.merges.end()) return;
    heap.push_back({it->second.first, pos, it->second.second});
    std::push_heap(heap.begin(), heap.end());
  };
  for (int32_t i = 0; i + 1 < n; ++i) push(i);
  while (!heap.empty()) {
    std::pop_heap(heap.begin(), heap.end());
    const EncodeState::Entry top = heap.back();
    heap.pop_back();
    auto& s = syms[static_cast<size_t>(top.pos)];
    if (s.id < 0 || s.next < 0) continue;  // absorbed, or now the last symbol
    auto& right = syms[static_cast<size_t>(s.next)];
    const auto it = m.merges.find(pair_key(s.id, right.id));
    if (it == m.merges.end() || it->second.second != top.id) continue;  // stale
    s.id = top.id;
    right.id = -1;
    s.next = right.next;
    if (s.next >= 0) syms[static_cast<size_t>(s.next)].prev = top.pos;
    if (s.prev >= 0) push(s.prev);
    push(top.pos);
  }
  for (int32_t p = 0; p >= 0; p = syms[static_cast<size_t>(p)].next) out.push_back(syms[static_cast<size_t>(p)].id);
}

void HfBpe::Impl::encode_word(std::string_view word, EncodeState& st, std::vector<int32_t>& out) const {
  const Impl& m = *this;
  if (word.size() == 1) {
    out.push_back(m.byte_id[static_cast<unsigned char>(word[0])]);
    return;
  }
  if (m.ignore_merges)
    if (const auto it = m.vocab_bytes.find(word); it != m.vocab_bytes.end()) {
      out.push_back(it->second);
      return;
    }
  if (const auto it = st.cache.find(word); it != st.cache.end()) {
    const auto [at, len] = it->second;
    out.insert(out.end(), st.store.begin() + at, st.store.begin() + at + len);
    return;
  }
  const size_t before = out.size();
  merge_word(word, st, out);
  if (st.store.size() > (size_t{1} << 24) || st.cache.size() > (size_t{1} << 20)) {  // bound it on rare words
    st.cache.clear();
    st.store.clear();
  }
  const auto at = static_cast<uint32_t>(st.store.size());
  st.store.insert(st.store.end(), out.begin() + static_cast<std::ptrdiff_t>(before), out.end());
  st.cache.emplace(std::string(word), std::pair<uint32_t, uint32_t>{at, static_cast<uint32_t>(out.size() - before)});
}

// Text without added tokens: pre-tokenized by the steps, each piece merged.
void HfBpe::Impl::encode_plain(std::string_view text, EncodeState& st, std::vector<int32_t>& out) const {
  const Impl& m = *this;
  st.pieces.assign(1, text);
  for (const Step& step : m.steps) {
    st.next.clear();
    for (std::string_view p : st.pieces) {
      if (step.prefix_space && p.front() != ' ') p = st.held.emplace_back(std::string(1, ' ').append(p));
      if (step.regex)
        split_isolated(step.regex.get(), p, st, st.next);
      else
        st.next.push_back(p);
    }
    std::swap(st.pieces, st.next);
  }
  for (std::string_view p : st.pieces) encode_word(p, st, out);
}

// Splits out the added tokens of `group` (then of the next group), as AddedVocabulary does:
// lstrip/rstrip widen a match over neighbouring whitespace, never past the previous match.
// `text` normalized (a view of itself when already normal); bytes that are not UTF-8 are kept as
// they are, and the well-formed runs between them normalized one by one.
std::string_view HfBpe::Impl::normalize(std::string_view text, EncodeState& st) const {
  UErrorCode err = U_ZERO_ERROR;
  if (normalizer->isNormalizedUTF8(icu::StringPiece(text.data(), static_cast<int32_t>(text.size())), err) &&
      U_SUCCESS(err))
    return text;  // also false (with an error) for ill-formed UTF-8: handled below
  std::string& out = st.held.emplace_back();
  icu::StringByteSink<std::string> sink(&out);
  for (size_t i = 0; i < text.size();) {
    size_t j = i;
    while (j < text.size() && utf8::next_char(text, j).first != utf8::kInvalid) j += utf8::next_char(text, j).second;
    if (j > i) {
      err = U_ZERO_ERROR;
      normalizer->normalizeUTF8(0, icu::StringPiece(text.data() + i, static_cast<int32_t>(j - i)), sink, nullptr, err);
      STRATA_CHECK(U_SUCCESS(err), "ICU normalization: ", u_errorName(err));
    }
    if (j < text.size()) out += text[j++];
    i = j;
  }
  return out;
}

void HfBpe::Impl::encode_group(std::string_view text, size_t group, EncodeState& st, std::vector<int32_t>& out) const {
  const Impl& m = *this;
  if (group == 1 && normalizer) text = normalize(text, st);  // what the special tokens left, as the library does
  if (text.empty()) return;
  if (group == m.added.size()) return encode_plain(text, st, out);
  const AddedSet& set = m.added[group];
  size_t done = 0, from = 0;
  while (!set.tokens.empty()) {
    const auto [at, k] = set.find(text, from);
    if (k == set.tokens.size()) break;
    const Added& a = set.tokens[k];
    size_t b = at, e = at + a.content.size();
    for (size_t len; a.lstrip && b > done && (len = utf8::space_before(text, b)) > 0;) b -= len;
    for (size_t len; a.rstrip && (len = utf8::space_at(text, e)) > 0;) e += len;
    encode_group(text.substr(done, b - done), group + 1, st, out);
    out.push_back(a.id);
    done = from = e;
  }
  encode_group(text.substr(done), group + 1, st, out);
}

void HfBpe::encode_append(std::string_view text, std::vector<int32_t>& out) const {
  std::unique_ptr<EncodeState> st;
  {
    const std::lock_guard lock(impl_->spare_mutex);
    st = std::move(impl_->spare);
  }
  if (!st) st = std::make_unique<EncodeState>();  // first call, or another thread has the spare one
  st->held.clear();
  impl_->encode_group(text, 0, *st, out);
  const std::lock_guard lock(impl_->spare_mutex);
  impl_->spare = std::move(st);
}

}  // namespace strata::io
