#!/usr/bin/env python3
"""Writes tests/fixtures/hf/: two small byte-level BPE tokenizer.json files trained by the
Hugging Face `tokenizers` library on Debian text, and the ids that library's encode gives for a
set of tricky strings (the oracle test_io_hf_tokenizer compares io::Tokenizer with).

  gpt2.json   ByteLevel pre-tokenizer (GPT-2's regex built in), <|endoftext|>, <mask> (lstrip,
              as RoBERTa has it) and a non-special added token [note]
  llama3.json Sequence[Split(Llama 3's regex, isolated), ByteLevel(use_regex=false)],
              ignore_merges, <|begin_of_text|> and <|end_of_text|>
  qwen2.json  NFC normalizer, Sequence[Split(Qwen 2's regex: single digits), ByteLevel],
              <|endoftext|>, <|im_start|>, <|im_end|>
  cases.json  {"tokenizers": VERSION, "cases": [{"tokenizer", "text", "ids", "decoded"}]}

Run with a python that has `tokenizers` (bench/.venv): python make_tokenizer_fixtures.py [OUT_DIR]
Also used by tests/interop/check_hf_tokenizer.py to build the same tokenizers on the fly.
"""
import json
import os
import sys

GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
LLAMA3_PATTERN = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
                  r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")

QWEN2_PATTERN = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
                 r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")

TRAIN_FILES = ["/usr/share/common-licenses/GPL-3", "/usr/share/common-licenses/Apache-2.0",
               "/usr/share/common-licenses/MPL-2.0"]

# English, accents, CJK, emoji, whitespace runs, digits, contractions, added tokens in text.
CASES = [
    "",
    " ",
    "\n",
    "Hello, world!",
    "The GNU General Public License is a free, copyleft license for software.",
    "don't I'll we've they're she'd it's I'M DON'T We'Ve",
    "café naïve résumé Ångström façade — “quoted” ‘single’",
    "e\u0301 combining accent, Zoë, Ελληνικά, русский текст",
    "日本語のテキストと中文分词测试、한국어 문장。",
    "emoji 👍🏽 🇫🇷 👨‍👩‍👧 ❤️ 🤖!",
    "   leading spaces",
    "trailing spaces   ",
    "\t\ttabs\tinside\t",
    "line one\nline two\n\n\nthree blank\r\nwindows\r\n",
    "  \n  \n mixed whitespace \t \n",
    "nbsp\u00a0and\u3000ideographic space\u2009thin",
    "12345 3.14159 1,000,000 2024-05-20 12345678901234567890",
    "version v1.2.3-rc4 and 0x7fff_ffff",
    "a<|endoftext|>b",
    "<|endoftext|><|endoftext|> two in a row",
    "end of document.<|endoftext|>",
    "x <mask> y  <mask>z",
    "hello[note]world [note] again",
    "<|begin_of_text|>Llama's own <|end_of_text|> tokens",
    "<|endoftext",
    "zero\u200bwidth and soft\u00adhyphen",
    "int main() { return 0; } // code\n\tif (x != y) { y += 2; }",
    "ＦＵＬＬＷＩＤＴＨ ａｂｃ",
    "مرحبا بالعالم",
    "!!!??? ... ---- ____ ****",
    "not NFC: Ame\u0301lie, \u212bngstro\u0308m, \u1100\u1161 hangul jamo, \ufb01ne ligature",
    "<|im_start|>user\nhi<|im_end|>",
    # Where regex engines may disagree: Unicode White_Space and its neighbours, \p{N} beyond 0-9,
    # combining marks (not \p{L}), a byte-order mark.
    "a\u0085b\u1680c\u2000d\u200ae\u2028f\u2029g\u202fh\u205fi\u180ej\ufeffk \u000bl\u000cm\u001cn",
    "Ⅻ ½ ² ٣٤ １２３ ௰ 𝟘𝟙 x²+y³",
    "नमस्ते दुनिया, ภาษาไทย, עִבְרִית, I'D 'S 'Re",
]


def train(kind, vocab_size=1500, files=TRAIN_FILES):
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    if kind == "gpt2":
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        special = ["<|endoftext|>"]
    else:
        tok = Tokenizer(models.BPE(ignore_merges=kind == "llama3"))
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(LLAMA3_PATTERN if kind == "llama3" else QWEN2_PATTERN), behavior="isolated",
                                 invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
        special = ["<|begin_of_text|>", "<|end_of_text|>"] if kind == "llama3" else [
            "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
        if kind == "qwen2":
            tok.normalizer = normalizers.NFC()
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train(files, trainer)
    if kind == "gpt2":
        tok.add_special_tokens([AddedToken("<mask>", lstrip=True, special=True)])
        tok.add_tokens([AddedToken("[note]", special=False)])
    return tok


def main():
    import tokenizers
    out = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "../../tests/fixtures/hf")
    os.makedirs(out, exist_ok=True)
    cases = []
    for kind in ("gpt2", "llama3", "qwen2"):
        tok = train(kind)
        tok.save(os.path.join(out, kind + ".json"), pretty=False)
        for text in CASES:
            ids = tok.encode(text, add_special_tokens=False).ids
            decoded = tok.decode(ids, skip_special_tokens=False)
            cases.append({"tokenizer": kind + ".json", "text": text, "ids": ids, "decoded": decoded})
    with open(os.path.join(out, "cases.json"), "w", encoding="utf-8") as f:
        json.dump({"tokenizers": tokenizers.__version__, "cases": cases}, f, ensure_ascii=False, indent=0)
    print(f"wrote {out}: gpt2.json, llama3.json, qwen2.json, cases.json ({len(cases)} cases, tokenizers {tokenizers.__version__})")


if __name__ == "__main__":
    main()
