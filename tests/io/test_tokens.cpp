// Tokenizers (byte-level, BPE training and encoding, external) and TokenDataset: round trips,
// determinism, window arithmetic, reads across shard boundaries (in memory and from the files),
// and one test per kind of bad input at open.
#include <gtest/gtest.h>

#include <fstream>
#include <sstream>

#include "io/dataset.hpp"
#include "io/tokenizer.hpp"
#include "io/tokens.hpp"
#include "io_test_util.hpp"

namespace strata::io {
namespace {

using test::expect_input_error;
using test::TempDir;
using test::write_raw;

// Real text when the machine has it (GPL-3 is ~35 KB of English), else generated text.
std::string sample_text() {
  std::ifstream in("/usr/share/common-licenses/GPL-3", std::ios::binary);
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (text.size() > 10000) return text;
  std::ostringstream os;
  const char* words[] = {"the", "program", "license", "software", "free", "copy", "of", "and", "to", "you"};
  for (int i = 0; i < 6000; ++i) os << words[(i * 7 + i / 13) % 10] << ((i % 11 == 10) ? ".\n" : " ");
  return os.str();
}

// UTF-8 of several scripts, an emoji, and every byte value (invalid UTF-8 included).
std::string mixed_text() {
  std::string s = "naïve café — 日本語のテキスト, Ελληνικά, emoji 🙂🚀\n\ttabs\r\n";
  for (int b = 0; b < 256; ++b) s += static_cast<char>(b);
  return s + "<|endoftext|> is plain text here";
}

// Merges applied the slow, obvious way: merge 0 over the whole text left to right, then 1, ...
std::vector<int32_t> replay(const std::string& text, const std::vector<Merge>& merges) {
  std::vector<int32_t> ids;
  for (char c : text) ids.push_back(static_cast<unsigned char>(c));
  for (size_t m = 0; m < merges.size(); ++m) {
    std::vector<int32_t> next;
    for (size_t i = 0; i < ids.size(); ++i) {
      if (i + 1 < ids.size() && ids[i] == merges[m][0] && ids[i + 1] == merges[m][1]) {
        next.push_back(256 + static_cast<int32_t>(m));
        ++i;
      } else {
        next.push_back(ids[i]);
      }
    }
    ids.swap(next);
  }
  return ids;
}

TEST(Tokenizer, ByteLevelRoundTripsAnyBytes) {
  const Tokenizer t = Tokenizer::byte_level();
  EXPECT_EQ(t.name(), "byte");
  EXPECT_EQ(t.vocab_size(), 257);
  EXPECT_EQ(t.eot(), 256);
  const std::string text = mixed_text();
  const std::vector<int32_t> ids = t.encode(text);
  ASSERT_EQ(ids.size(), text.size());
  for (size_t i = 0; i < ids.size(); ++i) EXPECT_EQ(ids[i], static_cast<unsigned char>(text[i]));
  EXPECT_EQ(t.decode(ids), text);
  EXPECT_EQ(t.decode(std::vector<int32_t>{104, 105, 256, 33}), "hi<|endoftext|>!");
  expect_input_error([&] { t.decode(std::vector<int32_t>{257}); }, {"token id 257", "outside the vocabulary"});
}

TEST(Tokenizer, BpeTrainedMergesCompressAndRoundTrip) {
  const std::string text = sample_text();
  BpeTrainStats stats;
  const Tokenizer t = Tokenizer::train_bpe(text, 257 + 400, &stats);
  EXPECT_EQ(t.name(), "bpe");
  EXPECT_EQ(stats.merges, 400);
  EXPECT_EQ(t.merges().size(), 400u);
  EXPECT_EQ(t.vocab_size(), 657);
  EXPECT_EQ(t.eot(), 656);
  const std::vector<int32_t> ids = t.encode(text);
  // Encoding reproduces training's final segmentation, and merges shrink the text a lot.
  EXPECT_EQ(static_cast<int64_t>(ids.size()), stats.tokens_after);
  EXPECT_LT(ids.size() * 2, text.size()) << "400 merges should at least halve English text";
  EXPECT_EQ(t.decode(ids), text);
  for (int32_t id : ids) EXPECT_TRUE(id >= 0 && id < t.eot());
  // Text it was not trained on, including bytes it never saw: every byte is encodable.
  const std::string other = mixed_text();
  EXPECT_EQ(t.decode(t.encode(other)), other);
  EXPECT_EQ(t.encode(other), replay(other, t.merges()));
  // The fast encoder equals the obvious replay of the merges.
  const std::string part = text.substr(1000, 3000);
  EXPECT_EQ(t.encode(part), replay(part, t.merges()));
  // Each merge's piece is its two parts' bytes.
  for (size_t i = 0; i < t.merges().size(); ++i)
    EXPECT_EQ(t.piece(256 + static_cast<int32_t>(i)),
              std::string(t.piece(t.merges()[i][0])) + std::string(t.piece(t.merges()[i][1])));
}

TEST(Tokenizer, BpeTrainingIsDeterministicWithSmallestPairTies) {
  const std::string text = sample_text();
  EXPECT_EQ(Tokenizer::train_bpe(text, 500).merges(), Tokenizer::train_bpe(text, 500).merges());
  // (a, b) and (c, d) both occur twice: the smaller pair first; then no pair occurs twice.
  std::vector<std::string_view> docs{"abab", "cdcd"};
  BpeTrainStats stats;
  const Tokenizer t = Tokenizer::train_bpe(docs, 1000, &stats);
  EXPECT_EQ(t.merges(), (std::vector<Merge>{{'a', 'b'}, {'c', 'd'}}));
  EXPECT_EQ(stats.merges, 2);
  EXPECT_EQ(t.vocab_size(), 259);  // fewer merges than asked: the vocabulary is 257 + merges
  EXPECT_EQ(stats.tokens_after, 4);
}

TEST(Tokenizer, BpePairsDoNotSpanDocuments) {
  std::vector<std::string_view> split{"a", "a", "a", "a", "b", "b"};
  EXPECT_TRUE(Tokenizer::train_bpe(split, 300).merges().empty());
  // The same bytes as one document: (a, a) occurs 3 times (overlapping) and is merged; "aaa"
  // becomes (aa) a, left to right.
  const Tokenizer t = Tokenizer::train_bpe(std::string_view("aaaabb"), 258);
  ASSERT_EQ(t.merges(), (std::vector<Merge>{{'a', 'a'}}));
  EXPECT_EQ(t.encode("aaa"), (std::vector<int32_t>{256, 'a'}));
  EXPECT_EQ(t.encode("aaaaa"), (std::vector<int32_t>{256, 256, 'a'}));
}

TEST(Tokenizer, BadMergesAndExternal) {
  expect_input_error([] { Tokenizer::bpe({{'a', 'b'}, {'a', 258}}); }, {"BPE merge 1", "(97, 258)", "below 257"});
  expect_input_error([] { Tokenizer::train_bpe(std::string_view("abc"), 200); }, {"vocabulary size 200", ">= 257"});
  const Tokenizer e = Tokenizer::external(50257, 50256);
  EXPECT_EQ(e.name(), "external");
  EXPECT_FALSE(e.can_decode());
  expect_input_error([&] { e.decode(std::vector<int32_t>{1}); }, {"external", "cannot decode"});
  expect_input_error([&] { e.encode("x"); }, {"external", "cannot encode"});
  expect_input_error([] { Tokenizer::external(100, 100); }, {"end-of-text id 100"});
}

// Token i of the test streams.
int32_t token(int64_t i, int64_t vocab) { return static_cast<int32_t>((i * 7919 + 3) % vocab); }

std::vector<int32_t> stream(int64_t first, int64_t n, int64_t vocab) {
  std::vector<int32_t> v;
  for (int64_t i = first; i < first + n; ++i) v.push_back(token(i, vocab));
  return v;
}

class TokenModes : public ::testing::TestWithParam<bool> {
 protected:
  TokenDatasetOptions options() const { return {GetParam() ? int64_t{1} << 30 : 0}; }
};

TEST_P(TokenModes, WindowsAcrossShardBoundaries) {
  TempDir dir;
  const Tokenizer t = Tokenizer::byte_level();
  write_token_shard(dir / "t-0.h5", stream(0, 5, 257), t);
  write_token_shard(dir / "t-1.h5", stream(5, 3, 257), t);
  write_token_shard(dir / "t-2.h5", stream(8, 9, 257), t);
  TokenDataset ds = TokenDataset::open(dir.path().string(), "--data", options());
  EXPECT_EQ(ds.in_memory(), GetParam());
  EXPECT_EQ(ds.num_tokens(), 17);
  EXPECT_EQ(ds.vocab_size(), 257);
  EXPECT_EQ(ds.tokenizer().name(), "byte");
  EXPECT_EQ(ds.shard_tokens(), (std::vector<int64_t>{5, 3, 9}));
  EXPECT_EQ(ds.shard_dtypes()[0], "uint16");
  // Every [start, start + length): within one shard, across one boundary, across two.
  for (int64_t start = 0; start < 17; ++start)
    for (int64_t len = 0; start + len <= 17; ++len) {
      std::vector<int32_t> got(static_cast<size_t>(len) + 1, -1);
      ds.read_window(start, len, got.data());
      got.pop_back();
      ASSERT_EQ(got, stream(start, len, 257)) << "window [" << start << ", " << start + len << ")";
    }
  // (17 - 1) / T non-overlapping windows; targets are inputs shifted by one.
  EXPECT_EQ(ds.num_windows(1), 16);
  EXPECT_EQ(ds.num_windows(4), 4);
  EXPECT_EQ(ds.num_windows(5), 3);
  EXPECT_EQ(ds.num_windows(16), 1);
  std::vector<int32_t> x(4), y(4);
  for (int64_t i = 0; i < 4; ++i) {
    ds.read_sample(i, 4, x.data(), y.data());
    EXPECT_EQ(x, stream(4 * i, 4, 257));
    EXPECT_EQ(y, stream(4 * i + 1, 4, 257));
  }
  expect_input_error([&] { ds.num_windows(17); },
                     {"--data: sequence length 17 needs at least 18 tokens", "3 shards", "holds only 17"});
  expect_input_error([&] { ds.num_windows(0); }, {"--data: sequence length 0"});
  EXPECT_THROW(ds.read_window(10, 8, x.data()), Error);
}

TEST_P(TokenModes, WideVocabularyIsStoredAsUint32) {
  TempDir dir;
  const Tokenizer t = Tokenizer::external(70000, 69999);
  write_token_shard(dir / "w-0.h5", stream(0, 100, 70000), t);
  write_token_shard(dir / "w-1.h5", stream(100, 50, 70000), t);
  TokenDataset ds = TokenDataset::open(dir / "w-*.h5", "--data", options());
  EXPECT_EQ(ds.shard_dtypes(), (std::vector<std::string>{"uint32", "uint32"}));
  EXPECT_EQ(ds.tokenizer().name(), "external");
  EXPECT_EQ(ds.tokenizer().eot(), 69999);
  std::vector<int32_t> got(150);
  ds.read_window(0, 150, got.data());
  EXPECT_EQ(got, stream(0, 150, 70000));
}

INSTANTIATE_TEST_SUITE_P(InMemoryAndFromFile, TokenModes, ::testing::Bool());

TEST(TokenDataset, BpeMergesTravelWithTheData) {
  TempDir dir;
  const std::string text = sample_text();
  const Tokenizer t = Tokenizer::train_bpe(text, 257 + 100);
  std::vector<int32_t> ids = t.encode(text);
  ids.push_back(t.eot());
  write_token_shard(dir / "b.h5", ids, t);
  TokenDataset ds = TokenDataset::open(dir / "b.h5", "--data");
  EXPECT_EQ(ds.tokenizer().merges(), t.merges());
  EXPECT_EQ(ds.tokenizer().eot(), 356);
  std::vector<int32_t> got(ids.size());
  ds.read_window(0, ds.num_tokens(), got.data());
  EXPECT_EQ(ds.tokenizer().decode(got), text + std::string(Tokenizer::kEotText));
  EXPECT_TRUE(is_token_dataset(dir / "b.h5", "--data"));
}

// A token file written field by field, so each field can be wrong.
struct RawTokens {
  hid_t type = H5T_STD_U16LE;
  std::vector<hsize_t> dims{4};
  std::vector<uint32_t> values{1, 2, 3, 4};
  int64_t vocab = 257, eot = 256, num_tokens = -1;  // -1: not written
  std::string tokenizer = "byte", kind = "tokens";
  bool with_tokens = true, with_vocab = true;

