// UTF-8 and byte-level helpers of the Hugging Face tokenizer (io/hf_bpe): GPT-2's byte to code
// point map, encoding and decoding one code point, and Unicode White_Space as Rust judges it.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>

namespace strata::io::utf8 {

// GPT-2's bytes_to_unicode: printable Latin-1 bytes stand for themselves, the other 68 bytes
// for code points 256, 257, ... in byte order. Returns byte -> code point.
std::array<uint32_t, 256> bytes_to_unicode();

// The UTF-8 bytes of code point `cp`.
std::string encode(uint32_t cp);

constexpr uint32_t kInvalid = 0xFFFFFFFFu;

// The code point starting at s[i] and its length in bytes; (kInvalid, 1) for a byte that starts
// no well-formed character (overlong forms and surrogates included, as PCRE2 and ICU judge).
std::pair<uint32_t, size_t> next_char(std::string_view s, size_t i);

// Rust's char::is_whitespace (Unicode White_Space), which lstrip/rstrip of added tokens use.
bool is_space(uint32_t cp);

// Length of the whitespace character ending at s[end) (0 when there is none).
size_t space_before(std::string_view s, size_t end);
// Length of the whitespace character starting at s[i] (0 when there is none).
size_t space_at(std::string_view s, size_t i);

}  // namespace strata::io::utf8
