// The pipeline executor: one stage's program, action by action (execution model in schedule.hpp).
#include "parallel/pipeline.hpp"

#include <algorithm>
#include <chrono>
#include <thread>

#include "parallel/values.hpp"

namespace strata::parallel {

namespace {

void stand_in_compute(double ms) {
  if (ms > 0) std::this_thread::sleep_for(std::chrono::duration<double, std::milli>(ms));
}

}  // namespace

PipelineExecutor::PipelineExecutor(Communicator& pp, ScheduleKind kind, int micro_batches, const Shape& input_shape,
                                   const Shape& output_shape, DType dtype, Device device, double stand_in_ms)
    : pp_(pp),
      kind_(kind),
      stage_(pp.rank()),
      stages_(pp.size()),
      micro_batches_(micro_batches),
      dtype_(dtype),
      device_(device),
      stand_in_ms_(stand_in_ms) {
  // Generated and checked (matching messages, no deadlock) before any step runs.
  const std::vector<StageProgram> programs = make_schedule(kind, stages_, micro_batches);
  check_schedule(programs);
  program_ = programs[static_cast<size_t>(stage_)];
  for (size_t k = 0; k < program_.size(); ++k)
    if (program_[k].op == Op::Backward) last_backward_ = k;
  const auto m = static_cast<size_t>(micro_batches);
  contexts_.resize(m);
  outputs_.resize(m);
  input_grads_.resize(m);
  // Every receive buffer is sized once.
  for (size_t i = 0; i < m; ++i) {
    if (!first_stage()) received_activations_.push_back(Tensor::empty(input_shape, dtype, device));
    if (!last_stage()) received_grads_.push_back(Tensor::empty(output_shape, dtype, device));
  }
  // Every stage receives what its neighbours send; GPipe has up to m messages in flight per
  // direction, 1F1B up to P. One slot more than that: a full inbox never holds up a sender, so
  // no message has to be moved aside (shared_memory.hpp).
  int64_t largest_message = 0;
  for (const auto* received : {&received_activations_, &received_grads_})
    for (const Tensor& t : *received) largest_message = std::max(largest_message, static_cast<int64_t>(t.nbytes()));
  const int in_flight = kind == ScheduleKind::GPipe ? micro_batches : std::min(micro_batches, stages_);
  if (stages_ > 1 && device.is_cpu()) pp.reserve_messages(largest_message, in_flight + 1);
}

void PipelineExecutor::run_step(const StageWork& work, bool record) {
  using clock = std::chrono::steady_clock;
  const auto step_start = clock::now();
  const auto seconds = [&] { return std::chrono::duration<double>(clock::now() - step_start).count(); };
  if (record) timeline_.clear();
  int in_flight = 0;
  for (size_t k = 0; k < program_.size(); ++k) {
    const Action a = program_[k];
    const auto i = static_cast<size_t>(a.micro_batch);
    const double start = seconds();
    switch (a.op) {
      case Op::RecvActivation:
        pp_.recv(received_activations_[i], stage_ - 1, message_tag(a.op, a.micro_batch));
        break;
      case Op::RecvGrad:
        pp_.recv(received_grads_[i], stage_ + 1, message_tag(a.op, a.micro_batch));
        break;
      case Op::SendActivation:
        sends_.push_back(pp_.send_async(outputs_[i], stage_ + 1, message_tag(a.op, a.micro_batch)));
        break;
      case Op::SendGrad:
        sends_.push_back(pp_.send_async(input_grads_[i], stage_ - 1, message_tag(a.op, a.micro_batch)));
        break;
      case Op::Forward: {
        const Tensor x = first_stage() ? work.input(a.micro_batch) : received_activations_[i];
        outputs_[i] = work.forward(a.micro_batch, x, contexts_[i]);
        // The last stage keeps the loss's gradient where the output was: its backward's input.
        if (last_stage()) outputs_[i] = work.loss(a.micro_batch, outputs_[i]);
        peak_in_flight_ = std::max(peak_in_flight_, ++in_flight);
        stand_in_compute(stand_in_ms_);
        break;
      }
      case Op::Backward: {
        const Tensor& dy = last_stage() ? outputs_[i] : received_grads_[i];
        input_grads_[i] = work.backward(a.micro_batch, dy, contexts_[i], k == last_backward_);
        --in_flight;
        stand_in_compute(2 * stand_in_ms_);
        break;
      }
    }
    if (record && (a.op == Op::Forward || a.op == Op::Backward))
      timeline_.push_back({stage_, a.op, a.micro_batch, start, seconds()});
  }
  for (WorkPtr& w : sends_) w->wait();
  sends_.clear();
}

Tensor PipelineExecutor::forward_only(const std::function<Tensor()>& input, const Shape& input_shape,
                                      const std::function<Tensor(const Tensor& x)>& forward) {
  constexpr int kTag = 0;  // between steps: no training message is in flight
  Tensor x;
  if (first_stage()) {
    x = input();
  } else {
    x = Tensor::empty(input_shape, dtype_, device_);
    pp_.recv(x, stage_ - 1, kTag);
  }
  const Tensor y = forward(x);
  if (last_stage()) return y;
  pp_.send(y, stage_ + 1, kTag);
  return Tensor();
}

std::vector<TimelineEvent> PipelineExecutor::gather_timeline(MpiCommunicator& pp) {
  constexpr int kFields = 5, kTag = 0;
  if (stage_ != 0) {
    std::vector<double> packed;
    for (const TimelineEvent& e : timeline_)
      packed.insert(packed.end(), {static_cast<double>(e.stage), static_cast<double>(static_cast<int>(e.op)),
                                   static_cast<double>(e.micro_batch), e.start_s, e.end_s});
    send_values(pp, packed, 0, kTag);
    return {};
  }
  std::vector<TimelineEvent> all = timeline_;
  for (int s = 1; s < stages_; ++s) {
    const std::vector<double> p = recv_values(pp, s, kTag);
    for (size_t k = 0; k + kFields <= p.size(); k += kFields)
      all.push_back({static_cast<int>(p[k]), static_cast<Op>(static_cast<int>(p[k + 1])), static_cast<int>(p[k + 2]),
                     p[k + 3], p[k + 4]});
  }
  return all;
}

}  // namespace strata::parallel
