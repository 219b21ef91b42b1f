#include "parallel/stage/engine.hpp"

#include <algorithm>
#include <chrono>
#include <thread>

#include "core/log.hpp"
#include "core/ops.hpp"
#include "core/trace.hpp"
#include "parallel/runtime/watchdog.hpp"

namespace strata::parallel {

void FaultInjection::after_backward(int64_t step, int rank) const {
  if (step == fail_step && rank == fail_rank) STRATA_THROW("injected failure at step ", step, " (--debug-fail-step)");
  if (slow_ms > 0 && rank == fail_rank) std::this_thread::sleep_for(std::chrono::duration<double, std::milli>(slow_ms));
}

void FaultInjection::before_agreement(int64_t step, int rank, Communicator& world) const {
  if (step != mismatch_step) return;
  const Tensor extra = Tensor::zeros({4}, DType::F32);
  world.all_reduce(extra, rank == fail_rank ? ReduceOp::Avg : ReduceOp::Sum);
}

// The engine's chunks for step_callbacks: its data-parallel replicas.
class StageEngine::Replicas final : public ChunkRunner {
 public:
  explicit Replicas(StageEngine& engine) : engine_(engine) {}
  Tensor forward(int chunk, const Tensor& x, std::vector<layers::Context>& ctx, const layers::StepInfo& info) override {
    return engine_.chunk(chunk).forward(x, ctx, info);
  }
  Tensor backward(int chunk, const Tensor& dy, std::vector<layers::Context>& ctx, bool last_of_step,
                  bool input_grad) override {
    return engine_.chunk(chunk).backward(dy, ctx, last_of_step, input_grad);
  }

