#include "train/trainer.hpp"

#include <unistd.h>

#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <optional>
#include <sstream>

#include "core/allocator.hpp"
#include "core/log.hpp"
#include "core/ops.hpp"
#include "core/trace.hpp"
#include "io/checkpoint.hpp"
#include "io/parallel_checkpoint.hpp"
#include "io/shared_files.hpp"
#include "io/timeline.hpp"
#include "io/training_state.hpp"
#include "parallel/shared_memory.hpp"
#include "parallel/values.hpp"
#include "parallel/watchdog.hpp"
#include "train/plan.hpp"

namespace strata::train {

namespace {

// Set by the preemption handlers; read at step boundaries. sig_atomic_t: async-signal-safe.
volatile std::sig_atomic_t g_stop_signal = 0;

// A second SIGINT or SIGTERM while a stop is pending means the graceful stop takes too long (a
// save stuck in I/O, a rank that never reaches the step boundary): leave at once, with one line
// by write(2) and _exit, the async-signal-safe calls. The last committed checkpoint stays intact
// (saves are atomic). A repeated SIGUSR1 (Slurm's warning) keeps waiting for the save.
extern "C" void on_preemption_signal(int signal) {
  if (g_stop_signal != 0 && signal != SIGUSR1) {
    parallel::unlink_shared_segments_for_exit();  // names still in setup's create-and-map window
    static const char kLine[] = "error: a second stop signal: exiting at once, without saving (exit code 4)\n";
    [[maybe_unused]] const ssize_t ignored = write(STDERR_FILENO, kLine, sizeof kLine - 1);
    _exit(kExitSecondSignal);
  }
  g_stop_signal = signal;
}

}  // namespace

void install_preemption_handlers() {
  struct sigaction action {};
  action.sa_handler = on_preemption_signal;
  sigemptyset(&action.sa_mask);
  action.sa_flags = SA_RESTART;  // MPI and file I/O in progress are not interrupted
  for (int signal : {SIGTERM, SIGUSR1, SIGINT}) sigaction(signal, &action, nullptr);
}

Trainer::Trainer(const Config& config, MPI_Comm world)
    : config_(config),
      dtype_(config.precision),
      scaler_(layers::LossScaler::from_flags(config.loss_scale, precision_name(config.precision),
                                             config.loss_scale_init, config.loss_scale_window)) {
  // The device first (collective: ranks of a node agree on their GPUs), then the grid's
  // communicators over it: NCCL ids are broadcast over MPI.
  const DeviceKind kind = config_.device;
  const parallel::Transport transport = config_.comm;
  device_ = parallel::select_device(world, kind, transport);
  grid_ = std::make_unique<parallel::ProcessGrid>(world, grid_axes(config_), transport, device_, config_.shared_memory);
  ops::set_allow_tf32(config_.tf32);
  // MFU's denominator, measured (a GEMM on the CPU) before anything of the run is allocated; its
  // buffers go back, and out of the high-water mark, at once.
  if (device_.is_cpu() || config_.plan_tflops > 0) peak_flops_ = compute_rate(config_);
  host_allocator().release_cached();
  host_allocator().reset_peak();
  rank_ = grid_->world().rank();
  dp_ = grid_->dp_size();
  replica_ = grid_->replica();
  stage_ = grid_->stage();
  tp_rank_ = grid_->coord("tp");
  if (grid_->has("tp")) tensor_parallel_ = std::make_unique<parallel::TensorParallel>(grid_->comm("tp"));
  loss_ = layers::SoftmaxCrossEntropy(tensor_parallel_.get());

  // One job per checkpoint directory, from before anything is read or written in it to the end.
  parallel::agree(world, [&] {
    if (rank_ != 0 || config_.checkpoint_dir.empty() || config_.eval_only) return;
    directory_lock_ = std::make_unique<io::DirectoryLock>(config_.checkpoint_dir);  // first: the probe is ours
    io::require_writable_directory(config_.checkpoint_dir, "--checkpoint-dir");
    saver_ = std::make_unique<io::CheckpointSaver>(config_.checkpoint_dir, config_.keep, config_.async_save,
                                                   parallel::watchdog::kCheckpointTimeoutS);
  });
  // auto: every rank writes its part where HDF5 is parallel; --async-save's background thread
  // is rank 0's (no MPI there), but a stop signal's save waits anyway, so it goes in parallel.
  if (!config_.checkpoint_dir.empty() && !config_.eval_only) {
    const bool automatic = config_.checkpoint_io == "auto" && io::ParallelCheckpointFile::available();
    parallel_io_ = config_.checkpoint_io == "parallel" || (automatic && !config_.async_save);
    parallel_io_at_stop_ = parallel_io_ || automatic;
    log::info("checkpoints: ",
              parallel_io_
                  ? "every rank writes its own part (--checkpoint-io parallel: parallel HDF5 over MPI-IO)"
                  : detail::cat("rank 0 writes them", config_.async_save ? " in the background" : "",
                                " (--checkpoint-io rank0",
                                parallel_io_at_stop_ ? "; after a stop signal every rank writes its part" : "", ")"));
  }
  // Every rank reads and writes where rank 0 does (multi-node: a shared filesystem), checked
  // now rather than at the first resume; each throws alike on every rank.
  if (!config_.checkpoint_dir.empty() && !config_.eval_only)
    io::require_shared_directory(world, config_.checkpoint_dir, "--checkpoint-dir");
  const std::string resume_path = config_.resume == "auto" || config_.resume == "none" ? "" : config_.resume;
  for (const auto& [flag, spec] : {std::pair{"--data", config_.data},
                                   {"--val-data", config_.val_data},
                                   {"--init-from", config_.init_from},
                                   {"--resume", resume_path}})
    if (!spec.empty()) io::require_same_files(world, spec, flag);

  // Token data: windows of --seq-len tokens, else the preset's context length.
  const int64_t seq_len = !layers::is_language_model(config_.model) ? 0
                          : config_.model.seq_len > 0               ? config_.model.seq_len
                                                                    : layers::resolve_preset(config_.model).seq_len;
  if (!config_.data.empty()) train_data_ = io::open_samples(config_.data, "--data", seq_len);
  if (!config_.val_data.empty()) val_data_ = io::open_samples(config_.val_data, "--val-data", seq_len);
  const io::Samples& shape_source = train_data_ ? *train_data_ : *val_data_;
  if (train_data_ && val_data_)
    if (const std::string warning = io::check_evaluation_data(*train_data_, *val_data_); !warning.empty() && rank_ == 0)
      log::warn(warning);

  // The classes are the data's; a checkpoint to start from knows its model's, which evaluation
  // data (a subset without the highest labels) may not show.
  // Opened once: its classes size the model, its tensors fill it below.
  std::unique_ptr<io::CheckpointReader> init_from;
  num_classes_ = shape_source.num_classes();
  targets_per_sample_ = shape_numel(shape_source.target_shape());
  // Rank 0 checks the file whole (its manifest's crc32: one read of the file), then every rank opens it.
  parallel::agree(world, [&] {
    if (rank_ == 0 && !config_.init_from.empty()) io::CheckpointReader checked(config_.init_from);
  });
  parallel::agree(world, [&] {
    if (config_.init_from.empty()) return;
    init_from = std::make_unique<io::CheckpointReader>(config_.init_from, /*whole_file=*/false);
    note_unchecked(*init_from);
    if (init_from->has_attr("num_classes")) num_classes_ = std::max(num_classes_, init_from->attr_int("num_classes"));
  });
  model_ = std::make_unique<layers::Model>(
      layers::build_model(config_.model, shape_source.input_shape(), num_classes_, tensor_parallel_.get()));
  // P x v virtual stages; this rank's chunk c is virtual stage c·P + stage (v = 1 but interleaved).
  const int v = config_.virtual_stages;
  stages_ = parallel::partition_layers(*model_, grid_->pp_size(), config_.partition, v);
  // A layout that cannot fit is refused before anything is allocated; on the CPU the allocator
  // then holds each rank to the cap (device memory is the GPU's to refuse).
  planned_ = plan_ranks(config_, *model_, num_classes_, stages_, grid_->world().size());
  check_fits(config_, planned_);
  if (device_.is_cpu()) host_allocator().set_limit(static_cast<size_t>(config_.device_memory));
  tied_ = std::make_unique<parallel::TiedEmbedding>(grid_->pp(), *model_, stages_, config_.zero, dtype_, device_);
  plan_ = parallel::make_batch_plan(config_.global_batch, config_.micro_batch, dp_);
  STRATA_REQUIRE(config_.gradient_accumulation == 0 || config_.gradient_accumulation == plan_.count,
                 "--deepspeed-config: train_batch_size ", config_.global_batch, " = train_micro_batch_size_per_gpu ",
                 plan_.micro, " x gradient_accumulation_steps x ", dp_, " data-parallel replicas gives ", plan_.count,
                 " accumulation steps, but gradient_accumulation_steps is ", config_.gradient_accumulation);
  std::vector<Shape> input_shapes, output_shapes;
  for (int c = 0; c < v; ++c) {
    const parallel::StageRange range = chunk_range(c);
    chunks_.push_back(std::make_unique<parallel::DataParallel>(
        grid_->dp(), *model_, range,
        parallel::DataParallelConfig{config_.zero, static_cast<int64_t>(config_.bucket_mb * (1 << 20)), config_.seed,
                                     dtype_, device_, config_.optimizer}));
    chunks_.back()->set_before_reduce([this](size_t layer) { tied_->add_head_gradient(layer); });
    chunk_ptrs_.push_back(chunks_.back().get());
    input_shapes.push_back(layers::batch_shape(plan_.micro, model_->shape(range.begin)));
    output_shapes.push_back(layers::batch_shape(plan_.micro, model_->shape(range.end)));
  }
  state_gather_ = std::make_unique<parallel::StateGather>(*grid_, *model_, stages_, chunk_ptrs_);

  // The schedule is generated and checked (matching messages, no deadlock) before any step.
  pipeline_ = std::make_unique<parallel::PipelineExecutor>(grid_->pp(), config_.schedule_kind,
                                                           static_cast<int>(plan_.count), v, input_shapes,
                                                           output_shapes, dtype_, device_, config_.bench_stage_ms);
  if (grid_->has("tp")) pipeline_->set_tensor_parallel(&grid_->comm("tp"));

  if (train_data_) {
    STRATA_REQUIRE(train_data_->size() >= config_.global_batch, "--data has ", train_data_->size(),
                   " samples, fewer than one --global-batch of ", config_.global_batch);
    sampler_ =
        std::make_unique<io::EpochSampler>(train_data_->size(), config_.global_batch, config_.seed, config_.shuffle);
    const int64_t per_epoch = sampler_->steps_per_epoch();
    // Sample positions (epoch x samples) stay within int64 for any run: a multi-exabyte token
    // file read for 2^20 epochs would not.
    STRATA_REQUIRE(checked_mul(config_.epochs + 1, train_data_->size() + config_.global_batch), "--epochs ",
                   config_.epochs, " over ", train_data_->size(), " samples overflows 64-bit sample positions");
    total_steps_ = config_.steps > 0 ? config_.steps : config_.epochs * per_epoch;
    if (config_.steps > 0 && config_.epochs > 0) total_steps_ = std::min(config_.steps, config_.epochs * per_epoch);
    config_.schedule.total_steps = total_steps_;  // cosine decays over the whole run
  }

  // Each stage reads its own tensors: a bad one fails that stage's ranks only.
  parallel::agree(world, [&] {
    if (init_from)
      state_gather_->load_model(
          [&](const std::string&, const layers::ParamEntry& e, int64_t begin, int64_t end, const Tensor& out) {
            init_from->read_part(io::model_value_tensor(*init_from, e.name, e.trainable, e.full_shape()), e.shape,
                                 e.split, begin, end, out);
          });
  });
  if (config_.resume == "auto") {
    // Rank 0 picks and verifies (warning once per skipped file) and tells the others the step.
    int64_t step = -1;
    if (rank_ == 0) {
      const std::string path = io::newest_checkpoint(config_.checkpoint_dir);
      if (!path.empty()) step = io::CheckpointReader(path, /*whole_file=*/false).attr_int("step");  // checked
    }
    step = parallel::broadcast_value(grid_->mpi_world(), step, 0);
    if (step < 0)
      log::info("--resume auto: no complete checkpoint in ", config_.checkpoint_dir, ", starting from step 0");
    else
      parallel::agree(world, [&] { resume_from(io::checkpoint_path(config_.checkpoint_dir, step)); });
  } else if (config_.resume != "none") {
    parallel::agree(world, [&] {
      if (rank_ == 0) io::CheckpointReader checked(config_.resume);  // one whole-file check for the job
    });
    parallel::agree(world, [&] { resume_from(config_.resume); });
  }
  if (rank_ == 0) metrics_ = io::MetricsWriter(config_.metrics);
  parallel::agree(world, [&] {
    // Also when --resume auto found nothing: the run starts again from step 0.
    if (config_.resume != "none") metrics_.drop_after(start_step_);
  });
  // The shared-memory buffers (one-node CPU groups) count against the cap too.
  if (device_.is_cpu() && config_.device_memory > 0)
    host_allocator().set_limit(static_cast<size_t>(
        std::max<int64_t>(1, config_.device_memory - static_cast<int64_t>(parallel::shared_memory_peak_bytes()))));
  for (auto& chunk : chunks_) chunk->broadcast_parameters();  // every replica starts from replica 0's values
  tied_->refresh(*chunks_.front());  // a tied head's copy from wte (chunk 0) as initialised or loaded
  // What rank 0 writes during training, checked now rather than after hours of it.
  parallel::agree(world, [&] {
    if (rank_ == 0 && !config_.eval_only) check_output_paths();
  });

  log::info("model ", config_.model.name, ", input ", shape_str(shape_source.input_shape()), ", ", num_classes_,
            " classes\n", model_->summary());
  print_plan();
  // MFU's numerator: the whole model's FLOPs (no tp shards), 2 per multiply-add, forward and
  // twice that backward; recomputation is not counted (model FLOPs, as PaLM defines MFU).
  const layers::Model whole = layers::build_model(config_.model, shape_source.input_shape(), num_classes_, nullptr);
  for (size_t i = 0; i < whole.size(); ++i)
    flops_per_sample_ += 6.0 * static_cast<double>(whole.layer(i).flops(whole.shape(i)));
  if (!config_.trace.empty())
    trace_ = std::make_unique<parallel::TraceSession>(
        grid_->mpi_world(), config_.trace, config_.trace_first, config_.trace_last,
        detail::cat("rank ", rank_, ": stage ", stage_, ", replica ", replica_, ", tp ", tp_rank_));
  if (train_data_)
    log::info("data: ", train_data_->size(), " training samples, ", sampler_->steps_per_epoch(), " steps per epoch of ",
              config_.global_batch, " (", plan_.count, " micro-batch(es) of ", plan_.micro, " per replica); ",
              "training ", total_steps_, " steps");
}

void Trainer::check_output_paths() const {
  if (!config_.checkpoint_dir.empty()) io::require_writable_directory(config_.checkpoint_dir, "--checkpoint-dir");
  for (const auto& [flag, path] :
       {std::pair{"--metrics", config_.metrics}, {"--timeline", config_.timeline}, {"--trace", config_.trace}})
    if (!path.empty()) io::require_writable_file(path, flag);
}

void Trainer::note_unchecked(const io::CheckpointReader& reader) const {
  if (!reader.has_manifest() && rank_ == 0)
    log::info("note: checkpoint ", reader.path(), " has no manifest (written before manifests): its whole-file ",
              "checksum and position are not checked");
}

void Trainer::resume_from(const std::string& path) {
  const io::CheckpointReader reader(path, /*whole_file=*/false);  // rank 0 has checked it whole
  note_unchecked(reader);
  STRATA_REQUIRE(reader.attr_int("format_version") >= 2, "checkpoint ", path,
                 " holds no training state (format_version 1): use --init-from to start from its model");
  const io::RunState saved = io::read_run_state(reader);
  STRATA_REQUIRE(saved.optimizer == config_.optimizer.name, "checkpoint ", path, " was saved with --optimizer ",
                 saved.optimizer, " but this run uses --optimizer ", config_.optimizer.name);
  // Each rank reads only its own parts (its tp shards, its ZeRO shard of the optimizer state).
  const auto read = [&](const std::string& state, const layers::ParamEntry& e, int64_t begin, int64_t end,
                        const Tensor& out) {
    const std::string name = state.empty() ? io::model_value_tensor(reader, e.name, e.trainable, e.full_shape())
                                           : io::optimizer_tensor(state, e.name);
    reader.read_part(name, e.shape, e.split, begin, end, out);
  };
  state_gather_->load_model(read);
  state_gather_->load_optimizer(read);
  // Only an fp16 run's scale was adapted; another precision's (1) would start this one at 1.
  if (scaler_.mode() == layers::LossScaler::Mode::Dynamic && saved.has_loss_scale && saved.precision == "fp16")
    scaler_.restore(saved.loss_scale, saved.loss_scale_good_steps);
  start_step_ = saved.step;
  window_loss_ = saved.log_window_loss;
  window_steps_ = saved.log_window_steps;
  for (auto& chunk : chunks_) chunk->optimizer().set_steps_taken(saved.optimizer_step);
  next_epoch_ = saved.epoch;
  next_in_epoch_ = saved.step_in_epoch;
  const int64_t saved_batch = saved.global_batch;
  STRATA_REQUIRE(start_step_ >= 0 && next_epoch_ >= 0 && next_in_epoch_ >= 0 && saved_batch > 0, "checkpoint ", path,
                 " has a bad position: step ", start_step_, ", epoch ", next_epoch_, ", step_in_epoch ", next_in_epoch_,
                 ", global_batch ", saved_batch, " (expected steps >= 0 and a positive batch)");
  STRATA_REQUIRE(!train_data_ || next_in_epoch_ * saved_batch <= train_data_->size(), "checkpoint ", path,
                 " is at step ", next_in_epoch_, " of an epoch of batches of ", saved_batch, ", beyond the ",
                 train_data_->size(), " samples of --data");
  if (saved_batch != config_.global_batch) {
    // Same samples seen, counted in this run's batches: the position is approximate.
    next_in_epoch_ = next_in_epoch_ * saved_batch / config_.global_batch;
    if (rank_ == 0)
      log::warn("checkpoint ", path, " was saved with --global-batch ", saved_batch, ", this run uses ",
                config_.global_batch, ": the data position is approximate");
  }
  STRATA_REQUIRE(!sampler_ || start_step_ <= total_steps_, "checkpoint ", path, " is at step ", start_step_,
                 ", beyond the ", total_steps_, " steps of this run");
  log::info("resuming from ", path, " at step ", start_step_, " (epoch ", next_epoch_, ", step ", next_in_epoch_,
            " of the epoch)");
}

void Trainer::print_plan() {
  log::info(plan_report(config_, *model_, stages_, planned_));
  // The plan is computed from shapes (what --dry-run prints); rank 0 checks it against what
  // every rank allocated, so a plan that drifts from the allocations is seen, not trusted.
  std::vector<int64_t> mine{tied_->parameter_bytes(), tied_->gradient_bytes(), 0};
  for (const auto& chunk : chunks_) {
    mine[0] += chunk->parameter_bytes();
    mine[1] += chunk->gradient_bytes();
    mine[2] += chunk->optimizer_bytes();
  }
  const std::vector<int64_t> real = parallel::all_gather_values(grid_->mpi_world(), mine);
  // Which groups go through shared memory (all on one node) and which through MPI: what a
  // cluster, or STRATA_RANKS_PER_NODE on one machine, changes. Collective over each group.
  std::string transport;
  if (device_.is_cpu())
    for (const parallel::ProcessGrid::Axis& axis : grid_->axes())
      if (grid_->size(axis.name) > 1)
        transport += detail::cat(transport.empty() ? " " : ", ", axis.name, " ",
                                 grid_->mpi_comm(axis.name).node_local() ? "shared memory" : "MPI");
  if (rank_ != 0) return;
  if (!transport.empty()) log::info("  rank 0's groups communicate through:", transport);
  for (int k = 0; k < grid_->world().size(); ++k) {
    const parallel::RankBytes& p = planned_[static_cast<size_t>(k)];
    const int64_t* r = real.data() + 3 * k;
    if (r[0] != p.params || r[1] != p.grads || r[2] != p.optimizer)
      log::warn("rank ", k, " allocated params ", r[0], ", grads ", r[1], ", optimizer ", r[2], " but its plan says ",
                p.params, ", ", p.grads, ", ", p.optimizer, " (an error in the plan; training goes on)");
  }
}

const io::Samples* Trainer::eval_data() const { return val_data_ ? val_data_.get() : train_data_.get(); }

void Trainer::record_evaluation(const std::string& what, const EvalResult& r) {
  const int64_t step = config_.eval_only ? start_step_ : total_steps_;
  if (rank_ == 0) metrics_.append(io::EvalRecord{step, what, r.loss, r.accuracy, r.samples, r.tokens});
}

void Trainer::sum_over_world(std::vector<double>& values) { parallel::all_reduce_sum(grid_->world(), values); }

Tensor Trainer::to_compute(const Tensor& x) const {
  if (x.dtype() == DType::I32) return to_device(x);  // token ids stay ids
  if (x.dtype() == dtype_ && x.device() == device_) return x;
  const Tensor y = Tensor::empty(x.shape(), dtype_, device_);
  ops::copy(x, y);
  return y;
}

Tensor Trainer::to_device(const Tensor& t) const {
  if (!t.defined() || t.device() == device_) return t;
  const Tensor d = Tensor::empty(t.shape(), t.dtype(), device_);
  ops::copy(t, d);
  return d;
}

double Trainer::train_step(const io::Batch& batch, int64_t step) {
  const bool record = !config_.timeline.empty() && step + 1 == total_steps_;
  parallel::watchdog::set_step(step);
  if (record) grid_->world().barrier();  // a common origin for every stage's clock
  const int64_t dp_bytes_before = grid_->dp().bytes_sent();
  parallel::Communicator* tp = grid_->has("tp") ? &grid_->comm("tp") : nullptr;
  const int64_t tp_bytes_before = tp ? tp->bytes_sent() : 0;

  for (auto& chunk : chunks_) chunk->zero_grads();
  tied_->zero_head_gradient();
  double loss_sum = 0;
  // The loss is the mean over the GLOBAL batch, so summing gradients over replicas (and over
  // micro-batches) gives exactly the single-rank gradient: no separate averaging step.
  // (times the loss scale with fp16, divided out again before the step.)
  const float scale = static_cast<float>(scaler_.scale() / static_cast<double>(targets_per_batch()));
  const auto first_of = [this](int micro) { return micro * plan_.micro; };
  parallel::StageWork work;
  work.input = [&](int micro) { return to_compute(batch.x.slice(first_of(micro), first_of(micro) + plan_.micro)); };
  work.forward = [&](int micro, int chunk, const Tensor& x, std::vector<layers::Context>& ctx) {
    return chunks_[static_cast<size_t>(chunk)]->forward(
        x, ctx, {layers::Mode::Train, config_.seed, step, batch.first_sample + first_of(micro)});
  };
  work.loss = [&](int micro, const Tensor& y) {
    layers::Context loss_ctx;
    loss_sum += loss_.forward(y, to_device(batch.y.slice(first_of(micro), first_of(micro) + plan_.micro)), loss_ctx);
    return loss_.backward(loss_ctx, scale);
  };
  work.backward = [&](int, int chunk, const Tensor& dy, std::vector<layers::Context>& ctx, bool last_of_step) {
    // The first virtual stage (stage 0, chunk 0) has no input gradient to send.
    return chunks_[static_cast<size_t>(chunk)]->backward(dy, ctx, last_of_step, !first_stage() || chunk > 0);
  };
  pipeline_->run_step(work, record);
  tied_->send_head_gradient();
  if (step + 1 == config_.debug_fail_step && rank_ == config_.debug_fail_rank)
    STRATA_THROW("injected failure at step ", step + 1, " (--debug-fail-step)");

  const double loss_scale = scaler_.scale();
  const bool overflow_injected = step + 1 == config_.debug_overflow_step && rank_ == 0;
  bool stepped = false;
  {
    const trace::Span span(trace::Track::Optimizer, "optimizer step");
    stepped = parallel::optimizer_step(chunk_ptrs_, layers::learning_rate(config_.schedule, step), scaler_,
                                       config_.clip_grad, grid_->world(), grid_->pp(), tp, overflow_injected);
    if (stepped) tied_->refresh(*chunks_.front());
  }
  if (!stepped && rank_ == 0)  // the same on every rank: agreed over the world
    log::warn("step ", step + 1, ": gradients overflowed at loss scale ", loss_scale, "; step skipped, loss scale now ",
              scaler_.scale());
  if (record) write_timeline();
  dp_bytes_per_step_ = grid_->dp().bytes_sent() - dp_bytes_before;
  tp_bytes_per_step_ = tp ? tp->bytes_sent() - tp_bytes_before : 0;
  // The preemption flag rides on the all-reduce every step does anyway: all ranks agree
  // at the same step boundary without an extra collective.
  // The loss: non-zero on last stages only, counted once per tensor-parallel group.
  if (step + 1 == config_.debug_mismatch_step) {
    const Tensor extra = Tensor::zeros({4}, DType::F32);
    const bool odd = rank_ == config_.debug_fail_rank;
    grid_->world().all_reduce(extra, odd ? parallel::ReduceOp::Avg : parallel::ReduceOp::Sum);
  }
  std::vector<double> loss{tp_rank_ == 0 ? loss_sum : 0.0, g_stop_signal != 0 ? 1.0 : 0.0};
  // The collective fingerprints ride on the same all-gather (a mismatch aborts every rank).
  parallel::watchdog::sum_checking_fingerprints(grid_->world(), loss);
  stop_agreed_ = loss[1] > 0;
  return loss[0];
}

namespace {

// Seconds blocked in waits so far: on pipeline messages, and on every other group.
std::pair<double, double> blocked_seconds() {
  double pipeline = 0, other = 0;
  for (const auto& [name, seconds] : parallel::watchdog::waited_seconds()) (name == "pp" ? pipeline : other) += seconds;
  return {pipeline, other};
}

}  // namespace

void Trainer::log_progress(int64_t step, int64_t epoch, double loss, int64_t steps, double seconds, double eta_s) {
  const auto [pipeline_now, comm_now] = blocked_seconds();
  // Every rank's window: its own waits, and its memory high-water mark.
  const auto us = [](double s) { return static_cast<int64_t>(s * 1e6); };
  const std::vector<int64_t> all = parallel::all_gather_values(
      grid_->mpi_world(), {us(seconds), us(comm_now - comm_wait_before_), us(pipeline_now - pipeline_wait_before_),
                           us(data_wait_s_), peak_bytes()});
  pipeline_wait_before_ = pipeline_now;
  comm_wait_before_ = comm_now;
  data_wait_s_ = 0;
  if (rank_ != 0) return;
  const int ranks = grid_->world().size();
  std::vector<io::RankWindow> windows;
  int64_t peak = 0;
  for (int r = 0; r < ranks; ++r) {
    const int64_t* v = all.data() + 5 * r;
    windows.push_back({static_cast<double>(v[0]) * 1e-6, static_cast<double>(v[1]) * 1e-6,
                       static_cast<double>(v[2]) * 1e-6, static_cast<double>(v[3]) * 1e-6});
    peak = std::max(peak, v[4]);
  }
  io::ProgressRecord record;
  record.step = step;
  record.epoch = epoch;
  record.loss = loss;
  record.lr = layers::learning_rate(config_.schedule, step - 1);
  record.step_time_s = seconds / static_cast<double>(std::max<int64_t>(steps, 1));
  record.samples_per_s = static_cast<double>(config_.global_batch) / std::max(record.step_time_s, 1e-9);
  if (targets_per_sample_ > 1) record.tokens_per_s = record.samples_per_s * static_cast<double>(targets_per_sample_);
  // NCCL's waits order streams and return at once: the host's wait measures nothing there.
  if (grid_->transport() != parallel::Transport::Nccl || ranks == 1) record.split = io::average_split(windows);
  record.tflops_per_rank = flops_per_sample_ * record.samples_per_s / ranks / 1e12;
  if (peak_flops_ > 0) record.mfu = record.tflops_per_rank * 1e12 / peak_flops_;
  record.dp_bytes_per_step = dp_bytes_per_step_;
  record.tp_bytes_per_step = tp_bytes_per_step_;
  record.peak_bytes = peak;
  record.eta_s = eta_s;
  log::info(io::progress_line(record, total_steps_));
  metrics_.append(record);
}

TrainEnd Trainer::train() {
  using clock = std::chrono::steady_clock;
  const int64_t per_epoch = sampler_->steps_per_epoch();
  // Only the first stage reads inputs and only the last reads labels; middle stages read
  // nothing but still follow the sampler (the loader of labels is cheap).
  io::Loader loader(*train_data_, *sampler_, replica_ * plan_.local, plan_.local, config_.prefetch, first_stage());
  // A resumed run continues mid-epoch exactly where the checkpoint's batches stopped.
  const auto normalise = [per_epoch](int64_t& epoch, int64_t& in_epoch) {
    epoch += in_epoch / per_epoch;
    in_epoch %= per_epoch;
  };
  normalise(next_epoch_, next_in_epoch_);
  loader.start(next_epoch_, next_in_epoch_);

  parallel::watchdog::set_timeout(config_.timeout);  // setup ran under watchdog::kSetupTimeoutS
  int64_t timed_steps = 0;  // of the window, run by this process (a resumed window began earlier)
  auto window_start = clock::now();
  const auto run_start = clock::now();
  std::tie(pipeline_wait_before_, comm_wait_before_) = blocked_seconds();
  for (int64_t step = start_step_; step < total_steps_; ++step) {
    if (trace_) trace_->begin_step(step + 1);
    trace::set_step(step + 1);  // what this thread records until the step is done belongs to it
    double step_loss = 0;
    const io::Batch* next = nullptr;
    {
      const trace::Span span(trace::Track::Step, trace::recording() ? detail::cat("step ", step + 1) : "");
      const auto wait_start = clock::now();
      {
        const trace::Span wait(trace::Track::Data, "wait for the loader");
        next = &loader.next();
      }
      data_wait_s_ += std::chrono::duration<double>(clock::now() - wait_start).count();
      step_loss = train_step(*next, step);
    }
    trace::set_step(-1);
    const io::Batch& batch = *next;
    const double loss = step_loss / static_cast<double>(targets_per_batch());
    if (!std::isfinite(loss)) {  // all-reduced: the same on every rank
      if (rank_ == 0)
        log::error("the loss of step ", step + 1, " is ", std::isnan(loss) ? "nan" : "infinite",
                   ": training stopped without saving this state; lower --lr, clip (--clip-grad) or check the data");
      return TrainEnd::Diverged;
    }
    window_loss_ += loss;
    next_epoch_ = batch.epoch;
    next_in_epoch_ = batch.step_in_epoch + 1;
    normalise(next_epoch_, next_in_epoch_);
    ++window_steps_;
    ++timed_steps;
    const int64_t done = step + 1;
    if (done % config_.log_every == 0 || done == total_steps_) {
      const double seconds = std::chrono::duration<double>(clock::now() - window_start).count();
      const double elapsed = std::chrono::duration<double>(clock::now() - run_start).count();
      const double eta = elapsed / static_cast<double>(done - start_step_) * static_cast<double>(total_steps_ - done);
      log_progress(done, batch.epoch, window_loss_ / static_cast<double>(window_steps_), timed_steps, seconds, eta);
      window_loss_ = 0;
      window_steps_ = 0;
      timed_steps = 0;
      window_start = clock::now();
    }
    if (config_.eval_every > 0 && done % config_.eval_every == 0 && done != total_steps_ && val_data_) {
      const EvalResult r = evaluate(*val_data_);
      log::info("eval at step ", done, ": loss ", r.loss,
                r.tokens ? detail::cat("  perplexity ", std::exp(r.loss)) : std::string(), "  accuracy ",
                100.0 * r.accuracy, "%");
      if (rank_ == 0) metrics_.append(io::EvalRecord{done, "val", r.loss, r.accuracy, r.samples, r.tokens});
    }
    if (stop_agreed_ && done != total_steps_) {
      log::info("preemption signal received: stopping after step ", done,
                config_.checkpoint_dir.empty() ? " (no --checkpoint-dir: nothing saved)" : "");
      if (!config_.checkpoint_dir.empty()) save_checkpoint(done, true, /*at_stop=*/true);
      grid_->world().barrier();  // no rank exits (ending the job) before rank 0 has committed
      return TrainEnd::Preempted;
    }
    if (config_.save_every > 0 && done % config_.save_every == 0 && done != total_steps_ &&
        !config_.checkpoint_dir.empty())
      save_checkpoint(done, false);
  }
  if (!config_.checkpoint_dir.empty()) save_checkpoint(total_steps_, true);
  // Peak micro-batches in flight per stage (activation memory), from replica 0 of each.
  std::vector<double> peaks(static_cast<size_t>(grid_->pp_size()), 0.0);
  if (replica_ == 0 && tp_rank_ == 0) peaks[static_cast<size_t>(stage_)] = pipeline_->peak_in_flight();
  sum_over_world(peaks);
  std::ostringstream os;
  for (double p : peaks) os << " " << p;
  log::info("peak micro-batches in flight per stage:", os.str(), " (", parallel::to_string(config_.schedule_kind), ", ",
            plan_.count, " micro-batches)");
  // The Megatron collectives, the cross-entropy's and the pipeline's all-gathers, as the tp
  // communicator counts them (parallel::Communicator::bytes_sent): the formula's check.
  if (grid_->has("tp")) log::info("tensor-parallel bytes sent by rank 0 in the last step: ", tp_bytes_per_step_);
  // What every rank needed at most, to set beside the plan printed at the start.
  const std::vector<int64_t> peaks_bytes = parallel::all_gather_values(grid_->mpi_world(), {peak_bytes()});
  std::ostringstream mem;
  for (int64_t b : peaks_bytes) mem << " " << b;
  log::info("memory high-water mark per rank (bytes: allocator and shared-memory buffers):", mem.str());
  return TrainEnd::Finished;
}

EvalResult Trainer::evaluate(const io::Samples& data) {
  const trace::Span span(trace::Track::Evaluation, "evaluate");
  // Every sample is evaluated exactly once: replica r takes a contiguous slice of the dataset,
  // runs it forward through the pipeline, and the last stages' sums are reduced.
  // Every replica evaluates with replica 0's BatchNorm statistics (the ones checkpoints keep,
  // as PyTorch DDP broadcasts its buffers), so the metric is the saved model's.
  for (auto& chunk : chunks_) chunk->broadcast_buffers();
  const int64_t n = data.size();
  const int64_t begin = n * replica_ / dp_, end = n * (replica_ + 1) / dp_;
  // The same number of pieces on every replica: ZeRO 3 gathers each layer's parameters across
  // the replicas in every forward. A replica out of samples runs sample 0 and counts nothing.
  // At most 256 samples per piece, and at most ~64 MiB of outputs (a language model's logits:
  // 256 windows of GPT-2's 1024 x 50257 would be 52 GB), at least one sample; under
  // --device-memory a training micro-batch, whose activations are known to fit.
  const int64_t output_bytes = shape_numel(model_->shape(model_->size())) * static_cast<int64_t>(sizeof(float));
  const int64_t largest_slice = (n + dp_ - 1) / dp_,
                most = config_.device_memory > 0
                           ? plan_.micro
                           : std::clamp<int64_t>((int64_t{64} << 20) / std::max<int64_t>(output_bytes, 1), 1, 256);
  const int64_t pieces = std::max<int64_t>(1, (largest_slice + most - 1) / most);
  std::vector<double> sums{0, 0};  // loss, correct
  std::vector<layers::Context> ctx;
  for (int64_t k = 0; k < pieces; ++k) {
    const int64_t first = begin + (end - begin) * k / pieces, last = begin + (end - begin) * (k + 1) / pieces;
    const bool counted = last > first;
    const int64_t b = counted ? first : 0, count = counted ? last - first : 1;
    const auto input_shape = [&](int chunk) {
      return layers::batch_shape(count, model_->shape(chunk_range(chunk).begin));
    };
    const Tensor y = Tensor::empty(layers::batch_shape(count, data.target_shape()), DType::I32);
    const Tensor out = pipeline_->forward_only(
        [&] {
          const Tensor x = Tensor::empty(input_shape(0), data.input_dtype());
          io::read_range(data, b, b + count, x, y);
          return to_compute(x);
        },
        input_shape,
        [&](int chunk, const Tensor& x) {
          return chunks_[static_cast<size_t>(chunk)]->forward(x, ctx, {layers::Mode::Eval, config_.seed, 0, b});
        });
    if (!last_stage() || !counted) continue;
    if (!first_stage()) io::read_range(data, b, b + count, Tensor(), y);
    const Tensor labels = to_device(y);
    layers::Context loss_ctx;
    const double loss = loss_.forward(out, labels, loss_ctx);
    // Every target counts: a class label, or each next token of a window.
    const int64_t correct = loss_.count_correct(out, labels);
    if (tp_rank_ != 0) continue;  // every rank of a tensor-parallel group has the same sums
    sums[0] += loss;
    sums[1] += static_cast<double>(correct);
  }
  sum_over_world(sums);
  const auto targets = static_cast<double>(n * targets_per_sample_);
  return {sums[0] / targets, sums[1] / targets, n, targets_per_sample_ > 1};
}

void Trainer::save_checkpoint(int64_t step, bool wait, bool at_stop) {
  // rank0: rank 0 writes the whole file (or hands it to its background thread) while the others
  // wait in the next collective. parallel: every rank writes its part, rank 0 finishes the file.
  const parallel::watchdog::AtLeast io_deadline(parallel::watchdog::kCheckpointTimeoutS);
  trace::Span span(trace::Track::Checkpoint, detail::cat("save checkpoint of step ", step));
  STRATA_CHECK(rank_ != 0 || saver_, "checkpoint of step ", step, " without a checkpoint directory");
  const bool in_parallel = at_stop ? parallel_io_at_stop_ : parallel_io_;
  if (saver_) saver_->begin(step, in_parallel);
  std::optional<io::ParallelCheckpointFile::Written> written;
  if (in_parallel) {
    io::ParallelCheckpointFile file(io::checkpoint_path(config_.checkpoint_dir, step), grid_->mpi_world().comm());
    state_gather_->write_parts(
        [&](const std::string& state, const layers::ParamEntry& e, int64_t begin, int64_t end, const Tensor& values) {
          file.write(io::state_tensor(state, e.name), e.shape, e.split, begin, end, values);
        });
    written = file.close();
  } else {
    state_gather_->gather([&](const std::string& state, const layers::ParamEntry& e, const Tensor& full) {
      saver_->add(io::state_tensor(state, e.name), full);
    });
  }
  if (!saver_) return;
  const int64_t per_epoch = sampler_->steps_per_epoch();
  io::RunState saved;
  saved.step = step;
  saved.optimizer_step = chunks_.front()->optimizer().steps_taken();
  saved.epoch = next_epoch_ + next_in_epoch_ / per_epoch;
  saved.step_in_epoch = next_in_epoch_ % per_epoch;
  saved.seed = config_.seed;
  saved.global_batch = config_.global_batch;
  saved.model = config_.model.name;
  saved.optimizer = config_.optimizer.name;
  saved.precision = precision_name(config_.precision);
  saved.num_classes = num_classes_;
  saved.loss_scale = scaler_.scale();
  saved.loss_scale_good_steps = scaler_.good_steps();
  saved.log_window_loss = window_loss_;
  saved.log_window_steps = window_steps_;
  for (const auto& [key, value] : config_.effective) saved.config += key + " = " + value + "\n";
  const auto attributes = [saved](io::CheckpointWriter& writer) { io::write_run_state(writer, saved); };
  if (written)
    saver_->finish_parallel(*written, attributes);
  else
    saver_->finish(attributes);
  if (wait) saver_->wait();
}

int64_t Trainer::peak_bytes() const {
  // The gradient and parameter buffers of one-node CPU groups are shared-memory segments, not
  // allocator blocks: both count.
  return static_cast<int64_t>(allocator_for(device_).peak_in_use() +
                              (device_.is_cpu() ? parallel::shared_memory_peak_bytes() : 0));
}

void Trainer::write_trace() {
  if (!trace_) return;
  const std::string summary = trace_->write();
  if (rank_ == 0) log::info(summary);
}

void Trainer::write_timeline() {
  // Replica 0 of every stage (tp rank 0: the others run the same schedule) sends its events to
  // rank 0, which renders them.
  if (replica_ != 0 || tp_rank_ != 0) return;
  const std::vector<parallel::TimelineEvent> all = pipeline_->gather_timeline(grid_->mpi_pp());
  if (stage_ != 0) return;
  log::info(io::write_timeline(config_.timeline, all, grid_->pp_size(), plan_.count,
                               parallel::to_string(config_.schedule_kind)));
}

}  // namespace strata::train
