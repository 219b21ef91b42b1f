// Hugging Face byte-level BPE (io/hf_bpe.hpp) against ids the `tokenizers` library produced
// (tests/fixtures/hf, made by tools/interop/make_tokenizer_fixtures.py): GPT-2-style,
// Llama-3-style and Qwen-2-style (NFC) tokenizer.json files on English, accents, CJK, emoji,
// whitespace runs, digits, contractions and added tokens inside text. Also: decoding round-trips (any bytes), token
// shards store and reload the tokenizer, and each kind of bad tokenizer.json is one-line Input error.
#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <thread>

#include "io/hf_bpe.hpp"
#include "io/tokenizer.hpp"
#include "io/tokens.hpp"
#include "io_test_util.hpp"

namespace strata::io {
namespace {

using test::expect_input_error;
using test::TempDir;

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  EXPECT_TRUE(in.good()) << path;
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

std::string fixture(const std::string& name) { return read_file(std::string(STRATA_HF_FIXTURES) + "/" + name); }

TEST(HfTokenizer, IdsEqualTheLibrarysOnTrickyStrings) {
  const auto cases = nlohmann::json::parse(fixture("cases.json"));
  std::map<std::string, Tokenizer> toks;
  for (const char* name : {"gpt2.json", "llama3.json", "qwen2.json"}) toks.emplace(name, Tokenizer::hf(fixture(name)));
  int checked = 0;
  for (const auto& c : cases.at("cases")) {
    const Tokenizer& tok = toks.at(c.at("tokenizer").get<std::string>());
    const auto text = c.at("text").get<std::string>();
    const auto expected = c.at("ids").get<std::vector<int32_t>>();
    EXPECT_EQ(tok.encode(text), expected) << c.at("tokenizer") << ": \"" << text << "\"";
    // The library's decode: the text itself, except whitespace an lstrip token absorbed and
    // what NFC changed.
    EXPECT_EQ(tok.decode(expected), c.at("decoded").get<std::string>()) << c.at("tokenizer");
    if (text.find("<mask>") == std::string::npos && c.at("tokenizer") != "qwen2.json") {
      EXPECT_EQ(tok.decode(expected), text) << c.at("tokenizer");
    }
    ++checked;
  }
  EXPECT_GE(checked, 90);
}

TEST(HfTokenizer, EndOfTextAndVocabulary) {
  const Tokenizer gpt2 = Tokenizer::hf(fixture("gpt2.json"));
  EXPECT_EQ(gpt2.kind(), Tokenizer::Kind::Hf);
  EXPECT_EQ(gpt2.name(), "hf");
  EXPECT_EQ(gpt2.piece(gpt2.eot()), "<|endoftext|>");
  EXPECT_EQ(gpt2.vocab_size(), 1502);  // 1500 trained + <mask> + [note]
  const Tokenizer llama = Tokenizer::hf(fixture("llama3.json"));
  EXPECT_EQ(llama.piece(llama.eot()), "<|end_of_text|>");
  EXPECT_EQ(Tokenizer::hf(fixture("llama3.json"), "<|begin_of_text|>").eot(), 0);
  expect_input_error([&] { Tokenizer::hf(fixture("gpt2.json"), "<|nope|>"); }, {"no token '<|nope|>'"});
  expect_input_error([&] { gpt2.decode(std::vector<int32_t>{1502}); }, {"outside the vocabulary"});
}

TEST(HfTokenizer, AnyBytesRoundTrip) {
  std::string s = "naïve café — 日本語, emoji 🙂🚀\n\ttabs  \r\n   ";
  for (int b = 0; b < 256; ++b) s += static_cast<char>(b);  // invalid UTF-8 included
  s += "\xe6\x97<|endoftext|>\xff tail";
  for (const char* name : {"gpt2.json", "llama3.json", "qwen2.json"}) {  // s is NFC where it is UTF-8
    const Tokenizer tok = Tokenizer::hf(fixture(name));
    EXPECT_EQ(tok.decode(tok.encode(s)), s) << name;
  }
  // NFC composes e + U+0301 into U+00E9, also between bytes that are not UTF-8.
  const Tokenizer qwen = Tokenizer::hf(fixture("qwen2.json"));
  EXPECT_EQ(qwen.decode(qwen.encode("\xff"
                                    "e\xcc\x81\xfe")),
            "\xff\xc3\xa9\xfe");
  const std::string gpl = read_file("/usr/share/common-licenses/GPL-3");
  const Tokenizer tok = Tokenizer::hf(fixture("gpt2.json"));
  const std::vector<int32_t> ids = tok.encode(gpl);
  EXPECT_EQ(tok.decode(ids), gpl);
  EXPECT_LT(ids.size(), gpl.size() / 3);  // trained on it: well compressed
}

TEST(HfTokenizer, ShardsStoreAndReloadIt) {
  TempDir dir;
  const Tokenizer tok = Tokenizer::hf(fixture("llama3.json"));
  std::vector<int32_t> ids = tok.encode("Hello, world! 日本語");
  ids.push_back(tok.eot());
  write_token_shard(dir / "a.h5", ids, tok);
  write_token_shard(dir / "b.h5", ids, tok);
  const TokenDataset ds = TokenDataset::open(dir.path().string(), "--data");
  EXPECT_EQ(ds.tokenizer().kind(), Tokenizer::Kind::Hf);
  EXPECT_EQ(ds.tokenizer().eot(), tok.eot());
  EXPECT_EQ(ds.vocab_size(), tok.vocab_size());
  EXPECT_EQ(ds.tokenizer().hf_json(), tok.hf_json());
  EXPECT_EQ(ds.tokenizer().decode(ids), "Hello, world! 日本語<|end_of_text|>");
  EXPECT_EQ(ds.tokenizer().encode("Hello, world! 日本語"), tok.encode("Hello, world! 日本語"));

  // Another tokenizer.json in one shard: the shards disagree.
  write_token_shard(dir / "c.h5", ids, Tokenizer::hf(fixture("llama3.json"), "<|begin_of_text|>"));
  expect_input_error([&] { TokenDataset::open(dir.path().string(), "--data"); }, {"c.h5", "all shards must agree"});
}

// Forms other files use: merges as "left right" strings (tokenizers < 0.20), normalizers in a
// Sequence (empty, as DeepSeek V3's, or NFC alone).
TEST(HfTokenizer, OtherSpellings) {
  const std::string gpl = read_file("/usr/share/common-licenses/GPL-3") + "Ame\u0301lie";
  auto j = nlohmann::json::parse(fixture("gpt2.json"));
  for (auto& m : j["model"]["merges"]) m = m[0].get<std::string>() + " " + m[1].get<std::string>();
  j["normalizer"] = {{"type", "Sequence"}, {"normalizers", nlohmann::json::array()}};
  EXPECT_EQ(Tokenizer::hf(j.dump()).encode(gpl), Tokenizer::hf(fixture("gpt2.json")).encode(gpl));
  auto q = nlohmann::json::parse(fixture("qwen2.json"));
  q["normalizer"] = {{"type", "Sequence"}, {"normalizers", {{{"type", "NFC"}}}}};
  EXPECT_EQ(Tokenizer::hf(q.dump()).encode(gpl), Tokenizer::hf(fixture("qwen2.json")).encode(gpl));
}

// Encoding keeps one cache between calls and gives other threads their own: same ids.
TEST(HfTokenizer, ConcurrentEncodes) {
  const Tokenizer tok = Tokenizer::hf(fixture("llama3.json"));
  const std::string gpl = read_file("/usr/share/common-licenses/GPL-3");
  const std::vector<int32_t> want = tok.encode(gpl);
  std::vector<std::thread> threads;
  std::vector<int> same(4, 0);
  for (size_t t = 0; t < same.size(); ++t)
    threads.emplace_back([&, t] {
      for (int k = 0; k < 3; ++k) same[t] += tok.encode(gpl) == want;
    });
  for (auto& th : threads) th.join();
  EXPECT_EQ(same, std::vector<int>(4, 3));
}

// Ids as the file gives them, holes included: an added token with id 100000 (as Llama 3's
// 128256 ids, added tokens after the vocabulary) makes vocab_size 100001 and uint32 shards; ids
// no token has do not decode; the other ids are unchanged.
TEST(HfTokenizer, LargeIdsAndHoles) {
  auto j = nlohmann::json::parse(fixture("llama3.json"));  // with ignore_merges
  j["added_tokens"].push_back({{"id", 100000}, {"content", "<|big|>"}, {"special", true}, {"normalized", false}});
  const Tokenizer tok = Tokenizer::hf(j.dump());
  EXPECT_EQ(tok.vocab_size(), 100001);
  const std::vector<int32_t> ids = tok.encode("a<|big|>b");
  EXPECT_EQ(ids, (std::vector<int32_t>{tok.encode("a")[0], 100000, tok.encode("b")[0]}));
  TempDir dir;
  write_token_shard(dir / "big.h5", ids, tok);
  const TokenDataset ds = TokenDataset::open(dir / "big.h5", "--data");
  EXPECT_EQ(ds.shard_dtypes()[0], "uint32");
  EXPECT_EQ(ds.tokenizer().decode(ids), "a<|big|>b");
  expect_input_error([&] { tok.decode(std::vector<int32_t>{50000}); }, {"token id 50000 is not in the tokenizer.json"});
  const std::string gpl = read_file("/usr/share/common-licenses/GPL-3");
  EXPECT_EQ(tok.encode(gpl), Tokenizer::hf(fixture("llama3.json")).encode(gpl));
}

// Shards whose hf tokenizer is missing, damaged or of another size: one line naming the file.
TEST(HfTokenizer, BadShards) {
  TempDir dir;
  const Tokenizer tok = Tokenizer::hf(fixture("gpt2.json"));
  const std::vector<int32_t> ids{5, 6, tok.eot()};
  auto edit = [&](const std::string& name, auto&& change) {
    const std::string path = dir / name;
    write_token_shard(path, ids, tok);
    h5::File f(H5Fopen(path.c_str(), H5F_ACC_RDWR, H5P_DEFAULT));
    change(f);
    return path;
  };
  auto open = [](const std::string& path) { return [path] { TokenDataset::open(path, "--data"); }; };
  expect_input_error(open(edit("nojson.h5", [](hid_t f) { H5Ldelete(f, "tokenizer/json", H5P_DEFAULT); })),
                     {"nojson.h5", "tokenizer 'hf' but no dataset 'tokenizer/json'"});
  expect_input_error(open(edit("badjson.h5",
                               [](hid_t f) {
                                 H5Ldelete(f, "tokenizer/json", H5P_DEFAULT);
                                 const std::string text = "{\"model\": [";
                                 const hsize_t n = text.size();
                                 h5::Space space(H5Screate_simple(1, &n, nullptr));
                                 h5::DataSet d(H5Dcreate2(f, "tokenizer/json", H5T_STD_U8LE, space, H5P_DEFAULT,
                                                          H5P_DEFAULT, H5P_DEFAULT));
                                 H5Dwrite(d, H5T_NATIVE_UCHAR, H5S_ALL, H5S_ALL, H5P_DEFAULT, text.data());
                               })),
                     {"badjson.h5", "has a 'tokenizer/json' that is not valid JSON"});
  expect_input_error(open(edit("vocab.h5", [](hid_t f) { h5::write_attr(f, "vocab_size", int64_t{50257}); })),
                     {"vocab.h5", "vocab_size 50257", "1502 ids"});
  expect_input_error(open(edit("eot.h5", [](hid_t f) { h5::write_attr(f, "eot", int64_t{1502}); })),
                     {"eot.h5", "eot 1502 outside the vocabulary"});
}

// Each way a tokenizer.json can be wrong: one line naming what.
TEST(HfTokenizer, BadTokenizerJson) {
  const auto good = nlohmann::json::parse(fixture("gpt2.json"));
  auto bad = [&](auto&& edit, std::vector<std::string> words) {
    nlohmann::json j = good;
    edit(j);
    expect_input_error([&] { Tokenizer::hf(j.dump()); }, words);
  };
  expect_input_error([] { Tokenizer::hf("{\"model\": {\"type\": \"BPE\", "); }, {"not valid JSON"});
  expect_input_error([] { Tokenizer::hf("[1, 2]"); }, {"not a tokenizer.json"});
  bad([](auto& j) { j["model"]["type"] = "WordPiece"; }, {"not byte-level BPE", "WordPiece"});
  bad([](auto& j) { j["pre_tokenizer"] = {{"type", "Whitespace"}}; }, {"not byte-level BPE", "Whitespace"});
  bad([](auto& j) { j["pre_tokenizer"] = nullptr; }, {"not byte-level BPE"});
  bad([](auto& j) { j["normalizer"] = {{"type", "Lowercase"}}; }, {"normalizer 'Lowercase'", "NFC"});
  bad([](auto& j) { j["model"]["merges"][3] = {"Ġt", "zzz"}; }, {"merge 3", "'zzz' is not in the vocabulary"});
  bad([](auto& j) { j["model"]["merges"][5] = "onlyone"; }, {"merge 5", "two tokens"});
  bad([](auto& j) { j["model"]["vocab"].erase("a"); }, {"no token for byte 97"});
  bad([](auto& j) { j["model"]["vocab"] = 7; }, {"model.vocab"});
  bad([](auto& j) { j["model"]["dropout"] = 0.1; }, {"dropout"});
  bad([](auto& j) { j["model"]["continuing_subword_prefix"] = "##"; }, {"continuing_subword_prefix"});
  bad([](auto& j) { j["added_tokens"][0]["single_word"] = true; }, {"single_word"});
  bad([](auto& j) { j["added_tokens"][0]["content"] = 5; }, {"unexpected structure"});
  bad(
      [](auto& j) {
        j["pre_tokenizer"] = {{"type", "Sequence"},
                              {"pretokenizers",
                               {{{"type", "Split"}, {"pattern", {{"Regex", "(unclosed"}}}, {"behavior", "Isolated"}},
                                {{"type", "ByteLevel"}, {"use_regex", false}}}}};
      },
      {"cannot compile", "Split"});
  bad(
      [](auto& j) {
        j["added_tokens"] = nlohmann::json::array();
        j["model"]["vocab"].erase("<|endoftext|>");
      },
      {"<|endoftext|>", "--eot-token"});
}

}  // namespace
}  // namespace strata::io
