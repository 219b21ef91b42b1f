#include "train/trainer.hpp"

#include <cerrno>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <sstream>
#include <thread>

#include "core/log.hpp"
#include "core/ops.hpp"
#include "io/checkpoint.hpp"
#include "parallel/batch_plan.hpp"

namespace strata::train {

namespace fs = std::filesystem;

namespace {

std::string format_duration(double seconds) {
  const int64_t s = static_cast<int64_t>(std::max(0.0, seconds));
  char buf[32];
  if (s >= 3600)
    std::snprintf(buf, sizeof buf, "%lldh%02lldm", static_cast<long long>(s / 3600),
                  static_cast<long long>(s / 60 % 60));
  else
    std::snprintf(buf, sizeof buf, "%lldm%02llds", static_cast<long long>(s / 60), static_cast<long long>(s % 60));
  return buf;
}

// Set by the preemption handlers; read at step boundaries. sig_atomic_t: async-signal-safe.
volatile std::sig_atomic_t g_stop_signal = 0;

extern "C" void on_preemption_signal(int signal) { g_stop_signal = signal; }

// Optimizer-state messages cycle through tags below MPI's guaranteed minimum MPI_TAG_UB.
constexpr int kMaxTag = 32000;

// Checkpoints hold f32 host tensors whatever the precision and device of the run.
Tensor host_f32(const Tensor& t) {
  if (!t.defined() || (t.dtype() == DType::F32 && t.device().is_cpu())) return t;
  const Tensor h = Tensor::empty(t.shape());
  ops::copy(t, h);
  return h;
}

// A resumed run logs again the steps after its checkpoint: their earlier lines go (written
// to a new file, then renamed), so --metrics reads as one uninterrupted run.
void drop_metrics_after(const std::string& path, int64_t step) {
  std::ifstream in(path);
  std::string kept, line;
  bool dropped = false;
  while (std::getline(in, line)) {
    long long logged = 0;
    if (std::sscanf(line.c_str(), "{\"step\": %lld", &logged) == 1 && logged > step) {
      dropped = true;
      continue;
    }
    kept += line + "\n";
  }
  if (!dropped) return;
  const std::string tmp = path + ".tmp";
  std::ofstream out(tmp, std::ios::trunc);
  out << kept;
  out.close();
  STRATA_REQUIRE(out.good(), "--metrics: cannot write '", tmp, "': ", std::strerror(errno));
  std::error_code ec;
  fs::rename(tmp, path, ec);
  STRATA_REQUIRE(!ec, "--metrics: cannot replace '", path, "': ", ec.message());
}

// --bench-stage-ms: a stand-in for compute that leaves the core to the other ranks.
void simulated_compute(double ms) {
  if (ms > 0) std::this_thread::sleep_for(std::chrono::duration<double, std::milli>(ms));
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
  grid_ = std::make_unique<parallel::ProcessGrid>(world, config_.pp, transport, device_, config_.shared_memory);
  ops::set_allow_tf32(config_.tf32);
  rank_ = grid_->world().rank();
  dp_ = grid_->dp_size();
  replica_ = grid_->replica();
  stage_ = grid_->stage();

  if (!config_.data.empty()) train_data_ = std::make_unique<io::Dataset>(io::Dataset::open(config_.data, "--data"));
  if (!config_.val_data.empty())
    val_data_ = std::make_unique<io::Dataset>(io::Dataset::open(config_.val_data, "--val-data"));
  const io::Dataset& shape_source = train_data_ ? *train_data_ : *val_data_;
  const io::DatasetInfo& info = shape_source.info();
  if (train_data_ && val_data_) {
    const io::DatasetInfo& v = val_data_->info();
    STRATA_REQUIRE(v.sample_shape == info.sample_shape, "--val-data samples have shape ", shape_str(v.sample_shape),
                   " but --data samples have shape ", shape_str(info.sample_shape));
    STRATA_REQUIRE(v.num_classes <= info.num_classes, "--val-data has labels up to ", v.num_classes - 1,
                   " but --data has only ", info.num_classes, " classes");
    // Each file says how to normalise it; a split converted with its own statistics is
    // evaluated on inputs scaled unlike the training data.
    if ((v.scale != info.scale || v.mean != info.mean || v.std != info.std) && rank_ == 0)
      log::warn("--val-data is normalised with mean ", io::values_str(v.mean), " std ", io::values_str(v.std),
                " but --data with mean ", io::values_str(info.mean), " std ", io::values_str(info.std),
                ": evaluation sees inputs scaled unlike training's (strata-data convert-idx --stats-from)");
  }

  // The classes are the data's; a checkpoint to start from knows its model's, which evaluation
  // data (a subset without the highest labels) may not show.
  // Opened once: its classes size the model, its tensors fill it below.
  std::unique_ptr<io::CheckpointReader> init_from;
  num_classes_ = info.num_classes;
  parallel::agree(world, [&] {
    if (config_.init_from.empty()) return;
    init_from = std::make_unique<io::CheckpointReader>(config_.init_from);
    if (init_from->has_attr("num_classes")) num_classes_ = std::max(num_classes_, init_from->attr_int("num_classes"));
  });
  model_ = std::make_unique<layers::Model>(layers::build_model(config_.model, info.sample_shape, num_classes_));
  stages_ = parallel::partition_layers(*model_, grid_->pp_size(), config_.partition);
  begin_ = stages_[static_cast<size_t>(stage_)].begin;
  end_ = stages_[static_cast<size_t>(stage_)].end;
  // ZeRO pads the flat buffers to dp equal shards so the parameter all-gather has equal chunks.
  const int64_t pad = config_.zero > 0 ? parallel::shard_pad_multiple(dp_) : parallel::kShardAlign;
  // ZeRO 2 and 3 never allocate the full gradient buffer: GradientSync holds the shard and
  // slots. ZeRO 3 neither allocates the full parameter buffer: the store holds this replica's
  // S-element shard (elements replica*S onwards) and ParameterGather the windows.
  const bool sharded_grads = config_.zero >= 2, sharded_params = config_.zero == 3;
  const parallel::Shard shard = parallel::shard_of(
      layers::ParameterStore::layout_numel(layers::ParameterStore::layout(*model_, begin_, end_)), dp_, replica_);
  // The full buffers come from the data-parallel communicator: on one node, shared memory that
  // the bucket all-reduces (and ZeRO's reduces and parameter all-gather) read in place.
  store_ = std::make_unique<layers::ParameterStore>(
      *model_, config_.seed, begin_, end_, pad, !sharded_grads, !sharded_params, replica_ * shard.size, shard.size,
      dtype_, device_, [this](int64_t numel, DType dtype) { return grid_->dp().allocate(numel, dtype, device_); });
  optimizer_ = std::make_unique<parallel::ShardedOptimizer>(config_.optimizer, config_.zero, grid_->dp(), *store_);
  const auto bucket_bytes = static_cast<int64_t>(config_.bucket_mb * (1 << 20));
  sync_ = sharded_grads ? std::make_unique<parallel::GradientSync>(grid_->dp(), *model_, *store_, bucket_bytes,
                                                                   optimizer_->shard().size)
                        : std::make_unique<parallel::GradientSync>(grid_->dp(), *store_, bucket_bytes,
                                                                   config_.zero == 1 ? optimizer_->shard().size : 0);
  if (sharded_params) gather_ = std::make_unique<parallel::ParameterGather>(grid_->dp(), *model_, *store_, shard.size);

  // Batch arithmetic: global = micro * micro-batches * dp.
  const parallel::BatchPlan plan = parallel::make_batch_plan(config_.global_batch, config_.micro_batch, dp_);
  local_batch_ = plan.local;
  micro_batch_ = plan.micro;
  micro_batches_ = plan.count;

  // The schedule is generated and checked (matching messages, no deadlock) before any step.
  const parallel::ScheduleKind schedule_kind = config_.schedule_kind;
  const std::vector<parallel::StageProgram> programs =
      parallel::make_schedule(schedule_kind, grid_->pp_size(), static_cast<int>(micro_batches_));
  parallel::check_schedule(programs);
  program_ = programs[static_cast<size_t>(stage_)];
  for (size_t k = 0; k < program_.size(); ++k)
    if (program_[k].op == parallel::Op::Backward) last_backward_ = k;
  const size_t m = static_cast<size_t>(micro_batches_);
  contexts_.resize(m);
  outputs_.resize(m);
  input_grads_.resize(m);
  // Shape inference sizes every receive buffer once.
  for (size_t i = 0; i < m; ++i) {
    if (!first_stage())
      received_activations_.push_back(
          Tensor::empty(layers::batch_shape(micro_batch_, model_->shape(begin_)), dtype_, device_));
    if (!last_stage())
      received_grads_.push_back(Tensor::empty(layers::batch_shape(micro_batch_, model_->shape(end_)), dtype_, device_));
  }
  // Every stage receives what its neighbours send; GPipe has up to m messages in flight per
  // direction, 1F1B up to P. One slot more than that: a full inbox never holds up a sender, so
  // no message has to be moved aside (shared_memory.hpp).
  int64_t largest_message = 0;
  for (const auto* received : {&received_activations_, &received_grads_})
    for (const Tensor& t : *received) largest_message = std::max(largest_message, static_cast<int64_t>(t.nbytes()));
  const int64_t in_flight = schedule_kind == parallel::ScheduleKind::GPipe
                                ? micro_batches_
                                : std::min<int64_t>(micro_batches_, grid_->pp_size());
  if (grid_->pp_size() > 1 && device_.is_cpu())
    grid_->pp().reserve_messages(largest_message, static_cast<int>(in_flight + 1));

  if (train_data_) {
    STRATA_REQUIRE(train_data_->size() >= config_.global_batch, "--data has ", train_data_->size(),
                   " samples, fewer than one --global-batch of ", config_.global_batch);
    sampler_ =
        std::make_unique<io::EpochSampler>(train_data_->size(), config_.global_batch, config_.seed, config_.shuffle);
    const int64_t per_epoch = sampler_->steps_per_epoch();
    total_steps_ = config_.steps > 0 ? config_.steps : config_.epochs * per_epoch;
    if (config_.steps > 0 && config_.epochs > 0) total_steps_ = std::min(config_.steps, config_.epochs * per_epoch);
    config_.schedule.total_steps = total_steps_;  // cosine decays over the whole run
  }

  // Each stage reads its own tensors: a bad one fails that stage's ranks only.
  parallel::agree(world, [&] {
    if (init_from) load_model(*init_from);
  });
  if (config_.resume == "auto") {
    // Rank 0 picks and verifies (warning once per skipped file) and tells the others the step.
    std::vector<double> step{0.0};
    if (rank_ == 0) {
      const std::string path = io::newest_checkpoint(config_.checkpoint_dir);
      step[0] = path.empty() ? -1.0 : static_cast<double>(io::CheckpointReader(path).attr_int("step"));
    }
    sum_over_world(step);
    if (step[0] < 0)
      log::info("--resume auto: no complete checkpoint in ", config_.checkpoint_dir, ", starting from step 0");
    else
      parallel::agree(world,
                      [&] { resume_from(io::checkpoint_path(config_.checkpoint_dir, static_cast<int64_t>(step[0]))); });
  } else if (config_.resume != "none") {
    parallel::agree(world, [&] { resume_from(config_.resume); });
  }
  parallel::agree(world, [&] {
    // Also when --resume auto found nothing: the run starts again from step 0.
    if (config_.resume != "none" && rank_ == 0 && !config_.metrics.empty())
      drop_metrics_after(config_.metrics, start_step_);
  });
  sync_->broadcast_parameters();  // every replica starts from replica 0's values
  // What rank 0 writes during training, checked now rather than after hours of it.
  parallel::agree(world, [&] {
    if (rank_ == 0 && !config_.dry_run && !config_.eval_only) check_output_paths();
  });

  log::info("model ", config_.model.name, ", input ", shape_str(info.sample_shape), ", ", num_classes_, " classes\n",
            model_->summary());
  print_plan();
  if (train_data_)
    log::info("data: ", train_data_->size(), " training samples, ", sampler_->steps_per_epoch(), " steps per epoch of ",
              config_.global_batch, " (", micro_batches_, " micro-batch(es) of ", micro_batch_, " per replica); ",
              config_.dry_run ? "--dry-run: not training" : detail::cat("training ", total_steps_, " steps"));
}

void Trainer::check_output_paths() const {
  if (!config_.checkpoint_dir.empty()) {
    std::error_code ec;
    fs::create_directories(config_.checkpoint_dir, ec);
    STRATA_REQUIRE(!ec, "--checkpoint-dir: cannot create '", config_.checkpoint_dir, "': ", ec.message());
    const fs::path probe = fs::path(config_.checkpoint_dir) / ".strata-write-test";
    STRATA_REQUIRE(std::ofstream(probe).good(), "--checkpoint-dir: cannot write in '", config_.checkpoint_dir,
                   "': ", std::strerror(errno));
    fs::remove(probe, ec);
  }
  for (const auto& [flag, path] : {std::pair{"--metrics", config_.metrics}, {"--timeline", config_.timeline}}) {
    if (path.empty()) continue;
    STRATA_REQUIRE(!fs::is_directory(path), flag, " must name a file, found the directory '", path, "'");
    const bool existed = fs::exists(path);
    STRATA_REQUIRE(std::ofstream(path, std::ios::app).good(), flag, ": cannot write '", path,
                   "': ", std::strerror(errno));
    if (!existed) fs::remove(path);  // --timeline writes it later; --metrics appends to it
  }
}

void Trainer::load_model(const io::CheckpointReader& reader) {
  for (const layers::ParamEntry& e : store_->entries()) {
    const std::string name = "model/" + e.name;
    STRATA_REQUIRE(reader.has(name), "checkpoint ", reader.path(), " has no tensor ", name,
                   " (was it saved from a different --model?)");
    reader.require_shape(name, e.shape);  // first, so that a mismatch names the model tensor
    // Read whole (the crc covers the whole tensor), kept whole or (ZeRO 3) only this rank's part.
    // A mixed-precision run saved its f32 master weights too: the full-precision values.
    const std::string master = "optimizer/master/" + e.name;
    const Tensor t = Tensor::empty(e.shape);
    reader.read_tensor(e.trainable && reader.has(master) ? master : name, t);
    store_->set_value(e, t);
    optimizer_->set_master(e, t);
  }
}

parallel::Shard Trainer::state_range(int s, int r) const {
  const parallel::StageRange range = stages_[static_cast<size_t>(s)];
  const int64_t used =
      layers::ParameterStore::layout_numel(layers::ParameterStore::layout(*model_, range.begin, range.end));
  if (config_.zero == 0) return {used, 0, used};
  return parallel::shard_of(used, dp_, r);
}

void Trainer::resume_from(const std::string& path) {
  const io::CheckpointReader reader(path);
  STRATA_REQUIRE(reader.attr_int("format_version") >= 2, "checkpoint ", path,
                 " holds no training state (format_version 1): use --init-from to start from its model");
  const std::string saved_optimizer = reader.attr_string("optimizer");
  STRATA_REQUIRE(saved_optimizer == config_.optimizer.name, "checkpoint ", path, " was saved with --optimizer ",
                 saved_optimizer, " but this run uses --optimizer ", config_.optimizer.name);
  load_model(reader);
  // This rank's shard of each state tensor: read the tensor whole (crc), keep the owned range.
  const parallel::Shard mine = state_range(stage_, replica_);
  for (const auto& [state, local] : optimizer_->state()) {
    if (state == "master") continue;  // set by load_model, also from checkpoints of f32 runs
    for (const layers::ParamEntry& e : store_->entries()) {
      const layers::Overlap o = layers::overlap(e, mine.begin, mine.end);
      if (!e.trainable || o.size == 0) continue;
      const Tensor full = Tensor::empty(e.shape);
      reader.read_tensor("optimizer/" + state + "/" + e.name, full);
      local.view(o.in_range, {o.size}).copy_from(full.view(o.in_entry, {o.size}));
    }
  }
  // Only an fp16 run's scale was adapted; another precision's (1) would start this one at 1.
  if (scaler_.mode() == layers::LossScaler::Mode::Dynamic && reader.has_attr("loss_scale") &&
      reader.attr_string("precision") == "fp16")
    scaler_.restore(reader.attr_double("loss_scale"), reader.attr_int("loss_scale_good_steps"));
  start_step_ = reader.attr_int("step");
  if (reader.has_attr("log_window_steps")) {
    window_loss_ = reader.attr_double("log_window_loss");
    window_steps_ = reader.attr_int("log_window_steps");
  }
  optimizer_->set_steps_taken(reader.attr_int("optimizer_step"));
  next_epoch_ = reader.attr_int("epoch");
  next_in_epoch_ = reader.attr_int("step_in_epoch");
  const int64_t saved_batch = reader.attr_int("global_batch");
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
  const int pp = grid_->pp_size();
  std::ostringstream os;
  os << "plan: " << pp << " stage(s) x " << dp_ << " replica(s), schedule "
     << parallel::to_string(config_.schedule_kind) << ", " << micro_batches_ << " micro-batch(es) of " << micro_batch_
     << ", zero " << config_.zero << ", optimizer " << config_.optimizer.name << ", "
     << parallel::device_kind_name(config_.device) << " " << precision_name(config_.precision) << " (loss scale "
     << scaler_.describe() << "):";
  for (int s = 0; s < pp; ++s) {
    const parallel::StageRange r = stages_[static_cast<size_t>(s)];
    int64_t trainable = 0;
    for (const layers::ParamEntry& e : layers::ParameterStore::layout(*model_, r.begin, r.end))
      if (e.trainable) trainable += shape_numel(e.shape);
    os << "\n  stage " << s << ": layers " << r.begin << "-" << r.end - 1 << " (" << model_->layer(r.begin).name()
       << " .. " << model_->layer(r.end - 1).name() << "), " << trainable << " parameters";
  }

  // Each rank reports its own allocations; int64 rows travel as bytes (collectives carry no i64).
  constexpr int64_t kColumns = 4;
  int64_t activations = 0;
  for (size_t i = begin_; i < end_; ++i) activations += shape_numel(model_->shape(i + 1)) * micro_batch_;
  const int64_t window_bytes = gather_ ? gather_->allocated_bytes() : 0;  // ZeRO 3's two window slots
  const int64_t mine[kColumns] = {
      static_cast<int64_t>(store_->params().nbytes() + store_->buffers().nbytes()) + window_bytes,
      static_cast<int64_t>(store_->grads().nbytes()) + sync_->allocated_bytes(), optimizer_->state_bytes(),
      activations * static_cast<int64_t>(dtype_size(dtype_))};
  const int ranks = grid_->world().size();
  const Tensor row = Tensor::empty({static_cast<int64_t>(sizeof mine)}, DType::U8);
  const Tensor all = Tensor::empty({ranks * static_cast<int64_t>(sizeof mine)}, DType::U8);
  std::memcpy(row.raw(), mine, sizeof mine);
  if (ranks > 1)
    grid_->world().all_gather(row, all);
  else
    std::memcpy(all.raw(), mine, sizeof mine);
  const auto* rows = static_cast<const int64_t*>(all.raw());
  os << "\n  bytes per rank (params include non-trained buffers; activations per micro-batch):";
  for (int k = 0; k < ranks; ++k) {
    const int64_t* v = rows + k * kColumns;
    os << "\n  rank " << k << " (stage " << k / dp_ << ", replica " << k % dp_ << "): params " << v[0] << ", grads "
       << v[1] << ", optimizer " << v[2] << ", activations " << v[3];
  }
  log::info(os.str());
}

const io::Dataset* Trainer::eval_data() const { return val_data_ ? val_data_.get() : train_data_.get(); }

void Trainer::sum_over_world(std::vector<double>& values) { parallel::all_reduce_sum(grid_->world(), values); }

Tensor Trainer::to_compute(const Tensor& x) const {
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

bool Trainer::unscale_and_check(const Tensor& grads, int64_t step) {
  if (!scaler_.enabled()) return true;
  // Only the owned part is stepped, and every element is owned by some rank: checking the
  // owned parts and agreeing over the world covers all gradients once.
  const Tensor owned = optimizer_->owned_grads(grads);
  if (step + 1 == config_.debug_overflow_step && rank_ == 0 && owned.numel() > 0)
    ops::fill(owned.view(0, {1}), std::numeric_limits<float>::infinity());
  std::vector<double> overflow{owned.numel() > 0 && !ops::all_finite(owned) ? 1.0 : 0.0};
  sum_over_world(overflow);
  const double scale = scaler_.scale();
  if (!scaler_.update(overflow[0] > 0)) {
    if (rank_ == 0)  // the same on every rank: agreed above
      log::warn("step ", step + 1, ": gradients overflowed at loss scale ", scale, "; step skipped, loss scale now ",
                scaler_.scale());
    return false;
  }
  if (owned.numel() > 0) ops::scale(owned, static_cast<float>(1.0 / scale));
  return true;
}

double Trainer::train_step(const io::Batch& batch, int64_t step) {
  using clock = std::chrono::steady_clock;
  const bool record = !config_.timeline.empty() && step + 1 == total_steps_;
  if (record) grid_->world().barrier();  // a common origin for every stage's clock
  const auto step_start = clock::now();
  const auto seconds = [&] { return std::chrono::duration<double>(clock::now() - step_start).count(); };
  const int64_t dp_bytes_before = grid_->dp().bytes_sent();

  // ZeRO 0/1: the flat gradient buffer; ZeRO 2: this rank's gradient shard.
  const Tensor& grads = sync_->sharded() ? sync_->shard_grads() : store_->grads();
  grads.fill_zero();
  double loss_sum = 0;
  // The loss is the mean over the GLOBAL batch, so summing gradients over replicas (and over
  // micro-batches) gives exactly the single-rank gradient: no separate averaging step.
  // (times the loss scale with fp16, divided out again before the step.)
  const float scale = static_cast<float>(scaler_.scale() / static_cast<double>(config_.global_batch));
  parallel::Communicator& pipe = grid_->pp();
  int in_flight = 0;
  for (size_t k = 0; k < program_.size(); ++k) {
    const parallel::Action a = program_[k];
    const size_t i = static_cast<size_t>(a.micro_batch);
    const int64_t first = a.micro_batch * micro_batch_;
    const double start = seconds();
    switch (a.op) {
      case parallel::Op::RecvActivation:
        pipe.recv(received_activations_[i], stage_ - 1, parallel::message_tag(a.op, a.micro_batch));
        break;
      case parallel::Op::RecvGrad:
        pipe.recv(received_grads_[i], stage_ + 1, parallel::message_tag(a.op, a.micro_batch));
        break;
      case parallel::Op::SendActivation:
        sends_.push_back(pipe.send_async(outputs_[i], stage_ + 1, parallel::message_tag(a.op, a.micro_batch)));
        break;
      case parallel::Op::SendGrad:
        sends_.push_back(pipe.send_async(input_grads_[i], stage_ - 1, parallel::message_tag(a.op, a.micro_batch)));
        break;
      case parallel::Op::Forward: {
        const Tensor x =
            first_stage() ? to_compute(batch.x.slice(first, first + micro_batch_)) : received_activations_[i];
        const layers::StepInfo info{layers::Mode::Train, config_.seed, step, batch.first_sample + first};
        outputs_[i] = forward_stage(x, contexts_[i], info);
        if (last_stage()) {  // the loss, and its gradient to start this micro-batch's backward
          layers::Context loss_ctx;
          loss_sum += loss_.forward(outputs_[i], to_device(batch.y.slice(first, first + micro_batch_)), loss_ctx);
          outputs_[i] = loss_.backward(loss_ctx, scale);
        }
        peak_in_flight_ = std::max(peak_in_flight_, ++in_flight);
        simulated_compute(config_.bench_stage_ms);
        break;
      }
      case parallel::Op::Backward: {
        const Tensor dy = last_stage() ? outputs_[i] : received_grads_[i];
        // ZeRO 2 syncs every backward: without a full gradient buffer there is nowhere to
        // accumulate micro-batches locally, so each one's buckets go to their owners.
        if (k != last_backward_ && !sync_->sharded()) {
          input_grads_[i] = model_->backward(dy, contexts_[i], begin_, end_, {}, !first_stage());
        } else {  // the step's last backward on this stage (any with ZeRO 2): buckets overlap it
          sync_->begin();
          if (gather_) {  // ZeRO 3: the top layer's window now, each lower one as the layer above is done
            gather_->begin_pass(/*backward=*/true);
            gather_->next();
          }
          input_grads_[i] = model_->backward(
              dy, contexts_[i], begin_, end_,
              [this](size_t layer) {
                sync_->layer_done(layer);
                if (gather_) gather_->layer_done(layer);
              },
              !first_stage());
          const auto wait_start = clock::now();
          sync_->finish();  // what backward did not hide: exposed communication
          exposed_comm_s_ += std::chrono::duration<double>(clock::now() - wait_start).count();
        }
        --in_flight;
        simulated_compute(2 * config_.bench_stage_ms);
        break;
      }
    }
    if (record && (a.op == parallel::Op::Forward || a.op == parallel::Op::Backward))
      timeline_.push_back({stage_, a.op, a.micro_batch, start, seconds()});
  }
  for (parallel::WorkPtr& w : sends_) w->wait();
  sends_.clear();
  if (step + 1 == config_.debug_fail_step && rank_ == config_.debug_fail_rank)
    STRATA_THROW("injected failure at step ", step + 1, " (--debug-fail-step)");

  if (unscale_and_check(grads, step)) {
    if (config_.clip_grad > 0) {
      // The global norm spans every stage; within a stage the optimizer sums its dp shards.
      std::vector<double> squares{optimizer_->grad_sum_squares(grads)};
      parallel::all_reduce_sum(pipe, squares);
      layers::clip_by_global_norm(optimizer_->owned_grads(grads), squares[0],
                                  config_.clip_grad);  // only what is stepped
    }
    optimizer_->step(store_->params(), grads, layers::learning_rate(config_.schedule, step));
  }
  if (record) write_timeline(timeline_);
  dp_bytes_per_step_ = grid_->dp().bytes_sent() - dp_bytes_before;
  // The preemption flag rides on the all-reduce every step does anyway: all ranks agree
  // at the same step boundary without an extra collective.
  std::vector<double> loss{loss_sum, g_stop_signal != 0 ? 1.0 : 0.0};  // loss: non-zero on last stages only
  sum_over_world(loss);
  stop_agreed_ = loss[1] > 0;
  return loss[0];
}

Tensor Trainer::forward_stage(const Tensor& x, std::vector<layers::Context>& ctx, const layers::StepInfo& info) {
  if (!gather_) return model_->forward(x, ctx, info, begin_, end_);
  gather_->begin_pass(/*backward=*/false);
  Tensor h = x;
  for (size_t i = begin_; i < end_; ++i) {
    if (gather_->has_params(i)) gather_->next();
    h = model_->forward(h, ctx, info, i, i + 1);
  }
  return h;
}

void Trainer::log_progress(int64_t step, int64_t epoch, double loss, float lr, double samples_per_s,
                           double comm_fraction, double eta_s) const {
  // NCCL's waits order streams and return at once: the host's wait measures nothing there.
  const bool comm_measured = grid_->transport() != parallel::Transport::Nccl || dp_ == 1;
  char comm[32] = "n/a (NCCL)", comm_json[32] = "null";
  if (comm_measured) {
    std::snprintf(comm, sizeof comm, "%.1f%%", 100.0 * comm_fraction);
    std::snprintf(comm_json, sizeof comm_json, "%.4f", comm_fraction);
  }
  char line[256];
  std::snprintf(line, sizeof line, "step %lld/%lld  epoch %lld  loss %.4f  lr %.4g  %.0f samples/s  comm %s  eta %s",
                static_cast<long long>(step), static_cast<long long>(total_steps_), static_cast<long long>(epoch), loss,
                lr, samples_per_s, comm, format_duration(eta_s).c_str());
  log::info(line);
  if (!config_.metrics.empty() && rank_ == 0) {
    std::ofstream out(config_.metrics, std::ios::app);
    char json[256];
    std::snprintf(json, sizeof json,
                  "{\"step\": %lld, \"epoch\": %lld, \"loss\": %.6f, \"lr\": %.6g, \"samples_per_s\": %.1f, "
                  "\"exposed_comm_fraction\": %s, \"dp_bytes_per_step\": %lld}\n",
                  static_cast<long long>(step), static_cast<long long>(epoch), loss, lr, samples_per_s, comm_json,
                  static_cast<long long>(dp_bytes_per_step_));
    out << json;
    out.flush();
    if (!out.good() && !metrics_lost_) {  // metrics are lost, not the training: warn once, go on
      metrics_lost_ = true;
      log::warn("--metrics: cannot write '", config_.metrics, "' (", std::strerror(errno),
                "): its lines are being lost");
    }
  }
}

TrainEnd Trainer::train() {
  using clock = std::chrono::steady_clock;
  const int64_t per_epoch = sampler_->steps_per_epoch();
  // Only the first stage reads inputs and only the last reads labels; middle stages read
  // nothing but still follow the sampler (the loader of labels is cheap).
  io::Loader loader(*train_data_, *sampler_, replica_ * local_batch_, local_batch_, config_.prefetch, first_stage());
  // A resumed run continues mid-epoch exactly where the checkpoint's batches stopped.
  const auto normalise = [per_epoch](int64_t& epoch, int64_t& in_epoch) {
    epoch += in_epoch / per_epoch;
    in_epoch %= per_epoch;
  };
  normalise(next_epoch_, next_in_epoch_);
  loader.start(next_epoch_, next_in_epoch_);

  int64_t timed_steps = 0;  // of the window, run by this process (a resumed window began earlier)
  auto window_start = clock::now();
  const auto run_start = clock::now();
  for (int64_t step = start_step_; step < total_steps_; ++step) {
    const io::Batch& batch = loader.next();
    const double loss = train_step(batch, step) / static_cast<double>(config_.global_batch);
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
      const double rate = static_cast<double>(timed_steps * config_.global_batch) / std::max(seconds, 1e-9);
      const double elapsed = std::chrono::duration<double>(clock::now() - run_start).count();
      const double eta = elapsed / static_cast<double>(done - start_step_) * static_cast<double>(total_steps_ - done);
      log_progress(done, batch.epoch, window_loss_ / static_cast<double>(window_steps_),
                   layers::learning_rate(config_.schedule, step), rate, exposed_comm_s_ / std::max(seconds, 1e-9), eta);
      exposed_comm_s_ = 0;
      window_loss_ = 0;
      window_steps_ = 0;
      timed_steps = 0;
      window_start = clock::now();
    }
    if (config_.eval_every > 0 && done % config_.eval_every == 0 && done != total_steps_ && val_data_) {
      const EvalResult r = evaluate(*val_data_);
      log::info("eval at step ", done, ": loss ", r.loss, "  accuracy ", 100.0 * r.accuracy, "%");
    }
    if (stop_agreed_ && done != total_steps_) {
      log::info("preemption signal received: stopping after step ", done,
                config_.checkpoint_dir.empty() ? " (no --checkpoint-dir: nothing saved)" : "");
      if (!config_.checkpoint_dir.empty()) save_checkpoint(done);
      grid_->world().barrier();  // no rank exits (ending the job) before rank 0 has committed
      return TrainEnd::Preempted;
    }
    if (config_.save_every > 0 && done % config_.save_every == 0 && done != total_steps_ &&
        !config_.checkpoint_dir.empty())
      save_checkpoint(done);
  }
  if (!config_.checkpoint_dir.empty()) save_checkpoint(total_steps_);
  // Peak micro-batches in flight per stage (activation memory), from replica 0 of each.
  std::vector<double> peaks(static_cast<size_t>(grid_->pp_size()), 0.0);
  if (replica_ == 0) peaks[static_cast<size_t>(stage_)] = peak_in_flight_;
  sum_over_world(peaks);
  std::ostringstream os;
  for (double p : peaks) os << " " << p;
  log::info("peak micro-batches in flight per stage:", os.str(), " (", parallel::to_string(config_.schedule_kind), ", ",
            micro_batches_, " micro-batches)");
  return TrainEnd::Finished;
}

EvalResult Trainer::evaluate(const io::Dataset& data) {
  // Every sample is evaluated exactly once: replica r takes a contiguous slice of the dataset,
  // runs it forward through the pipeline, and the last stages' sums are reduced.
  // Every replica evaluates with replica 0's BatchNorm statistics (the ones checkpoints keep,
  // as PyTorch DDP broadcasts its buffers), so the metric is the saved model's.
  sync_->broadcast_buffers();
  const int64_t n = data.size();
  const int64_t begin = n * replica_ / dp_, end = n * (replica_ + 1) / dp_;
  // The same number of chunks on every replica: ZeRO 3 gathers each layer's parameters across
  // the replicas in every forward. A replica out of samples runs sample 0 and counts nothing.
  const int64_t largest_slice = (n + dp_ - 1) / dp_, most = std::max<int64_t>(micro_batch_, 256);
  const int64_t chunks = std::max<int64_t>(1, (largest_slice + most - 1) / most);
  parallel::Communicator& pipe = grid_->pp();
  std::vector<double> sums{0, 0};  // loss, correct
  std::vector<layers::Context> ctx;
  for (int64_t k = 0; k < chunks; ++k) {
    const int64_t first = begin + (end - begin) * k / chunks, last = begin + (end - begin) * (k + 1) / chunks;
    const bool counted = last > first;
    const int64_t b = counted ? first : 0, count = counted ? last - first : 1;
    Tensor x = first_stage() ? Tensor::empty(layers::batch_shape(count, model_->shape(begin_)))
                             : Tensor::empty(layers::batch_shape(count, model_->shape(begin_)), dtype_, device_);
    Tensor y = last_stage() ? Tensor::empty({count}, DType::I32) : Tensor();
    if (first_stage())
      io::read_range(data, b, b + count, x, last_stage() ? y : Tensor::empty({count}, DType::I32));
    else
      pipe.recv(x, stage_ - 1, 0);
    if (last_stage() && !first_stage()) io::read_range(data, b, b + count, Tensor(), y);
    y = to_device(y);
    const Tensor out = forward_stage(to_compute(x), ctx, {layers::Mode::Eval, config_.seed, 0, b});
    if (!last_stage()) {
      pipe.send(out, stage_ + 1, 0);
      continue;
    }
    if (!counted) continue;
    layers::Context loss_ctx;
    sums[0] += loss_.forward(out, y, loss_ctx);
    sums[1] += static_cast<double>(ops::count_correct(out, y));
  }
  sum_over_world(sums);
  return {sums[0] / static_cast<double>(n), sums[1] / static_cast<double>(n), n};
}

void Trainer::save_checkpoint(int64_t step) {
  // Rank 0 writes; the others send it one tensor (or their piece of one) at a time, so no rank
  // ever holds more than its own stage plus one full tensor.
  parallel::Communicator& world = grid_->world();
  std::unique_ptr<io::CheckpointWriter> writer;
  const std::string path = io::checkpoint_path(config_.checkpoint_dir, step);
  if (rank_ == 0) writer = std::make_unique<io::CheckpointWriter>(path);
  for (int s = 0; s < grid_->pp_size(); ++s) {
    const int owner = grid_->rank_of(s, 0);
    // ZeRO 3: every replica of stage s takes part in gathering each of its tensors.
    const bool gathers = gather_ && stage_ == s;
    if (rank_ != 0 && rank_ != owner && !gathers) continue;
    const parallel::StageRange r = stages_[static_cast<size_t>(s)];
    int tag = 0;
    for (const layers::ParamEntry& e : layers::ParameterStore::layout(*model_, r.begin, r.end)) {
      const Tensor value = host_f32(gathers && e.trainable ? gather_->gather(e)
                                    : stage_ == s          ? store_->value(e)
                                                           : Tensor());
      if (rank_ == owner && owner == 0) {
        writer->write_tensor("model/" + e.name, value);
      } else if (rank_ == owner) {
        world.send(value, 0, tag++);
      } else if (rank_ == 0) {
        const Tensor t = Tensor::empty(e.shape);
        world.recv(t, owner, tag++);
        writer->write_tensor("model/" + e.name, t);
      }
    }
  }

  // Optimizer state: every rank owning part of a tensor's flat range sends that piece; rank 0
  // assembles the full tensor. Everyone walks the same (stage, state, entry, replica) order, so
  // sends and receives pair up in order; the tags only need to differ between neighbours.
  const std::vector<std::pair<std::string, Tensor>> states = optimizer_->state();
  int tag = 0;
  for (int s = 0; s < grid_->pp_size(); ++s) {
    const parallel::StageRange r = stages_[static_cast<size_t>(s)];
    const int owners = config_.zero == 0 ? 1 : dp_;  // without ZeRO replica 0's copy is the state
    for (const auto& [state, local] : states)
      for (const layers::ParamEntry& e : layers::ParameterStore::layout(*model_, r.begin, r.end)) {
        if (!e.trainable) continue;
        const Tensor full = rank_ == 0 ? Tensor::empty(e.shape) : Tensor();
        for (int q = 0; q < owners; ++q) {
          const parallel::Shard range = state_range(s, q);
          const layers::Overlap o = layers::overlap(e, range.begin, range.end);
          if (o.size == 0) continue;
          const int from = grid_->rank_of(s, q);
          tag = (tag + 1) % kMaxTag;
          if (from == rank_ && rank_ == 0)
            full.view(o.in_entry, {o.size}).copy_from(local.view(o.in_range, {o.size}));
          else if (from == rank_)
            world.send(host_f32(local.view(o.in_range, {o.size})), 0, tag);
          else if (rank_ == 0)
            world.recv(full.view(o.in_entry, {o.size}), from, tag);
        }
        if (writer) writer->write_tensor("optimizer/" + state + "/" + e.name, full);
      }
  }
  if (!writer) return;
  const int64_t per_epoch = sampler_->steps_per_epoch();
  writer->set_attr("step", step);
  writer->set_attr("optimizer_step", optimizer_->steps_taken());
  writer->set_attr("epoch", next_epoch_ + next_in_epoch_ / per_epoch);
  writer->set_attr("step_in_epoch", next_in_epoch_ % per_epoch);
  writer->set_attr("seed", config_.seed);
  writer->set_attr("global_batch", config_.global_batch);
  writer->set_attr("model", config_.model.name);
  writer->set_attr("optimizer", config_.optimizer.name);
  writer->set_attr("precision", precision_name(config_.precision));
  writer->set_attr("num_classes", num_classes_);
  writer->set_attr("loss_scale", scaler_.scale());
  writer->set_attr("loss_scale_good_steps", scaler_.good_steps());
  // The progress line's loss averages the steps since the last one: a resumed run logs the same.
  writer->set_attr("log_window_loss", window_loss_);
  writer->set_attr("log_window_steps", window_steps_);
  std::string effective;
  for (const auto& [key, value] : config_.effective) effective += key + " = " + value + "\n";
  writer->set_attr("config", effective);
  writer->commit();
  // Only a complete checkpoint becomes `latest`, and only then are older ones removed.
  io::update_latest(config_.checkpoint_dir, path);
  io::prune_checkpoints(config_.checkpoint_dir, config_.keep, path);
  log::info("saved checkpoint ", path);
}

void Trainer::write_timeline(const std::vector<parallel::TimelineEvent>& mine) {
  // Replica 0 of every stage sends its events (5 floats each) to rank 0, which renders them.
  const int pp = grid_->pp_size();
  if (replica_ != 0) return;
  parallel::Communicator& pipe = grid_->pp();  // replica 0's pipeline: ranks 0 .. pp-1 by stage
  const auto pack = [](const std::vector<parallel::TimelineEvent>& events) {
    const Tensor t = Tensor::empty({static_cast<int64_t>(events.size()), 5});
    float* p = t.data<float>();
    for (const parallel::TimelineEvent& e : events) {
      *p++ = static_cast<float>(e.stage);
      *p++ = static_cast<float>(static_cast<int>(e.op));
      *p++ = static_cast<float>(e.micro_batch);
      *p++ = static_cast<float>(e.start_s);
      *p++ = static_cast<float>(e.end_s);
    }
    return t;
  };
  if (stage_ != 0) {
    const Tensor count = Tensor::empty({1}, DType::I32);
    count.data<int32_t>()[0] = static_cast<int32_t>(mine.size());
    pipe.send(count, 0, 0);
    pipe.send(pack(mine), 0, 1);
    return;
  }
  std::vector<parallel::TimelineEvent> all = mine;
  for (int s = 1; s < pp; ++s) {
    const Tensor count = Tensor::empty({1}, DType::I32);
    pipe.recv(count, s, 0);
    const Tensor t = Tensor::empty({count.data<int32_t>()[0], 5});
    pipe.recv(t, s, 1);
    const float* p = t.data<float>();
    for (int64_t k = 0; k < t.dim(0); ++k, p += 5)
      all.push_back({static_cast<int>(p[0]), static_cast<parallel::Op>(static_cast<int>(p[1])), static_cast<int>(p[2]),
                     p[3], p[4]});
  }
  std::ofstream(config_.timeline) << parallel::render_svg(all, pp);
  std::ostringstream os;
  os << "timeline of the last step (" << parallel::to_string(config_.schedule_kind) << ", " << pp << " stages, "
     << micro_batches_ << " micro-batches) written to " << config_.timeline << "\n"
     << parallel::render_ascii(all, pp) << "\nbubble (idle) fraction per stage:";
  for (double f : parallel::bubble_fractions(all, pp)) os << " " << f;
  os << "  (formula (P-1)/(m+P-1) = " << static_cast<double>(pp - 1) / static_cast<double>(micro_batches_ + pp - 1)
     << ")";
  log::info(os.str());
}

}  // namespace strata::train
