// bench_ddp_step: data-parallel training-step throughput and its time breakdown, on random
// in-memory data, for the zoo's mlp and cnn. Each step is exactly train::Trainer::train_step
// with one micro-batch: zero grads, forward, softmax cross-entropy (scaled by 1 / global
// batch), backward with parallel::GradientSync (buckets start their all-reduce from the
// after-layer hook, progress() between layers), GradientSync::finish (timed: the exposed
// communication), SGD momentum 0.9, and the one-float all-reduce of the loss. The counterpart
// of bench/torch_ddp_step.py; bench/run_ddp_vs_torch.sh runs the two side by side.
//
//   build/bench_ddp_step --model mlp --batch 128                       # 1 rank: the baseline
//   mpirun -np 2 build/bench_ddp_step --model mlp --batch 128          # 2 ranks, batch per rank
//
// --batch is per rank (global batch = batch x ranks), as torch DDP's per-process batch.
// Diagnostics: --no-sync skips gradient sync (ranks compute side by side, no communication:
// what the machine allows without it); --no-overlap starts every bucket only after backward
// (blocking all-reduce of the whole gradient at the end); --bucket-mb sets the bucket size;
// --zero 1 is train's --zero 1: each bucket is reduced to the owners of its pieces, each rank
// steps its shard and the parameters are all-gathered (the "optimizer" time includes the
// all-gather). The parameter and gradient buffers come from the dp communicator, as in train
// (shared memory on one node: collectives in place); --no-shared-memory puts them in ordinary
// memory, so the collectives go through MPI (the ring all-reduce), for the side-by-side comparison.
#include <mpi.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "bench_common.hpp"
#include "core/ops.hpp"
#include "core/tensor.hpp"
#include "layers/loss.hpp"
#include "layers/model.hpp"
#include "parallel/gradient_sync.hpp"
#include "parallel/mpi.hpp"
#include "parallel/process_grid.hpp"
#include "parallel/zero.hpp"

namespace {

using namespace strata;
using bench::clock_type;
using bench::median;
using bench::seconds_since;

struct Options : bench::CommonOptions {  // batch is per rank
  double bucket_mb = 25.0;
  bool sync = true;
  bool overlap = true;
  int zero = 0;               // ZeRO stage: 0 or 1
  bool shared_memory = true;  // the dp group may use shared memory (train's default)
};

Options parse(int argc, char** argv) {
  Options o;
  bool no_sync = false, no_overlap = false, no_shared = false;
  bench::po::options_description desc("usage: [mpirun -np N] bench_ddp_step [options]\noptions");
  bench::add_common_options(desc, o, "samples per step per rank (global batch = batch x ranks)");
  // clang-format off
  desc.add_options()
    ("bucket-mb", bench::po::value(&o.bucket_mb)->default_value(o.bucket_mb), "gradient bucket size, MiB")
    ("no-sync", bench::po::bool_switch(&no_sync), "skip gradient sync (ranks side by side, no communication)")
    ("no-overlap", bench::po::bool_switch(&no_overlap), "all-reduce every bucket only after backward")
    ("no-shared-memory", bench::po::bool_switch(&no_shared), "buffers in ordinary memory: collectives through MPI")
    ("zero", bench::po::value(&o.zero)->default_value(o.zero), "ZeRO stage 0 or 1, as train's --zero");
  // clang-format on
  bench::parse_or_exit(argc, argv, desc);
  bench::check_common(o, desc);
  bench::require(o.bucket_mb > 0, "bucket-mb must be > 0", desc);
  bench::require(o.zero == 0 || o.zero == 1, "zero must be 0 or 1", desc);
  o.sync = !no_sync;
  o.overlap = !no_overlap;
  o.shared_memory = !no_shared;
  return o;
}

// Seconds spent per step in each phase, summed over a window.
struct Times {
  double compute = 0;  // zero grads + forward + loss + backward (incl. bucket starts, progress)
  double exposed = 0;  // GradientSync::finish: waiting for the buckets
  double optim = 0;    // SGD step (ZeRO 1: of the shard, and the parameter all-gather)
  double loss_ar = 0;  // the loss all-reduce (Trainer::sum_over_replicas)
};

struct Bench {
  parallel::ProcessGrid& grid;
  layers::Model model;
  layers::ParameterStore store;
  parallel::ShardedOptimizer optimizer;
  parallel::GradientSync sync;
  layers::SoftmaxCrossEntropy loss;
  std::vector<layers::Context> ctx;
  Tensor x, y, loss_buf;
  const Options& o;
  int64_t step = 0;

