#include "train/trainer.hpp"

#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>

#include "core/log.hpp"
#include "core/ops.hpp"
#include "io/checkpoint.hpp"

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

std::string checkpoint_path(const std::string& dir, int64_t step) {
  char name[64];
  std::snprintf(name, sizeof name, "step-%08lld.h5", static_cast<long long>(step));
  return (fs::path(dir) / name).string();
}

}  // namespace

Trainer::Trainer(const Config& config, MPI_Comm world)
    : config_(config), grid_(std::make_unique<parallel::ProcessGrid>(world, 1)) {
  rank_ = grid_->world().rank();
  dp_ = grid_->dp_size();
  replica_ = grid_->replica();

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
  }

  model_ = std::make_unique<layers::Model>(layers::build_model(config_.model, info.sample_shape, info.num_classes));
  store_ = std::make_unique<layers::ParameterStore>(*model_, config_.seed);
  optimizer_ = std::make_unique<layers::Optimizer>(config_.optimizer, store_->params().numel());
  STRATA_REQUIRE(config_.bucket_mb > 0, "--bucket-mb must be positive, found ", config_.bucket_mb);
  sync_ = std::make_unique<parallel::GradientSync>(grid_->dp(), *store_,
                                                   static_cast<int64_t>(config_.bucket_mb * (1 << 20)));

  // Batch arithmetic: global = micro * accumulation * dp.
  STRATA_REQUIRE(config_.global_batch % dp_ == 0, "--global-batch ", config_.global_batch, " must be divisible by the ",
                 dp_, " data-parallel ranks");
  local_batch_ = config_.global_batch / dp_;
  micro_batch_ = config_.micro_batch > 0 ? config_.micro_batch : local_batch_;
  STRATA_REQUIRE(local_batch_ % micro_batch_ == 0, "--global-batch ", config_.global_batch,
                 " must equal --micro-batch (", micro_batch_, ") x accumulation steps x ", dp_, " ranks; ",
                 local_batch_, " samples per rank is not a multiple of ", micro_batch_);

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

  if (!config_.init_from.empty()) {
    io::CheckpointReader reader(config_.init_from);
    for (const layers::ParamEntry& e : store_->entries()) {
      const std::string name = "model/" + e.name;
      STRATA_REQUIRE(reader.has(name), "checkpoint ", config_.init_from, " has no tensor ", name,
                     " (was it saved from a different --model?)");
      reader.read_tensor(name, store_->value(e));
    }
  }
  sync_->broadcast_parameters();  // every replica starts from replica 0's values
  if (!config_.checkpoint_dir.empty() && rank_ == 0) {
    std::error_code ec;
    fs::create_directories(config_.checkpoint_dir, ec);
    STRATA_REQUIRE(!ec, "--checkpoint-dir: cannot create '", config_.checkpoint_dir, "': ", ec.message());
  }

  log::info("model ", config_.model.name, " on ", dp_, " rank(s), input ", shape_str(info.sample_shape), ", ",
            info.num_classes, " classes\n", model_->summary());
  if (train_data_)
    log::info("data: ", train_data_->size(), " training samples, ", sampler_->steps_per_epoch(), " steps per epoch of ",
              config_.global_batch, " (", local_batch_ / micro_batch_, " micro-batch(es) of ", micro_batch_,
              " per rank); training ", total_steps_, " steps");
}

const io::Dataset* Trainer::eval_data() const { return val_data_ ? val_data_.get() : train_data_.get(); }

void Trainer::sum_over_replicas(std::vector<double>& values) const {
  if (dp_ == 1) return;
  const Tensor t = Tensor::empty({static_cast<int64_t>(values.size())});
  std::copy(values.begin(), values.end(), t.data<float>());
  grid_->dp().all_reduce(t, parallel::ReduceOp::Sum);
  std::copy(t.data<float>(), t.data<float>() + t.numel(), values.begin());
}

double Trainer::train_step(const io::Batch& batch, int64_t step) {
  store_->grads().fill_zero();
  double loss_sum = 0;
  // The loss is the mean over the GLOBAL batch, so summing gradients over replicas (and over
  // micro-batches) gives exactly the single-rank gradient: no separate averaging step.
  const float scale = 1.0f / static_cast<float>(config_.global_batch);
  const int64_t micro_batches = local_batch_ / micro_batch_;
  for (int64_t m = 0; m < micro_batches; ++m) {
    const int64_t begin = m * micro_batch_;
    const Tensor x = batch.x.slice(begin, begin + micro_batch_);
    const Tensor y = batch.y.slice(begin, begin + micro_batch_);
    layers::StepInfo info{layers::Mode::Train, config_.seed, step, batch.first_sample + begin};
    const Tensor logits = model_->forward(x, contexts_, info);
    layers::Context loss_ctx;
    loss_sum += loss_.forward(logits, y, loss_ctx);
    const Tensor dlogits = loss_.backward(loss_ctx, scale);
    if (m + 1 < micro_batches) {
      model_->backward(dlogits, contexts_);  // accumulate locally; sync only after the last
    } else {
      sync_->begin();
      model_->backward(dlogits, contexts_, 0, SIZE_MAX, [this](size_t layer) { sync_->layer_done(layer); });
      const auto wait_start = std::chrono::steady_clock::now();
      sync_->finish();  // what backward did not hide: exposed communication
      exposed_comm_s_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - wait_start).count();
    }
  }
  if (step == config_.debug_fail_step && rank_ == config_.debug_fail_rank)
    STRATA_THROW("injected failure at step ", step, " (--debug-fail-step)");
  const Tensor& grads = store_->grads();
  if (config_.clip_grad > 0) layers::clip_by_global_norm(grads, ops::sum_squares(grads), config_.clip_grad);
  optimizer_->step(store_->params(), grads, layers::learning_rate(config_.schedule, step));
  std::vector<double> loss{loss_sum};
  sum_over_replicas(loss);
  return loss[0];
}

