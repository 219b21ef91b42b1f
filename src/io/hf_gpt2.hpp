// Hugging Face GPT-2 (transformers' GPT2LMHeadModel) <-> Strata's gpt model: the options
// (config.json <-> the checkpoint's `config` attribute) and the tensor names and layouts
// (hf_convert.hpp runs the conversions).
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

#include "io/hf_convert.hpp"

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

// The model options as a checkpoint's `config` attribute records them (train's flags).
std::string gpt2_strata_config(const Gpt2Options& o);
// Every weight of the model, in HF's order (embeddings, blocks, ln_f, untied lm_head).
std::vector<HfTensor> gpt2_tensor_map(const Gpt2Options& o);

}  // namespace strata::io
