// strata-data: makes and checks datasets in Strata's HDF5 format (docs/formats.md).
//   strata-data convert-idx --images X-images-idx3-ubyte.gz --labels X-labels-idx1-ubyte.gz --out PREFIX
//                           [--shards N] [--stats-from DATA]
//   strata-data synthetic --out PREFIX --samples N --shape C,H,W|F --classes K [--shards S] [--seed X] [--dtype u8|f32]
//                         [--first-sample I] [--stats-from DATA]
//   strata-data tokenize --input FILE_OR_DIR... --out PREFIX --tokenizer byte|bpe [--vocab-size N]
//                        [--val-fraction F] [--shards K]
//   strata-data import-bin --input FILE_OR_DIR... --out PREFIX [--vocab-size N] [--eot ID] [--raw]
//   strata-data inspect SPEC
//   strata-data bench SPEC [--batch B] [--steps N]
// Bad input exits with code 2 and one line on stderr; other failures with code 1.
#include <zlib.h>

#include <boost/program_options.hpp>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <limits>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "core/error.hpp"
#include "core/rng.hpp"
#include "core/tensor.hpp"
#include "io/dataset.hpp"
#include "io/loader.hpp"
#include "io/sampler.hpp"
#include "io/tokenizer.hpp"
#include "io/tokens.hpp"

namespace po = boost::program_options;
using namespace strata;
using io::ShardAttrs;

