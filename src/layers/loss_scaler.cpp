#include "layers/loss_scaler.hpp"

#include <cmath>

#include "core/error.hpp"

namespace strata::layers {

LossScaler::LossScaler(Mode mode, double scale, int64_t window) : mode_(mode), scale_(scale), window_(window) {
  STRATA_REQUIRE(std::isfinite(scale) && scale > 0, "the loss scale must be a positive number, found ", scale);
  STRATA_REQUIRE(window > 0, "--loss-scale-window must be positive, found ", window);
}

LossScaler LossScaler::from_flags(const std::string& loss_scale, const std::string& precision, double init_scale,
                                  int64_t window) {
  if (loss_scale == "auto") return precision == "fp16" ? LossScaler(Mode::Dynamic, init_scale, window) : LossScaler();
  if (loss_scale == "dynamic") return LossScaler(Mode::Dynamic, init_scale, window);
  if (loss_scale == "none") return LossScaler();
  size_t used = 0;
  double value = 0;
  try {
    value = std::stod(loss_scale, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  STRATA_REQUIRE(used == loss_scale.size() && used > 0 && std::isfinite(value) && value > 0,
                 "--loss-scale must be auto, dynamic, none or a positive number, found '", loss_scale, "'");
  return LossScaler(Mode::Fixed, value, window);
}

bool LossScaler::update(bool overflow) {
  if (mode_ == Mode::None) return true;
  if (overflow) {
    if (mode_ == Mode::Dynamic) scale_ *= 0.5;
    good_steps_ = 0;
    return false;
  }
  if (mode_ == Mode::Dynamic && ++good_steps_ == window_) {
    scale_ *= 2.0;
    good_steps_ = 0;
  }
  return true;
}

void LossScaler::restore(double scale, int64_t good_steps) {
  STRATA_REQUIRE(std::isfinite(scale) && scale > 0 && good_steps >= 0, "checkpoint loss scale ", scale,
                 " / good steps ", good_steps, " are not valid");
  scale_ = scale;
  good_steps_ = good_steps;
}

std::string LossScaler::describe() const {
  switch (mode_) {
    case Mode::None:
      return "none";
    case Mode::Fixed:
      return detail::cat("fixed ", scale_);
    case Mode::Dynamic:
      return detail::cat("dynamic from ", scale_, ", doubled after ", window_, " good steps");
  }
  return "?";
}

}  // namespace strata::layers
