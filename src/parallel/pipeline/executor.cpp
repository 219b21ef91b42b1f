// The pipeline executor: one stage's program, action by action (execution model in schedule.hpp).
#include "parallel/pipeline/executor.hpp"

#include <algorithm>
#include <chrono>
#include <thread>
#include <utility>

#include "core/trace.hpp"
#include "parallel/runtime/host_values.hpp"

namespace strata::parallel {

namespace {

void stand_in_compute(double ms) {
  if (ms > 0) std::this_thread::sleep_for(std::chrono::duration<double, std::milli>(ms));
}

}  // namespace

PipelineExecutor::PipelineExecutor(Communicator& pp, ScheduleKind kind, int micro_batches, const Shape& input_shape,
                                   const Shape& output_shape, DType dtype, Device device, double stand_in_ms)
    : PipelineExecutor(pp, kind, micro_batches, 1, {input_shape}, {output_shape}, dtype, device, stand_in_ms) {}

PipelineExecutor::PipelineExecutor(Communicator& pp, ScheduleKind kind, int micro_batches, int virtual_stages,
                                   const std::vector<Shape>& input_shapes, const std::vector<Shape>& output_shapes,
                                   DType dtype, Device device, double stand_in_ms)
    : pp_(pp),
      kind_(kind),
      stage_(pp.rank()),
      stages_(pp.size()),
      micro_batches_(micro_batches),
      virtual_stages_(virtual_stages),
      dtype_(dtype),
      device_(device),
      stand_in_ms_(stand_in_ms) {
  // Generated and checked (matching messages, no deadlock) before any step runs.
  const std::vector<StageProgram> programs = make_schedule(kind, stages_, micro_batches, virtual_stages);
  check_schedule(programs);
  const auto v = static_cast<size_t>(virtual_stages), m = static_cast<size_t>(micro_batches);
  STRATA_CHECK(input_shapes.size() == v && output_shapes.size() == v, "pipeline: ", virtual_stages, " chunks but ",
               input_shapes.size(), " input and ", output_shapes.size(), " output shapes");
  program_ = programs[static_cast<size_t>(stage_)];
  last_backward_.assign(v, 0);
  for (size_t k = 0; k < program_.size(); ++k)
    if (program_[k].op == Op::Backward) last_backward_[static_cast<size_t>(program_[k].chunk)] = k;
  contexts_.assign(v, std::vector<std::vector<layers::Context>>(m));
  outputs_.assign(v, std::vector<Tensor>(m));
  input_grads_.assign(v, std::vector<Tensor>(m));
  input_shapes_ = input_shapes;
  output_shapes_ = output_shapes;
  // The largest message this stage sends or receives (one stage hands its chunks' messages over
  // in memory): a chunk's input and its gradient, its output and that gradient. Not the pipe's
  // own input or output (a language model's logits would make every slot vocabulary-sized).
  int64_t largest_message = 0;
  for (int c = 0; c < virtual_stages && stages_ > 1; ++c) {
    const auto bytes = [&](const Shape& shape) { return shape_numel(shape) * static_cast<int64_t>(dtype_size(dtype)); };
    if (!first_virtual_stage(c))
      largest_message = std::max(largest_message, bytes(input_shapes[static_cast<size_t>(c)]));
    if (!last_virtual_stage(c))
      largest_message = std::max(largest_message, bytes(output_shapes[static_cast<size_t>(c)]));
  }
  // Every stage receives what its neighbours send; GPipe has up to m messages in flight per
  // direction, 1F1B up to P. Interleaved (v >= 2, so m >= P and v*m >= 2P) at most 2P per
  // sender whatever the timing: 2P - 1, or 2P for P = 2, where one neighbour sends both
  // directions (test_schedule). One slot more than that: a full inbox never holds up a sender,
  // so no message has to be moved aside (shared_memory.hpp).
  int in_flight = std::min(micro_batches, stages_);
  if (kind == ScheduleKind::GPipe) in_flight = micro_batches;
  if (virtual_stages > 1) in_flight = 2 * stages_;
  if (stages_ > 1) {
    mailbox_bytes_ = largest_message;
    mailbox_slots_ = in_flight + 1;
  }
  if (stages_ > 1 && device.is_cpu()) pp.reserve_messages(mailbox_bytes_, mailbox_slots_);
}

Tensor PipelineExecutor::message_part(const Tensor& t) const {
  if (!tp_ || tp_->size() == 1 || t.numel() % tp_->size() != 0) return t;
  const int64_t part = t.numel() / tp_->size();
  return t.view(tp_->rank() * part, {part});
}

void PipelineExecutor::receive(const Tensor& t, int peer, int tag) {
  const Tensor part = message_part(t);
  pp_.recv(part, peer, tag);
  if (part.numel() != t.numel()) tp_->all_gather(part, t.view(0, {t.numel()}));  // in place: part is my chunk
}

void PipelineExecutor::run_step(const StageCallbacks& work, bool record) {
  using clock = std::chrono::steady_clock;
  const auto step_start = clock::now();
  const auto seconds = [&] { return std::chrono::duration<double>(clock::now() - step_start).count(); };
  if (record) timeline_.clear();
  int in_flight = 0;
  // The tensor each chunk's forward reads and backward starts from, per [chunk][micro-batch]:
  // a receive buffer, or with one stage the previous (next) chunk's output (input gradient).
  std::vector<std::vector<Tensor>> x(static_cast<size_t>(virtual_stages_)), dy(x);
  for (auto* t : {&x, &dy})
    for (auto& per_chunk : *t) per_chunk.resize(static_cast<size_t>(micro_batches_));
  for (size_t k = 0; k < program_.size(); ++k) {
    const Action a = program_[k];
    const auto i = static_cast<size_t>(a.micro_batch), c = static_cast<size_t>(a.chunk);
    const double start = seconds();
    // Messages to this same stage (P = 1, chunk to chunk) stay in memory. A tag names the
    // sending chunk (schedule.hpp): the peer's for a receive.
    const bool communicates = a.op != Op::Forward && a.op != Op::Backward;
    const bool receives = a.op == Op::RecvActivation || a.op == Op::RecvGrad;
    const StageChunk peer = communicates ? peer_of(a.op, stage_, a.chunk, stages_) : StageChunk{stage_, a.chunk};
    const bool local = peer.stage == stage_;
    const int tag =
        communicates && !local ? message_tag(a.op, a.micro_batch, receives ? peer.chunk : a.chunk, micro_batches_) : 0;
    const auto pc = static_cast<size_t>(peer.chunk);
    switch (a.op) {
      case Op::RecvActivation:
        if (local) {
          x[c][i] = std::move(outputs_[pc][i]);
        } else {
          // From the caching allocator, not m buffers kept for the run: it lives while the
          // micro-batch's forward context keeps it, and its block is reused after that.
          x[c][i] = Tensor::empty(input_shapes_[c], dtype_, device_);
          receive(x[c][i], peer.stage, tag);
        }
        break;
      case Op::RecvGrad:
        if (local) {
          dy[c][i] = std::move(input_grads_[pc][i]);
        } else {
          dy[c][i] = Tensor::empty(output_shapes_[c], dtype_, device_);
          receive(dy[c][i], peer.stage, tag);
        }
        break;
      // A started send keeps its tensor alive (every transport's Work holds it), so the stage
      // lets go of what it sent at once, and of everything a micro-batch used once its compute
      // has run: nothing of a step is held into the next, and the last stage does not keep the
      // loss gradients (micro-batch x logits each) of all m micro-batches.
      case Op::SendActivation:
        if (!local) sends_.push_back(pp_.send_async(message_part(std::exchange(outputs_[c][i], {})), peer.stage, tag));
        break;
      case Op::SendGrad:
        if (!local)
          sends_.push_back(pp_.send_async(message_part(std::exchange(input_grads_[c][i], {})), peer.stage, tag));
        break;
      case Op::Forward: {
        const Tensor input = first_virtual_stage(a.chunk) ? work.input(a.micro_batch) : x[c][i];
        {
          trace::Span span(trace::Track::Compute, "forward");
          span.arg("micro", a.micro_batch).arg("chunk", a.chunk);
          outputs_[c][i] = work.forward(a.micro_batch, a.chunk, input, contexts_[c][i]);
        }
        x[c][i] = Tensor();  // what backward needs of it, the contexts keep
        // The last virtual stage keeps the loss's gradient where the output was: its
        // backward's input.
        if (last_virtual_stage(a.chunk)) {
          trace::Span span(trace::Track::Compute, "loss");
          span.arg("micro", a.micro_batch);
          outputs_[c][i] = work.loss(a.micro_batch, outputs_[c][i]);
        }
        peak_in_flight_ = std::max(peak_in_flight_, ++in_flight);
        stand_in_compute(stand_in_ms_);
        break;
      }
      case Op::Backward: {
        const Tensor& grad = last_virtual_stage(a.chunk) ? outputs_[c][i] : dy[c][i];
        trace::Span span(trace::Track::Compute, "backward");
        span.arg("micro", a.micro_batch).arg("chunk", a.chunk);
        input_grads_[c][i] = work.backward(a.micro_batch, a.chunk, grad, contexts_[c][i], k == last_backward_[c]);
        dy[c][i] = Tensor();
        if (last_virtual_stage(a.chunk)) outputs_[c][i] = Tensor();  // the loss gradient, used
        --in_flight;
        stand_in_compute(2 * stand_in_ms_);
        break;
      }
    }
    if (record && (a.op == Op::Forward || a.op == Op::Backward))
      timeline_.push_back({stage_, a.op, a.micro_batch, start, seconds(), a.chunk});
    // A finished send lets go of its message now, not at the end of the step: the stage never
    // holds more sent messages than are in flight.
    std::erase_if(sends_, [](WorkPtr& w) { return w->test(); });
  }
  for (WorkPtr& w : sends_) w->wait();
  sends_.clear();
}

Tensor PipelineExecutor::forward_only(const std::function<Tensor()>& input, const Shape& input_shape,
                                      const std::function<Tensor(const Tensor& x)>& forward) {
  STRATA_CHECK(virtual_stages_ == 1, "pipeline: forward_only with one forward for ", virtual_stages_, " chunks");
  return forward_only(
      input, [&](int) { return input_shape; }, [&](int, const Tensor& x) { return forward(x); });
}

Tensor PipelineExecutor::forward_only(const std::function<Tensor()>& input,
                                      const std::function<Shape(int chunk)>& input_shape,
                                      const std::function<Tensor(int chunk, const Tensor& x)>& forward) {
  // Between steps no training message is in flight: the tag is the sending chunk. Sends block,
  // but every receiver is already waiting for exactly that message (one chain through the
  // virtual stages).
  Tensor y;
  for (int c = 0; c < virtual_stages_; ++c) {
    Tensor x;
    if (first_virtual_stage(c)) {
      x = input();
    } else {
      const StageChunk from = peer_of(Op::RecvActivation, stage_, c, stages_);
      if (from.stage == stage_) {
        x = y;  // one stage: the previous chunk's output
      } else {
        x = Tensor::empty(input_shape(c), dtype_, device_);
        receive(x, from.stage, from.chunk);
      }
    }
    y = forward(c, x);
    if (last_virtual_stage(c)) return y;
    const StageChunk to = peer_of(Op::SendActivation, stage_, c, stages_);
    if (to.stage != stage_) pp_.send(message_part(y), to.stage, c);
  }
  return Tensor();
}

std::vector<TimelineEvent> PipelineExecutor::gather_timeline(MpiCommunicator& pp) {
  constexpr int kFields = 6, kTag = 0;
  if (stage_ != 0) {
    std::vector<double> packed;
    for (const TimelineEvent& e : timeline_)
      packed.insert(packed.end(),
                    {static_cast<double>(e.stage), static_cast<double>(static_cast<int>(e.op)),
                     static_cast<double>(e.micro_batch), e.start_s, e.end_s, static_cast<double>(e.chunk)});
    send_values(pp, packed, 0, kTag);
    return {};
  }
  std::vector<TimelineEvent> all = timeline_;
  for (int s = 1; s < stages_; ++s) {
    const std::vector<double> p = recv_values(pp, s, kTag);
    for (size_t k = 0; k + kFields <= p.size(); k += kFields)
      all.push_back({static_cast<int>(p[k]), static_cast<Op>(static_cast<int>(p[k + 1])), static_cast<int>(p[k + 2]),
                     p[k + 3], p[k + 4], static_cast<int>(p[k + 5])});
  }
  return all;
}

}  // namespace strata::parallel
