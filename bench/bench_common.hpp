// bench_common.hpp: what bench_train_step, bench_ddp_step and bench_collectives share: the
// timing helpers, the options every training-step benchmark takes (Boost.Program_options, as
// src/train/config.cpp), and the model + fixed random MNIST-shaped batch they time.
#pragma once

#include <algorithm>
#include <boost/program_options.hpp>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <iostream>
#include <random>
#include <string>
#include <vector>

#include "core/tensor.hpp"
#include "layers/zoo.hpp"

namespace strata::bench {

namespace po = boost::program_options;
using clock_type = std::chrono::steady_clock;

inline double seconds_since(clock_type::time_point t0) {
  return std::chrono::duration<double>(clock_type::now() - t0).count();
}

inline double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// The options of every training-step benchmark (and of bench/torch_models.py's scripts).
struct CommonOptions {
  std::string model = "mlp";
  int64_t batch = 128;
  int warmup = 20;  // untimed steps first (caches, allocator free lists, OpenBLAS buffers)
  int steps = 20;   // steps per timed window
  int windows = 7;  // timed windows; the median window is reported
  int threads = 1;
  float lr = 0.01f;
  uint64_t seed = 1;
};

inline void add_common_options(po::options_description& desc, CommonOptions& o,
                               const char* batch_help = "samples per step") {
  // clang-format off
  desc.add_options()
    ("help,h", "print this help")
    ("model", po::value(&o.model)->default_value(o.model), "mlp | cnn")
    ("batch", po::value(&o.batch)->default_value(o.batch), batch_help)
    ("warmup", po::value(&o.warmup)->default_value(o.warmup), "untimed steps first")
    ("steps", po::value(&o.steps)->default_value(o.steps), "steps per timed window")
    ("windows", po::value(&o.windows)->default_value(o.windows), "timed windows; the median is reported")
    ("threads", po::value(&o.threads)->default_value(o.threads), "ops threads")
    ("lr", po::value(&o.lr)->default_value(o.lr, "0.01"), "SGD learning rate (momentum 0.9)")
    ("seed", po::value(&o.seed)->default_value(o.seed), "parameter and data seed");
  // clang-format on
}

// Parses argv into the variables desc points at. --help prints the options and exits 0; a bad
// or unknown option prints the error and the options and exits 2.
inline void parse_or_exit(int argc, char** argv, const po::options_description& desc) {
  try {
    po::variables_map vm;
    po::store(po::parse_command_line(argc, argv, desc), vm);
    if (vm.count("help")) {
      std::cout << desc << "\n";
      std::exit(0);
    }
    po::notify(vm);
  } catch (const std::exception& e) {
    std::cerr << e.what() << "\n" << desc << "\n";
    std::exit(2);
  }
}

// Exits 2 with msg and the options when a check on the parsed values fails.
inline void require(bool ok, const char* msg, const po::options_description& desc) {
  if (ok) return;
  std::cerr << msg << "\n" << desc << "\n";
  std::exit(2);
}

inline void check_common(const CommonOptions& o, const po::options_description& desc) {
  require(o.batch > 0 && o.steps > 0 && o.windows > 0 && o.threads > 0, "batch, steps, windows, threads must be > 0",
          desc);
}

// The zoo model on 1x28x28 inputs, 10 classes.
inline layers::Model build_bench_model(const std::string& name, const std::vector<int64_t>& hidden) {
  layers::ModelSpec spec;
  spec.name = name;
  spec.hidden = hidden;
  return layers::build_model(spec, {1, 28, 28}, 10);
}

// One fixed random batch: x uniform in [0, 1) of shape {batch, 1, 28, 28}, y labels in 0..9.
inline void random_batch(int64_t batch, uint64_t seed, Tensor& x, Tensor& y) {
  x = Tensor::empty({batch, 1, 28, 28});
  y = Tensor::empty({batch}, DType::I32);
  std::mt19937 gen(static_cast<uint32_t>(seed));
  std::uniform_real_distribution<float> u(0.0f, 1.0f);
  std::uniform_int_distribution<int32_t> label(0, 9);
  float* xp = x.data<float>();
  for (int64_t i = 0; i < x.numel(); ++i) xp[i] = u(gen);
  int32_t* yp = y.data<int32_t>();
  for (int64_t i = 0; i < y.numel(); ++i) yp[i] = label(gen);
}

}  // namespace strata::bench
