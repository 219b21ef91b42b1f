// The language model a checkpoint holds (gpt, llama or a preset of either), rebuilt from its
// `config` attribute (the options of the run that saved it) and its tensors' shapes: what
// strata-sample generates with, strata-convert exports and the interop tests' logits run.
#pragma once

#include <cstdint>
#include <map>
#include <string>

#include "io/checkpoint/file.hpp"
#include "layers/zoo.hpp"

namespace strata::io {

struct LanguageModel {
  layers::ModelSpec spec;                     // presets resolved; seq_len and vocab as the tensors have them
  int64_t classes = 0;                        // the data's vocabulary (num_classes), at most spec.vocab
  std::map<std::string, std::string> config;  // the config attribute's options
};

// Input error (one line naming the file) for a checkpoint without a config attribute, of another
// model, or whose options do not parse.
LanguageModel language_model_of(const CheckpointReader& reader);

}  // namespace strata::io
