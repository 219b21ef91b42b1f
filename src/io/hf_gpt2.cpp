// Hugging Face GPT-2 <-> Strata gpt: options and tensor map.
#include "io/hf_gpt2.hpp"

#include <cstdio>
#include <sstream>

#include "core/error.hpp"
#include "io/hf_json.hpp"

namespace strata::io {

using hf_json::flag, hf_json::json, hf_json::parse_object, hf_json::positive, hf_json::positive_number;

Gpt2Options parse_hf_gpt2_config(const std::string& text, const std::string& where) {
  const json j = parse_object(text, where);
  if (j.contains("architectures")) {
    const json& a = j["architectures"];
    STRATA_REQUIRE(a.is_array() && a.size() == 1 && a[0] == "GPT2LMHeadModel", where, ": 'architectures' is ", a.dump(),
                   "; strata-convert reads GPT2LMHeadModel (GPT-2) only");
  }
  STRATA_REQUIRE(!j.contains("model_type") || j["model_type"] == "gpt2", where, ": 'model_type' is ",
                 j["model_type"].dump(), "; strata-convert reads gpt2 only");
  Gpt2Options o;
  o.vocab = positive(j, "vocab_size", where);
  o.positions = positive(j, "n_positions", where,
                         j.contains("n_ctx") ? std::optional(positive(j, "n_ctx", where)) : std::nullopt);
  o.embed = positive(j, "n_embd", where);
  o.layers = positive(j, "n_layer", where);
  o.heads = positive(j, "n_head", where);
  STRATA_REQUIRE(o.embed % o.heads == 0, where, ": 'n_head' (", o.heads, ") must divide 'n_embd' (", o.embed, ")");
  const int64_t inner = positive(j, "n_inner", where, 4 * o.embed);
  STRATA_REQUIRE(inner == 4 * o.embed, where, ": 'n_inner' is ", inner,
                 "; Strata's gpt MLP is 4 n_embd = ", 4 * o.embed, " wide");
  const std::string act = j.value("activation_function", std::string("gelu_new"));
  if (act == "gelu_new" || act == "gelu_pytorch_tanh")
    o.activation = "gelu_tanh";
  else if (act == "gelu")
    o.activation = "gelu";
  else
    STRATA_THROW_INPUT(where, ": 'activation_function' is '", act,
                       "'; Strata's gpt computes gelu (exact) or gelu_new / gelu_pytorch_tanh (tanh approximation)");
  o.norm_eps = positive_number(j, "layer_norm_epsilon", o.norm_eps, where);
  o.tie_embeddings = flag(j, "tie_word_embeddings", true, where);
  STRATA_REQUIRE(flag(j, "scale_attn_weights", true, where), where,
                 ": 'scale_attn_weights' is false; Strata's attention always scales by 1/sqrt(head size)");
  for (const char* key : {"scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn", "add_cross_attention"})
    STRATA_REQUIRE(!flag(j, key, false, where), where, ": '", key, "' is true; Strata's gpt does not support it");
  return o;
}

std::string hf_gpt2_config_json(const Gpt2Options& o, const std::string& dtype, int32_t eot) {
  nlohmann::ordered_json j;
  j["architectures"] = {"GPT2LMHeadModel"};
  j["model_type"] = "gpt2";
  j["vocab_size"] = o.vocab;
  j["n_positions"] = o.positions;
  j["n_embd"] = o.embed;
  j["n_layer"] = o.layers;
  j["n_head"] = o.heads;
  j["n_inner"] = nullptr;  // 4 n_embd
  j["activation_function"] = o.activation == "gelu_tanh" ? "gelu_new" : "gelu";
  j["layer_norm_epsilon"] = o.norm_eps;
  j["tie_word_embeddings"] = o.tie_embeddings;
  j["resid_pdrop"] = o.dropout;
  j["embd_pdrop"] = o.dropout;
  j["attn_pdrop"] = o.dropout;
  j["initializer_range"] = 0.02;
  j["scale_attn_weights"] = true;
  j["scale_attn_by_inverse_layer_idx"] = false;
  j["reorder_and_upcast_attn"] = false;
  j["use_cache"] = true;
  // The tokenizer's end-of-text; without one GPT-2's <|endoftext|> (50256) where the vocabulary
  // has it, else none (transformers refuses ids outside the vocabulary).
  j["bos_token_id"] = eot >= 0 ? json(eot) : o.vocab > 50256 ? json(50256) : json(nullptr);
  j["eos_token_id"] = j["bos_token_id"];
  j["torch_dtype"] = dtype;
  return j.dump(2) + "\n";
}

std::vector<HfTensor> gpt2_tensor_map(const Gpt2Options& o) {
  const int64_t d = o.embed;
  std::vector<HfTensor> m;
  const auto add = [&](std::string hf, std::string strata, Shape shape, bool transposed = false) {
    m.push_back({std::move(hf), std::move(strata), std::move(shape), transposed});
  };
  add("transformer.wte.weight", "wte/weight", {o.vocab, d});
  add("transformer.wpe.weight", "wpe/weight", {o.positions, d});
  for (int64_t i = 0; i < o.layers; ++i) {
    const std::string hf = "transformer.h." + std::to_string(i) + ".", st = "h" + std::to_string(i) + "/";
    add(hf + "ln_1.weight", st + "ln_1/weight", {d});
    add(hf + "ln_1.bias", st + "ln_1/bias", {d});
    add(hf + "attn.c_attn.weight", st + "attn/c_attn/weight", {d, 3 * d}, true);
    add(hf + "attn.c_attn.bias", st + "attn/c_attn/bias", {3 * d});
    add(hf + "attn.c_proj.weight", st + "attn/c_proj/weight", {d, d}, true);
    add(hf + "attn.c_proj.bias", st + "attn/c_proj/bias", {d});
    add(hf + "ln_2.weight", st + "ln_2/weight", {d});
    add(hf + "ln_2.bias", st + "ln_2/bias", {d});
    add(hf + "mlp.c_fc.weight", st + "mlp/c_fc/weight", {d, 4 * d}, true);
    add(hf + "mlp.c_fc.bias", st + "mlp/c_fc/bias", {4 * d});
    add(hf + "mlp.c_proj.weight", st + "mlp/c_proj/weight", {4 * d, d}, true);
    add(hf + "mlp.c_proj.bias", st + "mlp/c_proj/bias", {d});
  }
  add("transformer.ln_f.weight", "ln_f/weight", {d});
  add("transformer.ln_f.bias", "ln_f/bias", {d});
  if (!o.tie_embeddings) add("lm_head.weight", "lm_head/weight", {o.vocab, d});
  return m;
}

std::string gpt2_strata_config(const Gpt2Options& o) {
  char eps[32];
  std::snprintf(eps, sizeof eps, "%.9g", o.norm_eps);
  std::ostringstream s;
  s << "model = gpt\nlayers = " << o.layers << "\nheads = " << o.heads << "\nembed = " << o.embed
    << "\nseq-len = " << o.positions << "\nvocab = " << o.vocab
    << "\ntie-embeddings = " << (o.tie_embeddings ? "true" : "false") << "\nactivation = " << o.activation
    << "\nnorm-eps = " << eps << "\n";
  return s.str();
}

}  // namespace strata::io
