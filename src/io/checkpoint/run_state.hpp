// The checkpoint schema of a training run, in one place: where the model's and the optimizer's
// tensors live in the file and which root attributes record the run's position and settings
// (docs/checkpoints.md). Tensors are full and named by the layers' stable entry names, so any
// layout reads them.
#pragma once

#include <cstdint>
#include <string>

#include "io/checkpoint/file.hpp"

namespace strata::io {

// "model/<entry>": a parameter or buffer.
std::string model_tensor(const std::string& entry);
// "optimizer/<state>/<entry>": optimizer state ("momentum", "exp_avg", ...; "master" holds the
// f32 master weights of a mixed-precision run).
std::string optimizer_tensor(const std::string& state, const std::string& entry);
// A tensor by StateGather's naming: `state` "" is the model's own value.
std::string state_tensor(const std::string& state, const std::string& entry);

// Reads entry `entry`'s value into `out` (f32, host): its f32 master weights when the entry is
// trainable and the checkpoint has them, else the model tensor. Input errors name the tensor
// (missing: "was it saved from a different --model?"; shape) before anything is read.
void read_model_value(const CheckpointReader& reader, const std::string& entry, bool trainable, const Tensor& out);
// The tensor read_model_value reads for an entry of `shape` (the checks are the same), for reading
// part of it (CheckpointReader::read_part).
std::string model_value_tensor(const CheckpointReader& reader, const std::string& entry, bool trainable,
                               const Shape& shape);

// The root attributes of a training checkpoint (format version 2).
struct RunState {
  int64_t step = 0;                      // optimizer steps logged so far (the file's name)
  int64_t optimizer_step = 0;            // steps the optimizer took (fp16 skips overflowed ones)
  int64_t epoch = 0, step_in_epoch = 0;  // the data position of the next batch
  uint64_t seed = 0;
  int64_t global_batch = 0;
  std::string model, optimizer, precision;
  int64_t num_classes = 0;  // 0: not recorded (older files)
  double loss_scale = 1.0;
  int64_t loss_scale_good_steps = 0;
  bool has_loss_scale = false;
  // The progress line's loss averages the steps since the last line: a resumed run logs the same.
  double log_window_loss = 0;
  int64_t log_window_steps = 0;
  std::string config;  // "key = value" lines of the effective options
};

void write_run_state(CheckpointWriter& writer, const RunState& state);
// Input error naming the attribute when a required one is missing.
RunState read_run_state(const CheckpointReader& reader);

}  // namespace strata::io
