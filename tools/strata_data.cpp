// strata-data: makes and checks datasets in Strata's HDF5 format (docs/formats.md).
//   strata-data convert-idx --images X-images-idx3-ubyte.gz --labels X-labels-idx1-ubyte.gz --out PREFIX
//                           [--shards N] [--stats-from DATA]
//   strata-data synthetic --out PREFIX --samples N --shape C,H,W|F --classes K [--shards S] [--seed X] [--dtype u8|f32]
//                         [--first-sample I] [--stats-from DATA]
//   strata-data tokenize --input FILE_OR_DIR... --out PREFIX --tokenizer byte|bpe|hf:TOKENIZER.JSON
//                        [--vocab-size N] [--eot-token TEXT] [--val-fraction F] [--shards K]
//   strata-data import-bin --input FILE_OR_DIR... --out PREFIX [--vocab-size N] [--eot ID] [--raw]
//                          [--tokenizer hf:TOKENIZER.JSON [--eot-token TEXT]]
//   strata-data inspect SPEC
//   strata-data bench SPEC [--batch B] [--steps N]
// Bad input exits with code 2 and one line on stderr; other failures with code 1.
#include <zlib.h>

#include <algorithm>
#include <boost/program_options.hpp>
#include <chrono>
#include <climits>
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
#include "data_tool.hpp"
#include "io/batch_order.hpp"
#include "io/dataset.hpp"
#include "io/loader.hpp"
#include "io/shard_files.hpp"
#include "io/tokens.hpp"

using namespace strata;
using io::ShardAttrs;

namespace strata::data_tool {

// Splits `n` samples into `shards` contiguous parts, the first n % shards one larger.
std::vector<int64_t> shard_sizes(int64_t n, int shards) {
  std::vector<int64_t> sizes(static_cast<size_t>(shards), n / shards);
  for (int64_t i = 0; i < n % shards; ++i) ++sizes[static_cast<size_t>(i)];
  return sizes;
}

// Checks that --out is a file prefix and creates its directory.
void prepare_prefix(const std::string& prefix) {
  std::error_code ec;
  STRATA_REQUIRE(!prefix.empty() && prefix.back() != '/' && !std::filesystem::is_directory(prefix, ec),
                 "--out: expected a file prefix (PREFIX.h5 or PREFIX-00000-of-0000N.h5 are written), found '", prefix,
                 "'");
  // The longest name written: PREFIX-train-00000-of-00000.h5.
  constexpr size_t kLongestSuffix = sizeof("-train-00000-of-00000.h5") - 1;
  const size_t name = std::filesystem::path(prefix).filename().string().size();
  STRATA_REQUIRE(name + kLongestSuffix <= NAME_MAX, "--out: the file names of prefix '",
                 std::filesystem::path(prefix).filename().string().substr(0, 40), "...' (", name,
                 " bytes) would pass the filesystem's ", NAME_MAX, "-byte limit");
  std::filesystem::path parent = std::filesystem::path(prefix).parent_path();
  if (!parent.empty()) std::filesystem::create_directories(parent, ec);
}

void check_inputs(const std::vector<std::string>& inputs, const std::vector<std::string>& outputs) {
  namespace fs = std::filesystem;
  std::error_code ec;
  for (size_t i = 0; i < inputs.size(); ++i) {
    for (size_t j = 0; j < i; ++j)
      STRATA_REQUIRE(!fs::equivalent(inputs[i], inputs[j], ec), "--input: '", inputs[i], "' is given twice",
                     inputs[i] == inputs[j] ? "" : detail::cat(" (as '", inputs[j], "')"));
    for (const std::string& out : outputs)
      STRATA_REQUIRE(!fs::equivalent(inputs[i], out, ec), "--input: '", inputs[i], "' is ", out,
                     ", which --out would overwrite: choose another --out");
  }
}

OutputFiles::~OutputFiles() {
  std::error_code ec;
  for (const std::string& path : paths_) std::filesystem::remove(path, ec);
}

std::string OutputFiles::add(const std::string& path) { return paths_.emplace_back(path); }

// Parses `args` against `desc` (+ positional), reporting unknown or missing options as input errors.
po::variables_map parse(const std::vector<std::string>& args, const po::options_description& desc,
                        const po::positional_options_description& pos) {
  po::variables_map vm;
  try {
    po::store(po::command_line_parser(args).options(desc).positional(pos).run(), vm);
    po::notify(vm);
  } catch (const po::error& e) {
    STRATA_THROW_INPUT(e.what(), " (see strata-data --help)");
  }
  return vm;
}

}  // namespace strata::data_tool

using namespace strata::data_tool;

