// Tokenizers for language-model data (docs/formats.md, "Token datasets"): byte-level (one token
// per byte), byte-level BPE, Hugging Face byte-level BPE from a tokenizer.json (io/hf_bpe.hpp: its
// own ids, eot one of its added tokens), and "external" (ids imported from elsewhere, no
// vocabulary).
//
// Ids: 0..255 are the bytes; BPE merge i creates id 256 + i; the end-of-text id `eot` follows
// them: 256 for byte-level (vocab_size 257), 256 + M for BPE with M merges (vocab_size 257 + M).
// Every byte string is encodable (byte-level BPE has no unknown symbols); encode never produces
// eot: documents are separated by appending it.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace strata::io {

class HfBpe;

// A merge: the pair of ids (left, right) that becomes one new id.
using Merge = std::array<int32_t, 2>;

// What train_bpe did, for reports and tests.
struct BpeTrainStats {
  int64_t bytes = 0;         // text trained on
  int64_t tokens_after = 0;  // the text's token count with all learned merges applied
  int64_t merges = 0;        // merges learned (fewer than asked when no pair occurs twice)
  double seconds = 0.0;
};

class Tokenizer {
 public:
  enum class Kind { Byte, Bpe, Hf, External };

  // The text shown for eot by decode (encode treats this text as ordinary bytes).
  static constexpr std::string_view kEotText = "<|endoftext|>";

  static Tokenizer byte_level();
  // BPE from merges in merge order; an Input error unless merge i's ids are < 256 + i.
  static Tokenizer bpe(std::vector<Merge> merges);
  // Hugging Face byte-level BPE from tokenizer.json text (an Input error when it is not one);
  // eot is the token `eot_token` names, or by default <|endoftext|> / <|end_of_text|>.
  static Tokenizer hf(std::string json, std::string_view eot_token = {});
  // The same with eot given by id (as token shards store it).
  static Tokenizer hf_with_eot(std::string json, int64_t eot);
  // Ids without a vocabulary (e.g. GPT-2 ids from llm.c files): no encode or decode.
  static Tokenizer external(int64_t vocab_size, int32_t eot);

  // Byte-level BPE learned from `documents`: each round merges the most frequent adjacent pair
  // (ties: the smallest (left, right) ids), pairs never span two documents; stops after
  // vocab_size - 257 merges or when no pair occurs twice. Deterministic. Pair counts are updated
  // incrementally from the positions each merge touches (no recount per merge).
  static Tokenizer train_bpe(std::span<const std::string_view> documents, int64_t vocab_size,
                             BpeTrainStats* stats = nullptr);
  static Tokenizer train_bpe(std::string_view text, int64_t vocab_size, BpeTrainStats* stats = nullptr);

  Kind kind() const { return kind_; }
  // "byte", "bpe", "hf" or "external", as stored in the `tokenizer` attribute.
  const std::string& name() const { return name_; }
  int64_t vocab_size() const { return vocab_size_; }
  int32_t eot() const { return eot_; }
  const std::vector<Merge>& merges() const { return merges_; }
  bool can_decode() const { return kind_ != Kind::External; }
  // The Hugging Face tokenizer (kind Hf), else null.
  const HfBpe* hf_model() const { return hf_.get(); }
  // Its tokenizer.json text ("" for other kinds).
  const std::string& hf_json() const;

  // Text to ids (never eot). External tokenizers throw an Input error.
  std::vector<int32_t> encode(std::string_view text) const;
  void encode_append(std::string_view text, std::vector<int32_t>& out) const;
  // Ids to text; eot becomes kEotText (hf: its token's text). An Input error for an id outside the vocabulary or an
  // external tokenizer.
  std::string decode(std::span<const int32_t> ids) const;
  // The bytes of one token (kEotText for eot; hf: added tokens as written).
  std::string_view piece(int32_t id) const;

 private:
  Tokenizer(Kind kind, int64_t vocab_size, int32_t eot, std::vector<Merge> merges);
  void require_text(const char* what) const;

  Kind kind_ = Kind::Byte;
  std::string name_;
  int64_t vocab_size_ = 257;
  int32_t eot_ = 256;
  std::vector<Merge> merges_;
  std::vector<std::string> pieces_;              // bytes of ids below eot
  std::unordered_map<uint64_t, int32_t> ranks_;  // (left << 32 | right) -> merge index
  std::shared_ptr<const HfBpe> hf_;              // kind Hf: immutable, shared by copies
};

}  // namespace strata::io
