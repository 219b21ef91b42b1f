// The model zoo: mlp, cnn, resnet and gpt (a GPT-2-style language model; presets gpt2-124m,
// gpt2-350m, gpt2-774m, gpt2-1.5b), each a Model whose sizes come from the dataset's sample shape.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "layers/model.hpp"

namespace strata::layers {

struct ModelSpec {
  std::string name = "cnn";                 // mlp | cnn | resnet | gpt | a gpt preset (gpt2-124m, ...)
  std::vector<int64_t> hidden{1024, 1024};  // mlp hidden sizes
  int depth = 20;                           // resnet: 6n + 2
  int width = 16;                           // resnet: channels of the first stage
  // mlp/cnn: after each hidden activation. gpt: after the embedding, on the attention
  // probabilities, after each residual projection (attention and MLP).
  float dropout = 0.0f;
  // gpt (a preset sets layers, heads, embed, seq_len and vocab):
  int layers = 12;                  // transformer blocks
  int heads = 12;                   // attention heads; must divide embed
  int64_t embed = 768;              // model width D
  int64_t seq_len = 0;              // positions (wpe rows, T max); 0: the data's T
  int64_t vocab = 0;                // logits per position; 0: the data's (build_model's num_classes),
                                    // else at least that (padded, e.g. 50304)
  bool tie_embeddings = true;       // lm_head uses wte (see gpt.hpp: LMHead for the limits)
  std::string attention = "flash";  // flash (memory-efficient) | plain
  // Activation recomputation of the transformer blocks: none | block | full (gpt.hpp:
  // Recompute); only the gpt models have it (other models: an Input error unless "none").
  std::string recompute = "none";
  // gpt: the MLP's activation, gelu (exact, x Phi(x)) | gelu_tanh (GPT-2's tanh approximation,
  // Hugging Face's "gelu_new"), and the LayerNorms' epsilon.
  std::string activation = "gelu";
  float norm_eps = 1e-5f;
};

// The GPT presets' names and, for one of them, the spec with its shape fields set (layers,
// heads, embed, seq_len, and vocab unless the spec gives one); any other spec is returned unchanged.
const std::vector<std::string>& gpt_presets();
ModelSpec resolve_preset(const ModelSpec& spec);
// True for "gpt" and the presets: a language model, which reads token windows.
bool is_language_model(const ModelSpec& spec);

// num_classes: the dataset's classes (gpt: its vocabulary; the model's is spec.vocab if set).
// tp: the tensor-parallel group this rank's model is a shard of (gpt models only; null or
// size 1: the whole model, exactly as without it). The heads and the vocabulary must be
// divisible by its size; mlp, cnn and resnet refuse tp > 1 (Input errors, one line each).
Model build_model(const ModelSpec& spec, const Shape& input_shape, int num_classes, TensorParallelGroup* tp = nullptr);

}  // namespace strata::layers