namespace {

constexpr const char* kUsage =
    "usage: strata-data <command> [options]\n"
    "commands:\n"
    "  convert-idx --images FILE.gz --labels FILE.gz --out PREFIX [--shards N] [--stats-from DATA]\n"
    "      convert (Fashion-)MNIST IDX files to HDF5 shards\n"
    "  synthetic --out PREFIX --samples N --shape C,H,W|F --classes K [--shards S] [--seed X] [--dtype u8|f32]\n"
    "            [--first-sample I] [--stats-from DATA]\n"
    "      write a small learnable dataset (class patterns plus noise)\n"
    "  tokenize --input FILE_OR_DIR... --out PREFIX --tokenizer byte|bpe [--vocab-size N] [--val-fraction F]\n"
    "           [--shards K]\n"
    "      tokenize text files (one document each) into PREFIX-train and PREFIX-val token shards\n"
    "  import-bin --input FILE_OR_DIR... --out PREFIX [--vocab-size 50257] [--eot ID] [--raw]\n"
    "      convert llm.c (or, with --raw, headerless nanoGPT) .bin token files to token shards\n"
    "  inspect SPEC\n"
    "      describe a dataset or token dataset: a file, a directory of .h5 files, or a glob pattern\n"
    "  bench SPEC [--batch B] [--steps N]\n"
    "      time shuffled batch reads: in memory, from the files, and through the prefetching loader\n";

// ---- IDX (big-endian header, then raw bytes; gzip-compressed) ------------------------------

struct Idx {
  std::vector<int64_t> dims;
  std::vector<uint8_t> data;
};

// Reads an IDX file of unsigned bytes with `ndims` dimensions; `flag` names it in errors.
Idx read_idx(const std::string& path, int ndims, const std::string& flag) {
  gzFile f = gzopen(path.c_str(), "rb");
  STRATA_REQUIRE(f != nullptr, flag, ": cannot open '", path, "'");
  struct Closer {
    gzFile f;
    ~Closer() { gzclose(f); }
  } closer{f};
  auto read_exact = [&](void* dst, size_t n, const char* what) {
    auto* p = static_cast<uint8_t*>(dst);
    size_t done = 0;
    while (done < n) {
      const unsigned chunk = static_cast<unsigned>(std::min<size_t>(n - done, 1u << 30));
      const int got = gzread(f, p + done, chunk);
      STRATA_REQUIRE(got > 0, flag, ": '", path, "' is truncated or not gzip: expected ", n, " bytes of ", what,
                     ", found ", done);
      done += static_cast<size_t>(got);
    }
  };
  uint8_t magic[4];
  read_exact(magic, 4, "header");
  const uint32_t expected = 0x0800u | static_cast<uint32_t>(ndims);
  const uint32_t found = (uint32_t{magic[0]} << 24) | (uint32_t{magic[1]} << 16) | (uint32_t{magic[2]} << 8) | magic[3];
  char buf[64];
  std::snprintf(buf, sizeof buf, "0x%08x, found 0x%08x", expected, found);
  STRATA_REQUIRE(found == expected, flag, ": '", path, "' is not an IDX file of ", ndims,
                 "-D unsigned bytes: expected magic ", buf);
  Idx idx;
  int64_t total = 1;
  for (int d = 0; d < ndims; ++d) {
    uint8_t b[4];
    read_exact(b, 4, "header");
    idx.dims.push_back((int64_t{b[0]} << 24) | (int64_t{b[1]} << 16) | (int64_t{b[2]} << 8) | b[3]);
    total *= idx.dims.back();
  }
  STRATA_REQUIRE(idx.dims[0] > 0, flag, ": '", path, "' holds 0 items");
  for (size_t d = 1; d < idx.dims.size(); ++d)
    STRATA_REQUIRE(idx.dims[d] > 0, flag, ": '", path, "' has items of size 0 (dimension ", d, ")");
  // gzip compresses at most ~1032:1: a header that claims more than that cannot be whole, and
  // must not make us allocate it.
  std::error_code ec;
  const auto on_disk = static_cast<int64_t>(std::filesystem::file_size(path, ec));
  STRATA_REQUIRE(ec || total <= 1100 * on_disk, flag, ": '", path, "' is truncated: its header claims ", total,
                 " bytes of data, more than a ", on_disk, "-byte file can hold");
  idx.data.resize(static_cast<size_t>(total));
  read_exact(idx.data.data(), idx.data.size(), "data");
  uint8_t extra = 0;
  STRATA_REQUIRE(gzread(f, &extra, 1) == 0, flag, ": '", path, "' has data beyond the ", total,
                 " bytes its header describes");
  return idx;
}

// Splits `n` samples into `shards` contiguous parts, the first n % shards one larger.
std::vector<int64_t> shard_sizes(int64_t n, int shards) {
  std::vector<int64_t> sizes(static_cast<size_t>(shards), n / shards);
  for (int64_t i = 0; i < n % shards; ++i) ++sizes[static_cast<size_t>(i)];
  return sizes;
}

// Checks that --out is a file prefix and creates its directory.
void prepare_prefix(const std::string& prefix) {
  STRATA_REQUIRE(!prefix.empty() && prefix.back() != '/' && !std::filesystem::is_directory(prefix),
                 "--out: expected a file prefix (PREFIX.h5 or PREFIX-00000-of-0000N.h5 are written), found '", prefix,
                 "'");
  std::filesystem::path parent = std::filesystem::path(prefix).parent_path();
  std::error_code ec;
  if (!parent.empty()) std::filesystem::create_directories(parent, ec);
}

// Writes inputs (N, ...) and labels as `shards` files named from `prefix`; prints their names.
void write_shards(const std::string& prefix, int shards, const Tensor& inputs, const std::vector<int32_t>& labels,
                  const ShardAttrs& attrs) {
  prepare_prefix(prefix);
  int64_t begin = 0;
  const auto sizes = shard_sizes(inputs.dim(0), shards);
  for (int s = 0; s < shards; ++s) {
    const int64_t end = begin + sizes[static_cast<size_t>(s)];
    const std::string path = io::shard_path(prefix, s, shards);
    io::write_shard(path, inputs.slice(begin, end),
                    std::span<const int32_t>(labels.data() + begin, static_cast<size_t>(end - begin)), attrs);
    std::cout << path << ": " << end - begin << " samples\n";
    begin = end;
  }
}

// Normalisation attributes computed over the data, so training inputs are standardised, or
// taken from the dataset `stats_from` (--stats-from: a test split with its training split's);
// and the class count (the labels' highest + 1 unless the generator says more).
ShardAttrs stats_attrs(const Tensor& inputs, float scale, const std::vector<int32_t>& labels, int classes,
                       const std::string& stats_from) {
  ShardAttrs attrs;
  attrs.num_classes = std::max(classes, *std::max_element(labels.begin(), labels.end()) + 1);
  if (stats_from.empty()) {
    attrs.scale = scale;
    io::channel_stats(inputs, scale, inputs.dim(1), attrs.mean, attrs.std);
    return attrs;
  }
  // Only the attributes are wanted: a zero in-memory limit keeps the samples on disk.
  const io::DatasetInfo from = io::Dataset::open(stats_from, "--stats-from", {0}).info();
  const Shape sample(inputs.shape().begin() + 1, inputs.shape().end());
  STRATA_REQUIRE(from.sample_shape == sample && from.input_dtype == inputs.dtype(), "--stats-from: '", stats_from,
                 "' has samples ", shape_str(from.sample_shape), " ", dtype_name(from.input_dtype), " but these are ",
                 shape_str(sample), " ", dtype_name(inputs.dtype()));
  attrs.scale = from.scale;
  attrs.mean = from.mean;
  attrs.std = from.std;
  return attrs;
}

void check_shards(int shards, int64_t samples) {
  STRATA_REQUIRE(shards >= 1 && shards <= samples, "--shards: expected 1..", samples,
                 " (one sample per shard at least), found ", shards);
}

// ---- commands --------------------------------------------------------------------------------

// Parses `args` against `desc` (+ positional), reporting unknown or missing options as input errors.
po::variables_map parse(const std::vector<std::string>& args, const po::options_description& desc,
                        const po::positional_options_description& pos = {}) {
  po::variables_map vm;
  try {
    po::store(po::command_line_parser(args).options(desc).positional(pos).run(), vm);
    po::notify(vm);
  } catch (const po::error& e) {
    STRATA_THROW_INPUT(e.what(), " (see strata-data --help)");
  }
  return vm;
}

int convert_idx(const std::vector<std::string>& args) {
  std::string images_path, labels_path, out, stats_from;
  int shards = 1;
  po::options_description desc("convert-idx options");
  desc.add_options()("images", po::value(&images_path)->required(), "images IDX file (.gz)")(
      "labels", po::value(&labels_path)->required(), "labels IDX file (.gz)")(
      "out", po::value(&out)->required(), "output prefix")("shards", po::value(&shards), "number of shards")(
      "stats-from", po::value(&stats_from),
      "normalise with this dataset's scale, mean and std (a test split with its training split's) instead of "
      "its own");
  parse(args, desc);

  Idx images = read_idx(images_path, 3, "--images");
  Idx labels_idx = read_idx(labels_path, 1, "--labels");
  const int64_t n = images.dims[0];
  STRATA_REQUIRE(labels_idx.dims[0] == n, "--labels: '", labels_path, "' holds ", labels_idx.dims[0],
                 " labels but --images '", images_path, "' holds ", n, " images");
  check_shards(shards, n);

  Tensor inputs = Tensor::empty({n, 1, images.dims[1], images.dims[2]}, DType::U8);
  std::copy(images.data.begin(), images.data.end(), inputs.data<uint8_t>());
  std::vector<int32_t> labels(labels_idx.data.begin(), labels_idx.data.end());
  write_shards(out, shards, inputs, labels, stats_attrs(inputs, 1.0f / 255.0f, labels, 0, stats_from));
  return 0;
}

Shape parse_shape(const std::string& s) {
  Shape shape;
  std::stringstream ss(s);
  std::string part;
  while (std::getline(ss, part, ',')) {
    char* end = nullptr;
    const long long v = std::strtoll(part.c_str(), &end, 10);
    STRATA_REQUIRE(!part.empty() && *end == '\0' && v > 0, "--shape: expected C,H,W or F (positive integers), found '",
                   s, "'");
    shape.push_back(v);
  }
  STRATA_REQUIRE(!shape.empty(), "--shape: expected C,H,W or F, found '", s, "'");
  return shape;
}

int synthetic(const std::vector<std::string>& args) {
  std::string out, shape_arg, dtype_arg = "u8", stats_from;
  int64_t samples = 0, first = 0;
  int classes = 0, shards = 1;
  uint64_t seed = 0;
  po::options_description desc("synthetic options");
  desc.add_options()("out", po::value(&out)->required(), "output prefix")(
      "samples", po::value(&samples)->required(), "number of samples")("shape", po::value(&shape_arg)->required(),
                                                                       "sample shape: C,H,W or F")(
      "classes", po::value(&classes)->required(), "number of classes")(
      "shards", po::value(&shards), "number of shards")("seed", po::value(&seed), "random seed")(
      "dtype", po::value(&dtype_arg), "u8 or f32")("first-sample", po::value(&first),
                                                   "index of the first sample: a held-out split with the same classes")(
      "stats-from", po::value(&stats_from), "normalise with this dataset's scale, mean and std");
  parse(args, desc);
  STRATA_REQUIRE(samples >= 1, "--samples: expected >= 1, found ", samples);
  STRATA_REQUIRE(first >= 0, "--first-sample: expected >= 0, found ", first);
  STRATA_REQUIRE(classes >= 2, "--classes: expected >= 2, found ", classes);
  STRATA_REQUIRE(dtype_arg == "u8" || dtype_arg == "f32", "--dtype: expected u8 or f32, found '", dtype_arg, "'");
  check_shards(shards, samples);
  const Shape sample_shape = parse_shape(shape_arg);
  const int64_t numel = shape_numel(sample_shape);
  const bool u8 = dtype_arg == "u8";

  // Each class has a fixed random pattern; a sample is 0.6 * its class pattern + 0.4 * noise,
  // all values in [0, 1]: easily learnable, and a pure function of the seed.
  const uint64_t key = rng::derive_key(seed, rng::kSynthetic);
  constexpr uint64_t kLabelStream = uint64_t{1} << 40, kNoiseStream = uint64_t{1} << 41;
  Shape shape{samples};
  shape.insert(shape.end(), sample_shape.begin(), sample_shape.end());
  Tensor inputs = Tensor::empty(shape, u8 ? DType::U8 : DType::F32);
  std::vector<int32_t> labels(static_cast<size_t>(samples));
  uint8_t* bytes = u8 ? inputs.data<uint8_t>() : nullptr;
  float* floats = u8 ? nullptr : inputs.data<float>();
  for (int64_t i = 0; i < samples; ++i) {
    const auto index = static_cast<uint64_t>(first + i);  // which sample of the generator's sequence
    const auto label = static_cast<int32_t>(rng::bits64(key, kLabelStream, index) % classes);
    labels[static_cast<size_t>(i)] = label;
    for (int64_t j = 0; j < numel; ++j) {
      const float v = 0.6f * rng::uniform(key, static_cast<uint64_t>(label), static_cast<uint64_t>(j)) +
                      0.4f * rng::uniform(key, kNoiseStream + index, static_cast<uint64_t>(j));
      if (u8)
        bytes[i * numel + j] = static_cast<uint8_t>(std::lround(v * 255.0f));
      else
        floats[i * numel + j] = v;
    }
  }
  write_shards(out, shards, inputs, labels,
               stats_attrs(inputs, u8 ? 1.0f / 255.0f : 1.0f, labels, classes, stats_from));
  return 0;
}

std::string join_floats(const std::vector<float>& v) {
  std::ostringstream os;
  for (size_t i = 0; i < v.size(); ++i) os << (i ? ", " : "") << v[i];
  return os.str();
}

// ---- token datasets --------------------------------------------------------------------------

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

int tokenize(const std::vector<std::string>& args) {
  std::vector<std::string> inputs;
  std::string out, kind;
  int64_t vocab = 0;
  double val_fraction = 0.1;
  int shards = 1;
  po::options_description desc("tokenize options");
  desc.add_options()("input", po::value(&inputs)->multitoken()->required(),
                     "text files, or directories (every regular file inside, sorted); each file is one document")(
      "out", po::value(&out)->required(), "output prefix: PREFIX-train*.h5 and PREFIX-val.h5")(
      "tokenizer", po::value(&kind)->required(), "byte or bpe")("vocab-size", po::value(&vocab),
                                                                "bpe: ids in all, 257 + merges (byte: 257)")(
      "val-fraction", po::value(&val_fraction), "the last F of the token stream becomes PREFIX-val.h5 (0.1)")(
      "shards", po::value(&shards), "training shards (1)");
  parse(args, desc);
  STRATA_REQUIRE(kind == "byte" || kind == "bpe", "--tokenizer: expected byte or bpe, found '", kind, "'");
  STRATA_REQUIRE(val_fraction >= 0 && val_fraction < 1, "--val-fraction: expected 0 <= F < 1, found ", val_fraction);
  STRATA_REQUIRE(shards >= 1, "--shards: expected >= 1, found ", shards);
  if (kind == "byte")
    STRATA_REQUIRE(vocab == 0 || vocab == 257,
                   "--vocab-size: the byte tokenizer has 257 ids (256 bytes and end-of-text), found ", vocab);
  else
    STRATA_REQUIRE(vocab >= 257,
                   "--vocab-size: --tokenizer bpe needs N >= 257 (256 bytes, N - 257 merges, "
                   "end-of-text), found ",
                   vocab);
  prepare_prefix(out);

  const std::vector<std::string> files = list_inputs(inputs, "");
  std::vector<std::string> docs;
  int64_t bytes = 0;
  for (const auto& f : files) {
    docs.push_back(read_text_file(f));
    bytes += static_cast<int64_t>(docs.back().size());
  }
  STRATA_REQUIRE(bytes > 0, "--input: the ", files.size(), " file(s) hold no text (0 bytes)");

  io::Tokenizer tok = io::Tokenizer::byte_level();
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
  for (const auto& d : docs) {
    tok.encode_append(d, stream);
    stream.push_back(tok.eot());
  }
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
  for (int s = 0; s < shards; ++s) {
    const int64_t size = sizes[static_cast<size_t>(s)];
    const std::string path = io::shard_path(out + "-train", s, shards);
    io::write_token_shard(path, std::span(stream).subspan(static_cast<size_t>(begin), static_cast<size_t>(size)), tok);
    std::cout << path << ": " << size << " tokens\n";
    begin += size;
  }
  if (n_val > 0) {
    const std::string path = out + "-val.h5";
    io::write_token_shard(path, std::span(stream).subspan(static_cast<size_t>(n_train)), tok);
    std::cout << path << ": " << n_val << " tokens\n";
  }
  std::printf("%zu documents, %lld bytes -> %lld tokens (train %lld, val %lld), %.3f bytes/token, tokenizer %s\n",
              files.size(), static_cast<long long>(bytes), static_cast<long long>(n), static_cast<long long>(n_train),
              static_cast<long long>(n_val), static_cast<double>(bytes) / static_cast<double>(n), tok.name().c_str());
  return 0;
}

// llm.c's token files: 256 little-endian int32 (magic, version, token count, unused), then the
// tokens: uint16 (version 1, GPT-2) or uint32 (version 2, LLaMA 3).
constexpr int32_t kLlmcMagic = 20240520;
constexpr int64_t kLlmcHeaderBytes = 256 * 4;

int import_bin(const std::vector<std::string>& args) {
  std::vector<std::string> inputs;
  std::string out;
  int64_t vocab = 50257, eot = -1;
  bool raw = false;
  po::options_description desc("import-bin options");
  desc.add_options()("input", po::value(&inputs)->multitoken()->required(),
                     ".bin files, or directories (their *.bin files, sorted); one output shard each")(
      "out", po::value(&out)->required(), "output prefix")("vocab-size", po::value(&vocab),
                                                           "ids in the vocabulary (50257, GPT-2)")(
      "eot", po::value(&eot), "the end-of-text id (vocab-size - 1: GPT-2's 50256)")(
      "raw", po::bool_switch(&raw), "headerless uint16 tokens (nanoGPT's train.bin / val.bin)");
  parse(args, desc);
  STRATA_REQUIRE(vocab >= 1 && vocab <= std::numeric_limits<int32_t>::max(), "--vocab-size: expected 1..",
                 std::numeric_limits<int32_t>::max(), ", found ", vocab);
  if (eot < 0) eot = vocab - 1;
  STRATA_REQUIRE(eot < vocab, "--eot: ", eot, " is outside the vocabulary [0, ", vocab, ")");
  const io::Tokenizer tok = io::Tokenizer::external(vocab, static_cast<int32_t>(eot));
  prepare_prefix(out);
  const std::vector<std::string> files = list_inputs(inputs, ".bin");

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
    const std::string dest = io::shard_path(out, static_cast<int>(i), static_cast<int>(files.size()));
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
  std::cout << files.size() << " file(s), " << total << " tokens, tokenizer external (vocab_size " << vocab << ", eot "
            << eot << ")\n";
  return 0;
}

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

int inspect(const std::vector<std::string>& args) {
  std::string spec;
  po::options_description desc("inspect options");
  desc.add_options()("spec", po::value(&spec)->required(), "file, directory or glob");
  po::positional_options_description pos;
  pos.add("spec", 1);
  parse(args, desc, pos);
  if (io::is_token_dataset(spec, "inspect")) return inspect_tokens(spec);

  io::Dataset ds = io::Dataset::open(spec, "inspect");
  const io::DatasetInfo& info = ds.info();
  std::cout << "files:         " << info.files.size() << "\n";
  for (const auto& f : info.files) std::cout << "  " << f << "\n";
  std::cout << "samples:       " << info.num_samples << "\n"
            << "sample shape:  " << shape_str(info.sample_shape) << "\n"
            << "input dtype:   " << dtype_name(info.input_dtype) << "\n"
            << "classes:       " << info.num_classes << "\n"
            << "normalisation: x = (raw * " << info.scale << " - mean[c]) / std[c], mean = [" << join_floats(info.mean)
            << "], std = [" << join_floats(info.std) << "]\n"
            << "per-class counts:\n";
  std::vector<int64_t> counts(static_cast<size_t>(info.num_classes));
  for (int32_t y : ds.labels()) ++counts[static_cast<size_t>(y)];
  for (size_t k = 0; k < counts.size(); ++k) std::cout << "  " << k << ": " << counts[k] << "\n";
  return 0;
}

// Shuffled batches per second for each way of reading; the numbers behind the in-memory
// threshold documented in docs/formats.md.
int bench(const std::vector<std::string>& args) {
  std::string spec;
  int64_t batch = 64, steps = 2000;
  po::options_description desc("bench options");
  desc.add_options()("spec", po::value(&spec)->required(), "file, directory or glob")(
      "batch", po::value(&batch), "batch size")("steps", po::value(&steps), "batches per measurement");
  po::positional_options_description pos;
  pos.add("spec", 1);
  parse(args, desc, pos);
  STRATA_REQUIRE(batch > 0 && steps > 0, "--batch and --steps must be positive, found ", batch, " and ", steps);

  using Clock = std::chrono::steady_clock;
  auto report = [&](const char* what, Clock::time_point t0, size_t sample_bytes) {
    const double s = std::chrono::duration<double>(Clock::now() - t0).count();
    std::printf("%-28s %9.1f us/batch %12.0f samples/s %9.1f MB/s (raw)\n", what, 1e6 * s / steps, steps * batch / s,
                steps * batch * sample_bytes / s / 1e6);
  };
  for (bool in_memory : {true, false}) {
    auto t_open = Clock::now();
    io::Dataset ds = io::Dataset::open(spec, "bench", {in_memory ? int64_t{1} << 40 : 0});
    std::printf("open (%s): %.1f ms\n", in_memory ? "load into memory" : "files",
                1e3 * std::chrono::duration<double>(Clock::now() - t_open).count());
    const size_t sample_bytes =
        static_cast<size_t>(shape_numel(ds.info().sample_shape)) * dtype_size(ds.info().input_dtype);
    io::EpochSampler sampler(ds.size(), batch, 1, true);
    Shape xs{batch};
    xs.insert(xs.end(), ds.info().sample_shape.begin(), ds.info().sample_shape.end());
    Tensor x = Tensor::empty(xs), y = Tensor::empty({batch}, DType::I32);
    std::vector<int64_t> idx(static_cast<size_t>(batch));
    auto t0 = Clock::now();
    for (int64_t k = 0; k < steps; ++k) {
      sampler.batch(k / sampler.steps_per_epoch(), k % sampler.steps_per_epoch(), idx);
      ds.read(idx, x, y);
    }
    report(in_memory ? "read, in memory" : "read, hyperslabs from files", t0, sample_bytes);
    io::Loader loader(ds, sampler, 0, batch, 2);
    loader.start(0, 0);
    t0 = Clock::now();
    for (int64_t k = 0; k < steps; ++k) loader.next();
    report(in_memory ? "loader, in memory" : "loader, from files", t0, sample_bytes);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const std::vector<std::string> all(argv + 1, argv + argc);
  if (all.empty() || all[0] == "--help" || all[0] == "-h" || all[0] == "help") {
    std::cout << kUsage;
    return all.empty() ? 2 : 0;
  }
  const std::string& command = all[0];
  const std::vector<std::string> args(all.begin() + 1, all.end());
  try {
    if (command == "convert-idx") return convert_idx(args);
    if (command == "synthetic") return synthetic(args);
    if (command == "tokenize") return tokenize(args);
    if (command == "import-bin") return import_bin(args);
    if (command == "inspect") return inspect(args);
    if (command == "bench") return bench(args);
    STRATA_THROW_INPUT("unknown command '", command,
                       "'; expected convert-idx, synthetic, tokenize, import-bin, inspect or bench");
  } catch (const Error& e) {
    std::cerr << "strata-data: error: " << e.what() << "\n";
    return e.kind() == ErrorKind::Input ? 2 : 1;
  } catch (const std::exception& e) {
    std::cerr << "strata-data: error: " << e.what() << "\n";
    return 1;
  }
}
