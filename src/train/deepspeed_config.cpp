// --deepspeed-config: DeepSpeed's JSON keys to train's options.
#include "train/deepspeed_config.hpp"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <sstream>

#include "core/error.hpp"

namespace strata::train {

using nlohmann::json;

namespace {

// Far deeper than any ds_config (3 levels); what is deeper is refused while parsing, before it
// can exhaust the stack of whoever walks it.
constexpr int kMaxDepth = 32;

// Dotted paths of every leaf under `tree` (an array is one leaf).
void leaves(const json& tree, const std::string& prefix, std::vector<std::string>& out) {
  if (!tree.is_object() || tree.empty()) {
    out.push_back(prefix);
    return;
  }
  for (const auto& [key, child] : tree.items()) leaves(child, prefix.empty() ? key : prefix + "." + key, out);
}

// A JSON value for a message: a string's text, else the JSON (cut short).
std::string shown(const json& v) {
  std::string text = v.is_string() ? v.get<std::string>() : v.dump();
  if (v.is_number_float()) {  // the shortest text that reads back (dump() prints 17 digits)
    char buf[32];
    text.assign(buf, std::to_chars(buf, buf + sizeof buf, v.get<double>()).ptr);
  }
  if (text.size() > 40) text = text.substr(0, 37) + "...";
  return text;
}

}  // namespace

DeepSpeedOptions read_deepspeed_config(const std::string& path) {
  std::error_code error;
  STRATA_REQUIRE(std::filesystem::is_regular_file(path, error), "--deepspeed-config: cannot read '", path,
                 "' (expected a DeepSpeed JSON file)");
  std::ifstream in(path, std::ios::binary);
  std::stringstream buffer;
  buffer << in.rdbuf();
  STRATA_REQUIRE(in.good() || in.eof(), "--deepspeed-config: cannot read '", path, "'");
  const std::string content = buffer.str();
  json root;
  try {
    root = json::parse(content, [](int depth, json::parse_event_t, json&) {
      STRATA_REQUIRE(depth <= kMaxDepth, "nested deeper than ", kMaxDepth, " levels");
      return true;
    });
  } catch (const json::parse_error& e) {
    const size_t at = std::min<size_t>(e.byte, content.size());
    const auto line = 1 + std::count(content.begin(), content.begin() + static_cast<std::ptrdiff_t>(at), '\n');
    std::string what = e.what();  // "[json.exception.parse_error.101] parse error at line 3, column 1: ..."
    if (const size_t colon = what.find(": "); colon != std::string::npos) what = what.substr(colon + 2);
    STRATA_THROW_INPUT("--deepspeed-config ", path, " line ", line, ": ", what, " (expected JSON)");
  } catch (const json::exception& e) {  // out_of_range.406: a number past double's range (1e999)
    std::string what = e.what();
    if (const size_t space = what.find("] "); space != std::string::npos) what = what.substr(space + 2);
    STRATA_THROW_INPUT("--deepspeed-config ", path, ": ", what, " (expected JSON)");
  } catch (const Error& e) {
    STRATA_THROW_INPUT("--deepspeed-config ", path, ": ", e.what(), " (expected a DeepSpeed config)");
  }
  const auto where = [&](const std::string& key) { return detail::cat("--deepspeed-config ", path, ": '", key, "'"); };
  STRATA_REQUIRE(root.is_object(), "--deepspeed-config ", path, ": expected a JSON object of DeepSpeed keys, found ",
                 root.type_name());

  DeepSpeedOptions out;
  std::set<std::string> used;
  // The value at a dotted key; every section on the way must be an object ("optimizer": "AdamW"
  // is refused, not ignored). "auto" (what Hugging Face's Trainer fills in) counts as not given.
  const auto find = [&](const std::string& key) -> const json* {
    const json* node = &root;
    std::string walked;
    for (size_t begin = 0;;) {
      const size_t dot = key.find('.', begin);
      const std::string part = key.substr(begin, dot == std::string::npos ? std::string::npos : dot - begin);
      const auto child = node->find(part);
      if (child == node->end()) return nullptr;
      walked += (walked.empty() ? "" : ".") + part;
      node = &*child;
      if (dot == std::string::npos) break;
      STRATA_REQUIRE(node->is_object(), where(walked), " must be an object (of its keys such as '", key.substr(dot + 1),
                     "'), found ", node->type_name(), " ", shown(*node));
      begin = dot + 1;
    }
    used.insert(key);
    return node->is_string() && node->get<std::string>() == "auto" ? nullptr : node;
  };
  const auto text = [&](const std::string& key) -> std::optional<std::string> {
    const json* v = find(key);
    if (!v) return std::nullopt;
    STRATA_REQUIRE(v->is_string(), where(key), " must be a string, found ", shown(*v));
    return v->get<std::string>();
  };
  const auto number = [&](const std::string& key) -> std::optional<double> {
    const json* v = find(key);
    if (!v) return std::nullopt;
    STRATA_REQUIRE(v->is_number() && std::isfinite(v->get<double>()), where(key), " must be a number, found '",
                   shown(*v), "'");
    return v->get<double>();
  };
  const auto integer = [&](const std::string& key) -> std::optional<int64_t> {
    const auto v = number(key);
    if (!v) return std::nullopt;
    STRATA_REQUIRE(*v == std::floor(*v) && std::fabs(*v) <= 9.007199254740992e15, where(key),
                   " must be an integer (of at most 2^53), found ", shown(*find(key)));
    return static_cast<int64_t>(*v);
  };
  const auto flag = [&](const std::string& key) {
    const json* v = find(key);
    STRATA_REQUIRE(!v || v->is_boolean(), where(key), " must be true or false, found ", shown(*v));
    return v && v->get<bool>();
  };
  std::map<std::string, std::string> options;  // train option -> value
  const auto as_real = [](double v) {          // the shortest text that reads back as v
    char buf[64];
    return std::string(buf, std::to_chars(buf, buf + sizeof buf, v).ptr);
  };
  const auto set_real = [&](
                            const std::string& option, const std::string& key,
                            const std::function<double(double)>& f = [](double v) { return v; }) {
    if (const auto v = number(key)) options[option] = as_real(f(*v));
  };
  const auto set_int = [&](const std::string& option, const std::string& key) {
    if (const auto v = integer(key)) options[option] = std::to_string(*v);
  };

  set_int("global-batch", "train_batch_size");
  set_int("micro-batch", "train_micro_batch_size_per_gpu");
  if (const auto a = integer("gradient_accumulation_steps")) out.gradient_accumulation = *a;
  set_real("clip-grad", "gradient_clipping");
  set_int("log-every", "steps_per_print");
  set_int("seed", "seed");
  set_int("zero", "zero_optimization.stage");
  // DeepSpeed's bucket sizes count elements; --bucket-mb is MiB of f32 gradients.
  set_real("bucket-mb", "zero_optimization.reduce_bucket_size", [](double v) { return v * 4 / (1 << 20); });
  // What Strata always does: accepted when on, unsupported when turned off.
  for (const char* always : {"zero_optimization.overlap_comm", "zero_optimization.contiguous_gradients",
                             "zero_optimization.reduce_scatter", "zero_optimization.allgather_partitions"})
    if (find(always) && !flag(always)) used.erase(always);

  const bool fp16 = flag("fp16.enabled"), bf16 = flag("bf16.enabled");
  STRATA_REQUIRE(!(fp16 && bf16), "--deepspeed-config ", path, ": fp16.enabled and bf16.enabled are both true");
  if (fp16) {
    options["precision"] = "fp16";
    if (const auto s = number("fp16.loss_scale")) options["loss-scale"] = *s == 0 ? "dynamic" : as_real(*s);
    if (const auto p = integer("fp16.initial_scale_power")) {
      STRATA_REQUIRE(*p >= 0 && *p <= 100, where("fp16.initial_scale_power"), " must be in [0, 100], found ", *p);
      options["loss-scale-init"] = as_real(std::ldexp(1.0, static_cast<int>(*p)));
    }
    set_int("loss-scale-window", "fp16.loss_scale_window");
  } else if (bf16) {
    options["precision"] = "bf16";
  }

  if (const auto type = text("optimizer.type")) {
    // DeepSpeed's Adam is AdamW unless adam_w_mode is false (its FusedAdam's default).
    STRATA_REQUIRE(*type == "Adam" || *type == "AdamW" || *type == "SGD", where("optimizer.type"),
                   " must be Adam, AdamW or SGD, found '", *type, "'");
    options["optimizer"] = *type == "SGD" ? "sgd" : "adamw";
    set_real("lr", "optimizer.params.lr");
    set_real("eps", "optimizer.params.eps");
    set_real("weight-decay", "optimizer.params.weight_decay");
    set_real("momentum", "optimizer.params.momentum");
    if (const json* betas = find("optimizer.params.betas")) {
      STRATA_REQUIRE(betas->is_array() && betas->size() == 2 && (*betas)[0].is_number() && (*betas)[1].is_number(),
                     where("optimizer.params.betas"), " must hold two numbers, found ", shown(*betas));
      options["beta1"] = as_real((*betas)[0].get<double>());
      options["beta2"] = as_real((*betas)[1].get<double>());
    }
  }

  if (const auto type = text("scheduler.type")) {
    STRATA_REQUIRE(*type == "WarmupLR" || *type == "WarmupCosineLR" || *type == "WarmupDecayLR",
                   where("scheduler.type"), " ", *type,
                   " is not supported (WarmupLR, WarmupDecayLR and WarmupCosineLR are)");
    set_int("warmup-steps", "scheduler.params.warmup_num_steps");
    // Strata warms up linearly from lr / warmup; DeepSpeed's default warm-up is logarithmic.
    if (const auto kind = text("scheduler.params.warmup_type"); !kind || *kind != "linear")
      out.unsupported.push_back("scheduler.params.warmup_type (" + kind.value_or("log, the default") +
                                "; Strata warms up linearly)");
    if (*type == "WarmupLR" || *type == "WarmupDecayLR") {
      // WarmupDecayLR: after warm-up, linearly from warmup_max_lr down to warmup_min_lr at total_num_steps.
      options["lr-schedule"] = *type == "WarmupLR" ? "constant" : "linear";
      set_real("lr", "scheduler.params.warmup_max_lr");
      if (*type == "WarmupDecayLR") {
        set_int("steps", "scheduler.params.total_num_steps");
        set_real("min-lr", "scheduler.params.warmup_min_lr");
      } else if (const auto min = number("scheduler.params.warmup_min_lr"); min && *min != 0) {
        used.erase("scheduler.params.warmup_min_lr");
      }
    } else {
      options["lr-schedule"] = "cosine";
      set_int("steps", "scheduler.params.total_num_steps");
      if (const auto ratio = number("scheduler.params.cos_min_ratio")) {
        const auto lr = options.find("lr");
        STRATA_REQUIRE(lr != options.end(), where("scheduler.params.cos_min_ratio"), " needs optimizer.params.lr");
        options["min-lr"] = as_real(*ratio * std::stod(lr->second));
      }
      if (const auto min = number("scheduler.params.warmup_min_ratio"); min && *min != 0)
        used.erase("scheduler.params.warmup_min_ratio");
    }
  }
  set_int("pp", "pipeline.stages");

  std::vector<std::string> all;
  leaves(root, "", all);
  for (const std::string& key : all)
    if (!used.count(key)) out.unsupported.push_back(key);
  std::sort(out.unsupported.begin(), out.unsupported.end());
  for (const auto& [option, value] : options) out.ini += option + " = " + value + "\n";
  return out;
}

}  // namespace strata::train
