// Byte-level and BPE tokenizers. Training keeps the text as a doubly linked list of tokens,
// exact counts of every adjacent pair, the positions where each pair may occur (stale entries
// are skipped when visited) and a lazy max-heap of (count, pair); a merge visits only its own
// pair's positions and adjusts the counts of the neighbouring pairs. Encoding replays the
// merges in order, each over the positions where its pair occurs, which gives the same tokens as applying
// merge 0, 1, ... in order, each left to right over the whole text, as training did.
#include "io/tokenizer.hpp"

#include <algorithm>
#include <chrono>
#include <limits>
#include <map>
#include <queue>

#include "core/error.hpp"
#include "io/hf_bpe.hpp"

namespace strata::io {

namespace {

constexpr uint64_t key(int32_t a, int32_t b) {
  return (uint64_t{static_cast<uint32_t>(a)} << 32) | static_cast<uint32_t>(b);
}
constexpr int32_t left_of(uint64_t k) { return static_cast<int32_t>(k >> 32); }
constexpr int32_t right_of(uint64_t k) { return static_cast<int32_t>(k & 0xffffffffu); }

// Tokens as a linked list over the original byte positions: a node keeps the position of its
// first byte; merging (p, next[p]) keeps p and unlinks the right node. -1 ends a document.
struct Chain {
  std::vector<int32_t> tok, prev, next;

