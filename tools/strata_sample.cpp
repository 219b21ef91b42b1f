// strata-sample: text from a trained GPT or Llama checkpoint, on the CPU, one process (no MPI).
//   strata-sample --checkpoint CKPT [--data TOKENS] [--prompt TEXT] [--tokens N] [--temperature F]
//                 [--top-k K] [--seed S] [--threads T]
// The model is rebuilt from the checkpoint's `config` attribute (model, layers, heads, embed,
// tie-embeddings, attention; Llama: kv-heads, ffn-hidden, rope-theta, rope-scaling, norm-eps and
// its positions, seq-len; a GPT's positions and the vocabulary from its tensors) and its tensors are
// loaded into a ParameterStore; layers::GptDecoder then generates with a key/value cache, one
// position per token. The text is encoded and decoded by the tokenizer of --data (default: the
// `data` option recorded in the checkpoint). Prints the prompt, the generated text as it comes,
// and a last line with the speed. Deterministic for a seed (Philox); temperature 0 is greedy.
// A context longer than the model's seq_len slides (layers/gpt_decode.hpp). An empty prompt
// starts from the end-of-text token. Bad input exits with code 2 and one line on stderr.
#include <algorithm>
#include <boost/program_options.hpp>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <map>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "core/error.hpp"
#include "core/ops.hpp"
#include "io/checkpoint/directory.hpp"
#include "io/checkpoint/file.hpp"
#include "io/checkpoint/language_model.hpp"
#include "io/checkpoint/run_state.hpp"
#include "io/tokenizer.hpp"
#include "io/tokens.hpp"
#include "layers/gpt_decode.hpp"
#include "layers/model.hpp"
#include "layers/parameter_store.hpp"
#include "layers/zoo.hpp"

namespace po = boost::program_options;
using namespace strata;