  // As the trainer builds them (pp = 1): ZeRO pads the store to dp equal shards.
  Bench(const Options& opt, parallel::ProcessGrid& g)
      : grid(g),
        model(bench::build_bench_model(opt.model, {1024, 1024})),
        store(model, opt.seed, 0, SIZE_MAX,
              opt.zero > 0 ? parallel::shard_pad_multiple(g.dp_size()) : parallel::kShardAlign, true, true, 0, 0,
              DType::F32, Device::cpu(),
              [&](int64_t numel, DType dtype) {
                return g.dp().allocate(numel, dtype, Device::cpu());  // ordinary memory with --no-shared-memory
              }),
        optimizer(layers::OptimizerConfig{"sgd", 0.9f}, parallel::Ownership(opt.zero, g.dp_size(), store.used_numel()),
                  g.dp(), store),
        sync(g.dp(), store, static_cast<int64_t>(opt.bucket_mb * (1 << 20)),
             opt.zero == 1 ? optimizer.shard().size : 0),
        o(opt) {
    sync.broadcast_parameters();
    bench::random_batch(o.batch, o.seed + 1000 * static_cast<uint64_t>(g.replica()), x, y);
    loss_buf = Tensor::empty({1});
  }

  // Trainer::train_step with one micro-batch, with a clock around each phase.
  double train_step(Times& t) {
    const auto t0 = clock_type::now();
    store.grads().fill_zero();
    const int64_t global_batch = o.batch * grid.dp_size();
    const float scale = 1.0f / static_cast<float>(global_batch);
    layers::StepInfo info{layers::Mode::Train, o.seed, step, grid.replica() * o.batch};
    const Tensor logits = model.forward(x, ctx, info);
    layers::Context loss_ctx;
    const double l = loss.forward(logits, y, loss_ctx);
    const Tensor dlogits = loss.backward(loss_ctx, scale);
    if (o.sync) {
      sync.begin();
      if (o.overlap)
        model.backward(dlogits, ctx, 0, SIZE_MAX, [this](size_t layer) { sync.layer_done(layer); });
      else
        model.backward(dlogits, ctx);
    } else {
      model.backward(dlogits, ctx);
    }
    const auto t1 = clock_type::now();
    if (o.sync) sync.finish();
    const auto t2 = clock_type::now();
    optimizer.step(store.params(), store.grads(), o.lr);
    const auto t3 = clock_type::now();
    loss_buf.data<float>()[0] = static_cast<float>(l);
    if (o.sync && grid.dp_size() > 1) grid.dp().all_reduce(loss_buf, parallel::ReduceOp::Sum);
    const auto t4 = clock_type::now();
    t.compute += std::chrono::duration<double>(t1 - t0).count();
    t.exposed += std::chrono::duration<double>(t2 - t1).count();
    t.optim += std::chrono::duration<double>(t3 - t2).count();
    t.loss_ar += std::chrono::duration<double>(t4 - t3).count();
    ++step;
    return loss_buf.data<float>()[0] / static_cast<double>(global_batch);
  }
};

double max_over(MPI_Comm comm, double v) {
  MPI_Allreduce(MPI_IN_PLACE, &v, 1, MPI_DOUBLE, MPI_MAX, comm);
  return v;
}

}  // namespace

