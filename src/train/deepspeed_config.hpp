// --deepspeed-config ds_config.json: the common subset of DeepSpeed's configuration, mapped to
// train's options (docs/migration.md has the table). Flags on the command line and in --config
// override it. Keys it does not map are listed, for one warning line each (an error with
// --strict-config); values it cannot reproduce (a scheduler Strata does not have, fp16 and bf16
// both enabled) are one-line input errors.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace strata::train {

struct DeepSpeedOptions {
  std::string ini;                       // "option = value" lines, as a --config file holds them
  std::vector<std::string> unsupported;  // dotted keys it does not map ("fp16.hysteresis"), sorted
  int64_t gradient_accumulation = 0;     // gradient_accumulation_steps (0: not given), checked against the plan
};

// Reads and maps `path` (nlohmann::json, nesting limited). Input errors name the file.
DeepSpeedOptions read_deepspeed_config(const std::string& path);

}  // namespace strata::train