void Trainer::log_progress(int64_t step, int64_t epoch, double loss, float lr, double samples_per_s,
                           double comm_fraction, double eta_s) const {
  char line[256];
  std::snprintf(line, sizeof line,
                "step %lld/%lld  epoch %lld  loss %.4f  lr %.4g  %.0f samples/s  comm %.1f%%  eta %s",
                static_cast<long long>(step), static_cast<long long>(total_steps_), static_cast<long long>(epoch), loss,
                lr, samples_per_s, 100.0 * comm_fraction, format_duration(eta_s).c_str());
  log::info(line);
  if (!config_.metrics.empty() && rank_ == 0) {
    std::ofstream out(config_.metrics, std::ios::app);
    STRATA_CHECK(out.good(), "cannot append to --metrics file ", config_.metrics);
    char json[256];
    std::snprintf(json, sizeof json,
                  "{\"step\": %lld, \"epoch\": %lld, \"loss\": %.6f, \"lr\": %.6g, \"samples_per_s\": %.1f, "
                  "\"exposed_comm_fraction\": %.4f}\n",
                  static_cast<long long>(step), static_cast<long long>(epoch), loss, lr, samples_per_s, comm_fraction);
    out << json;
  }
}

void Trainer::train() {
  using clock = std::chrono::steady_clock;
  const int64_t per_epoch = sampler_->steps_per_epoch();
  io::Loader loader(*train_data_, *sampler_, replica_ * local_batch_, local_batch_, config_.prefetch);
  loader.start(start_step_ / per_epoch, start_step_ % per_epoch);

  double window_loss = 0;
  int64_t window_steps = 0;
  auto window_start = clock::now();
  const auto run_start = clock::now();
  for (int64_t step = start_step_; step < total_steps_; ++step) {
    const io::Batch& batch = loader.next();
    window_loss += train_step(batch, step) / static_cast<double>(config_.global_batch);
    ++window_steps;
    const int64_t done = step + 1;
    if (done % config_.log_every == 0 || done == total_steps_) {
      const double seconds = std::chrono::duration<double>(clock::now() - window_start).count();
      const double rate = static_cast<double>(window_steps * config_.global_batch) / std::max(seconds, 1e-9);
      const double elapsed = std::chrono::duration<double>(clock::now() - run_start).count();
      const double eta = elapsed / static_cast<double>(done - start_step_) * static_cast<double>(total_steps_ - done);
      log_progress(done, step / per_epoch, window_loss / static_cast<double>(window_steps),
                   layers::learning_rate(config_.schedule, step), rate, exposed_comm_s_ / std::max(seconds, 1e-9), eta);
      exposed_comm_s_ = 0;
      window_loss = 0;
      window_steps = 0;
      window_start = clock::now();
    }
    if (config_.eval_every > 0 && done % config_.eval_every == 0 && done != total_steps_ && val_data_) {
      const EvalResult r = evaluate(*val_data_);
      log::info("eval at step ", done, ": loss ", r.loss, "  accuracy ", 100.0 * r.accuracy, "%");
    }
    if (config_.save_every > 0 && done % config_.save_every == 0 && done != total_steps_ &&
        !config_.checkpoint_dir.empty())
      save_checkpoint(done, done / per_epoch);
  }
  if (!config_.checkpoint_dir.empty()) save_checkpoint(total_steps_, total_steps_ / per_epoch);
}

EvalResult Trainer::evaluate(const io::Dataset& data) {
  // Every sample is evaluated exactly once: rank r takes a contiguous slice of the dataset and
  // the sums are reduced, so the metric is the single-rank one.
  const int64_t n = data.size();
  const int64_t begin = n * replica_ / dp_, end = n * (replica_ + 1) / dp_;
  const int64_t chunk = std::max<int64_t>(micro_batch_, 256);
  const Shape sample = data.info().sample_shape;
  std::vector<double> sums{0, 0};  // loss, correct
  std::vector<layers::Context> ctx;
  for (int64_t b = begin; b < end; b += chunk) {
    const int64_t count = std::min(chunk, end - b);
    Tensor x = Tensor::empty(layers::batch_shape(count, sample));
    Tensor y = Tensor::empty({count}, DType::I32);
    io::read_range(data, b, b + count, x, y);
    const Tensor logits = model_->forward(x, ctx, {layers::Mode::Eval, config_.seed, 0, b});
    layers::Context loss_ctx;
    sums[0] += loss_.forward(logits, y, loss_ctx);
    sums[1] += static_cast<double>(ops::count_correct(logits, y));
  }
  sum_over_replicas(sums);
  return {sums[0] / static_cast<double>(n), sums[1] / static_cast<double>(n), n};
}

void Trainer::save_checkpoint(int64_t step, int64_t epoch) {
  if (rank_ != 0) return;  // pp = 1: rank 0 holds every parameter
  const std::string path = checkpoint_path(config_.checkpoint_dir, step);
  io::CheckpointWriter writer(path);
  for (const layers::ParamEntry& e : store_->entries()) writer.write_tensor("model/" + e.name, store_->value(e));
  writer.set_attr("step", step);
  writer.set_attr("epoch", epoch);
  writer.set_attr("model", config_.model.name);
  writer.commit();
  log::info("saved checkpoint ", path);
}

}  // namespace strata::train
