// The pipeline executor: runs one stage's checked program (schedule.hpp) for a training step —
// receive, forward, send, the loss on the last stage, backward, send — over callbacks that say
// what the stage computes. It owns what a step's micro-batches need between actions: one
// context per micro-batch and chunk, what it received (taken from the caching allocator at each
// receive, let go once used), the outputs and input gradients until sent, the in-flight sends; it measures the peak of
// micro-batches in flight and records a timeline of the compute when asked. It knows nothing of models, data or ZeRO:
// the caller supplies them (the trainer: the stage's DataParallel forward/backward and the
// loss). With the interleaved schedule the stage holds v chunks (virtual stages c·P + s, see
// schedule.hpp) and every callback says which one it runs.
#pragma once

#include <functional>
#include <vector>

#include "layers/layer.hpp"
#include "parallel/comm/communicator.hpp"
#include "parallel/comm/mpi_communicator.hpp"
#include "parallel/pipeline/schedule.hpp"

namespace strata::parallel {

// What a stage computes for micro-batch `micro` of its chunk `chunk` (always 0 but for
// interleaved); the executor decides when.
struct StageCallbacks {
  // First virtual stage (stage 0, chunk 0): the micro-batch's input.
  std::function<Tensor(int micro)> input;
  // The chunk's forward of x, saving what backward needs in ctx.
  std::function<Tensor(int micro, int chunk, const Tensor& x, std::vector<layers::Context>& ctx)> forward;
  // Last virtual stage (stage P-1, chunk v-1): the loss of its output y (accumulated by the
  // callee) and its gradient.
  std::function<Tensor(int micro, const Tensor& y)> loss;
  // The chunk's backward from dy; `last_of_step`: no backward of this chunk follows in the
  // step (its gradient sync hooks on it). Returns the input's gradient (undefined on the first
  // virtual stage, which sends none).
  std::function<Tensor(int micro, int chunk, const Tensor& dy, std::vector<layers::Context>& ctx, bool last_of_step)>
      backward;
};

class PipelineExecutor {
 public:
  // Stage pp.rank() of pp.size() running `kind` over `micro_batches` per step. Generates and
  // checks the schedule of every stage (Internal error if it could deadlock). It receives
  // activations of `input_shape` and gradients of `output_shape` (per micro-batch, with the
  // batch dimension) in `dtype` on `device`. `stand_in_ms`: a benchmark
  // aid, sleeps that long per forward of a chunk (twice per backward) — compute that takes no
  // core.
  // Collective over pp when it reserves mailboxes for the messages (CPU, more than one stage).
  PipelineExecutor(Communicator& pp, ScheduleKind kind, int micro_batches, const Shape& input_shape,
                   const Shape& output_shape, DType dtype, Device device, double stand_in_ms = 0);
  // The same with v = virtual_stages chunks per stage (v > 1: interleaved only; Input errors
  // from make_schedule): chunk c receives activations of input_shapes[c] and gradients of
  // output_shapes[c] (per micro-batch, with the batch dimension; both of size v, the entries
  // of the first virtual stage's input and the last one's output unused).
  PipelineExecutor(Communicator& pp, ScheduleKind kind, int micro_batches, int virtual_stages,
                   const std::vector<Shape>& input_shapes, const std::vector<Shape>& output_shapes, DType dtype,
                   Device device, double stand_in_ms = 0);

  // Runs the stage's program for one step; returns when every send of the step is complete.
  // `record`: keep a timeline of its Forward/Backward events (seconds from the call).
  void run_step(const StageCallbacks& work, bool record = false);