 private:
  StageEngine& engine_;
};

namespace {

// What a sample's targets look like, from the model's output: a class label per sample for
// (classes) outputs, a next token per position for (T, vocabulary) ones.
Shape target_shape_of(const Shape& output) {
  return output.size() > 1 ? Shape(output.begin(), output.end() - 1) : Shape{};
}

}  // namespace

StageEngine::StageEngine(ProcessGrid& grid, layers::Model& model, std::vector<StageRange> stages,
                         const EngineSettings& settings)
    : grid_(grid),
      model_(model),
      settings_(settings),
      map_(std::move(stages), grid.pp_size()),
      scaler_(settings.scaler),
      targets_per_sample_(shape_numel(target_shape_of(model.shape(model.size())))),
      loss_(grid.tensor_parallel()) {
  const Layout& layout = settings_.layout;
  STRATA_CHECK(map_.chunks() == layout.virtual_stages && layout.pp == grid.pp_size() && layout.dp == grid.dp_size(),
               "StageEngine: the layout's pp ", layout.pp, " x dp ", layout.dp, " with ", layout.virtual_stages,
               " chunks does not match the grid's ", grid.pp_size(), " x ", grid.dp_size(), " with ", map_.chunks());
  // The tied head's copy first: it must exist before a DataParallel binds the head's layer.
  tied_ = std::make_unique<TiedEmbedding>(grid.pp(), model, map_.stages(), layout.zero, layout.dtype, grid.device());
  std::vector<Shape> input_shapes, output_shapes;
  for (int c = 0; c < layout.virtual_stages; ++c) {
    const StageRange range = map_.range(grid.stage(), c);
    chunks_.push_back(std::make_unique<DataParallel>(grid.dp(), model, range, layout, settings.seed, grid.device()));
    chunks_.back()->set_before_reduce([this](size_t layer) { tied_->add_head_gradient(layer); });
    chunk_ptrs_.push_back(chunks_.back().get());
    input_shapes.push_back(layers::batch_shape(layout.micro, model.shape(range.begin)));
    output_shapes.push_back(layers::batch_shape(layout.micro, model.shape(range.end)));
  }
  state_ = std::make_unique<StateGather>(grid, model, map_.stages(), chunk_ptrs_);
  // The schedule is generated and checked (matching messages, no deadlock) before any step.
  pipeline_ = std::make_unique<PipelineExecutor>(grid.pp(), layout.schedule, layout.micro_batches,
                                                 layout.virtual_stages, input_shapes, output_shapes, layout.dtype,
                                                 grid.device(), settings.stand_in_ms);
  // Stage boundaries carry the same tensor on every tp rank, except a sequence-parallel one's part.
  if (grid.has(Axis::Tensor) && !layout.sequence_parallel) pipeline_->set_tensor_parallel(&grid.comm(Axis::Tensor));
}

StepResult StageEngine::step(const Tensor& x, const Tensor& y, int64_t first_sample, int64_t step, float lr,
                             const std::function<bool()>& stop_requested, bool record_timeline) {
  const Layout& layout = settings_.layout;
  const int rank = grid_.world().rank();
  watchdog::set_step(step);
  if (record_timeline) grid_.world().barrier();  // a common origin for every stage's clock
  Communicator* tp = grid_.has(Axis::Tensor) ? &grid_.comm(Axis::Tensor) : nullptr;
  const int64_t dp_bytes_before = grid_.dp().bytes_sent(), tp_bytes_before = tp ? tp->bytes_sent() : 0;

  for (auto& c : chunks_) c->zero_grads();
  tied_->zero_head_gradient();
  // The loss is the mean over the GLOBAL batch's targets, so summing gradients over replicas
  // (and over micro-batches) gives exactly the single-rank gradient: no separate averaging step.
  // (Times the loss scale with fp16, divided out again before the optimizer step.)
  const auto targets = static_cast<double>(layout.micro * layout.micro_batches * layout.dp * targets_per_sample_);
  const auto scale = static_cast<float>(scaler_.scale() / targets);
  const auto micro_slice = [&](const Tensor& t, int micro) {
    return t.slice(micro * layout.micro, (micro + 1) * layout.micro);
  };
  MicroBatches data;
  data.input = [&](int micro) { return to_compute(micro_slice(x, micro)); };
  data.labels = [&](int micro) { return to_device(micro_slice(y, micro)); };
  data.size = layout.micro;
  double loss_sum = 0;
  Replicas replicas(*this);
  const StageCallbacks work = step_callbacks(
      *pipeline_, replicas, loss_, data, {layers::Mode::Train, settings_.seed, step, first_sample}, scale, loss_sum);
  pipeline_->run_step(work, record_timeline);
  tied_->send_head_gradient();
  settings_.faults.after_backward(step + 1, rank);

  StepResult result;
  const double loss_scale = scaler_.scale();
  {
    const trace::Span span(trace::Track::Optimizer, "optimizer step");
    result.stepped = optimizer_step(chunk_ptrs_, lr, scaler_, settings_.clip_grad, grid_.world(), grid_.pp(), tp,
                                    settings_.faults.overflow(step + 1, rank));
    if (result.stepped) tied_->refresh(*chunks_.front());
  }
  if (!result.stepped && rank == 0)  // the same on every rank: agreed over the world
    log::warn("step ", step + 1, ": gradients overflowed at loss scale ", loss_scale, "; step skipped, loss scale now ",
              scaler_.scale());
  result.dp_bytes = grid_.dp().bytes_sent() - dp_bytes_before;
  result.tp_bytes = tp ? tp->bytes_sent() - tp_bytes_before : 0;

  settings_.faults.before_agreement(step + 1, rank, grid_.world());
  // The loss (non-zero on last stages only, counted once per tensor-parallel group) and the stop
  // request ride on one all-gather, with every rank's collective fingerprints (a mismatch aborts
  // every rank): all ranks agree at the same step boundary without an extra collective.
  std::vector<double> agreed{grid_.tp_rank() == 0 ? loss_sum : 0.0, stop_requested && stop_requested() ? 1.0 : 0.0};
  watchdog::sum_checking_fingerprints(grid_.world(), agreed);
  result.loss = agreed[0] / targets;
  result.stop = agreed[1] > 0;
  return result;
}

EvalSums StageEngine::evaluate(int64_t n, DType input_dtype, const ReadSlice& read, bool capped) {
  const trace::Span span(trace::Track::Evaluation, "evaluate");
  // Every replica evaluates with replica 0's BatchNorm statistics (the ones checkpoints keep,
  // as PyTorch DDP broadcasts its buffers), so the metric is the saved model's.
  for (auto& c : chunks_) c->broadcast_buffers();
  const int dp = grid_.dp_size(), replica = grid_.replica();
  const int64_t begin = n * replica / dp, end = n * (replica + 1) / dp;
  // The same number of pieces on every replica: ZeRO 3 gathers each layer's parameters across
  // the replicas in every forward. A replica out of samples runs sample 0 and counts nothing.
  // At most 256 samples per piece, and at most ~64 MiB of outputs (a language model's logits:
  // 256 windows of GPT-2's 1024 x 50257 would be 52 GB), at least one sample; capped (under
  // --device-memory) a training micro-batch, whose activations are known to fit.
  const int64_t output_bytes = shape_numel(model_.shape(model_.size())) * static_cast<int64_t>(sizeof(float));
  const int64_t largest_slice = (n + dp - 1) / dp,
                most = capped ? settings_.layout.micro
                              : std::clamp<int64_t>((int64_t{64} << 20) / std::max<int64_t>(output_bytes, 1), 1, 256);
  const int64_t pieces = std::max<int64_t>(1, (largest_slice + most - 1) / most);
  const Shape targets = target_shape_of(model_.shape(model_.size()));
  const int stage = grid_.stage();
  std::vector<double> sums{0, 0};  // loss, correct
  std::vector<layers::Context> ctx;
  for (int64_t k = 0; k < pieces; ++k) {
    const int64_t first = begin + (end - begin) * k / pieces, last = begin + (end - begin) * (k + 1) / pieces;
    const bool counted = last > first;
    const int64_t b = counted ? first : 0, count = counted ? last - first : 1;
    const auto input_shape = [&](int c) {
      return layers::batch_shape(count, model_.shape(map_.range(stage, c).begin));
    };
    const Tensor labels = Tensor::empty(layers::batch_shape(count, targets), DType::I32);
    const Tensor out = pipeline_->forward_only(
        [&] {
          const Tensor x = Tensor::empty(input_shape(0), input_dtype);
          read(b, b + count, x, labels);
          return to_compute(x);
        },
        input_shape,
        [&](int c, const Tensor& x) {
          return chunk(c).forward(x, ctx, {layers::Mode::Eval, settings_.seed, 0, b});
        });
    if (!pipeline_->last_stage() || !counted) continue;
    if (!pipeline_->first_stage()) read(b, b + count, Tensor(), labels);
    const Tensor device_labels = to_device(labels);
    layers::Context loss_ctx;
    const double loss = loss_.forward(out, device_labels, loss_ctx);
    // Every target counts: a class label, or each next token of a window.
    const int64_t correct = loss_.count_correct(out, device_labels);
    if (grid_.tp_rank() != 0) continue;  // every rank of a tensor-parallel group has the same sums
    sums[0] += loss;
    sums[1] += static_cast<double>(correct);
  }
  all_reduce_sum(grid_.world(), sums);
  return {sums[0], sums[1]};
}

void StageEngine::set_wait_deadline(double seconds) { watchdog::set_timeout(seconds); }

StageEngine::Blocked StageEngine::blocked_seconds() {
  Blocked blocked;
  for (const auto& [group, seconds] : watchdog::waited_seconds())
    (group == "pp" ? blocked.pipeline : blocked.collectives) += seconds;
  return blocked;
}

void StageEngine::synchronise_replicas() {
  for (auto& c : chunks_) c->broadcast_parameters();  // every replica starts from replica 0's values
  tied_->refresh(*chunks_.front());                   // a tied head's copy from wte (chunk 0) as initialised or loaded
}

int64_t StageEngine::optimizer_steps() const { return chunks_.front()->optimizer().steps_taken(); }

void StageEngine::set_optimizer_steps(int64_t steps) {
  for (auto& c : chunks_) c->optimizer().set_steps_taken(steps);
}

int64_t StageEngine::trainable_parameters() const {
  int64_t n = 0;
  for (const auto& c : chunks_) n += c->store().num_trainable();
  return n;
}

std::vector<int64_t> StageEngine::allocated_bytes() const {
  std::vector<int64_t> bytes{tied_->parameter_bytes(), tied_->gradient_bytes(), 0};
  for (const auto& c : chunks_) {
    bytes[0] += c->parameter_bytes();
    bytes[1] += c->gradient_bytes();
    bytes[2] += c->optimizer_bytes();
  }
  return bytes;
}

std::vector<TimelineEvent> StageEngine::gather_timeline() {
  // Replica 0 of every stage (tp rank 0: the others run the same schedule) sends its events.
  if (grid_.replica() != 0 || grid_.tp_rank() != 0) return {};
  return pipeline_->gather_timeline(grid_.mpi_pp());
}

Tensor StageEngine::to_compute(const Tensor& x) const {
  if (x.dtype() == DType::I32) return to_device(x);  // token ids stay ids
  if (x.dtype() == settings_.layout.dtype && x.device() == grid_.device()) return x;
  const Tensor y = Tensor::empty(x.shape(), settings_.layout.dtype, grid_.device());
  ops::copy(x, y);
  return y;
}

Tensor StageEngine::to_device(const Tensor& t) const {
  if (!t.defined() || t.device() == grid_.device()) return t;
  const Tensor d = Tensor::empty(t.shape(), t.dtype(), grid_.device());
  ops::copy(t, d);
  return d;
}

}  // namespace strata::parallel
