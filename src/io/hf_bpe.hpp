// Hugging Face byte-level BPE read from a `tokenizer.json` (the `tokenizers` library's format),
// as GPT-2, RoBERTa, Llama 3 and Qwen 2 ship it; held by io::Tokenizer (kind Hf), which is what
// the rest of the code uses. Encoding matches `tokenizers`' `encode(text,
// add_special_tokens=False)`: added tokens are split out of the text first (those with
// normalized=false, then those with normalized=true; leftmost-longest; lstrip/rstrip absorb
// whitespace), each stretch between them is pre-tokenized (the Split regexes and ByteLevel of
// the pre_tokenizer, in order, PCRE2 in UTF + UCP mode) and every pre-token is merged by rank
// (lowest rank first, then leftmost, as the library's BPE does). A normalizer (NFC as Qwen 2 has,
// NFD, NFKC, NFKD; ICU) applies between the two kinds of added tokens, as in the library. Ids are
// the tokenizer.json's. Only what changes no id is ignored (offsets, the post-processor); anything
// else this does not implement (other normalizers and pre-tokenizers, dropout, subword prefixes)
// is an Input error.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace strata::io {

class HfBpe {
 public:
  // Parses tokenizer.json text; an Input error (one line, what is wrong and where) when it is
  // not byte-level BPE or is malformed.
  explicit HfBpe(std::string json);
  ~HfBpe();
  HfBpe(const HfBpe&) = delete;
  HfBpe& operator=(const HfBpe&) = delete;

  // The tokenizer.json text as given (what token shards store).
  const std::string& json() const;
  // Highest id (vocabulary or added token) + 1.
  int64_t vocab_size() const;
  int64_t num_merges() const;
  int64_t num_added() const;
  // The id of the token spelled `content` (an added token's content, or a vocabulary entry as
  // tokenizer.json writes it); -1 when there is none.
  int32_t find(std::string_view content) const;
  // The end-of-text id when `name` is empty: the added token <|endoftext|>, else <|end_of_text|>;
  // else the token `name`. An Input error when there is none.
  int32_t end_of_text(std::string_view name) const;

  // Appends the ids of `text` (any bytes; invalid UTF-8 is never matched by the regexes, so it
  // forms pre-tokens of its own). Thread safe.
  void encode_append(std::string_view text, std::vector<int32_t>& out) const;
  // The bytes of token `id` (an added token's content); an Input error for an id outside the
  // vocabulary or one no token has.
  std::string_view piece(int32_t id) const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace strata::io
