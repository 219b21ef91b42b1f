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
  bool tie_embeddings = true;       // lm_head uses wte (gpt.hpp: LMHead); train's default: ties_embeddings_by_default
  std::string attention = "flash";  // flash (memory-efficient) | plain
  // Activation recomputation of the transformer blocks: none | block | full (gpt.hpp:
  // Recompute); only the gpt models have it (other models: an Input error unless "none").
  std::string recompute = "none";
  // gpt: the MLP's activation, gelu (exact, x Phi(x)) | gelu_tanh (GPT-2's tanh approximation,
  // Hugging Face's "gelu_new"), and the LayerNorms' epsilon.
  std::string activation = "gelu";
  float norm_eps = 1e-5f;
  // llama (llama.hpp; a preset sets these, layers, heads, embed, seq_len and vocab):
  int kv_heads = 0;            // key/value heads (0: --heads); 1: multi-query
  int64_t ffn_hidden = 0;      // SwiGLU hidden size (0: Llama's rule from the width, see build_llama)
  double rope_theta = 500000;  // rotary base (Llama 3)
  double rope_scaling = 0;     // Llama 3.1's frequency scaling factor (8; 3.2: 32); 0: none
};

// The GPT presets' names and, for one of them, the spec with its shape fields set (layers,
// heads, embed, seq_len, and vocab unless the spec gives one); any other spec is returned unchanged.
const std::vector<std::string>& gpt_presets();
// The Llama presets (llama3.2-1b, llama3.2-3b, llama3.1-8b, llama3.1-70b): the published shapes
// (and kv_heads, ffn_hidden, norm_eps, rope_theta, rope_scaling) set by resolve_preset likewise.
const std::vector<std::string>& llama_presets();
ModelSpec resolve_preset(const ModelSpec& spec);
// A llama's SwiGLU hidden size: ffn_hidden, or Llama's rule when 0 (2/3 of 4 embed, rounded up
// to a multiple of 256).
int64_t llama_ffn_hidden(const ModelSpec& spec);
// True for "gpt", "llama" and their presets: a language model, which reads token windows.
bool is_language_model(const ModelSpec& spec);
// True for "llama" and its presets.
bool is_llama(const ModelSpec& spec);
// Whether the model ties its LM head to the token embedding unless told (--tie-embeddings):
// GPT-2 and Llama 3.2 (1B, 3B) do, Llama 3.1 and "llama" do not.
bool ties_embeddings_by_default(const std::string& model);

// num_classes: the dataset's classes (gpt: its vocabulary; the model's is spec.vocab if set).
// tp: the tensor-parallel group this rank's model is a shard of (gpt models only; null or
// size 1: the whole model, exactly as without it). The heads and the vocabulary must be
// divisible by its size; mlp, cnn and resnet refuse tp > 1 (Input errors, one line each).
Model build_model(const ModelSpec& spec, const Shape& input_shape, int num_classes, TensorParallelGroup* tp = nullptr);

}  // namespace strata::layers