namespace {

constexpr const char* kUsage =
    "usage: strata-data <command> [options]\n"
    "commands:\n"
    "  convert-idx --images FILE.gz --labels FILE.gz --out PREFIX [--shards N] [--stats-from DATA]\n"
    "      convert (Fashion-)MNIST IDX files to HDF5 shards\n"
    "  synthetic --out PREFIX --samples N --shape C,H,W|F --classes K [--shards S] [--seed X] [--dtype u8|f32]\n"
    "            [--first-sample I] [--stats-from DATA]\n"
    "      write a small learnable dataset (class patterns plus noise)\n"
    "  tokenize --input FILE_OR_DIR... --out PREFIX --tokenizer byte|bpe|hf:TOKENIZER.JSON [--vocab-size N]\n"
    "           [--eot-token TEXT] [--val-fraction F] [--shards K]\n"
    "      tokenize text files (one document each) into PREFIX-train and PREFIX-val token shards\n"
    "      (hf: a Hugging Face byte-level BPE tokenizer.json, GPT-2 / Llama 3 style, its ids kept)\n"
    "  import-bin --input FILE_OR_DIR... --out PREFIX [--vocab-size 50257] [--eot ID] [--raw]\n"
    "             [--tokenizer hf:TOKENIZER.JSON [--eot-token TEXT]]\n"
    "      convert llm.c (or, with --raw, headerless nanoGPT) .bin token files to token shards\n"
    "      (--tokenizer: the tokenizer.json that made the ids, stored so they decode)\n"
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
  STRATA_REQUIRE(classes >= 2 && classes <= io::kMaxClasses, "--classes: expected 2..", io::kMaxClasses, ", found ",
                 classes);
  STRATA_REQUIRE(dtype_arg == "u8" || dtype_arg == "f32", "--dtype: expected u8 or f32, found '", dtype_arg, "'");
  check_shards(shards, samples);
  const Shape sample_shape = parse_shape(shape_arg);
  const bool u8 = dtype_arg == "u8";
  Shape shape{samples};
  shape.insert(shape.end(), sample_shape.begin(), sample_shape.end());
  STRATA_REQUIRE(checked_numel(shape, u8 ? 1 : 4), "--samples ", samples, " of --shape ", shape_arg,
                 " need more than 2^63 bytes");
  const int64_t numel = shape_numel(sample_shape);

  // Each class has a fixed random pattern; a sample is 0.6 * its class pattern + 0.4 * noise,
  // all values in [0, 1]: easily learnable, and a pure function of the seed.
  const uint64_t key = rng::derive_key(seed, rng::kSynthetic);
  constexpr uint64_t kLabelStream = uint64_t{1} << 40, kNoiseStream = uint64_t{1} << 41;
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

int inspect(const std::vector<std::string>& args) {
  std::string spec;
  po::options_description desc("inspect options");
  desc.add_options()("spec", po::value(&spec), "file, directory or glob");
  po::positional_options_description pos;
  pos.add("spec", 1);
  parse(args, desc, pos);
  STRATA_REQUIRE(!spec.empty(), "inspect needs the data: strata-data inspect FILE|DIR|GLOB|PREFIX");
  // The PREFIX another command's --out took names what it wrote: PREFIX.h5, or its shards.
  if (!std::filesystem::exists(spec)) {
    if (std::filesystem::exists(spec + ".h5")) {
      spec += ".h5";
    } else {
      try {
        io::list_shards(spec + "-*-of-*.h5", "inspect");  // an Input error when there are none
        spec += "-*-of-*.h5";
      } catch (const Error&) {  // neither: the spec's own "does not exist" follows
      }
    }
  }
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
  // Up to 2^24 classes (io::kMaxClasses): a terminal's worth, then a summary line.
  constexpr size_t kShown = 50;
  for (size_t k = 0; k < std::min(counts.size(), kShown); ++k) std::cout << "  " << k << ": " << counts[k] << "\n";
  if (counts.size() > kShown)
    std::cout << "  ... " << counts.size() - kShown << " more classes ("
              << std::count_if(counts.begin() + kShown, counts.end(), [](int64_t n) { return n > 0; })
              << " of them with samples)\n";
  return 0;
}

// Shuffled batches per second for each way of reading; the numbers behind the in-memory
// threshold documented in docs/formats.md.
int bench(const std::vector<std::string>& args) {
  std::string spec;
  int64_t batch = 64, steps = 2000;
  po::options_description desc("bench options");
  desc.add_options()("spec", po::value(&spec), "file, directory or glob")("batch", po::value(&batch), "batch size")(
      "steps", po::value(&steps), "batches per measurement");
  po::positional_options_description pos;
  pos.add("spec", 1);
  parse(args, desc, pos);
  STRATA_REQUIRE(!spec.empty(), "bench needs the data: strata-data bench FILE|DIR|GLOB [--batch N] [--steps N]");
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
    io::BatchOrder sampler(ds.size(), batch, 1, true);
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
  // `strata-data COMMAND --help`: the usage, which covers every command.
  if (std::find(args.begin(), args.end(), "--help") != args.end() ||
      std::find(args.begin(), args.end(), "-h") != args.end()) {
    std::cout << kUsage;
    return 0;
  }
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