  // A forward pass through the pipeline outside the schedule (evaluation): the first stage
  // forwards input(), the others receive a tensor of `input_shape` from the stage before;
  // every stage but the last sends its output on. Returns the last stage's output (undefined
  // elsewhere). Collective over the pipeline group. One chunk per stage only.
  Tensor forward_only(const std::function<Tensor()>& input, const Shape& input_shape,
                      const std::function<Tensor(const Tensor& x)>& forward);
  // The same through every chunk in virtual-stage order (chunk 0 of every stage, then chunk 1,
  // ...): chunk c receives a tensor of input_shape(c) unless it is the first virtual stage,
  // and forward(c, x) computes it. Returns the last virtual stage's output on the last stage.
  Tensor forward_only(const std::function<Tensor()>& input, const std::function<Shape(int chunk)>& input_shape,
                      const std::function<Tensor(int chunk, const Tensor& x)>& forward);

  // With tensor parallelism the tensors between stages (a block's output and its gradient,
  // after the block's all-reduces) are the same on every rank of this stage's tp group, and
  // each tp rank talks to the same tp rank of the neighbouring stage: each then sends only its
  // 1/T of a message and the receiving group all-gathers the parts over `tp` (Megatron's
  // scatter-gather), so a stage boundary carries each tensor once, not T times. Set before the
  // first step; null (the default) sends whole tensors.
  void set_tensor_parallel(Communicator* tp) { tp_ = tp; }

  int stage() const { return stage_; }
  int stages() const { return stages_; }
  bool first_stage() const { return stage_ == 0; }
  bool last_stage() const { return stage_ == stages_ - 1; }
  // Chunk c of this stage is the whole pipe's first (last) virtual stage.
  bool first_virtual_stage(int chunk) const { return first_stage() && chunk == 0; }
  bool last_virtual_stage(int chunk) const { return last_stage() && chunk == virtual_stages_ - 1; }
  int micro_batches() const { return micro_batches_; }
  int virtual_stages() const { return virtual_stages_; }
  ScheduleKind kind() const { return kind_; }
  const StageProgram& program() const { return program_; }
  // The most (micro-batch, chunk) pairs forwarded but not yet backwarded at once, over all
  // steps so far.
  int peak_in_flight() const { return peak_in_flight_; }
  // What the executor asks of the pipeline group's mailboxes on a CPU (Communicator::reserve_messages):
  // its largest message and slots per sender; 0 and 0 without a pipeline.
  int64_t mailbox_bytes() const { return mailbox_bytes_; }
  int mailbox_slots() const { return mailbox_slots_; }
  // The last recorded step's events (this stage's).
  const std::vector<TimelineEvent>& timeline() const { return timeline_; }
  // Collective over `pp` (the MPI communicator of this executor's group): stage 0 receives
  // every stage's recorded events (returned there, empty elsewhere).
  std::vector<TimelineEvent> gather_timeline(MpiCommunicator& pp);

 private:
  // The part of message `t` this rank sends or receives: its 1/T with tensor parallelism (when
  // T divides the size), else all of it.
  Tensor message_part(const Tensor& t) const;
  // Receives message `t` from `peer` (its part, then the tp group's all-gather).
  void receive(const Tensor& t, int peer, int tag);

  Communicator& pp_;
  Communicator* tp_ = nullptr;
  ScheduleKind kind_;
  int stage_, stages_, micro_batches_, virtual_stages_;
  DType dtype_;
  Device device_;
  double stand_in_ms_;
  StageProgram program_;
  std::vector<size_t> last_backward_;  // per chunk: position of the step's last Backward in program_
  // Indexed [chunk][micro-batch]:
  std::vector<std::vector<std::vector<layers::Context>>> contexts_;
  std::vector<Shape> input_shapes_, output_shapes_;         // per chunk, of one micro-batch: what it receives
  std::vector<std::vector<Tensor>> outputs_, input_grads_;  // what this stage sends
  std::vector<WorkPtr> sends_;
  int peak_in_flight_ = 0;
  int64_t mailbox_bytes_ = 0;
  int mailbox_slots_ = 0;
  std::vector<TimelineEvent> timeline_;
};

}  // namespace strata::parallel
