// The pipeline executor: runs one stage's checked program (schedule.hpp) for a training step —
// receive, forward, send, the loss on the last stage, backward, send — over callbacks that say
// what the stage computes. It owns what a step's micro-batches need between actions: one
// context per micro-batch, the receive buffers (sized once), the outputs and input gradients
// being sent, the in-flight sends; it measures the peak of micro-batches in flight and records
// a timeline of the compute when asked. It knows nothing of models, data or ZeRO: the caller
// supplies them (the trainer: the stage's DataParallel forward/backward and the loss).
#pragma once

#include <functional>
#include <vector>

#include "layers/layer.hpp"
#include "parallel/communicator.hpp"
#include "parallel/mpi_communicator.hpp"
#include "parallel/schedule.hpp"

namespace strata::parallel {

// What a stage computes for micro-batch `micro`; the executor decides when.
struct StageWork {
  // First stage: the micro-batch's input.
  std::function<Tensor(int micro)> input;
  // The stage's forward of x, saving what backward needs in ctx.
  std::function<Tensor(int micro, const Tensor& x, std::vector<layers::Context>& ctx)> forward;
  // Last stage: the loss of the stage's output y (accumulated by the callee) and its gradient.
  std::function<Tensor(int micro, const Tensor& y)> loss;
  // The stage's backward from dy; `last_of_step`: no backward of this stage follows in the
  // step (gradient sync hooks on it). Returns the input's gradient (undefined on the first
  // stage, which sends none).
  std::function<Tensor(int micro, const Tensor& dy, std::vector<layers::Context>& ctx, bool last_of_step)> backward;
};

class PipelineExecutor {
 public:
  // Stage pp.rank() of pp.size() running `kind` over `micro_batches` per step. Generates and
  // checks the schedule of every stage (Internal error if it could deadlock) and sizes the
  // receive buffers: activations of `input_shape`, gradients of `output_shape` (per
  // micro-batch, with the batch dimension) in `dtype` on `device`. `stand_in_ms`: a benchmark
  // aid, sleeps that long per forward (twice per backward) — compute that takes no core.
  // Collective over pp when it reserves mailboxes for the messages (CPU, more than one stage).
  PipelineExecutor(Communicator& pp, ScheduleKind kind, int micro_batches, const Shape& input_shape,
                   const Shape& output_shape, DType dtype, Device device, double stand_in_ms = 0);

  // Runs the stage's program for one step; returns when every send of the step is complete.
  // `record`: keep a timeline of its Forward/Backward events (seconds from the call).
  void run_step(const StageWork& work, bool record = false);

  // A forward pass through the pipeline outside the schedule (evaluation): the first stage
  // forwards input(), the others receive a tensor of `input_shape` from the stage before;
  // every stage but the last sends its output on. Returns the last stage's output (undefined
  // elsewhere). Collective over the pipeline group.
  Tensor forward_only(const std::function<Tensor()>& input, const Shape& input_shape,
                      const std::function<Tensor(const Tensor& x)>& forward);

  int stage() const { return stage_; }
  int stages() const { return stages_; }
  bool first_stage() const { return stage_ == 0; }
  bool last_stage() const { return stage_ == stages_ - 1; }
  int micro_batches() const { return micro_batches_; }
  ScheduleKind kind() const { return kind_; }
  const StageProgram& program() const { return program_; }
  // The most micro-batches forwarded but not yet backwarded at once, over all steps so far.
  int peak_in_flight() const { return peak_in_flight_; }
  // The last recorded step's events (this stage's).
  const std::vector<TimelineEvent>& timeline() const { return timeline_; }
  // Collective over `pp` (the MPI communicator of this executor's group): stage 0 receives
  // every stage's recorded events (returned there, empty elsewhere).
  std::vector<TimelineEvent> gather_timeline(MpiCommunicator& pp);

 private:
  Communicator& pp_;
  ScheduleKind kind_;
  int stage_, stages_, micro_batches_;
  DType dtype_;
  Device device_;
  double stand_in_ms_;
  StageProgram program_;
  size_t last_backward_ = 0;  // position of the step's last Backward in program_
  std::vector<std::vector<layers::Context>> contexts_;
  std::vector<Tensor> received_activations_, received_grads_;  // reused receive buffers
  std::vector<Tensor> outputs_, input_grads_;                  // what this stage sends
  std::vector<WorkPtr> sends_;
  int peak_in_flight_ = 0;
  std::vector<TimelineEvent> timeline_;
};

}  // namespace strata::parallel