  void write(const std::string& path) const {
    if (with_tokens)
      write_raw(path, "tokens", type, H5T_NATIVE_UINT32, dims, values.data());
    else
      write_raw(path, "other", H5T_STD_U16LE, H5T_NATIVE_UINT32, {4}, values.data());
    h5::File f(H5Fopen(path.c_str(), H5F_ACC_RDWR, H5P_DEFAULT));
    if (!kind.empty()) h5::write_attr(f, "kind", kind);
    if (with_vocab) h5::write_attr(f, "vocab_size", vocab);
    h5::write_attr(f, "eot", eot);
    h5::write_attr(f, "tokenizer", tokenizer);
    if (num_tokens >= 0) h5::write_attr(f, "num_tokens", num_tokens);
  }
};

TEST(TokenDataset, OpenErrorsNameTheFile) {
  TempDir dir;
  auto bad = [&](const RawTokens& r, const std::vector<std::string>& words) {
    static int n = 0;
    const std::string path = dir / ("bad-" + std::to_string(n++) + ".h5");
    r.write(path);
    std::vector<std::string> all{"--data: '" + path + "'"};
    all.insert(all.end(), words.begin(), words.end());
    expect_input_error([&] { TokenDataset::open(path, "--data"); }, all);
  };
  RawTokens ok;
  ok.write(dir / "ok.h5");
  EXPECT_EQ(TokenDataset::open(dir / "ok.h5", "--data").num_tokens(), 4);

  RawTokens r = ok;
  r.with_tokens = false;
  bad(r, {"has no dataset 'tokens'"});
  r = ok;
  r.type = H5T_STD_I32LE;
  bad(r, {"'tokens' have type int32", "expected uint16 or uint32"});
  r = ok;
  r.type = H5T_IEEE_F32LE;
  bad(r, {"type float32"});
  r = ok;
  r.dims = {2, 2};
  bad(r, {"'tokens' have shape [2, 2]", "expected 1-D"});
  r = ok;
  r.values = {1, 2, 257, 4};
  bad(r, {"holds token 257 at index 2", ">= vocab_size 257"});
  r = ok;
  r.dims = {0};
  bad(r, {"is empty"});
  r = ok;
  r.num_tokens = 5;
  bad(r, {"has num_tokens 5 but 'tokens' holds 4"});
  r = ok;
  r.with_vocab = false;
  bad(r, {"no root attribute 'vocab_size'"});
  r = ok;
  r.kind = "images";
  bad(r, {"has kind 'images'"});
  r = ok;
  r.vocab = 300;
  bad(r, {"tokenizer 'byte' with vocab_size 300"});
  r = ok;
  r.tokenizer = "bpe";
  bad(r, {"tokenizer 'bpe' but no dataset 'tokenizer/merges'"});
  r = ok;
  r.tokenizer = "wordpiece";
  bad(r, {"has tokenizer 'wordpiece'", "byte, bpe, hf or external"});
  r = ok;
  r.eot = 257;
  bad(r, {"has eot 257 outside the vocabulary"});

  // Shards that disagree.
  TempDir mixed;
  ok.write(mixed / "a.h5");
  write_token_shard(mixed / "b.h5", std::vector<int32_t>{1, 2}, Tokenizer::external(300, 299));
  expect_input_error([&] { TokenDataset::open(mixed.path().string(), "--data"); },
                     {"--data: '" + (mixed / "b.h5") + "' has tokenizer 'external' (vocab_size 300",
                      "'byte' (vocab_size 257", "all shards must agree"});
  TempDir merges;
  write_token_shard(merges / "a.h5", std::vector<int32_t>{1, 2}, Tokenizer::bpe({{'a', 'b'}}));
  write_token_shard(merges / "b.h5", std::vector<int32_t>{1, 2}, Tokenizer::bpe({{'a', 'c'}}));
  expect_input_error([&] { TokenDataset::open(merges.path().string(), "--val-data"); },
                     {"--val-data: '" + (merges / "b.h5") + "'", "all shards must agree"});

  // The spec itself, and a file that is not a token dataset.
  expect_input_error([&] { TokenDataset::open(dir / "missing.h5", "--data"); }, {"--data: '", "does not exist"});
  expect_input_error([&] { TokenDataset::open(dir / "none-*.h5", "--data"); }, {"matches no files"});
  Tensor x = Tensor::zeros({2, 3});
  const std::vector<int32_t> y{0, 1};
  write_shard(dir / "classes.h5", x, y, {});
  EXPECT_FALSE(is_token_dataset(dir / "classes.h5", "--data"));
  expect_input_error([&] { TokenDataset::open(dir / "classes.h5", "--data"); }, {"has no dataset 'tokens'"});
  std::ofstream(dir / "text.h5") << "not hdf5";
  expect_input_error([&] { TokenDataset::open(dir / "text.h5", "--data"); }, {"is not an HDF5 file"});
}

TEST(TokenDataset, WriterRejectsIdsOutsideTheVocabularyAndRemovesItsFile) {
  TempDir dir;
  const std::string path = dir / "w.h5";
  expect_input_error(
      [&] {
        write_token_shard(path, std::vector<int32_t>{1, 257}, Tokenizer::byte_level());
      },
      {"token 257 at index 1", "outside the vocabulary [0, 257)"});
  EXPECT_FALSE(std::filesystem::exists(path));
}

}  // namespace
}  // namespace strata::io
