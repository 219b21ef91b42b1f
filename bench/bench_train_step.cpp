// bench_train_step: samples/s of full training steps — train's own step (parallel::StageEngine:
// zero grads, forward, softmax cross-entropy, backward, SGD momentum step) — on random in-memory
// data, one process, for the zoo's mlp and cnn. The counterpart of bench/torch_train_step.py: same models, same batch,
// same warm-up and timing (median of several timed windows). --profile adds a per-layer
// forward/backward breakdown to see where the time goes.
//
//   bench_train_step --model mlp --batch 128 --warmup 20 --steps 20 --windows 7 --threads 1 [--precision bf16]
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "bench_common.hpp"
#include "bench_step.hpp"
#include "core/allocator.hpp"
#include "core/ops.hpp"
#include "core/tensor.hpp"
#include "parallel/runtime/mpi.hpp"

namespace {

using namespace strata;
using bench::clock_type;
using bench::median;
using bench::seconds_since;

struct Options : bench::CommonOptions {
  std::vector<int64_t> hidden{1024, 1024};
  std::string precision = "fp32";
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
    ("precision", bench::po::value(&o.precision)->default_value(o.precision), "fp32 | bf16 (train's --precision)")
    ("profile", bench::po::bool_switch(&o.profile), "add a per-layer forward/backward breakdown")
    ("profile-steps", bench::po::value(&o.profile_steps)->default_value(o.profile_steps), "steps of --profile");
  // clang-format on
  bench::parse_or_exit(argc, argv, desc);
  bench::check_common(o, desc);
  bench::require(o.precision == "fp32" || o.precision == "bf16", "--precision must be fp32 or bf16", desc);
  o.hidden = parse_list(hidden);
  return o;
}

}  // namespace

int main(int argc, char** argv) {
  const Options o = parse(argc, argv);
  parallel::MpiRuntime mpi(argc, argv);  // the step's communicators (one rank)
  try {
    ops::set_num_threads(o.threads);
    // The step under test: train's own (bench_step.hpp) on one rank, SGD with momentum 0.9.
    bench::StepSetup setup;
    setup.optimizer = layers::OptimizerConfig{"sgd", 0.9f};
    setup.batch = o.batch;
    setup.seed = o.seed;
    setup.lr = o.lr;
    setup.dtype = parse_precision(o.precision);
    bench::StepBench b(MPI_COMM_SELF, setup, [&] { return bench::build_bench_model(o.model, o.hidden); });
    Tensor x, y;
    bench::random_batch(o.batch, o.seed, x, y);
    b.set_batch(x, y);
    std::printf(
        "strata bench_train_step: model %s, %s, batch %lld, threads %d, %lld trainable parameters; train's step "
        "(StageEngine)\n",
        o.model.c_str(), o.precision.c_str(), static_cast<long long>(o.batch), ops::num_threads(),
        static_cast<long long>(b.engine().trainable_parameters()));
    double first_loss = 0;
    for (int s = 0; s < o.warmup; ++s) {
      const double l = b.step();
      if (s == 0) first_loss = l;
    }
    const AllocatorStats before = host_allocator().stats();
    std::vector<double> rates;
    double last_loss = 0;
    for (int w = 0; w < o.windows; ++w) {
      const auto t0 = clock_type::now();
      for (int s = 0; s < o.steps; ++s) last_loss = b.step();
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
    std::printf("\nloss: first %.4f, last %.4f\n", first_loss, last_loss);
    std::printf("median %.1f samples/s, %.3f ms/step\n", med, 1e3 * static_cast<double>(o.batch) / med);
    // One line for scripts.
    std::printf("RESULT impl=strata model=%s precision=%s batch=%lld threads=%d samples_per_s=%.2f\n", o.model.c_str(),
                o.precision.c_str(), static_cast<long long>(o.batch), o.threads, med);
    if (o.profile) bench::print_profile(b, o.profile_steps);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_train_step: %s\n", e.what());
    return 1;
  }
  return 0;
}
