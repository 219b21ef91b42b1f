// Hugging Face Llama <-> Strata llama: options and tensor map.
#include "io/hf_llama.hpp"

#include <cstdio>
#include <optional>
#include <sstream>

#include "core/error.hpp"
#include "io/hf_json.hpp"

namespace strata::io {

using hf_json::flag, hf_json::json, hf_json::parse_object, hf_json::positive, hf_json::positive_number;

namespace {

// Llama 3.1's rope scaling as Strata computes it (llama.hpp's RopeScaling).
constexpr double kLowFreqFactor = 1.0, kHighFreqFactor = 4.0;
constexpr int64_t kOriginalContext = 8192;

// The "llama3" scaling's factor, 0 for none (rope_type "default"); an Input error for another.
double rope_scaling_factor(const json& scaling, const std::string& where) {
  if (scaling.is_null()) return 0;
  STRATA_REQUIRE(scaling.is_object(), where, ": the rope scaling must be an object, found ", scaling.dump());
  const std::string type = scaling.value("rope_type", scaling.value("type", std::string("default")));
  if (type == "default") return 0;
  STRATA_REQUIRE(type == "llama3", where, ": rope_type '", type,
                 "' is not supported (Strata's llama computes none or Llama 3.1's 'llama3')");
  const double factor = positive_number(scaling, "factor", 0, where);
  STRATA_REQUIRE(factor >= 1, where, ": the llama3 rope scaling needs a 'factor' >= 1, found ",
                 scaling.value("factor", json()).dump());
  STRATA_REQUIRE(positive_number(scaling, "low_freq_factor", kLowFreqFactor, where) == kLowFreqFactor &&
                     positive_number(scaling, "high_freq_factor", kHighFreqFactor, where) == kHighFreqFactor &&
                     positive(scaling, "original_max_position_embeddings", where, kOriginalContext) == kOriginalContext,
                 where, ": the llama3 rope scaling ", scaling.dump(),
                 " differs from Llama 3.1's low_freq_factor 1, high_freq_factor 4 and original context 8192, the "
                 "ones Strata computes");
  return factor;
}

}  // namespace

LlamaOptions parse_hf_llama_config(const std::string& text, const std::string& where) {
  const json j = parse_object(text, where);
  if (j.contains("architectures")) {
    const json& a = j["architectures"];
    STRATA_REQUIRE(a.is_array() && a.size() == 1 && a[0] == "LlamaForCausalLM", where, ": 'architectures' is ",
                   a.dump(), "; a llama config.json names LlamaForCausalLM");
  }
  STRATA_REQUIRE(j.value("model_type", json()) == "llama", where, ": 'model_type' is ",
                 j.value("model_type", json()).dump(), "; expected llama");
  LlamaOptions o;
  o.vocab = positive(j, "vocab_size", where);
  o.embed = positive(j, "hidden_size", where);
  o.ffn_hidden = positive(j, "intermediate_size", where);
  o.layers = positive(j, "num_hidden_layers", where);
  o.heads = positive(j, "num_attention_heads", where);
  o.kv_heads = positive(j, "num_key_value_heads", where, o.heads);
  o.positions = positive(j, "max_position_embeddings", where, 2048);  // LlamaConfig's default
  STRATA_REQUIRE(o.embed % o.heads == 0 && o.embed / o.heads % 2 == 0, where, ": 'num_attention_heads' (", o.heads,
                 ") must divide 'hidden_size' (", o.embed, ") into heads of an even size");
  STRATA_REQUIRE(o.heads % o.kv_heads == 0, where, ": 'num_key_value_heads' (", o.kv_heads,
                 ") must divide 'num_attention_heads' (", o.heads, ")");
  const int64_t head_dim = positive(j, "head_dim", where, o.embed / o.heads);
  STRATA_REQUIRE(head_dim == o.embed / o.heads, where, ": 'head_dim' is ", head_dim,
                 "; Strata's llama has heads of hidden_size / num_attention_heads = ", o.embed / o.heads);
  const std::string act = j.value("hidden_act", std::string("silu"));
  STRATA_REQUIRE(act == "silu", where, ": 'hidden_act' is '", act, "'; Strata's llama MLP is SwiGLU (silu)");
  o.norm_eps = positive_number(j, "rms_norm_eps", 1e-6, where);  // LlamaConfig's default
  // transformers 5 keeps the rotary settings in rope_parameters; 4 in rope_theta and rope_scaling.
  if (j.contains("rope_parameters") && !j["rope_parameters"].is_null()) {
    const json& p = j["rope_parameters"];
    STRATA_REQUIRE(p.is_object(), where, ": 'rope_parameters' must be an object, found ", p.dump());
    o.rope_theta = positive_number(p, "rope_theta", 10000, where);
    o.rope_scaling = rope_scaling_factor(p, where);
  } else {
    o.rope_theta = positive_number(j, "rope_theta", 10000, where);
    o.rope_scaling = rope_scaling_factor(j.value("rope_scaling", json()), where);
  }
  for (const char* key : {"attention_bias", "mlp_bias"})
    STRATA_REQUIRE(!flag(j, key, false, where), where, ": '", key, "' is true; Strata's llama has no biases");
  STRATA_REQUIRE(positive(j, "pretraining_tp", where, 1) == 1, where,
                 ": 'pretraining_tp' is not 1 (Strata computes the exact, unsliced products)");
  o.tie_embeddings = flag(j, "tie_word_embeddings", false, where);
  return o;
}

std::string hf_llama_config_json(const LlamaOptions& o, const std::string& dtype, int32_t eot) {
  nlohmann::ordered_json j;
  j["architectures"] = {"LlamaForCausalLM"};
  j["model_type"] = "llama";
  j["vocab_size"] = o.vocab;
  j["hidden_size"] = o.embed;
  j["intermediate_size"] = o.ffn_hidden;
  j["num_hidden_layers"] = o.layers;
  j["num_attention_heads"] = o.heads;
  j["num_key_value_heads"] = o.kv_heads;
  j["head_dim"] = o.embed / o.heads;
  j["hidden_act"] = "silu";
  j["max_position_embeddings"] = o.positions;
  j["rms_norm_eps"] = o.norm_eps;
  j["rope_theta"] = o.rope_theta;
  if (o.rope_scaling > 0)
    j["rope_scaling"] = {{"rope_type", "llama3"},
                         {"factor", o.rope_scaling},
                         {"low_freq_factor", kLowFreqFactor},
                         {"high_freq_factor", kHighFreqFactor},
                         {"original_max_position_embeddings", kOriginalContext}};
  else
    j["rope_scaling"] = nullptr;
  j["attention_bias"] = false;
  j["attention_dropout"] = 0.0;
  j["mlp_bias"] = false;
  j["pretraining_tp"] = 1;
  j["tie_word_embeddings"] = o.tie_embeddings;
  j["initializer_range"] = 0.02;
  j["use_cache"] = true;
  j["bos_token_id"] = eot >= 0 ? json(eot) : json(nullptr);
  j["eos_token_id"] = j["bos_token_id"];
  j["torch_dtype"] = dtype;
  return j.dump(2) + "\n";
}

std::string llama_strata_config(const LlamaOptions& o) {
  char eps[32];
  std::snprintf(eps, sizeof eps, "%.9g", o.norm_eps);
  std::ostringstream s;
  s.precision(17);
  s << "model = llama\nlayers = " << o.layers << "\nheads = " << o.heads << "\nkv-heads = " << o.kv_heads
    << "\nembed = " << o.embed << "\nffn-hidden = " << o.ffn_hidden << "\nseq-len = " << o.positions
    << "\nvocab = " << o.vocab << "\ntie-embeddings = " << (o.tie_embeddings ? "true" : "false")
    << "\nrope-theta = " << o.rope_theta << "\nrope-scaling = " << o.rope_scaling << "\nnorm-eps = " << eps << "\n";
  return s.str();
}

std::vector<HfTensor> llama_tensor_map(const LlamaOptions& o) {
  const int64_t d = o.embed, kv = o.kv_heads * (o.embed / o.heads), f = o.ffn_hidden;
  std::vector<HfTensor> m;
  const auto add = [&](std::string hf, std::string strata, Shape shape) {
    m.push_back({std::move(hf), std::move(strata), std::move(shape), false});
  };
  add("model.embed_tokens.weight", "wte/weight", {o.vocab, d});
  for (int64_t i = 0; i < o.layers; ++i) {
    const std::string hf = "model.layers." + std::to_string(i) + ".", st = "layers." + std::to_string(i) + "/";
    add(hf + "self_attn.q_proj.weight", st + "self_attn/q_proj/weight", {d, d});
    add(hf + "self_attn.k_proj.weight", st + "self_attn/k_proj/weight", {kv, d});
    add(hf + "self_attn.v_proj.weight", st + "self_attn/v_proj/weight", {kv, d});
    add(hf + "self_attn.o_proj.weight", st + "self_attn/o_proj/weight", {d, d});
    add(hf + "mlp.gate_proj.weight", st + "mlp/gate_proj/weight", {f, d});
    add(hf + "mlp.up_proj.weight", st + "mlp/up_proj/weight", {f, d});
    add(hf + "mlp.down_proj.weight", st + "mlp/down_proj/weight", {d, f});
    add(hf + "input_layernorm.weight", st + "input_layernorm/weight", {d});
    add(hf + "post_attention_layernorm.weight", st + "post_attention_layernorm/weight", {d});
  }
  add("model.norm.weight", "norm/weight", {d});
  if (!o.tie_embeddings) add("lm_head.weight", "lm_head/weight", {o.vocab, d});
  return m;
}

}  // namespace strata::io
