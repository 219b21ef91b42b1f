// strata-convert: Hugging Face GPT-2 and Llama checkpoints in and out (docs/formats.md, "Hugging Face").
//   strata-convert import-hf --model-dir DIR --out FILE.h5
//   strata-convert export-hf --checkpoint FILE.h5 --out DIR [--shard-size 5GB] [--dtype F32|BF16|F16]
//                            [--tokenizer DATA|tokenizer.json|none]
//   strata-convert logits --checkpoint FILE.h5 --tokens 1,2,3 --out FILE.f32
// import-hf writes a model-only Strata checkpoint (train --init-from, --eval-only, strata-sample);
// export-hf writes config.json and safetensors that transformers' from_pretrained loads. Both
// stream tensor by tensor. logits writes the model's (T, V) f32 logits over the tokens, raw
// little-endian (the interop tests' view of Strata's forward). One process, no MPI. Bad input:
// one line on stderr, exit 2.
#include <boost/program_options.hpp>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "core/error.hpp"
#include "core/ops.hpp"
#include "io/hf_convert.hpp"

namespace po = boost::program_options;
using namespace strata;

namespace {

constexpr const char* kUsage =
    "usage: strata-convert import-hf --model-dir DIR --out FILE.h5\n"
    "       strata-convert export-hf --checkpoint FILE.h5 --out DIR [--shard-size 5GB] [--dtype F32|BF16|F16]\n"
    "                            [--tokenizer DATA|tokenizer.json|none]\n"
    "       strata-convert logits --checkpoint FILE.h5 --tokens ID,ID,... --out FILE.f32\n";

// "5GB", "500MB", "10KB" (transformers' decimal units), "2GiB", "64KiB", or plain bytes.
uint64_t parse_size(const std::string& text) {
  size_t used = 0;
  double value = 0;
  try {
    value = std::stod(text, &used);
  } catch (const std::exception&) {
    STRATA_THROW_INPUT("--shard-size must be a size such as 5GB, 500MB or 1000000, found '", text, "'");
  }
  const std::string unit = text.substr(used);
  static const std::pair<const char*, double> units[] = {
      {"", 1},     {"B", 1},        {"KB", 1e3},        {"MB", 1e6},
      {"GB", 1e9}, {"KiB", 1024.0}, {"MiB", 1048576.0}, {"GiB", 1073741824.0}};
  for (const auto& [name, scale] : units)
    if (unit == name) {
      STRATA_REQUIRE(value * scale >= 1 && value * scale < 1e18, "--shard-size must be positive, found '", text, "'");
      return static_cast<uint64_t>(value * scale);
    }
  STRATA_THROW_INPUT("--shard-size: unknown unit '", unit, "' in '", text, "' (B, KB, MB, GB, KiB, MiB, GiB)");
}

std::vector<int32_t> parse_tokens(const std::string& text) {
  std::vector<int32_t> out;
  std::istringstream in(text);
  for (std::string item; std::getline(in, item, ',');) {
    try {
      size_t used = 0;
      const long v = std::stol(item, &used);
      STRATA_REQUIRE(used == item.size() && v >= 0 && v <= INT32_MAX, "");
      out.push_back(static_cast<int32_t>(v));
    } catch (const std::exception&) {
      STRATA_THROW_INPUT("--tokens must be comma-separated token ids, found '", item, "'");
    }
  }
  return out;
}

int run(int argc, char** argv) {
  STRATA_REQUIRE(argc >= 2, "give a command: import-hf, export-hf or logits (see --help)");
  const std::string command = argv[1];
  if (command == "--help" || command == "-h") {
    std::cout << kUsage;
    return 0;
  }
  std::string model_dir, out, checkpoint, shard_size, dtype, tokenizer, tokens;
  po::options_description desc("options");
  // clang-format off
  desc.add_options()
    ("help,h", "print this help and exit")
    ("model-dir", po::value(&model_dir), "import-hf: a Hugging Face model directory (config.json, safetensors)")
    ("checkpoint", po::value(&checkpoint), "export-hf, logits: a Strata gpt or llama checkpoint (.h5)")
    ("out", po::value(&out), "import-hf: the checkpoint to write; export-hf: the directory; logits: the file")
    ("shard-size", po::value(&shard_size)->default_value("5GB"), "export-hf: the largest safetensors shard")
    ("dtype", po::value(&dtype), "export-hf: F32 | BF16 | F16 (default: the checkpoint's precision)")
    ("tokenizer", po::value(&tokenizer), "export-hf: the Hugging Face tokenizer written beside the weights: token data holding one, a tokenizer.json, or none (default: the checkpoint's training data's, when it is there and has one)")
    ("tokens", po::value(&tokens), "logits: comma-separated token ids");
  // clang-format on
  po::variables_map vm;
  try {
    po::store(po::command_line_parser(argc - 1, argv + 1).options(desc).run(), vm);
    po::notify(vm);
  } catch (const po::error& e) {
    STRATA_THROW_INPUT(e.what(), " (see --help)");
  }
  if (vm.count("help")) {
    std::cout << kUsage << desc << "\n";
    return 0;
  }
  const auto need = [&](const char* flag, const std::string& value) {
    STRATA_REQUIRE(!value.empty(), command, " needs --", flag, " (see --help)");
  };
  using clock = std::chrono::steady_clock;
  const clock::time_point start = clock::now();
  const auto seconds = [&] { return std::chrono::duration<double>(clock::now() - start).count(); };
  if (command == "import-hf") {
    need("model-dir", model_dir);
    need("out", out);
    io::import_hf(model_dir, out);
    std::printf("import-hf: %s -> %s in %.2f s\n", model_dir.c_str(), out.c_str(), seconds());
  } else if (command == "export-hf") {
    need("checkpoint", checkpoint);
    need("out", out);
    const std::string tokenizer_note = io::export_hf(checkpoint, out, parse_size(shard_size), dtype, tokenizer);
    std::printf("export-hf: %s -> %s in %.2f s; %s\n", checkpoint.c_str(), out.c_str(), seconds(),
                tokenizer_note.c_str());
  } else if (command == "logits") {
    need("checkpoint", checkpoint);
    need("tokens", tokens);
    need("out", out);
    const Tensor logits = io::checkpoint_logits(checkpoint, parse_tokens(tokens));
    std::ofstream f(out, std::ios::binary);
    f.write(static_cast<const char*>(logits.raw()), static_cast<std::streamsize>(logits.nbytes()));
    STRATA_REQUIRE(f.good(), "cannot write --out '", out, "'");
    std::printf("logits: %s (%lld x %lld f32)\n", out.c_str(), static_cast<long long>(logits.dim(0)),
                static_cast<long long>(logits.dim(1)));
  } else {
    STRATA_THROW_INPUT("unknown command '", command, "'; expected import-hf, export-hf or logits (see --help)");
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const Error& e) {
    std::cout << std::flush;
    std::cerr << "strata-convert: error: " << e.what() << "\n";
    return e.kind() == ErrorKind::Input ? 2 : 1;
  } catch (const nlohmann::json::exception& e) {  // a value of the wrong type in config.json: the input's fault
    std::cout << std::flush;
    std::cerr << "strata-convert: error: " << e.what() << "\n";
    return 2;
  } catch (const std::exception& e) {
    std::cout << std::flush;
    std::cerr << "strata-convert: error: " << e.what() << "\n";
    return 1;
  }
}