int main(int argc, char** argv) {
  const Options o = parse(argc, argv);
  parallel::MpiRuntime mpi(argc, argv);  // also picks the ring iallreduce, as train does
  int code = 0;
  try {
    ops::set_num_threads(o.threads);
    parallel::ProcessGrid grid(MPI_COMM_WORLD, 1, parallel::Transport::Mpi, Device::cpu(), o.shared_memory);
    const int ranks = grid.dp_size();
    const bool root = grid.world().rank() == 0;
    Bench b(o, grid);
    const auto& buckets = b.sync.buckets();
    if (root) {
      std::printf(
          "strata bench_ddp_step: model %s, %d rank(s) x %d thread(s), batch %lld per rank (global %lld), "
          "%lld trainable parameters (%.2f MB of f32 gradients)\n",
          o.model.c_str(), ranks, ops::num_threads(), static_cast<long long>(o.batch),
          static_cast<long long>(o.batch * ranks), static_cast<long long>(b.store.num_trainable()),
          4e-6 * static_cast<double>(b.store.grads().numel()));
      std::printf("gradient sync: %s, --bucket-mb %g -> %zu bucket(s):",
                  !o.sync     ? "OFF (--no-sync)"
                  : o.overlap ? "overlapped"
                              : "after backward (--no-overlap)",
                  o.bucket_mb, buckets.size());
      for (const auto& bk : buckets)
        std::printf(" [%.2f MB from layer %zu]", 4e-6 * static_cast<double>(bk.end - bk.begin), bk.first_layer);
      const char* alg = std::getenv("OMPI_MCA_coll_libnbc_iallreduce_algorithm");
      const auto& dp = static_cast<parallel::MpiCommunicator&>(grid.dp());
      const bool shared = dp.in_shared_memory(b.store.grads()) && dp.in_shared_memory(b.store.params());
      std::printf("\nZeRO stage %d; parameter and gradient buffers: %s\n", o.zero,
                  shared ? "shared memory (collectives in place)" : "ordinary memory (collectives through MPI)");
      std::printf("iallreduce algorithm (OMPI_MCA_coll_libnbc_iallreduce_algorithm): %s\n", alg ? alg : "default");
    }
    Times warm;
    double first_loss = 0, last_loss = 0;
    for (int s = 0; s < o.warmup; ++s) {
      const double l = b.train_step(warm);
      if (s == 0) first_loss = l;
    }
    std::vector<double> rates, compute, exposed, optim, loss_ar, total, exposed_max;
    for (int w = 0; w < o.windows; ++w) {
      MPI_Barrier(MPI_COMM_WORLD);
      Times t;
      const auto t0 = clock_type::now();
      for (int s = 0; s < o.steps; ++s) last_loss = b.train_step(t);
      const double sec = max_over(MPI_COMM_WORLD, seconds_since(t0));
      rates.push_back(static_cast<double>(o.steps * o.batch * ranks) / sec);
      const double k = 1e3 / o.steps;
      compute.push_back(t.compute * k);
      exposed.push_back(t.exposed * k);
      exposed_max.push_back(max_over(MPI_COMM_WORLD, t.exposed) * k);
      optim.push_back(t.optim * k);
      loss_ar.push_back(t.loss_ar * k);
      total.push_back(sec * k);
    }
    // Blocking all-reduce of each bucket alone, the machine otherwise idle: the communication
    // a step has to hide.
    double ar_alone = 0;
    if (o.sync && ranks > 1) {
      std::vector<double> ar;
      for (int r = 0; r < 11; ++r) {
        MPI_Barrier(MPI_COMM_WORLD);
        const auto t0 = clock_type::now();
        for (const auto& bk : buckets)
          grid.dp().all_reduce(b.store.grads().view(bk.begin, {bk.end - bk.begin}), parallel::ReduceOp::Sum);
        ar.push_back(max_over(MPI_COMM_WORLD, seconds_since(t0)) * 1e3);
      }
      ar_alone = median(ar);
    }
    if (root) {
      const double med = median(rates);
      std::printf("windows (global samples/s):");
      for (double r : rates) std::printf(" %.1f", r);
      std::printf("\nloss: first %.4f, last %.4f\n", first_loss, last_loss);
      std::printf(
          "per step, rank 0, median of windows (ms): compute %.3f  exposed comm %.3f (max over ranks %.3f)  "
          "optimizer %.3f  loss all-reduce %.3f  step %.3f\n",
          median(compute), median(exposed), median(exposed_max), median(optim), median(loss_ar), median(total));
      if (ranks > 1 && o.sync) std::printf("all-reduce of all buckets alone (blocking, idle): %.3f ms\n", ar_alone);
      std::printf("median %.1f samples/s, %.3f ms/step\n", med, 1e3 * static_cast<double>(o.batch * ranks) / med);
      std::printf(
          "RESULT impl=strata-ddp model=%s ranks=%d batch=%lld threads=%d samples_per_s=%.2f compute_ms=%.3f "
          "exposed_ms=%.3f optim_ms=%.3f loss_ar_ms=%.3f step_ms=%.3f exposed_frac=%.4f buckets=%zu "
          "bucket_mb=%g allreduce_alone_ms=%.3f zero=%d\n",
          o.model.c_str(), ranks, static_cast<long long>(o.batch), o.threads, med, median(compute), median(exposed),
          median(optim), median(loss_ar), median(total), median(exposed) / std::max(median(total), 1e-9),
          buckets.size(), o.bucket_mb, ar_alone, o.zero);
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", parallel::format_error(e).c_str());
    code = 1;
  }
  return code;
}
