// --deepspeed-config: DeepSpeed's JSON keys to train's options.
#include "train/deepspeed_config.hpp"

#include <algorithm>
#include <boost/property_tree/json_parser.hpp>
#include <boost/property_tree/ptree.hpp>
#include <charconv>
#include <cmath>
#include <functional>
#include <map>
#include <optional>
#include <set>

#include "core/error.hpp"

namespace strata::train {

namespace pt = boost::property_tree;

namespace {

// Dotted paths of every leaf under `tree` (array elements are their array's leaf).
void leaves(const pt::ptree& tree, const std::string& prefix, std::vector<std::string>& out) {
  if (tree.empty()) {
    out.push_back(prefix);
    return;
  }
  for (const auto& [key, child] : tree) {
    if (key.empty()) {  // an array: one leaf
      out.push_back(prefix);
      return;
    }
    leaves(child, prefix.empty() ? key : prefix + "." + key, out);
  }
}

}  // namespace

DeepSpeedOptions read_deepspeed_config(const std::string& path) {
  pt::ptree root;
  try {
    pt::read_json(path, root);
  } catch (const pt::json_parser_error& e) {
    STRATA_THROW_INPUT("--deepspeed-config ", path, " line ", e.line(), ": ", e.message(), " (expected JSON)");
  }
  DeepSpeedOptions out;
  std::set<std::string> used;
  const auto where = [&](const std::string& key) { return detail::cat("--deepspeed-config ", path, ": '", key, "'"); };
  const auto text = [&](const std::string& key) -> std::optional<std::string> {
    const auto v = root.get_optional<std::string>(pt::ptree::path_type(key, '.'));
    if (!v) return std::nullopt;
    used.insert(key);
    return *v;
  };
  const auto number = [&](const std::string& key) -> std::optional<double> {
    const auto v = text(key);
    if (!v) return std::nullopt;
    char* end = nullptr;
    const double d = std::strtod(v->c_str(), &end);
    STRATA_REQUIRE(!v->empty() && *end == '\0' && std::isfinite(d), where(key), " must be a number, found '", *v, "'");
    return d;
  };
  const auto flag = [&](const std::string& key) {
    const auto v = text(key);
    STRATA_REQUIRE(!v || *v == "true" || *v == "false", where(key), " must be true or false, found '", *v, "'");
    return v && *v == "true";
  };
  std::map<std::string, std::string> options;  // train option -> value
  const auto set = [&](const std::string& option, const std::string& key, const std::function<std::string(double)>& f) {
    if (const auto v = number(key)) options[option] = f(*v);
  };
  const auto as_int = [](double v) { return std::to_string(static_cast<int64_t>(std::llround(v))); };
  const auto as_real = [](double v) {  // the shortest text that reads back as v
    char buf[64];
    return std::string(buf, std::to_chars(buf, buf + sizeof buf, v).ptr);
  };

  set("global-batch", "train_batch_size", as_int);
  set("micro-batch", "train_micro_batch_size_per_gpu", as_int);
  if (const auto a = number("gradient_accumulation_steps")) out.gradient_accumulation = std::llround(*a);
  set("clip-grad", "gradient_clipping", as_real);
  set("log-every", "steps_per_print", as_int);
  set("seed", "seed", as_int);
  set("zero", "zero_optimization.stage", as_int);
  // DeepSpeed's bucket sizes count elements; --bucket-mb is MiB of f32 gradients.
  set("bucket-mb", "zero_optimization.reduce_bucket_size", [&](double v) { return as_real(v * 4 / (1 << 20)); });
  // What Strata always does: accepted when on, unsupported when turned off.
  for (const char* always : {"zero_optimization.overlap_comm", "zero_optimization.contiguous_gradients",
                             "zero_optimization.reduce_scatter", "zero_optimization.allgather_partitions"})
    if (text(always) && !flag(always)) used.erase(always);

  const bool fp16 = flag("fp16.enabled"), bf16 = flag("bf16.enabled");
  STRATA_REQUIRE(!(fp16 && bf16), "--deepspeed-config ", path, ": fp16.enabled and bf16.enabled are both true");
  if (fp16) {
    options["precision"] = "fp16";
    if (const auto s = number("fp16.loss_scale")) options["loss-scale"] = *s == 0 ? "dynamic" : as_real(*s);
    set("loss-scale-init", "fp16.initial_scale_power",
        [&](double p) { return as_real(std::ldexp(1.0, static_cast<int>(p))); });
    set("loss-scale-window", "fp16.loss_scale_window", as_int);
  } else if (bf16) {
    options["precision"] = "bf16";
  }

  if (const auto type = text("optimizer.type")) {
    // DeepSpeed's Adam is AdamW unless adam_w_mode is false (its FusedAdam's default).
    STRATA_REQUIRE(*type == "Adam" || *type == "AdamW" || *type == "SGD", where("optimizer.type"),
                   " must be Adam, AdamW or SGD, found '", *type, "'");
    options["optimizer"] = *type == "SGD" ? "sgd" : "adamw";
    set("lr", "optimizer.params.lr", as_real);
    set("eps", "optimizer.params.eps", as_real);
    set("weight-decay", "optimizer.params.weight_decay", as_real);
    set("momentum", "optimizer.params.momentum", as_real);
    if (const auto betas = root.get_child_optional("optimizer.params.betas")) {
      std::vector<std::string> values;
      for (const auto& [key, child] : *betas) values.push_back(child.get_value<std::string>());
      STRATA_REQUIRE(values.size() == 2, where("optimizer.params.betas"), " must hold two numbers, found ",
                     values.size());
      options["beta1"] = values[0];
      options["beta2"] = values[1];
      used.insert("optimizer.params.betas");
    }
  }

  if (const auto type = text("scheduler.type")) {
    STRATA_REQUIRE(*type == "WarmupLR" || *type == "WarmupCosineLR", where("scheduler.type"), " ", *type,
                   " is not supported (WarmupLR and WarmupCosineLR are; WarmupDecayLR's linear decay is not a "
                   "Strata schedule: use --lr-schedule cosine)");
    set("warmup-steps", "scheduler.params.warmup_num_steps", as_int);
    // Strata warms up linearly from lr / warmup; DeepSpeed's default warm-up is logarithmic.
    if (const auto kind = text("scheduler.params.warmup_type"); !kind || *kind != "linear")
      out.unsupported.push_back("scheduler.params.warmup_type (" + kind.value_or("log, the default") +
                                "; Strata warms up linearly)");
    if (*type == "WarmupLR") {
      options["lr-schedule"] = "constant";
      set("lr", "scheduler.params.warmup_max_lr", as_real);
      if (const auto min = number("scheduler.params.warmup_min_lr"); min && *min != 0)
        used.erase("scheduler.params.warmup_min_lr");
    } else {
      options["lr-schedule"] = "cosine";
      set("steps", "scheduler.params.total_num_steps", as_int);
      if (const auto ratio = number("scheduler.params.cos_min_ratio")) {
        const auto lr = options.find("lr");
        STRATA_REQUIRE(lr != options.end(), where("scheduler.params.cos_min_ratio"), " needs optimizer.params.lr");
        options["min-lr"] = as_real(*ratio * std::stod(lr->second));
      }
      if (const auto min = number("scheduler.params.warmup_min_ratio"); min && *min != 0)
        used.erase("scheduler.params.warmup_min_ratio");
    }
  }
  if (const auto stages = text("pipeline.stages"); stages && *stages != "auto") set("pp", "pipeline.stages", as_int);

  std::vector<std::string> all;
  leaves(root, "", all);
  for (const std::string& key : all)
    if (!used.count(key)) out.unsupported.push_back(key);
  std::sort(out.unsupported.begin(), out.unsupported.end());
  for (const auto& [option, value] : options) out.ini += option + " = " + value + "\n";
  return out;
}

}  // namespace strata::train