namespace {

struct Options {
  std::string checkpoint, data, prompt;
  int64_t tokens = 256;
  float temperature = 1.0f;
  int64_t top_k = 0;
  uint64_t seed = 0;
  int threads = 1;
};

// The checkpoint file: CKPT itself, or a checkpoint directory's newest complete one.
std::string checkpoint_file(const std::string& spec) {
  if (!std::filesystem::is_directory(spec)) return spec;
  const std::string path = io::newest_checkpoint(spec);
  STRATA_REQUIRE(!path.empty(), "--checkpoint: the directory ", spec, " holds no complete checkpoint");
  return path;
}

std::optional<Options> parse(int argc, char** argv) {
  Options o;
  po::options_description desc("usage: strata-sample --checkpoint CKPT [options]\noptions");
  // clang-format off
  desc.add_options()
    ("help,h", "print this help and exit")
    ("checkpoint", po::value(&o.checkpoint)->required(), "a gpt checkpoint (.h5), or a checkpoint directory (its newest)")
    ("data", po::value(&o.data), "token dataset whose tokenizer encodes the prompt and decodes (default: the checkpoint's --data)")
    ("prompt", po::value(&o.prompt)->default_value(""), "text to continue (empty: start from the end-of-text token)")
    ("tokens", po::value(&o.tokens)->default_value(256), "tokens to generate")
    ("temperature", po::value(&o.temperature)->default_value(1.0f), "softmax temperature (0: greedy argmax)")
    ("top-k", po::value(&o.top_k)->default_value(0), "sample among the k most likely tokens (0: all)")
    ("seed", po::value(&o.seed)->default_value(0), "seed of the sampling stream (Philox)")
    ("threads", po::value(&o.threads)->default_value(1), "CPU threads for the matrix products");
  // clang-format on
  po::variables_map vm;
  try {
    const po::parsed_options parsed = po::command_line_parser(argc, argv).options(desc).run();
    for (const po::option& opt : parsed.options)
      if (opt.position_key >= 0)
        STRATA_THROW_INPUT("unexpected argument '", opt.value.empty() ? opt.string_key : opt.value.front(),
                           "': every flag takes one value (quote a prompt with spaces)");
    po::store(parsed, vm);
    if (vm.count("help")) {
      std::cout << desc << "\n";
      return std::nullopt;
    }
    po::notify(vm);
  } catch (const po::error& e) {
    STRATA_THROW_INPUT(e.what(), " (see --help)");
  }
  STRATA_REQUIRE(o.tokens >= 0, "--tokens must not be negative, found ", o.tokens);
  STRATA_REQUIRE(o.temperature >= 0.0f && std::isfinite(o.temperature),
                 "--temperature must be finite and not negative, found ", o.temperature);
  STRATA_REQUIRE(o.top_k >= 0, "--top-k must not be negative, found ", o.top_k);
  STRATA_REQUIRE(o.threads >= 1, "--threads must be positive, found ", o.threads);
  return o;
}

int run(const Options& o) {
  ops::set_num_threads(o.threads);
  const io::CheckpointReader reader(checkpoint_file(o.checkpoint));
  const std::string& path = reader.path();
  const io::LanguageModel m = io::language_model_of(reader);
  const layers::ModelSpec& spec = m.spec;
  const std::map<std::string, std::string>& config = m.config;
  const int64_t classes = m.classes;
  const layers::Model model = layers::build_model(spec, {spec.seq_len}, static_cast<int>(classes));
  const layers::ParameterStore store(model, 0);
  for (const layers::ParamEntry& e : store.entries()) io::read_model_value(reader, e.name, e.trainable, store.value(e));
  layers::GptDecoder decoder(model, store);

  // The tokenizer: --data's, else the training data's.
  std::string data = o.data;
  if (data.empty()) {
    const auto it = config.find("data");
    STRATA_REQUIRE(it != config.end() && !it->second.empty(), "checkpoint ", path,
                   " records no --data; give --data (a token dataset with the tokenizer to decode with)");
    data = it->second;
  }
  const io::TokenDataset dataset =
      io::TokenDataset::open(data, o.data.empty() ? "--data (the checkpoint's training data)" : "--data");
  const io::Tokenizer& tokenizer = dataset.tokenizer();
  STRATA_REQUIRE(tokenizer.can_decode(), "--data ", data, " has an '", tokenizer.name(),
                 "' tokenizer (ids without text): strata-sample cannot encode the prompt or decode tokens with it");
  STRATA_REQUIRE(tokenizer.vocab_size() <= decoder.vocab(), "--data ", data, "'s tokenizer has ",
                 tokenizer.vocab_size(), " tokens, more than the model's vocabulary of ", decoder.vocab());

  std::vector<int32_t> context = tokenizer.encode(o.prompt);
  if (context.empty()) context.push_back(tokenizer.eot());
  std::cout << o.prompt << std::flush;
  layers::SampleOptions sample{o.temperature, o.top_k, o.seed, tokenizer.vocab_size()};
  using clock = std::chrono::steady_clock;
  const clock::time_point start = clock::now();
  clock::time_point first = start;
  int64_t produced = 0;
  layers::generate(decoder, context, o.tokens, sample, [&](int32_t token) {
    if (produced++ == 0) first = clock::now();
    std::cout << tokenizer.piece(token) << std::flush;
  });
  const double total = std::chrono::duration<double>(clock::now() - start).count();
  const double prefill = std::chrono::duration<double>(first - start).count();
  std::printf("\n-- %lld tokens in %.3f s: %.1f tokens/s (prompt of %zu tokens in %.3f s; context %lld, %s)\n",
              static_cast<long long>(o.tokens), total, total > 0 ? static_cast<double>(o.tokens) / total : 0.0,
              context.size(), prefill, static_cast<long long>(decoder.max_positions()),
              o.temperature == 0.0f ? "greedy" : "sampled");
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const std::optional<Options> options = parse(argc, argv);
    if (!options) return 0;
    return run(*options);
  } catch (const Error& e) {
    std::cout << std::flush;
    std::cerr << "strata-sample: error: " << e.what() << "\n";
    return e.kind() == ErrorKind::Input ? 2 : 1;
  } catch (const std::exception& e) {
    std::cout << std::flush;
    std::cerr << "strata-sample: error: " << e.what() << "\n";
    return 1;
  }
}
