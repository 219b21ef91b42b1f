// The training checkpoint schema: tensor names (model, optimizer state, master weights) and the
// run state's root attributes.
#include "io/checkpoint/run_state.hpp"

#include <cmath>

#include "core/limits.hpp"

namespace strata::io {

std::string model_tensor(const std::string& entry) { return "model/" + entry; }

std::string optimizer_tensor(const std::string& state, const std::string& entry) {
  return "optimizer/" + state + "/" + entry;
}

std::string state_tensor(const std::string& state, const std::string& entry) {
  return state.empty() ? model_tensor(entry) : optimizer_tensor(state, entry);
}

std::string model_value_tensor(const CheckpointReader& reader, const std::string& entry, bool trainable,
                               const Shape& shape) {
  const std::string name = model_tensor(entry);
  STRATA_REQUIRE(reader.has(name), "checkpoint ", reader.path(), " has no tensor ", name,
                 " (was it saved from a different --model?)");
  reader.require_shape(name, shape);  // first, so that a mismatch names the model tensor
  // A mixed-precision run saved its f32 master weights too: the full-precision values.
  const std::string master = optimizer_tensor("master", entry);
  if (!trainable || !reader.has(master)) return name;
  reader.require_shape(master, shape);
  return master;
}

void read_model_value(const CheckpointReader& reader, const std::string& entry, bool trainable, const Tensor& out) {
  reader.read_tensor(model_value_tensor(reader, entry, trainable, out.shape()), out);
}

void write_run_state(CheckpointWriter& writer, const RunState& s) {
  writer.set_position({s.step, s.epoch, s.step_in_epoch, s.seed});  // also the manifest's
  writer.set_attr("optimizer_step", s.optimizer_step);
  writer.set_attr("global_batch", s.global_batch);
  writer.set_attr("model", s.model);
  writer.set_attr("optimizer", s.optimizer);
  writer.set_attr("precision", s.precision);
  writer.set_attr("num_classes", s.num_classes);
  writer.set_attr("loss_scale", s.loss_scale);
  writer.set_attr("loss_scale_good_steps", s.loss_scale_good_steps);
  writer.set_attr("log_window_loss", s.log_window_loss);
  writer.set_attr("log_window_steps", s.log_window_steps);
  writer.set_attr("config", s.config);
}

namespace {

// A number the run reads back, held to the range its option has: one line naming the attribute.
void require_in(const CheckpointReader& reader, const char* attr, int64_t value, int64_t lo, int64_t hi) {
  STRATA_REQUIRE(value >= lo && value <= hi, "checkpoint ", reader.path(), ": attribute ", attr, " must be in [", lo,
                 ", ", hi, "], found ", value);
}

}  // namespace

RunState read_run_state(const CheckpointReader& reader) {
  using limits::kMaxSteps;
  RunState s;
  s.step = reader.attr_int("step");
  s.optimizer_step = reader.attr_int("optimizer_step");
  s.epoch = reader.attr_int("epoch");
  s.step_in_epoch = reader.attr_int("step_in_epoch");
  s.global_batch = reader.attr_int("global_batch");
  s.optimizer = reader.attr_string("optimizer");
  require_in(reader, "step", s.step, 0, kMaxSteps);
  require_in(reader, "optimizer_step", s.optimizer_step, 0, s.step);
  require_in(reader, "epoch", s.epoch, 0, limits::kMaxEpochs);
  require_in(reader, "step_in_epoch", s.step_in_epoch, 0, kMaxSteps);
  require_in(reader, "global_batch", s.global_batch, 1, limits::kMaxBatch);
  // Attributes added after format version 2 first shipped.
  if (reader.has_attr("seed")) s.seed = static_cast<uint64_t>(reader.attr_int("seed"));  // any 64 bits
  if (reader.has_attr("model")) s.model = reader.attr_string("model");
  if (reader.has_attr("precision")) s.precision = reader.attr_string("precision");
  if (reader.has_attr("num_classes")) {
    s.num_classes = reader.attr_int("num_classes");
    require_in(reader, "num_classes", s.num_classes, 0, limits::kMaxModelSize);
  }
  s.has_loss_scale = reader.has_attr("loss_scale");
  if (s.has_loss_scale) {
    s.loss_scale = reader.attr_double("loss_scale");
    s.loss_scale_good_steps = reader.attr_int("loss_scale_good_steps");
    STRATA_REQUIRE(s.loss_scale > 0 && std::isfinite(s.loss_scale), "checkpoint ", reader.path(),
                   ": attribute loss_scale must be positive and finite, found ", s.loss_scale);
    require_in(reader, "loss_scale_good_steps", s.loss_scale_good_steps, 0, kMaxSteps);
  }
  if (reader.has_attr("log_window_steps")) {
    s.log_window_loss = reader.attr_double("log_window_loss");
    s.log_window_steps = reader.attr_int("log_window_steps");
    require_in(reader, "log_window_steps", s.log_window_steps, 0, kMaxSteps);
  }
  if (reader.has_attr("config")) s.config = reader.attr_string("config");
  return s;
}

}  // namespace strata::io
