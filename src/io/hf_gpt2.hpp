// Hugging Face GPT-2 (transformers' GPT2LMHeadModel) <-> Strata's gpt model: the options
// (config.json <-> the checkpoint's `config` attribute), the tensor names and layouts, and the two
// streaming conversions strata-convert runs (one tensor in memory at a time).
//
// The map (HF name -> Strata name; HF's Conv1D stores weights (in, out), Strata's Linear (out, in),
// so those are transposed; the fused c_attn is q | k | v along the outputs in both):
//   transformer.wte.weight                (V, D)   -> model/wte/weight
//   transformer.wpe.weight                (P, D)   -> model/wpe/weight
//   transformer.h.{i}.ln_1.{weight,bias}  (D)      -> model/h{i}/ln_1/{weight,bias}   (ln_2 alike)
//   transformer.h.{i}.attn.c_attn.weight  (D, 3D)  -> model/h{i}/attn/c_attn/weight (3D, D), transposed
//   transformer.h.{i}.attn.c_proj.weight  (D, D)   -> model/h{i}/attn/c_proj/weight, transposed
//   transformer.h.{i}.mlp.c_fc.weight     (D, 4D)  -> model/h{i}/mlp/c_fc/weight (4D, D), transposed
//   transformer.h.{i}.mlp.c_proj.weight   (4D, D)  -> model/h{i}/mlp/c_proj/weight (D, 4D), transposed
//   biases (c_attn, c_proj, c_fc)                  -> .../bias, as they are
//   transformer.ln_f.{weight,bias}                 -> model/ln_f/{weight,bias}
//   lm_head.weight (V, D), untied models only      -> model/lm_head/weight
// Files without the "transformer." prefix (the original openai-community/gpt2 upload) read too;
// the attention's mask buffers (attn.bias, attn.masked_bias) of older files are not weights.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "core/tensor.hpp"

namespace strata::io {

// The options of a GPT-2 model both sides share.
struct Gpt2Options {
  int64_t vocab = 0, positions = 0, embed = 0, layers = 0, heads = 0;
  std::string activation = "gelu";  // Strata's names: gelu (exact) | gelu_tanh (HF "gelu_new")
  double norm_eps = 1e-5;
  bool tie_embeddings = true;
  float dropout = 0.0f;  // resid/embd/attn_pdrop on HF's side (training only)
};

// config.json's text -> the options. Input error (one line naming `where` and the key) for what
// Strata's gpt does not compute: another architecture or model_type, n_inner other than 4 n_embd,
// an activation other than gelu / gelu_new / gelu_pytorch_tanh, scale_attn_weights false,
// scale_attn_by_inverse_layer_idx, reorder_and_upcast_attn, add_cross_attention.
Gpt2Options parse_hf_gpt2_config(const std::string& text, const std::string& where);
// The options -> config.json (transformers' GPT2Config keys) with torch_dtype `dtype`
// ("float32", "bfloat16" or "float16") and bos/eos at the tokenizer's end-of-text `eot` (-1: none).
std::string hf_gpt2_config_json(const Gpt2Options& o, const std::string& dtype, int32_t eot = -1);

// One tensor of the map, for these options.
struct Gpt2Tensor {
  std::string hf, strata;  // "transformer.h.0.attn.c_attn.weight", "h0/attn/c_attn/weight"
  Shape hf_shape;          // Strata's shape is hf_shape reversed when transposed, else the same
  bool transposed = false;
};
// Every weight of the model, in HF's order (embeddings, blocks, ln_f, untied lm_head).
std::vector<Gpt2Tensor> gpt2_tensor_map(const Gpt2Options& o);

// A (rows, cols) host f32 tensor -> its (cols, rows) transpose (a new tensor).
Tensor transpose_2d(const Tensor& m);

// import-hf: the model directory `dir` (config.json; model.safetensors, or the shards named by
// model.safetensors.index.json) -> the Strata checkpoint `out` (model tensors, f32, and the
// model options in its `config` attribute, format_version 1: a model without training state,
// for --init-from). Prints one line per shard. Input error (one line) on bad input.
void import_hf_gpt2(const std::string& dir, const std::string& out);

// export-hf: the Strata gpt checkpoint `checkpoint` -> `dir` (created): config.json and
// model.safetensors, or shards of at most `shard_bytes` each (a tensor larger than that gets a
// shard of its own, as transformers does) with model.safetensors.index.json. dtype "F32",
// "BF16" or "F16"; empty: the checkpoint's precision (fp32 -> F32, bf16 -> BF16, fp16 -> F16).
// With a Hugging Face tokenizer also tokenizer.json, tokenizer_config.json (AutoTokenizer loads
// the directory) and config.json's bos/eos ids at its end-of-text token. `tokenizer`: token data
// (a file, directory or glob of token shards) or a tokenizer.json; "" takes the training data the
// checkpoint's config names when it is there and holds one (else no tokenizer files); "none":
// none. Returns the line that says which tokenizer went with it (or why none).
std::string export_hf_gpt2(const std::string& checkpoint, const std::string& dir, uint64_t shard_bytes,
                           const std::string& dtype, const std::string& tokenizer = "");

// The logits (T, V) of the gpt checkpoint's model over `tokens` (positions 0..T-1, T at most its
// seq_len), computed by the full forward in eval mode on the CPU: what interop tests compare.
Tensor gpt_checkpoint_logits(const std::string& checkpoint, const std::vector<int32_t>& tokens);

}  // namespace strata::io
