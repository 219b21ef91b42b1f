// Hugging Face GPT-2 <-> Strata gpt: options, tensor map and the streaming conversions.
#include "io/hf_gpt2.hpp"

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <sstream>

#include "core/error.hpp"
#include "io/checkpoint/file.hpp"
#include "io/checkpoint/run_state.hpp"
#include "io/safetensors.hpp"
#include "io/tokenizer.hpp"
#include "io/tokens.hpp"
#include "layers/gpt_decode.hpp"
#include "layers/parameter_store.hpp"
#include "layers/zoo.hpp"

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace strata::io {

namespace {

std::string read_text(const std::string& path, const std::string& what) {
  std::ifstream in(path, std::ios::binary);
  STRATA_REQUIRE(in.good(), what, " '", path, "' cannot be read");
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

void write_text(const std::string& path, const std::string& text) {
  std::ofstream f(path, std::ios::binary);
  f << text;
  f.close();
  STRATA_REQUIRE(f.good(), "cannot write '", path, "'");
}

json parse_json(const std::string& text, const std::string& where) {
  json j = json::parse(text, nullptr, /*allow_exceptions=*/false);
  STRATA_REQUIRE(j.is_object(), where, " is not a JSON object");
  return j;
}

// config.json's integer `key` (required unless a default is given), positive.
int64_t positive(const json& j, const char* key, const std::string& where, std::optional<int64_t> fallback = {}) {
  if (!j.contains(key) || j[key].is_null()) {
    STRATA_REQUIRE(fallback.has_value(), where, " has no '", key, "'");
    return *fallback;
  }
  STRATA_REQUIRE(j[key].is_number_integer() && j[key].get<int64_t>() > 0, where, ": '", key,
                 "' must be a positive integer, found ", j[key].dump());
  return j[key].get<int64_t>();
}

// config.json's boolean `key`, `fallback` when absent.
bool flag(const json& j, const char* key, bool fallback, const std::string& where) {
  if (!j.contains(key) || j[key].is_null()) return fallback;
  STRATA_REQUIRE(j[key].is_boolean(), where, ": '", key, "' must be true or false, found ", j[key].dump());
  return j[key].get<bool>();
}

const std::map<std::string, std::string>& safetensors_of_torch_dtype() {
  static const std::map<std::string, std::string> m{{"float32", "F32"}, {"bfloat16", "BF16"}, {"float16", "F16"}};
  return m;
}

std::string torch_dtype_of(const std::string& safetensors_dtype) {
  for (const auto& [torch, st] : safetensors_of_torch_dtype())
    if (st == safetensors_dtype) return torch;
  STRATA_THROW_INPUT("--dtype must be F32, BF16 or F16, found '", safetensors_dtype, "'");
}

// The checkpoint's `config` attribute's "key = value" lines.
std::map<std::string, std::string> config_lines(const std::string& text) {
  const auto entries = config_entries(text);
  return {entries.begin(), entries.end()};
}

// A gpt checkpoint's model: its options (from `config`, presets resolved, and the tensors' shapes)
// and the ModelSpec that rebuilds it.
struct CheckpointModel {
  Gpt2Options options;
  layers::ModelSpec spec;
  int64_t classes = 0;
};

CheckpointModel model_of_checkpoint(const CheckpointReader& reader) {
  const std::string& path = reader.path();
  STRATA_REQUIRE(reader.has_attr("config"), "checkpoint '", path,
                 "' records no config attribute (the model's options): cannot tell its model");
  const std::map<std::string, std::string> config = config_lines(reader.attr_string("config"));
  const auto get = [&](const char* key, const std::string& fallback) {
    const auto it = config.find(key);
    return it == config.end() ? fallback : it->second;
  };
  CheckpointModel m;
  layers::ModelSpec& s = m.spec;
  s.name = get("model", reader.has_attr("model") ? reader.attr_string("model") : "");
  STRATA_REQUIRE(layers::is_language_model(s) && !layers::is_llama(s), "checkpoint '", path, "' holds a '", s.name,
                 "' model; Hugging Face GPT-2 export takes gpt models (gpt or a gpt2-* preset)");
  for (const char* t : {"model/wte/weight", "model/wpe/weight"})
    STRATA_REQUIRE(reader.has(t), "checkpoint '", path, "' has no tensor ", t, " (is it a gpt checkpoint?)");
  const Shape wte = reader.shape("model/wte/weight"), wpe = reader.shape("model/wpe/weight");
  try {
    s.layers = std::stoi(get("layers", "12"));
    s.heads = std::stoi(get("heads", "12"));
    s.embed = std::stoll(get("embed", "768"));
    s.norm_eps = std::stof(get("norm-eps", "1e-05"));
  } catch (const std::exception&) {
    STRATA_THROW_INPUT("checkpoint '", path,
                       "': its config attribute has a non-numeric layers, heads, embed or norm-eps");
  }
  s.tie_embeddings = get("tie-embeddings", "true") == "true";
  s.activation = get("activation", "gelu");
  s.attention = get("attention", "flash");
  s.vocab = wte.at(0);
  s = layers::resolve_preset(s);
  s.seq_len = wpe.at(0);
  s.vocab = wte.at(0);
  STRATA_REQUIRE(wte.at(1) == s.embed, "checkpoint '", path, "': model/wte/weight is ", shape_str(wte),
                 " but its config says embed ", s.embed);
  m.classes = reader.has_attr("num_classes") ? reader.attr_int("num_classes") : s.vocab;
  Gpt2Options& o = m.options;
  o.vocab = s.vocab;
  o.positions = s.seq_len;
  o.embed = s.embed;
  o.layers = s.layers;
  o.heads = s.heads;
  o.activation = s.activation;
  o.norm_eps = std::stod(get("norm-eps", "1e-05"));  // as written ("0.001"), not widened from the float
  o.tie_embeddings = s.tie_embeddings;
  try {
    o.dropout = std::stof(get("dropout", "0"));
  } catch (const std::exception&) {
    o.dropout = 0.0f;
  }
  return m;
}

// The model options as the `config` attribute of a checkpoint records them (train's flags).
std::string strata_config_text(const Gpt2Options& o) {
  char eps[32];
  std::snprintf(eps, sizeof eps, "%.9g", o.norm_eps);
  std::ostringstream s;
  s << "model = gpt\nlayers = " << o.layers << "\nheads = " << o.heads << "\nembed = " << o.embed
    << "\nseq-len = " << o.positions << "\nvocab = " << o.vocab
    << "\ntie-embeddings = " << (o.tie_embeddings ? "true" : "false") << "\nactivation = " << o.activation
    << "\nnorm-eps = " << eps << "\n";
  return s.str();
}

}  // namespace

// ---- options ---------------------------------------------------------------------------------

Gpt2Options parse_hf_gpt2_config(const std::string& text, const std::string& where) {
  const json j = parse_json(text, where);
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
  if (j.contains("layer_norm_epsilon")) {
    STRATA_REQUIRE(j["layer_norm_epsilon"].is_number() && j["layer_norm_epsilon"].get<double>() > 0, where,
                   ": 'layer_norm_epsilon' must be a positive number, found ", j["layer_norm_epsilon"].dump());
    o.norm_eps = j["layer_norm_epsilon"].get<double>();
  }
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

std::vector<Gpt2Tensor> gpt2_tensor_map(const Gpt2Options& o) {
  const int64_t d = o.embed;
  std::vector<Gpt2Tensor> m;
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

Tensor transpose_2d(const Tensor& m) {
  STRATA_CHECK(m.ndim() == 2 && m.dtype() == DType::F32, "transpose_2d takes a 2-d f32 tensor, found ", m.str());
  const int64_t rows = m.shape()[0], cols = m.shape()[1];
  Tensor t = Tensor::empty({cols, rows});
  const float* src = m.data<float>();
  float* dst = t.data<float>();
  constexpr int64_t kBlock = 64;  // cache-sized tiles: both sides stream through memory
  for (int64_t r0 = 0; r0 < rows; r0 += kBlock)
    for (int64_t c0 = 0; c0 < cols; c0 += kBlock)
      for (int64_t r = r0; r < std::min(rows, r0 + kBlock); ++r)
        for (int64_t c = c0; c < std::min(cols, c0 + kBlock); ++c) dst[c * rows + r] = src[r * cols + c];
  return t;
}

// ---- import ----------------------------------------------------------------------------------

void import_hf_gpt2(const std::string& dir, const std::string& out) {
  STRATA_REQUIRE(fs::is_directory(dir), "--model-dir '", dir, "' is not a directory");
  const std::string config_path = (fs::path(dir) / "config.json").string();
  STRATA_REQUIRE(fs::exists(config_path), "--model-dir '", dir, "' has no config.json");
  const json config = parse_json(read_text(config_path, "config.json"), config_path);
  const Gpt2Options o = parse_hf_gpt2_config(config.dump(), config_path);
  for (const char* k : {"torch_dtype", "dtype"})  // value<std::string> below throws type_error.302 (exit 1) on others
    STRATA_REQUIRE(!config.contains(k) || config[k].is_string(), config_path, ": '", k, "' is ",
                   config.value(k, json()).dump(), "; expected float32, bfloat16 or float16");
  std::string torch_dtype = config.value("torch_dtype", config.value("dtype", std::string()));
  const auto expected_dtype = safetensors_of_torch_dtype().find(torch_dtype);
  STRATA_REQUIRE(torch_dtype.empty() || expected_dtype != safetensors_of_torch_dtype().end(), config_path,
                 ": 'torch_dtype' is '", torch_dtype, "'; expected float32, bfloat16 or float16");

  // Which file holds each tensor: the one model.safetensors, or the index's weight_map.
  std::map<std::string, std::string> file_of;  // HF name -> file name in dir
  std::vector<std::string> files;
  const fs::path single = fs::path(dir) / "model.safetensors", index = fs::path(dir) / "model.safetensors.index.json";
  if (fs::exists(single)) {
    files.push_back("model.safetensors");
  } else {
    STRATA_REQUIRE(fs::exists(index), "--model-dir '", dir,
                   "' has neither model.safetensors nor model.safetensors.index.json (a PyTorch .bin model? save it "
                   "with safe_serialization=True)");
    const json idx = parse_json(read_text(index.string(), "index"), index.string());
    STRATA_REQUIRE(idx.contains("weight_map") && idx["weight_map"].is_object(), index.string(),
                   " has no weight_map object");
    for (const auto& [name, file] : idx["weight_map"].items()) {
      STRATA_REQUIRE(file.is_string(), index.string(), ": weight_map's '", name, "' is not a file name");
      file_of[name] = file.get<std::string>();
      if (std::find(files.begin(), files.end(), file_of[name]) == files.end()) files.push_back(file_of[name]);
    }
    for (const std::string& f : files)
      STRATA_REQUIRE(fs::exists(fs::path(dir) / f), index.string(), " names shard '", f, "', which is missing from '",
                     dir, "'");
  }
  // Open every file (headers only) and find each tensor; names without "transformer." read too.
  std::map<std::string, std::unique_ptr<SafetensorsReader>> readers;
  std::map<std::string, std::pair<SafetensorsReader*, const SafetensorInfo*>> found;  // canonical name ->
  for (const std::string& f : files) {
    auto r = std::make_unique<SafetensorsReader>((fs::path(dir) / f).string());
    for (const SafetensorInfo& t : r->tensors()) {
      if (!file_of.empty()) {
        const auto it = file_of.find(t.name);
        STRATA_REQUIRE(it != file_of.end() && it->second == f, r->path(), " holds '", t.name,
                       "', which model.safetensors.index.json does not place there");
      }
      std::string name = t.name;
      if (name.rfind("transformer.", 0) != 0 && name.rfind("lm_head.", 0) != 0) name = "transformer." + name;
      found[name] = {r.get(), &t};
    }
    readers[f] = std::move(r);
  }
  for (const auto& [name, file] : file_of)
    STRATA_REQUIRE(readers.at(file)->find(name) != nullptr, "model.safetensors.index.json places '", name, "' in ",
                   file, ", which does not hold it");
  const std::vector<Gpt2Tensor> map = gpt2_tensor_map(o);
  for (const auto& [name, where] : found) {
    const bool known = std::any_of(map.begin(), map.end(), [&](const Gpt2Tensor& t) { return t.hf == name; });
    const bool buffer = name.ends_with(".attn.bias") || name.ends_with(".attn.masked_bias");
    const bool tied_head = name == "lm_head.weight" && o.tie_embeddings;  // transformers ties it to wte anyway
    STRATA_REQUIRE(known || buffer || tied_head, where.first->path(), " holds '", where.second->name,
                   "', which is not a weight of a GPT2LMHeadModel with config.json's n_layer ", o.layers);
  }
  for (const Gpt2Tensor& t : map) {
    const auto it = found.find(t.hf);
    STRATA_REQUIRE(it != found.end(), "--model-dir '", dir, "' has no tensor '", t.hf, "' (config.json: n_layer ",
                   o.layers, ", tie_word_embeddings ", o.tie_embeddings ? "true" : "false", ")");
    const SafetensorInfo& info = *it->second.second;
    STRATA_REQUIRE(info.shape == t.hf_shape, it->second.first->path(), ": '", info.name, "' has shape ",
                   shape_str(info.shape), " but config.json implies ", shape_str(t.hf_shape));
    STRATA_REQUIRE(info.dtype == "F32" || info.dtype == "BF16" || info.dtype == "F16", it->second.first->path(), ": '",
                   info.name, "' is ", info.dtype, "; expected F32, BF16 or F16");
    STRATA_REQUIRE(expected_dtype == safetensors_of_torch_dtype().end() || info.dtype == expected_dtype->second,
                   it->second.first->path(), ": '", info.name, "' is ", info.dtype,
                   " but config.json's torch_dtype is ", torch_dtype);
  }

  // Everything checked: now stream the tensors into the checkpoint, one at a time.
  CheckpointWriter writer(out);
  for (const Gpt2Tensor& t : map) {
    const auto& [reader, info] = found.at(t.hf);
    Tensor value = reader->read_f32(*info);
    writer.write_tensor("model/" + t.strata, t.transposed ? transpose_2d(value) : value);
  }
  // format_version 1: model tensors only (no optimizer state or data position); --init-from takes
  // it, --resume says it holds no training state.
  writer.set_attr("format_version", int64_t{1});
  writer.set_attr("model", "gpt");
  writer.set_attr("num_classes", o.vocab);
  writer.set_attr("precision", torch_dtype == "bfloat16" ? "bf16" : torch_dtype == "float16" ? "fp16" : "fp32");
  writer.set_attr("config", strata_config_text(o));
  writer.set_attr("source", "Hugging Face GPT2LMHeadModel " + fs::absolute(dir).string());
  writer.commit();
}

// ---- export ----------------------------------------------------------------------------------

namespace {

// The Hugging Face tokenizer export-hf writes beside the weights (null: none) and why.
struct ExportTokenizer {
  std::unique_ptr<Tokenizer> tokenizer;
  std::string note;
};

ExportTokenizer export_tokenizer(const CheckpointReader& reader, const std::string& flag) {
  ExportTokenizer out;
  if (flag == "none") {
    out.note = "no tokenizer (--tokenizer none)";
    return out;
  }
  if (flag.ends_with(".json")) {
    out.tokenizer = std::make_unique<Tokenizer>(Tokenizer::hf(read_text(flag, "--tokenizer")));
    out.note = "tokenizer " + flag;
    return out;
  }
  std::string spec = flag;
  if (spec.empty()) {  // the training data's, when it is still there
    spec = config_lines(reader.attr_string("config"))["data"];
    std::error_code ec;
    if (spec.empty() || (!fs::exists(spec, ec) && spec.find_first_of("*?[") == std::string::npos)) {
      out.note = "no tokenizer: the checkpoint's training data " +
                 (spec.empty() ? "is not recorded" : spec + " is not here") +
                 " (--tokenizer DATA or tokenizer.json names one)";
      return out;
    }
    try {
      const TokenDataset data = TokenDataset::open(spec, "--tokenizer");
      const Tokenizer& t = data.tokenizer();
      if (t.kind() != Tokenizer::Kind::Hf) {
        out.note = "no tokenizer: the training data " + spec + " has Strata's own (" + t.name() +
                   "), which transformers does not read";
        return out;
      }
      out.tokenizer = std::make_unique<Tokenizer>(t);
    } catch (const Error& e) {
      out.note = "no tokenizer: the training data " + spec + " is not token data (" + e.message() + ")";
      return out;
    }
  } else {
    const TokenDataset data = TokenDataset::open(spec, "--tokenizer");
    const Tokenizer& t = data.tokenizer();
    STRATA_REQUIRE(t.kind() == Tokenizer::Kind::Hf, "--tokenizer ", spec, ": its tokenizer is Strata's ", t.name(),
                   ", not a Hugging Face tokenizer.json");
    out.tokenizer = std::make_unique<Tokenizer>(t);
  }
  out.note = "tokenizer of " + spec;
  return out;
}

}  // namespace

std::string export_hf_gpt2(const std::string& checkpoint, const std::string& dir, uint64_t shard_bytes,
                           const std::string& dtype_flag, const std::string& tokenizer_flag) {
  const CheckpointReader reader(checkpoint);
  const CheckpointModel model = model_of_checkpoint(reader);
  const ExportTokenizer tokenizer = export_tokenizer(reader, tokenizer_flag);
  if (tokenizer.tokenizer)
    STRATA_REQUIRE(tokenizer.tokenizer->vocab_size() <= model.options.vocab, "the ", tokenizer.note, " has ",
                   tokenizer.tokenizer->vocab_size(), " ids but the model's vocabulary ", model.options.vocab);
  std::string dtype = dtype_flag;
  if (dtype.empty()) {
    const std::string precision = reader.has_attr("precision") ? reader.attr_string("precision") : "fp32";
    dtype = precision == "bf16" ? "BF16" : precision == "fp16" ? "F16" : "F32";
  }
  const std::string torch_dtype = torch_dtype_of(dtype);
  const std::vector<Gpt2Tensor> map = gpt2_tensor_map(model.options);
  for (const Gpt2Tensor& t : map) {
    Shape shape = t.hf_shape;
    if (t.transposed) std::reverse(shape.begin(), shape.end());
    STRATA_REQUIRE(reader.has("model/" + t.strata), "checkpoint '", checkpoint, "' has no tensor model/", t.strata,
                   " (its config: layers ", model.options.layers, ", tie-embeddings ",
                   model.options.tie_embeddings ? "true" : "false", ")");
    reader.require_shape("model/" + t.strata, shape);
  }

  // Shards as transformers cuts them: in order, a new shard when the next tensor would not fit.
  const size_t element = safetensors_dtype_size(dtype);
  std::vector<std::vector<SafetensorInfo>> shards(1);
  uint64_t in_shard = 0, total = 0;
  for (const Gpt2Tensor& t : map) {
    const uint64_t bytes = static_cast<uint64_t>(shape_numel(t.hf_shape)) * element;
    if (in_shard > 0 && in_shard + bytes > shard_bytes) {
      shards.emplace_back();
      in_shard = 0;
    }
    shards.back().push_back({t.hf, dtype, t.hf_shape, 0, 0});
    in_shard += bytes;
    total += bytes;
  }
  std::error_code ec;
  // Weights of another export left beside these would make a mixed model (transformers prefers
  // model.safetensors to an index): refuse rather than delete what is there.
  if (fs::is_directory(dir, ec))
    for (const fs::directory_entry& e : fs::directory_iterator(dir, ec)) {
      const std::string name = e.path().filename().string();
      STRATA_REQUIRE(!name.ends_with(".safetensors") && name != "model.safetensors.index.json", "--out '", dir,
                     "' already holds model weights (", name, "); give a new or empty directory");
    }
  fs::create_directories(dir, ec);
  STRATA_REQUIRE(!ec && fs::is_directory(dir), "--out '", dir, "' cannot be created (", ec.message(), ")");
  const auto shard_name = [&](size_t i) {
    if (shards.size() == 1) return std::string("model.safetensors");
    char name[64];
    std::snprintf(name, sizeof name, "model-%05zu-of-%05zu.safetensors", i + 1, shards.size());
    return std::string(name);
  };
  nlohmann::ordered_json weight_map;
  size_t next = 0;
  for (size_t i = 0; i < shards.size(); ++i) {
    SafetensorsWriter writer((fs::path(dir) / shard_name(i)).string(), shards[i], {{"format", "pt"}});
    for (const SafetensorInfo& info : shards[i]) {
      const Gpt2Tensor& t = map[next++];
      Shape shape = t.hf_shape;
      if (t.transposed) std::reverse(shape.begin(), shape.end());
      Tensor value = Tensor::empty(shape);
      read_model_value(reader, t.strata, true, value);  // a mixed-precision run's f32 master values
      writer.write(t.transposed ? transpose_2d(value) : value);
      weight_map[info.name] = shard_name(i);
    }
    writer.close();
  }
  if (shards.size() > 1) {
    nlohmann::ordered_json index;
    index["metadata"] = {{"total_size", total}};
    index["weight_map"] = weight_map;
    std::ofstream f(fs::path(dir) / "model.safetensors.index.json");
    f << index.dump(2) << "\n";
    STRATA_REQUIRE(f.good(), "cannot write model.safetensors.index.json in '", dir, "'");
  }
  const int32_t eot = tokenizer.tokenizer ? tokenizer.tokenizer->eot() : -1;
  write_text((fs::path(dir) / "config.json").string(), hf_gpt2_config_json(model.options, torch_dtype, eot));
  if (tokenizer.tokenizer) {
    const Tokenizer& t = *tokenizer.tokenizer;
    write_text((fs::path(dir) / "tokenizer.json").string(), t.hf_json());
    // What AutoTokenizer needs besides tokenizer.json: the generic fast class, the end-of-text
    // token and the context length.
    nlohmann::ordered_json config;
    config["tokenizer_class"] = "PreTrainedTokenizerFast";
    config["bos_token"] = std::string(t.piece(t.eot()));
    config["eos_token"] = std::string(t.piece(t.eot()));
    config["model_max_length"] = model.options.positions;
    write_text((fs::path(dir) / "tokenizer_config.json").string(), config.dump(2) + "\n");
  }
  return tokenizer.note;
}

// ---- logits ----------------------------------------------------------------------------------

Tensor gpt_checkpoint_logits(const std::string& checkpoint, const std::vector<int32_t>& tokens) {
  const CheckpointReader reader(checkpoint);
  const CheckpointModel m = model_of_checkpoint(reader);
  const layers::Model model = layers::build_model(m.spec, {m.spec.seq_len}, static_cast<int>(m.classes));
  const layers::ParameterStore store(model, 0);
  for (const layers::ParamEntry& e : store.entries()) read_model_value(reader, e.name, e.trainable, store.value(e));
  layers::GptDecoder decoder(model, store);
  const auto n = static_cast<int64_t>(tokens.size());
  STRATA_REQUIRE(n >= 1 && n <= m.spec.seq_len, "--tokens: give 1 to ", m.spec.seq_len, " token ids, found ", n);
  Tensor logits = Tensor::empty({n, m.spec.vocab});
  for (int64_t i = 0; i < n; ++i) {
    const Tensor& row = decoder.step(tokens[static_cast<size_t>(i)]);
    std::copy_n(row.data<float>(), m.spec.vocab, logits.data<float>() + i * m.spec.vocab);
  }
  return logits;
}

}  // namespace strata::io
