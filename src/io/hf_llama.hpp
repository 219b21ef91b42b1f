// Hugging Face Llama (transformers' LlamaForCausalLM) <-> Strata's llama model: the options
// (config.json <-> the checkpoint's `config` attribute) and the tensor names (hf_convert.hpp runs
// the conversions).
//
// The map (HF name -> Strata name; both store nn.Linear's (out, in), so nothing is transposed):
//   model.embed_tokens.weight                          (V, D)     -> model/wte/weight
//   model.layers.{i}.input_layernorm.weight            (D)        -> model/layers.{i}/input_layernorm/weight
//   model.layers.{i}.self_attn.{q,o}_proj.weight       (D, D)     -> model/layers.{i}/self_attn/{q,o}_proj/weight
//   model.layers.{i}.self_attn.{k,v}_proj.weight       (G Dh, D)  -> model/layers.{i}/self_attn/{k,v}_proj/weight
//   model.layers.{i}.post_attention_layernorm.weight   (D)        -> model/layers.{i}/post_attention_layernorm/weight
//   model.layers.{i}.mlp.{gate,up}_proj.weight         (F, D)     -> model/layers.{i}/mlp/{gate,up}_proj/weight
//   model.layers.{i}.mlp.down_proj.weight              (D, F)     -> model/layers.{i}/mlp/down_proj/weight
//   model.norm.weight                                  (D)        -> model/norm/weight
//   lm_head.weight (V, D), untied models only                     -> model/lm_head/weight
// Rotary layout: Hugging Face's checkpoints hold q_proj and k_proj rows in the order its
// rotate_half pairs them (i with i + Dh/2), which is Strata's convention too (llama.hpp): the rows
// are taken as they are. (Meta's original consolidated.pth pairs 2i with 2i + 1; transformers'
// convert_llama_weights_to_hf.py permutes those rows, and that file is not read here.)
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "io/hf_convert.hpp"

namespace strata::io {

// The options of a Llama both sides share.
struct LlamaOptions {
  int64_t vocab = 0, positions = 0, embed = 0, layers = 0, heads = 0, kv_heads = 0, ffn_hidden = 0;
  double norm_eps = 1e-5, rope_theta = 500000;
  double rope_scaling = 0;  // Llama 3.1's "llama3" rope scaling factor; 0: none
  bool tie_embeddings = false;
};

// config.json's text -> the options. Input error (one line naming `where` and the key) for what
// Strata's llama does not compute: another architecture or model_type, an activation other than
// silu, biases (attention_bias, mlp_bias), a head_dim other than hidden_size / heads, a rope
// scaling other than none or Llama 3.1's "llama3" with its published low/high frequency factors
// (1, 4) and original context (8192), pretraining_tp other than 1. Reads transformers 4's
// rope_theta / rope_scaling and transformers 5's rope_parameters.
LlamaOptions parse_hf_llama_config(const std::string& text, const std::string& where);
// The options -> config.json (transformers' LlamaConfig keys) with torch_dtype `dtype` and
// bos/eos at the tokenizer's end-of-text `eot` (-1: none).
std::string hf_llama_config_json(const LlamaOptions& o, const std::string& dtype, int32_t eot = -1);
// The model options as a checkpoint's `config` attribute records them (train's flags).
std::string llama_strata_config(const LlamaOptions& o);
// Every weight of the model, in the order of transformers' state dict.
std::vector<HfTensor> llama_tensor_map(const LlamaOptions& o);

}  // namespace strata::io
