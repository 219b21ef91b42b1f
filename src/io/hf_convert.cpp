// Hugging Face checkpoints in and out, for every architecture of the map (GPT-2, Llama).
#include "io/hf_convert.hpp"

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <sstream>

#include "core/error.hpp"
#include "io/checkpoint/file.hpp"
#include "io/checkpoint/language_model.hpp"
#include "io/checkpoint/run_state.hpp"
#include "io/hf_gpt2.hpp"
#include "io/hf_json.hpp"
#include "io/hf_llama.hpp"
#include "io/safetensors.hpp"
#include "io/tokenizer.hpp"
#include "io/tokens.hpp"
#include "layers/gpt_decode.hpp"
#include "layers/parameter_store.hpp"

namespace fs = std::filesystem;

namespace strata::io {

using hf_json::json;

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
std::map<std::string, std::string> config_entries_map(const std::string& text) {
  const auto entries = config_entries(text);
  return {entries.begin(), entries.end()};
}

// One architecture as the conversions see it: its tensors, what the Strata checkpoint records
// and what config.json says.
struct HfModel {
  std::string architecture;  // transformers' class: GPT2LMHeadModel | LlamaForCausalLM
  std::string strata_model;  // the checkpoint's model: gpt | llama
  std::vector<HfTensor> tensors;
  std::string strata_config;  // the checkpoint's config attribute
  int64_t vocab = 0, context = 0;
  bool tie_embeddings = false;
  std::string shape_note;  // the config.json keys that decide the tensors, for "has no tensor"
  std::function<std::string(const std::string& torch_dtype, int32_t eot)> config_json;
  // A tensor name of the files -> the map's; "" for a buffer that is no weight.
  std::function<std::string(const std::string&)> canonical;
};

HfModel gpt2_model(const Gpt2Options& o) {
  return HfModel{
      .architecture = "GPT2LMHeadModel",
      .strata_model = "gpt",
      .tensors = gpt2_tensor_map(o),
      .strata_config = gpt2_strata_config(o),
      .vocab = o.vocab,
      .context = o.positions,
      .tie_embeddings = o.tie_embeddings,
      .shape_note = detail::cat("n_layer ", o.layers, ", tie_word_embeddings ", o.tie_embeddings ? "true" : "false"),
      .config_json = [o](const std::string& dtype, int32_t eot) { return hf_gpt2_config_json(o, dtype, eot); },
      // The original openai-community/gpt2 upload has no "transformer." prefix; older files keep
      // the attention's mask buffers.
      .canonical = [](const std::string& name) -> std::string {
        if (name.ends_with(".attn.bias") || name.ends_with(".attn.masked_bias")) return "";
        if (name.starts_with("transformer.") || name.starts_with("lm_head.")) return name;
        return "transformer." + name;
      }};
}

HfModel llama_model(const LlamaOptions& o) {
  return HfModel{
      .architecture = "LlamaForCausalLM",
      .strata_model = "llama",
      .tensors = llama_tensor_map(o),
      .strata_config = llama_strata_config(o),
      .vocab = o.vocab,
      .context = o.positions,
      .tie_embeddings = o.tie_embeddings,
      .shape_note =
          detail::cat("num_hidden_layers ", o.layers, ", tie_word_embeddings ", o.tie_embeddings ? "true" : "false"),
      .config_json = [o](const std::string& dtype, int32_t eot) { return hf_llama_config_json(o, dtype, eot); },
      // Older files keep each attention's rotary frequencies (rotary_emb.inv_freq): computed, not weights.
      .canonical = [](const std::string& name) -> std::string {
        return name.ends_with(".rotary_emb.inv_freq") ? "" : name;
      }};
}

HfModel model_of_config(const std::string& text, const std::string& where) {
  const json j = hf_json::parse_object(text, where);
  const std::string type =
      j.contains("model_type") && j["model_type"].is_string() ? j["model_type"].get<std::string>() : "gpt2";
  if (type == "llama") return llama_model(parse_hf_llama_config(text, where));
  STRATA_REQUIRE(type == "gpt2", where, ": 'model_type' is ", j["model_type"].dump(),
                 "; strata-convert reads gpt2 (GPT2LMHeadModel) and llama (LlamaForCausalLM)");
  return gpt2_model(parse_hf_gpt2_config(text, where));
}

// The HF view of a Strata checkpoint's language model.
HfModel model_of_checkpoint(const LanguageModel& lm) {
  const layers::ModelSpec& s = lm.spec;
  const auto eps = [&] {  // as the run wrote it ("0.001"), not widened from the float
    const auto it = lm.config.find("norm-eps");
    return it == lm.config.end() ? static_cast<double>(s.norm_eps) : std::stod(it->second);
  };
  if (layers::is_llama(s)) {
    LlamaOptions o;
    o.vocab = s.vocab;
    o.positions = s.seq_len;
    o.embed = s.embed;
    o.layers = s.layers;
    o.heads = s.heads;
    o.kv_heads = s.kv_heads > 0 ? s.kv_heads : s.heads;
    o.ffn_hidden = layers::llama_ffn_hidden(s);
    o.norm_eps = eps();
    o.rope_theta = s.rope_theta;
    o.rope_scaling = s.rope_scaling;
    o.tie_embeddings = s.tie_embeddings;
    return llama_model(o);
  }
  Gpt2Options o;
  o.vocab = s.vocab;
  o.positions = s.seq_len;
  o.embed = s.embed;
  o.layers = s.layers;
  o.heads = s.heads;
  o.activation = s.activation;
  o.norm_eps = eps();
  o.tie_embeddings = s.tie_embeddings;
  try {
    const auto it = lm.config.find("dropout");
    o.dropout = it == lm.config.end() ? 0.0f : std::stof(it->second);
  } catch (const std::exception&) {
    o.dropout = 0.0f;
  }
  return gpt2_model(o);
}

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
    spec = config_entries_map(reader.attr_string("config"))["data"];
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

void import_hf(const std::string& dir, const std::string& out) {
  STRATA_REQUIRE(fs::is_directory(dir), "--model-dir '", dir, "' is not a directory");
  const std::string config_path = (fs::path(dir) / "config.json").string();
  STRATA_REQUIRE(fs::exists(config_path), "--model-dir '", dir, "' has no config.json");
  const std::string config_text = read_text(config_path, "config.json");
  const json config = hf_json::parse_object(config_text, config_path);
  const HfModel model = model_of_config(config_text, config_path);
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
    const json idx = hf_json::parse_object(read_text(index.string(), "index"), index.string());
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
  // Open every file (headers only) and find each tensor under the map's name.
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
      const std::string name = model.canonical(t.name);
      if (!name.empty()) found[name] = {r.get(), &t};
    }
    readers[f] = std::move(r);
  }
  for (const auto& [name, file] : file_of)
    STRATA_REQUIRE(readers.at(file)->find(name) != nullptr, "model.safetensors.index.json places '", name, "' in ",
                   file, ", which does not hold it");
  const std::vector<HfTensor>& map = model.tensors;
  for (const auto& [name, where] : found) {
    const bool known = std::any_of(map.begin(), map.end(), [&](const HfTensor& t) { return t.hf == name; });
    const bool tied_head = name == "lm_head.weight" && model.tie_embeddings;  // transformers ties it to wte anyway
    STRATA_REQUIRE(known || tied_head, where.first->path(), " holds '", where.second->name,
                   "', which is not a weight of a ", model.architecture, " with config.json's ", model.shape_note);
  }
  for (const HfTensor& t : map) {
    const auto it = found.find(t.hf);
    STRATA_REQUIRE(it != found.end(), "--model-dir '", dir, "' has no tensor '", t.hf,
                   "' (config.json: ", model.shape_note, ")");
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
  for (const HfTensor& t : map) {
    const auto& [reader, info] = found.at(t.hf);
    Tensor value = reader->read_f32(*info);
    writer.write_tensor("model/" + t.strata, t.transposed ? transpose_2d(value) : value);
  }
  // format_version 1: model tensors only (no optimizer state or data position); --init-from takes
  // it, --resume says it holds no training state.
  writer.set_attr("format_version", int64_t{1});
  writer.set_attr("model", model.strata_model);
  writer.set_attr("num_classes", model.vocab);
  writer.set_attr("precision", torch_dtype == "bfloat16" ? "bf16" : torch_dtype == "float16" ? "fp16" : "fp32");
  writer.set_attr("config", model.strata_config);
  writer.set_attr("source", "Hugging Face " + model.architecture + " " + fs::absolute(dir).string());
  writer.commit();
}

