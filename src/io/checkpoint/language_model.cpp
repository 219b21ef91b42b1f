#include "io/checkpoint/language_model.hpp"

#include "core/error.hpp"

namespace strata::io {

namespace {

double number(const std::map<std::string, std::string>& config, const std::string& key, double fallback,
              const std::string& path) {
  const auto it = config.find(key);
  if (it == config.end()) return fallback;
  try {
    size_t used = 0;
    const double v = std::stod(it->second, &used);
    if (used == it->second.size()) return v;
  } catch (const std::exception&) {
  }
  STRATA_THROW_INPUT("checkpoint ", path, ": its config attribute's ", key, " = '", it->second, "' is not a number");
}

std::string text(const std::map<std::string, std::string>& config, const std::string& key,
                 const std::string& fallback) {
  const auto it = config.find(key);
  return it == config.end() ? fallback : it->second;
}

}  // namespace

LanguageModel language_model_of(const CheckpointReader& reader) {
  const std::string& path = reader.path();
  STRATA_REQUIRE(reader.has_attr("config"), "checkpoint ", path,
                 " records no config attribute (the options of the run that saved it): cannot rebuild its model");
  LanguageModel m;
  for (const auto& [key, value] : config_entries(reader.attr_string("config"))) m.config[key] = value;
  layers::ModelSpec& s = m.spec;
  s.name = text(m.config, "model", reader.has_attr("model") ? reader.attr_string("model") : "");
  STRATA_REQUIRE(layers::is_language_model(s), "checkpoint ", path, " holds a '", s.name,
                 "' model, not a language model (gpt, llama or a preset of either)");
  const bool llama = layers::is_llama(s);
  for (const char* t : {"model/wte/weight", "model/wpe/weight"})
    STRATA_REQUIRE(reader.has(t) || (llama && std::string(t) == "model/wpe/weight"), "checkpoint ", path,
                   " has no tensor ", t, " (is it a ", s.name, " checkpoint?)");
  const auto integer = [&](const char* key, double fallback) {
    const double v = number(m.config, key, fallback, path);
    STRATA_REQUIRE(v == static_cast<double>(static_cast<int64_t>(v)) && v >= 0, "checkpoint ", path,
                   ": its config attribute's ", key, " = ", v, " is not a count");
    return static_cast<int64_t>(v);
  };
  const layers::ModelSpec defaults;
  s.layers = static_cast<int>(integer("layers", defaults.layers));
  s.heads = static_cast<int>(integer("heads", defaults.heads));
  s.embed = integer("embed", static_cast<double>(defaults.embed));
  s.kv_heads = static_cast<int>(integer("kv-heads", defaults.kv_heads));
  s.ffn_hidden = integer("ffn-hidden", static_cast<double>(defaults.ffn_hidden));
  s.seq_len = integer("seq-len", 0);
  s.rope_theta = number(m.config, "rope-theta", defaults.rope_theta, path);
  s.rope_scaling = number(m.config, "rope-scaling", defaults.rope_scaling, path);
  s.norm_eps = static_cast<float>(number(m.config, "norm-eps", defaults.norm_eps, path));
  s.tie_embeddings =
      text(m.config, "tie-embeddings", layers::ties_embeddings_by_default(s.name) ? "true" : "false") == "true";
  s.attention = text(m.config, "attention", defaults.attention);
  s.activation = text(m.config, "activation", defaults.activation);
  s = layers::resolve_preset(s);
  // The tensors have the last word: wte's rows (the vocabulary, padded as trained) and wpe's (a
  // GPT's positions; a Llama's come from its --seq-len, rotary positions having no table).
  s.vocab = reader.shape("model/wte/weight").at(0);
  if (!llama) s.seq_len = reader.shape("model/wpe/weight").at(0);
  STRATA_REQUIRE(s.seq_len > 0, "checkpoint ", path,
                 ": its run took the context from its data (--seq-len 0); give the model's context in a checkpoint "
                 "saved with --seq-len");
  m.classes = reader.has_attr("num_classes") ? reader.attr_int("num_classes") : s.vocab;
  STRATA_REQUIRE(m.classes >= 1 && m.classes <= s.vocab, "checkpoint ", path, ": num_classes ", m.classes,
                 " is not within its vocabulary of ", s.vocab);
  return m;
}

}  // namespace strata::io
