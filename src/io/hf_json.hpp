// Readers of config.json values for the Hugging Face conversions (hf_gpt2, hf_llama, hf_convert):
// each wrong value one Input error naming the file (`where`) and the key.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>

#include "core/error.hpp"

namespace strata::io::hf_json {

using json = nlohmann::json;

inline json parse_object(const std::string& text, const std::string& where) {
  json j = json::parse(text, nullptr, /*allow_exceptions=*/false);
  STRATA_REQUIRE(j.is_object(), where, " is not a JSON object");
  return j;
}

// The integer `key`, positive; `fallback` when absent or null (required without one).
inline int64_t positive(const json& j, const char* key, const std::string& where,
                        std::optional<int64_t> fallback = {}) {
  if (!j.contains(key) || j[key].is_null()) {
    STRATA_REQUIRE(fallback.has_value(), where, " has no '", key, "'");
    return *fallback;
  }
  STRATA_REQUIRE(j[key].is_number_integer() && j[key].get<int64_t>() > 0, where, ": '", key,
                 "' must be a positive integer, found ", j[key].dump());
  return j[key].get<int64_t>();
}

// The number `key`, positive; `fallback` when absent or null.
inline double positive_number(const json& j, const char* key, double fallback, const std::string& where) {
  if (!j.contains(key) || j[key].is_null()) return fallback;
  STRATA_REQUIRE(j[key].is_number() && j[key].get<double>() > 0, where, ": '", key,
                 "' must be a positive number, found ", j[key].dump());
  return j[key].get<double>();
}

// The boolean `key`, `fallback` when absent or null.
inline bool flag(const json& j, const char* key, bool fallback, const std::string& where) {
  if (!j.contains(key) || j[key].is_null()) return fallback;
  STRATA_REQUIRE(j[key].is_boolean(), where, ": '", key, "' must be true or false, found ", j[key].dump());
  return j[key].get<bool>();
}

}  // namespace strata::io::hf_json
