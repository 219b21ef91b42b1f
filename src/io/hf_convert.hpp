// Hugging Face checkpoints in and out: a model directory of transformers (config.json and
// safetensors, one file or shards with model.safetensors.index.json) <-> a Strata checkpoint, for
// GPT-2 (GPT2LMHeadModel, hf_gpt2.hpp) and Llama (LlamaForCausalLM, hf_llama.hpp). Both
// directions stream tensor by tensor (one tensor in memory at a time); strata-convert runs them.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/tensor.hpp"

namespace strata::io {

// One tensor of an architecture's name map.
struct HfTensor {
  std::string hf, strata;  // "transformer.h.0.attn.c_attn.weight", "h0/attn/c_attn/weight"
  Shape hf_shape;          // Strata's shape is hf_shape reversed when transposed, else the same
  bool transposed = false;
};

// A (rows, cols) host f32 tensor -> its (cols, rows) transpose (a new tensor).
Tensor transpose_2d(const Tensor& m);

// import-hf: the model directory `dir` (config.json's model_type gpt2 or llama; model.safetensors,
// or the shards named by model.safetensors.index.json) -> the Strata checkpoint `out` (model
// tensors, f32, and the model options in its `config` attribute, format_version 1: a model without
// training state, for --init-from). Input error (one line) on bad input.
void import_hf(const std::string& dir, const std::string& out);

// export-hf: the Strata gpt or llama checkpoint `checkpoint` -> `dir` (created): config.json and
// model.safetensors, or shards of at most `shard_bytes` each (a tensor larger than that gets a
// shard of its own, as transformers does) with model.safetensors.index.json. dtype "F32",
// "BF16" or "F16"; empty: the checkpoint's precision (fp32 -> F32, bf16 -> BF16, fp16 -> F16).
// With a Hugging Face tokenizer also tokenizer.json, tokenizer_config.json (AutoTokenizer loads
// the directory) and config.json's bos/eos ids at its end-of-text token. `tokenizer`: token data
// (a file, directory or glob of token shards) or a tokenizer.json; "" takes the training data the
// checkpoint's config names when it is there and holds one (else no tokenizer files); "none":
// none. Returns the line that says which tokenizer went with it (or why none).
std::string export_hf(const std::string& checkpoint, const std::string& dir, uint64_t shard_bytes,
                      const std::string& dtype, const std::string& tokenizer = "");

// The logits (T, V) of the checkpoint's language model over `tokens` (positions 0..T-1, T at most
// its seq_len), computed by the KV-cached decoder in eval mode on the CPU (equal to the full
// forward's to rounding): what interop tests compare.
Tensor checkpoint_logits(const std::string& checkpoint, const std::vector<int32_t>& tokens);

}  // namespace strata::io
