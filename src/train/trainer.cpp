#include "train/trainer.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <thread>

#include "core/log.hpp"
#include "core/ops.hpp"
#include "io/shard_files.hpp"
#include "io/shared_files.hpp"
#include "layers/zoo.hpp"
#include "parallel/runtime/mpi.hpp"
#include "train/plan.hpp"
#include "train/signals.hpp"

namespace strata::train {

Trainer::Trainer(const Config& config, MPI_Comm world) : config_(config) {
  // The device first (collective: ranks of a node agree on their GPUs), then the grid's
  // communicators over it: NCCL ids are broadcast over MPI.
  const Device device = parallel::select_device(world, config_.runtime.device, config_.runtime.comm);
  int world_size = 1;
  MPI_Comm_size(world, &world_size);
  grid_ = std::make_unique<parallel::ProcessGrid>(world, grid_layout(config_, world_size).axes(), config_.runtime.comm,
                                                  device, config_.runtime.shared_memory);
  ops::set_allow_tf32(config_.runtime.tf32);
  const bool rate_known = device.is_cpu() || config_.plan.tflops > 0;  // else no MFU
  monitor_ = std::make_unique<Monitor>(
      config_.monitor, *grid_,
      rate_known ? compute_rate(config_.plan, config_.runtime.device, config_.layout.precision) : 0.0);
  checkpoints_ = std::make_unique<io::CheckpointManager>(config_.checkpoint, *grid_);
  const int rank = grid_->world().rank();
  for (const auto& [flag, spec] : {std::pair{"--data", config_.data.train}, {"--val-data", config_.data.val}})
    if (!spec.empty()) {
      io::require_same_files(world, spec, flag);
      if (const std::string note = io::left_out_note(spec, flag); !note.empty()) log::info(note);
    }

  // Token data: windows of --seq-len tokens, else the preset's context length.
  const int64_t seq_len = !layers::is_language_model(config_.model) ? 0
                          : config_.model.seq_len > 0               ? config_.model.seq_len
                                                                    : layers::resolve_preset(config_.model).seq_len;
  if (!config_.data.train.empty()) train_data_ = io::open_samples(config_.data.train, "--data", seq_len);
  if (!config_.data.val.empty()) val_data_ = io::open_samples(config_.data.val, "--val-data", seq_len);
  const io::DataSource& shape_source = train_data_ ? *train_data_ : *val_data_;
  if (train_data_ && val_data_)
    if (const std::string warning = io::check_evaluation_data(*train_data_, *val_data_); !warning.empty() && rank == 0)
      log::warn(warning);

  // The classes are the data's; a checkpoint to start from knows its model's, which evaluation
  // data (a subset without the highest labels) may not show.
  classes_ = std::max(shape_source.num_classes(), checkpoints_->init_from_classes());
  const int64_t classes = classes_;
  if (grid_->tensor_parallel()) grid_->tensor_parallel()->set_sequence_parallel(config_.layout.sequence_parallel);
  model_ = std::make_unique<layers::Model>(
      layers::build_model(config_.model, shape_source.input_shape(), classes, grid_->tensor_parallel()));
  const std::vector<parallel::StageRange> stages =
      parallel::partition_layers(*model_, grid_->pp_size(), config_.layout.partition, config_.layout.virtual_stages);
  // A layout that cannot fit is refused before anything is allocated; on the CPU the allocator
  // then holds each rank to the cap (device memory is the GPU's to refuse).
  const std::vector<parallel::RankBytes> planned =
      plan_ranks(config_, *model_, classes, stages, grid_->world().size(),
                 runtime_spec(config_, train_data_.get(), val_data_.get(), shape_source.input_shape()));
  check_fits(config_, planned);
  parallel::cap_host_memory(device, config_.plan.device_memory);
  const parallel::EngineSettings settings = engine_settings(config_, grid_->dp_size());
  const parallel::Layout& layout = settings.layout;
  STRATA_REQUIRE(
      config_.layout.gradient_accumulation == 0 || config_.layout.gradient_accumulation == layout.micro_batches,
      "--deepspeed-config: train_batch_size ", config_.layout.global_batch, " = train_micro_batch_size_per_gpu ",
      layout.micro, " x gradient_accumulation_steps x ", layout.dp, " data-parallel replicas gives ",
      layout.micro_batches, " accumulation steps, but gradient_accumulation_steps is ",
      config_.layout.gradient_accumulation);
  engine_ = std::make_unique<parallel::StageEngine>(*grid_, *model_, stages, settings);

  io::ResumeExpectations expected{config_.training.optimizer.name, config_.layout.global_batch, 0, -1};
  if (train_data_) {
    STRATA_REQUIRE(train_data_->size() >= config_.layout.global_batch, "--data has ", train_data_->size(),
                   " samples, fewer than one --global-batch of ", config_.layout.global_batch);
    sampler_ = std::make_unique<io::BatchOrder>(train_data_->size(), config_.layout.global_batch, config_.training.seed,
                                                config_.data.shuffle);
    const int64_t per_epoch = sampler_->steps_per_epoch();
    // Sample positions (epoch x samples) stay within int64 for any run: a multi-exabyte token
    // file read for 2^20 epochs would not.
    STRATA_REQUIRE(checked_mul(config_.training.epochs + 1, train_data_->size() + config_.layout.global_batch),
                   "--epochs ", config_.training.epochs, " over ", train_data_->size(),
                   " samples overflows 64-bit sample positions");
    int64_t& total = position_.total_steps;
    total = config_.training.steps > 0 ? config_.training.steps : config_.training.epochs * per_epoch;
    if (config_.training.steps > 0 && config_.training.epochs > 0)
      total = std::min(config_.training.steps, config_.training.epochs * per_epoch);
    layers::LrScheduleConfig& schedule = config_.training.lr_schedule;
    schedule.total_steps = total;  // cosine, linear and wsd decay to --min-lr at the run's end
    STRATA_REQUIRE(schedule.kind != "wsd" || schedule.warmup_steps + layers::wsd_decay_steps(schedule) <= total,
                   "--lr-schedule wsd: --warmup-steps ", schedule.warmup_steps, " and --lr-decay-steps ",
                   layers::wsd_decay_steps(schedule), " do not fit in the run's ", total, " steps");
    expected.samples = train_data_->size();
    expected.total_steps = total;
  }

  checkpoints_->load_init_from(engine_->state());
  double window_loss = 0;
  int64_t window_steps = 0;
  if (const std::optional<io::RunState> saved = checkpoints_->resume(engine_->state(), expected)) {
    restore(*saved);
    window_loss = saved->log_window_loss;
    window_steps = saved->log_window_steps;
  }
  // The shared-memory buffers the engine made (one-node CPU groups) count against the cap too.
  parallel::cap_host_memory(device, config_.plan.device_memory);
  engine_->synchronise_replicas();
  monitor_->open_outputs(config_.eval_only, config_.checkpoint.resume != "none", position_.start_step);
  log::info("model ", config_.model.name, ", input ", shape_str(shape_source.input_shape()), ", ", classes,
            " classes\n", model_->summary());
  log::info(plan_report(config_, *model_, engine_->map().stages(), planned));
  monitor_->start(*engine_, *model_, planned, position_.total_steps, position_.start_step, window_loss, window_steps);
  if (!train_data_) return;
  log::info("data: ", train_data_->size(), " training samples, ", sampler_->steps_per_epoch(), " steps per epoch of ",
            config_.layout.global_batch, " (", layout.micro_batches, " micro-batch(es) of ", layout.micro,
            " per replica); training ", position_.total_steps, " steps");
  const bool lr_given =
      std::any_of(config_.given.begin(), config_.given.end(), [](const auto& kv) { return kv.first == "lr"; });
  log::info("optimizer ", config_.training.optimizer.name, ", lr ", config_.training.lr_schedule.lr,
            lr_given ? "" : detail::cat(" (", config_.training.optimizer.name, "'s default; --lr sets it)"), ", ",
            config_.training.lr_schedule.kind, " schedule");
}

void Trainer::restore(const io::RunState& saved) {
  // Only an fp16 run's scale was adapted; another precision's (1) would start this one at 1.
  layers::LossScaler& scaler = engine_->scaler();
  if (scaler.mode() == layers::LossScaler::Mode::Dynamic && saved.has_loss_scale && saved.precision == "fp16")
    scaler.restore(saved.loss_scale, saved.loss_scale_good_steps);
  engine_->set_optimizer_steps(saved.optimizer_step);
  position_.start_step = saved.step;
  position_.epoch = saved.epoch;
  position_.in_epoch = saved.step_in_epoch;
}

io::RunState Trainer::run_state(int64_t step) const {
  const int64_t per_epoch = sampler_->steps_per_epoch();
  io::RunState state;
  state.step = step;
  state.optimizer_step = engine_->optimizer_steps();
  state.epoch = position_.epoch + position_.in_epoch / per_epoch;
  state.step_in_epoch = position_.in_epoch % per_epoch;
  state.seed = config_.training.seed;
  state.global_batch = config_.layout.global_batch;
  state.model = config_.model.name;
  state.optimizer = config_.training.optimizer.name;
  state.precision = precision_name(config_.layout.precision);
  state.num_classes = classes_;
  state.loss_scale = engine_->scaler().scale();
  state.loss_scale_good_steps = engine_->scaler().good_steps();
  state.log_window_loss = monitor_->window_loss();
  state.log_window_steps = monitor_->window_steps();
  for (const auto& [key, value] : config_.effective) state.config += key + " = " + value + "\n";
  return state;
}

TrainEnd Trainer::train() {
  using clock = std::chrono::steady_clock;
  const int64_t per_epoch = sampler_->steps_per_epoch(), total = position_.total_steps;
  const parallel::Layout& layout = engine_->layout();
  // Only the first stage reads inputs and only the last reads labels; middle stages read
  // nothing but still follow the sampler (the loader of labels is cheap).
  const int64_t local = layout.micro * layout.micro_batches;
  io::Loader loader(*train_data_, *sampler_, grid_->replica() * local, local, config_.data.prefetch,
                    grid_->stage() == 0);
  // A resumed run continues mid-epoch exactly where the checkpoint's batches stopped.
  position_.epoch += position_.in_epoch / per_epoch;
  position_.in_epoch %= per_epoch;
  loader.start(position_.epoch, position_.in_epoch);

  engine_->set_wait_deadline(config_.runtime.timeout);
  for (int64_t step = position_.start_step; step < total; ++step) {
    parallel::StepResult result;
    const io::Batch* batch = nullptr;
    const float lr = layers::learning_rate(config_.training.lr_schedule, step);
    {
      const Monitor::TracedStep traced(*monitor_, step);
      const auto wait_start = clock::now();
      {
        const trace::Span wait(trace::Track::Data, "wait for the loader");
        batch = &loader.next();
      }
      monitor_->waited_for_data(std::chrono::duration<double>(clock::now() - wait_start).count());
      result = engine_->step(batch->x, batch->y, batch->first_sample, step, lr, stop_requested,
                             monitor_->records_timeline(step));
    }
    if (!std::isfinite(result.loss)) {  // agreed: the same on every rank
      if (grid_->world().rank() == 0)
        log::error("the loss of step ", step + 1, " is ", std::isnan(result.loss) ? "nan" : "infinite",
                   ": training stopped without saving this state; lower --lr, clip (--clip-grad) or check the data");
      return TrainEnd::Diverged;
    }
    position_.epoch = batch->epoch + (batch->step_in_epoch + 1) / per_epoch;
    position_.in_epoch = (batch->step_in_epoch + 1) % per_epoch;
    const int64_t done = step + 1;
    monitor_->end_step(done, batch->epoch, lr, result);
    if (config_.monitor.eval_every > 0 && done % config_.monitor.eval_every == 0 && done != total && val_data_)
      monitor_->evaluation(done, evaluate(*val_data_));
    if (result.stop && done != total) {
      save_at_stop(done);
      return TrainEnd::Preempted;
    }
    checkpoints_->poll();  // a background save every rank has written is finished, before a new one starts
    checkpoints_->save_if_due(
        done, total, [&] { return run_state(done); }, engine_->state());
  }
  if (checkpoints_->writes()) checkpoints_->save(run_state(total), engine_->state(), /*wait=*/true);
  monitor_->finish();
  return TrainEnd::Finished;
}

void Trainer::save_at_stop(int64_t done) {
  log::info("preemption signal received: stopping after step ", done,
            config_.checkpoint.dir.empty() ? " (no --checkpoint-dir: nothing saved)" : "");
  if (checkpoints_->writes()) checkpoints_->save(run_state(done), engine_->state(), /*wait=*/true);
  grid_->world().barrier();  // no rank exits (ending the job) before rank 0 has committed
}

EvalResult Trainer::evaluate(const io::DataSource& data) {
  const parallel::EvalSums sums = engine_->evaluate(
      data.size(), data.input_dtype(),
      [&](int64_t begin, int64_t end, const Tensor& x, const Tensor& y) { io::read_range(data, begin, end, x, y); },
      /*capped=*/config_.plan.device_memory > 0);
  const auto targets = static_cast<double>(data.size() * engine_->targets_per_sample());
  return {sums.loss / targets, sums.correct / targets, data.size(), engine_->targets_per_sample() > 1};
}

const io::DataSource* Trainer::eval_data() const { return val_data_ ? val_data_.get() : train_data_.get(); }

void Trainer::record_evaluation(const std::string& what, const EvalResult& r) {
  monitor_->record_evaluation(config_.eval_only ? position_.start_step : position_.total_steps, what, r);
}

}  // namespace strata::train
