// bench_train_step: samples/s of full training steps (zero grads, forward, softmax
// cross-entropy, backward, SGD momentum step) on random in-memory data, one process, for the
// zoo's mlp and cnn. The counterpart of bench/torch_train_step.py: same models, same batch,
// same warm-up and timing (median of several timed windows). --profile adds a per-layer
// forward/backward breakdown to see where the time goes.
//
//   bench_train_step --model mlp --batch 128 --warmup 20 --steps 20 --windows 7 --threads 1
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "bench_common.hpp"
#include "core/allocator.hpp"
#include "core/ops.hpp"
#include "core/tensor.hpp"
#include "layers/loss.hpp"
#include "layers/model.hpp"
#include "layers/optimizer.hpp"

namespace {

using namespace strata;
using bench::clock_type;
using bench::median;
using bench::seconds_since;

struct Options : bench::CommonOptions {
  std::vector<int64_t> hidden{1024, 1024};
  bool profile = false;
  int profile_steps = 20;
};

std::vector<int64_t> parse_list(const std::string& s) {
  std::vector<int64_t> out;
  size_t pos = 0;
  while (pos < s.size()) {
    size_t end = s.find(',', pos);
    if (end == std::string::npos) end = s.size();
    out.push_back(std::atoll(s.substr(pos, end - pos).c_str()));
    pos = end + 1;
  }
  return out;
}

Options parse(int argc, char** argv) {
  Options o;
  std::string hidden = "1024,1024";
  bench::po::options_description desc("usage: bench_train_step [options]\noptions");
  bench::add_common_options(desc, o);
  // clang-format off
  desc.add_options()
    ("hidden", bench::po::value(&hidden)->default_value(hidden), "mlp hidden sizes, comma-separated")
    ("profile", bench::po::bool_switch(&o.profile), "add a per-layer forward/backward breakdown")
    ("profile-steps", bench::po::value(&o.profile_steps)->default_value(o.profile_steps), "steps of --profile");
  // clang-format on
  bench::parse_or_exit(argc, argv, desc);
  bench::check_common(o, desc);
  o.hidden = parse_list(hidden);
  return o;
}

// Everything one training step touches: the model, its flat buffers, the optimizer, the
// per-layer contexts and one fixed random batch.
struct Bench {
  layers::Model model;
  layers::ParameterStore store;
  layers::Optimizer optimizer;
  layers::SoftmaxCrossEntropy loss;
  std::vector<layers::Context> ctx;
  Tensor x, y;
  float lr;
  int64_t step = 0;
  size_t first_trainable = 0;  // the lowest layer with parameters: its dx is never needed

  explicit Bench(const Options& o)
      : model(bench::build_bench_model(o.model, o.hidden)),
        store(model, o.seed),
        optimizer(layers::OptimizerConfig{"sgd", 0.9f}, store.params().numel()),
        lr(o.lr) {
    for (const layers::ParamEntry& e : store.entries())
      if (e.trainable) {
        first_trainable = e.layer;
        break;
      }
    bench::random_batch(o.batch, o.seed, x, y);
  }

  // One step exactly as train::Trainer::train_step does it with one micro-batch and one rank.
  double train_step() {
    store.grads().fill_zero();
    const float scale = 1.0f / static_cast<float>(x.dim(0));
    layers::StepInfo info{layers::Mode::Train, 1, step, 0};
    const Tensor logits = model.forward(x, ctx, info);
    layers::Context loss_ctx;
    const double l = loss.forward(logits, y, loss_ctx);
    model.backward(loss.backward(loss_ctx, scale), ctx);
    optimizer.step(store.params(), store.grads(), lr);
    ++step;
    return l;
  }

