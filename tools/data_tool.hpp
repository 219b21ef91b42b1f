// strata-data's token commands (tokenize, import-bin, and inspect of a token dataset) and the
// helpers every command shares; main and the labelled-data commands are in strata_data.cpp.
#pragma once

#include <boost/program_options.hpp>
#include <cstdint>
#include <string>
#include <vector>

namespace strata::data_tool {

namespace po = boost::program_options;

// Parses `args` against `desc` (+ positional), reporting unknown or missing options as input errors.
po::variables_map parse(const std::vector<std::string>& args, const po::options_description& desc,
                        const po::positional_options_description& pos = {});
// Splits `n` samples into `shards` contiguous parts, the first n % shards one larger.
std::vector<int64_t> shard_sizes(int64_t n, int shards);
// Checks that --out is a file prefix and creates its directory.
void prepare_prefix(const std::string& prefix);
// Input errors for an input file named twice and for one that is among `outputs` (writing them
// would destroy it).
void check_inputs(const std::vector<std::string>& inputs, const std::vector<std::string>& outputs);

// Removes the files a command wrote unless it finished (commit()): a refused input half-way
// leaves nothing behind.
class OutputFiles {
 public:
  OutputFiles() = default;
  OutputFiles(const OutputFiles&) = delete;
  OutputFiles& operator=(const OutputFiles&) = delete;
  ~OutputFiles();
  // `path` is about to be written.
  std::string add(const std::string& path);
  void commit() { paths_.clear(); }

 private:
  std::vector<std::string> paths_;
};

int tokenize(const std::vector<std::string>& args);
int import_bin(const std::vector<std::string>& args);
// Describes a token dataset (counts, vocabulary, tokenizer, a decoded excerpt).
int inspect_tokens(const std::string& spec);

}  // namespace strata::data_tool
