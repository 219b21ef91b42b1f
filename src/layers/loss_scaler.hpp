// Loss scaling for fp16 training (Micikevicius et al., "Mixed Precision Training", 2018), with
// the rules of torch.cuda.amp.GradScaler: the loss gradient is multiplied by scale() so that
// small gradients survive fp16's narrow range; gradients are divided by it again before the
// optimizer step. A step whose gradients overflowed (inf/NaN anywhere) is skipped; dynamic
// scaling then halves the scale, and doubles it after `window` good steps in a row.
#pragma once

#include <cstdint>
#include <string>

namespace strata::layers {

class LossScaler {
 public:
  enum class Mode { None, Fixed, Dynamic };
  // None: scale 1 and no overflow check (fp32, bf16). Fixed: a constant scale; overflowing
  // steps are skipped. Dynamic: starts at `scale`, adapts as above.
  explicit LossScaler(Mode mode = Mode::None, double scale = 1.0, int64_t window = 2000);
  // Parses --loss-scale: auto (dynamic for fp16, none otherwise) | dynamic | none | a number.
  static LossScaler from_flags(const std::string& loss_scale, const std::string& precision, double init_scale,
                               int64_t window);

  Mode mode() const { return mode_; }
  bool enabled() const { return mode_ != Mode::None; }
  double scale() const { return scale_; }
  // Good steps in a row since the last change of scale (dynamic mode).
  int64_t good_steps() const { return good_steps_; }
  // Records whether this step's gradients overflowed (the same on every rank); returns whether
  // the optimizer may step.
  bool update(bool overflow);
  // Restores the state saved in a checkpoint.
  void restore(double scale, int64_t good_steps);
  std::string describe() const;

 private:
  Mode mode_;
  double scale_;
  int64_t window_;
  int64_t good_steps_ = 0;
};

}  // namespace strata::layers