// ---- export ----------------------------------------------------------------------------------

std::string export_hf(const std::string& checkpoint, const std::string& dir, uint64_t shard_bytes,
                      const std::string& dtype_flag, const std::string& tokenizer_flag) {
  const CheckpointReader reader(checkpoint);
  const HfModel model = model_of_checkpoint(language_model_of(reader));
  const ExportTokenizer tokenizer = export_tokenizer(reader, tokenizer_flag);
  if (tokenizer.tokenizer)
    STRATA_REQUIRE(tokenizer.tokenizer->vocab_size() <= model.vocab, "the ", tokenizer.note, " has ",
                   tokenizer.tokenizer->vocab_size(), " ids but the model's vocabulary ", model.vocab);
  std::string dtype = dtype_flag;
  if (dtype.empty()) {
    const std::string precision = reader.has_attr("precision") ? reader.attr_string("precision") : "fp32";
    dtype = precision == "bf16" ? "BF16" : precision == "fp16" ? "F16" : "F32";
  }
  const std::string torch_dtype = torch_dtype_of(dtype);
  const std::vector<HfTensor>& map = model.tensors;
  for (const HfTensor& t : map) {
    Shape shape = t.hf_shape;
    if (t.transposed) std::reverse(shape.begin(), shape.end());
    STRATA_REQUIRE(reader.has("model/" + t.strata), "checkpoint '", checkpoint, "' has no tensor model/", t.strata,
                   " (its model: ", model.shape_note, ")");
    reader.require_shape("model/" + t.strata, shape);
  }

  // Shards as transformers cuts them: in order, a new shard when the next tensor would not fit.
  const size_t element = safetensors_dtype_size(dtype);
  std::vector<std::vector<SafetensorInfo>> shards(1);
  uint64_t in_shard = 0, total = 0;
  for (const HfTensor& t : map) {
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
      const HfTensor& t = map[next++];
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
  write_text((fs::path(dir) / "config.json").string(), model.config_json(torch_dtype, eot));
  if (tokenizer.tokenizer) {
    const Tokenizer& t = *tokenizer.tokenizer;
    write_text((fs::path(dir) / "tokenizer.json").string(), t.hf_json());
    // What AutoTokenizer needs besides tokenizer.json: the generic fast class, the end-of-text
    // token and the context length.
    nlohmann::ordered_json config;
    config["tokenizer_class"] = "PreTrainedTokenizerFast";
    config["bos_token"] = std::string(t.piece(t.eot()));
    config["eos_token"] = std::string(t.piece(t.eot()));
    config["model_max_length"] = model.context;
    write_text((fs::path(dir) / "tokenizer_config.json").string(), config.dump(2) + "\n");
  }
  return tokenizer.note;
}

// ---- logits ----------------------------------------------------------------------------------

Tensor checkpoint_logits(const std::string& checkpoint, const std::vector<int32_t>& tokens) {
  const CheckpointReader reader(checkpoint);
  const LanguageModel m = language_model_of(reader);
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