  // The same step with a clock around every piece; times accumulate into the vectors.
  void profiled_step(std::vector<double>& fwd, std::vector<double>& bwd, double& zero_s, double& loss_s,
                     double& opt_s) {
    auto t = clock_type::now();
    store.grads().fill_zero();
    zero_s += seconds_since(t);
    const float scale = 1.0f / static_cast<float>(x.dim(0));
    layers::StepInfo info{layers::Mode::Train, 1, step, 0};
    ctx.resize(model.size());
    Tensor h = x;
    for (size_t i = 0; i < model.size(); ++i) {
      t = clock_type::now();
      h = model.layer(i).forward(h, ctx[i], info);
      fwd[i] += seconds_since(t);
    }
    t = clock_type::now();
    layers::Context loss_ctx;
    loss.forward(h, y, loss_ctx);
    Tensor g = loss.backward(loss_ctx, scale);
    loss_s += seconds_since(t);
    // As Model::backward: the input's gradient is not needed, so the lowest layer with
    // parameters skips dx and the layers below it are not run.
    for (size_t i = model.size(); i-- > 0 && g.defined();) {
      t = clock_type::now();
      ctx[i].input_grad = i > first_trainable;
      g = model.layer(i).backward(g, ctx[i]);
      bwd[i] += seconds_since(t);
    }
    t = clock_type::now();
    optimizer.step(store.params(), store.grads(), lr);
    opt_s += seconds_since(t);
    ++step;
  }
};

void profile(Bench& b, const Options& o) {
  const size_t n = b.model.size();
  std::vector<double> fwd(n, 0.0), bwd(n, 0.0);
  double zero_s = 0, loss_s = 0, opt_s = 0;
  for (int s = 0; s < o.profile_steps; ++s) b.profiled_step(fwd, bwd, zero_s, loss_s, opt_s);
  const double k = 1e3 / o.profile_steps;  // ms per step
  double total = zero_s + loss_s + opt_s;
  for (size_t i = 0; i < n; ++i) total += fwd[i] + bwd[i];
  std::printf("\nper-step breakdown (mean of %d profiled steps, ms)\n", o.profile_steps);
  std::printf("  %-10s %-28s %18s %9s %9s %6s\n", "layer", "kind", "output", "forward", "backward", "%");
  for (size_t i = 0; i < n; ++i) {
    const layers::Layer& l = b.model.layer(i);
    std::printf("  %-10s %-28s %18s %9.3f %9.3f %5.1f%%\n", l.name().c_str(), l.describe().c_str(),
                shape_str(b.model.shape(i + 1)).c_str(), fwd[i] * k, bwd[i] * k, 100.0 * (fwd[i] + bwd[i]) / total);
  }
  std::printf("  %-10s %-28s %18s %9.3f %9s %5.1f%%\n", "zero_grad", "fill_zero(grads)", "", zero_s * k, "",
              100.0 * zero_s / total);
  std::printf("  %-10s %-28s %18s %9.3f %9s %5.1f%%\n", "loss", "softmax_xent fwd+bwd", "", loss_s * k, "",
              100.0 * loss_s / total);
  std::printf("  %-10s %-28s %18s %9.3f %9s %5.1f%%\n", "optimizer", "sgd momentum 0.9", "", opt_s * k, "",
              100.0 * opt_s / total);
  std::printf("  %-10s %-28s %18s %9.3f\n", "total", "", "", total * k);
}

}  // namespace

int main(int argc, char** argv) {
  const Options o = parse(argc, argv);
  try {
    ops::set_num_threads(o.threads);
    Bench b(o);
    std::printf("strata bench_train_step: model %s, batch %lld, threads %d, %lld trainable parameters\n",
                o.model.c_str(), static_cast<long long>(o.batch), ops::num_threads(),
                static_cast<long long>(b.store.num_trainable()));
    double first_loss = 0;
    for (int s = 0; s < o.warmup; ++s) {
      const double l = b.train_step();
      if (s == 0) first_loss = l / static_cast<double>(o.batch);
    }
    const AllocatorStats before = host_allocator().stats();
    std::vector<double> rates;
    double last_loss = 0;
    for (int w = 0; w < o.windows; ++w) {
      const auto t0 = clock_type::now();
      for (int s = 0; s < o.steps; ++s) last_loss = b.train_step();
      const double sec = seconds_since(t0);
      rates.push_back(static_cast<double>(o.steps * o.batch) / sec);
    }
    const double med = median(rates);
    std::printf("windows (samples/s):");
    for (double r : rates) std::printf(" %.1f", r);
    const AllocatorStats after = host_allocator().stats();
    std::printf(
        "\nallocator during timed steps: %llu system allocations, %llu cache hits (%.1f per step), peak %.1f MiB in "
        "use",
        static_cast<unsigned long long>(after.system_allocs - before.system_allocs),
        static_cast<unsigned long long>(after.cache_hits - before.cache_hits),
        static_cast<double>(after.cache_hits - before.cache_hits) / (o.windows * o.steps),
        static_cast<double>(after.peak_in_use) / (1 << 20));
    std::printf("\nloss: first %.4f, last %.4f\n", first_loss, last_loss / static_cast<double>(o.batch));
    std::printf("median %.1f samples/s, %.3f ms/step\n", med, 1e3 * static_cast<double>(o.batch) / med);
    // One line for scripts.
    std::printf("RESULT impl=strata model=%s batch=%lld threads=%d samples_per_s=%.2f\n", o.model.c_str(),
                static_cast<long long>(o.batch), o.threads, med);
    if (o.profile) profile(b, o);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_train_step: %s\n", e.what());
    return 1;
  }
  return 0;
}