  void build(std::span<const std::string_view> documents) {
    size_t total = 0;
    for (auto d : documents) total += d.size();
    tok.resize(total);
    prev.resize(total);
    next.resize(total);
    size_t pos = 0;
    for (auto d : documents) {
      for (size_t i = 0; i < d.size(); ++i, ++pos) {
        tok[pos] = static_cast<unsigned char>(d[i]);
        prev[pos] = i == 0 ? -1 : static_cast<int32_t>(pos - 1);
        next[pos] = i + 1 == d.size() ? -1 : static_cast<int32_t>(pos + 1);
      }
    }
  }
  // Replaces the pair starting at p with `id`.
  void merge_at(int32_t p, int32_t id) {
    const int32_t q = next[p], r = next[q];
    tok[p] = id;
    tok[q] = -1;
    next[p] = r;
    if (r >= 0) prev[r] = p;
  }
};

struct HeapEntry {
  int64_t count;
  uint64_t pair;
  // The max-heap's top: the highest count, then the smallest (left, right).
  bool operator<(const HeapEntry& o) const { return count != o.count ? count < o.count : pair > o.pair; }
};

}  // namespace

Tokenizer::Tokenizer(Kind kind, int64_t vocab_size, int32_t eot, std::vector<Merge> merges)
    : kind_(kind), vocab_size_(vocab_size), eot_(eot), merges_(std::move(merges)) {
  name_ = kind == Kind::Byte ? "byte" : kind == Kind::Bpe ? "bpe" : kind == Kind::Hf ? "hf" : "external";
  if (kind == Kind::External || kind == Kind::Hf) return;
  pieces_.reserve(256 + merges_.size());
  for (int b = 0; b < 256; ++b) pieces_.emplace_back(1, static_cast<char>(b));
  for (size_t i = 0; i < merges_.size(); ++i) {
    const auto [a, b] = merges_[i];
    STRATA_REQUIRE(a >= 0 && b >= 0 && a < 256 + static_cast<int64_t>(i) && b < 256 + static_cast<int64_t>(i),
                   "BPE merge ", i, " is (", a, ", ", b, "); expected ids below ", 256 + i,
                   " (bytes 0..255 and the tokens of earlier merges)");
    pieces_.push_back(pieces_[static_cast<size_t>(a)] + pieces_[static_cast<size_t>(b)]);
    ranks_.emplace(key(a, b), static_cast<int32_t>(i));  // a repeated pair keeps its first merge
  }
}

Tokenizer Tokenizer::byte_level() { return Tokenizer(Kind::Byte, 257, 256, {}); }

Tokenizer Tokenizer::bpe(std::vector<Merge> merges) {
  STRATA_REQUIRE(merges.size() < static_cast<size_t>(std::numeric_limits<int32_t>::max() - 257), "BPE has ",
                 merges.size(), " merges; too many for int32 ids");
  const auto m = static_cast<int32_t>(merges.size());
  return Tokenizer(Kind::Bpe, 257 + int64_t{m}, 256 + m, std::move(merges));
}

Tokenizer Tokenizer::hf(std::string json, std::string_view eot_token) {
  auto model = std::make_shared<const HfBpe>(std::move(json));
  Tokenizer t(Kind::Hf, model->vocab_size(), model->end_of_text(eot_token), {});
  t.hf_ = std::move(model);
  return t;
}

Tokenizer Tokenizer::hf_with_eot(std::string json, int64_t eot) {
  auto model = std::make_shared<const HfBpe>(std::move(json));
  STRATA_REQUIRE(eot >= 0 && eot < model->vocab_size(), "end-of-text id ", eot, " is outside the vocabulary [0, ",
                 model->vocab_size(), ")");
  model->piece(static_cast<int32_t>(eot));  // an Input error when no token has that id
  Tokenizer t(Kind::Hf, model->vocab_size(), static_cast<int32_t>(eot), {});
  t.hf_ = std::move(model);
  return t;
}

const std::string& Tokenizer::hf_json() const {
  static const std::string kNone;
  return hf_ ? hf_->json() : kNone;
}

Tokenizer Tokenizer::external(int64_t vocab_size, int32_t eot) {
  STRATA_REQUIRE(vocab_size >= 1 && vocab_size <= std::numeric_limits<int32_t>::max(), "vocabulary size ", vocab_size,
                 " is out of range; expected 1..", std::numeric_limits<int32_t>::max());
  STRATA_REQUIRE(eot >= 0 && eot < vocab_size, "end-of-text id ", eot, " is outside the vocabulary [0, ", vocab_size,
                 ")");
  return Tokenizer(Kind::External, vocab_size, eot, {});
}

Tokenizer Tokenizer::train_bpe(std::string_view text, int64_t vocab_size, BpeTrainStats* stats) {
  return train_bpe(std::span<const std::string_view>(&text, 1), vocab_size, stats);
}

Tokenizer Tokenizer::train_bpe(std::span<const std::string_view> documents, int64_t vocab_size, BpeTrainStats* stats) {
  const auto t0 = std::chrono::steady_clock::now();
  STRATA_REQUIRE(vocab_size >= 257 && vocab_size < std::numeric_limits<int32_t>::max(), "BPE vocabulary size ",
                 vocab_size, " is out of range; expected >= 257 (256 bytes, then one id per merge, then end-of-text)");
  size_t total = 0;
  for (auto d : documents) total += d.size();
  STRATA_REQUIRE(total < static_cast<size_t>(std::numeric_limits<int32_t>::max()), "BPE training text of ", total,
                 " bytes is too long; at most 2 GiB");
  const int64_t max_merges = vocab_size - 257;

  Chain c;
  c.build(documents);
  std::unordered_map<uint64_t, int64_t> count;
  std::unordered_map<uint64_t, std::vector<int32_t>> where;  // positions (ascending per round) where a pair may start
  for (size_t p = 0; p < c.tok.size(); ++p)
    if (c.next[p] >= 0) {
      const uint64_t k = key(c.tok[p], c.tok[static_cast<size_t>(c.next[p])]);
      ++count[k];
      where[k].push_back(static_cast<int32_t>(p));
    }
  std::priority_queue<HeapEntry> heap;
  for (const auto& [k, n] : count) heap.push({n, k});

  std::vector<Merge> merges;
  std::vector<uint64_t> raised;  // pairs whose count grew this round: pushed once at its end
  int64_t tokens = static_cast<int64_t>(total);
  auto dec = [&](uint64_t k) {
    auto it = count.find(k);
    if (--it->second == 0) {  // no occurrence left: its positions are all stale
      count.erase(it);
      where.erase(k);
    }
  };
  auto inc = [&](uint64_t k, int32_t pos) {
    ++count[k];
    where[k].push_back(pos);
    raised.push_back(k);
  };
  while (static_cast<int64_t>(merges.size()) < max_merges && !heap.empty()) {
    const HeapEntry top = heap.top();
    heap.pop();
    auto it = count.find(top.pair);
    if (it == count.end()) continue;
    if (it->second != top.count) {  // stale: the count fell since this entry (rises are pushed)
      if (it->second < top.count) heap.push({it->second, top.pair});
      continue;
    }
    if (top.count < 2) break;  // the best pair occurs once: merging it learns nothing general
    const int32_t a = left_of(top.pair), b = right_of(top.pair);
    const int32_t id = 256 + static_cast<int32_t>(merges.size());
    merges.push_back({a, b});
    std::vector<int32_t> positions = std::move(where[top.pair]);
    where.erase(top.pair);
    std::sort(positions.begin(), positions.end());
    positions.erase(std::unique(positions.begin(), positions.end()), positions.end());
    raised.clear();
    for (int32_t p : positions) {  // left to right, so "aaa" becomes (aa) a
      const auto up = static_cast<size_t>(p);
      if (c.tok[up] != a) continue;
      const int32_t q = c.next[up];
      if (q < 0 || c.tok[static_cast<size_t>(q)] != b) continue;
      const int32_t l = c.prev[up], r = c.next[static_cast<size_t>(q)];
      if (l >= 0) dec(key(c.tok[static_cast<size_t>(l)], a));
      if (r >= 0) dec(key(b, c.tok[static_cast<size_t>(r)]));
      dec(top.pair);
      c.merge_at(p, id);
      --tokens;
      if (l >= 0) inc(key(c.tok[static_cast<size_t>(l)], id), l);
      if (r >= 0) inc(key(id, c.tok[static_cast<size_t>(r)]), p);
    }
    std::sort(raised.begin(), raised.end());
    raised.erase(std::unique(raised.begin(), raised.end()), raised.end());
    for (uint64_t k : raised)
      if (auto f = count.find(k); f != count.end()) heap.push({f->second, k});
  }
  if (stats) {
    stats->bytes = static_cast<int64_t>(total);
    stats->tokens_after = tokens;
    stats->merges = static_cast<int64_t>(merges.size());
    stats->seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
  return bpe(std::move(merges));
}

void Tokenizer::require_text(const char* what) const {
  STRATA_REQUIRE(kind_ != Kind::External, "tokenizer 'external' has no vocabulary: cannot ", what,
                 " (the ids were imported; use the tokenizer that made them)");
}

std::vector<int32_t> Tokenizer::encode(std::string_view text) const {
  std::vector<int32_t> out;
  encode_append(text, out);
  return out;
}

void Tokenizer::encode_append(std::string_view text, std::vector<int32_t>& out) const {
  require_text("encode text");
  if (hf_) return hf_->encode_append(text, out);
  if (merges_.empty() || text.size() < 2) {
    for (char ch : text) out.push_back(static_cast<unsigned char>(ch));
    return;
  }
  STRATA_REQUIRE(text.size() < static_cast<size_t>(std::numeric_limits<int32_t>::max()), "text of ", text.size(),
                 " bytes is too long to encode at once; at most 2 GiB");
  Chain c;
  c.build(std::span<const std::string_view>(&text, 1));
  // Positions where each merge may apply, by merge index; the smallest index is done first,
  // over its positions left to right, and only creates pairs of later merges.
  std::map<int32_t, std::vector<int32_t>> pending;
  auto note = [&](int32_t p) {
    const int32_t q = c.next[static_cast<size_t>(p)];
    if (q < 0) return;
    auto it = ranks_.find(key(c.tok[static_cast<size_t>(p)], c.tok[static_cast<size_t>(q)]));
    if (it != ranks_.end()) pending[it->second].push_back(p);
  };
  for (size_t p = 0; p + 1 < c.tok.size(); ++p) note(static_cast<int32_t>(p));
  while (!pending.empty()) {
    const int32_t rank = pending.begin()->first;
    std::vector<int32_t> positions = std::move(pending.begin()->second);
    pending.erase(pending.begin());
    std::sort(positions.begin(), positions.end());
    const auto [a, b] = merges_[static_cast<size_t>(rank)];
    for (int32_t p : positions) {
      const auto up = static_cast<size_t>(p);
      const int32_t q = c.next[up];
      // Stale when p was absorbed or its pair changed since it was noted.
      if (c.tok[up] != a || q < 0 || c.tok[static_cast<size_t>(q)] != b) continue;
      c.merge_at(p, 256 + rank);
      if (c.prev[up] >= 0) note(c.prev[up]);
      note(p);
    }
  }
  for (int32_t p = 0; p >= 0; p = c.next[static_cast<size_t>(p)]) out.push_back(c.tok[static_cast<size_t>(p)]);
}

std::string_view Tokenizer::piece(int32_t id) const {
  require_text("decode ids");
  STRATA_REQUIRE(id >= 0 && id < vocab_size_, "token id ", id, " is outside the vocabulary [0, ", vocab_size_, ")");
  if (hf_) return hf_->piece(id);
  if (id == eot_) return kEotText;
  return pieces_[static_cast<size_t>(id)];
}

std::string Tokenizer::decode(std::span<const int32_t> ids) const {
  std::string out;
  for (int32_t id : ids) out += piece(id);
  return out;
}

}  // namespace strata::io
