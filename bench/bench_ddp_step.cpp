// bench_ddp_step: data-parallel training-step throughput and its time breakdown, on random
// in-memory data, for the zoo's mlp and cnn. Each step is train's own (parallel::StageEngine with
// one micro-batch, bench_step.hpp): zero grads, forward, softmax cross-entropy (scaled by 1 /
// global batch), backward with the gradient buckets reduced as layers finish, the wait for what
// backward did not hide, SGD momentum 0.9 (ZeRO: of this rank's shard, then the parameter
// all-gather), and the end-of-step agreement of the loss. The counterpart of
// bench/torch_ddp_step.py; bench/run_ddp_vs_torch.sh runs the two side by side.
//
//   build/bench_ddp_step --model mlp --batch 128                       # 1 rank: the baseline
//   mpirun -np 2 build/bench_ddp_step --model mlp --batch 128          # 2 ranks, batch per rank
//
// --batch is per rank (global batch = batch x ranks), as torch DDP's per-process batch.
// Diagnostics: --no-sync gives every rank a world of its own (ranks compute side by side, no
// communication: what the machine allows without it); --bucket-mb sets the bucket size; --zero
// is train's --zero. The parameter and gradient buffers come from the dp communicator, as in
// train (shared memory on one node: collectives in place); --no-shared-memory puts them in
// ordinary memory, so the collectives go through MPI (the ring all-reduce), for the side-by-side
// comparison. The breakdown's exposed communication is the watchdog's count of time blocked in
// the step's collectives (what the progress line's `comm` shows).
#include <mpi.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "bench_common.hpp"
#include "bench_step.hpp"
#include "core/ops.hpp"
#include "core/tensor.hpp"
#include "parallel/runtime/mpi.hpp"

namespace {

using namespace strata;
using bench::clock_type;
using bench::median;
using bench::seconds_since;

struct Options : bench::CommonOptions {  // batch is per rank
  double bucket_mb = 25.0;
  bool sync = true;
  int zero = 0;               // ZeRO stage 0-3
  bool shared_memory = true;  // the dp group may use shared memory (train's default)
};

Options parse(int argc, char** argv) {
  Options o;
  bool no_sync = false, no_shared = false;
  bench::po::options_description desc("usage: [mpirun -np N] bench_ddp_step [options]\noptions");
  bench::add_common_options(desc, o, "samples per step per rank (global batch = batch x ranks)");
  // clang-format off
  desc.add_options()
    ("bucket-mb", bench::po::value(&o.bucket_mb)->default_value(o.bucket_mb), "gradient bucket size, MiB")
    ("no-sync", bench::po::bool_switch(&no_sync), "every rank its own world (side by side, no communication)")
    ("no-shared-memory", bench::po::bool_switch(&no_shared), "buffers in ordinary memory: collectives through MPI")
    ("zero", bench::po::value(&o.zero)->default_value(o.zero), "ZeRO stage 0-3, as train's --zero");
  // clang-format on
  bench::parse_or_exit(argc, argv, desc);
  bench::check_common(o, desc);
  bench::require(o.bucket_mb > 0, "bucket-mb must be > 0", desc);
  bench::require(o.zero >= 0 && o.zero <= 3, "zero must be 0, 1, 2 or 3", desc);
  o.sync = !no_sync;
  o.shared_memory = !no_shared;
  return o;
}

double max_over(MPI_Comm comm, double v) {
  MPI_Allreduce(MPI_IN_PLACE, &v, 1, MPI_DOUBLE, MPI_MAX, comm);
  return v;
}

// Seconds this rank has been blocked in collectives so far (not pipeline messages).
double blocked_in_collectives() { return parallel::StageEngine::blocked_seconds().collectives; }

}  // namespace

int main(int argc, char** argv) {
  const Options o = parse(argc, argv);
  parallel::MpiRuntime mpi(argc, argv);  // also picks the ring iallreduce, as train does
  int code = 0;
  try {
    ops::set_num_threads(o.threads);
    bench::StepSetup setup;
    setup.optimizer = layers::OptimizerConfig{"sgd", 0.9f};
    setup.zero = o.zero;
    setup.bucket_bytes = static_cast<int64_t>(o.bucket_mb * (1 << 20));
    setup.batch = o.batch;
    setup.seed = o.seed;
    setup.lr = o.lr;
    setup.shared_memory = o.shared_memory;
    bench::StepBench b(o.sync ? MPI_COMM_WORLD : MPI_COMM_SELF, setup, [&] {
      return bench::build_bench_model(o.model, {1024, 1024});
    });
    parallel::ProcessGrid& grid = b.grid();
    int ranks = 1, world_rank = 0;
    MPI_Comm_size(MPI_COMM_WORLD, &ranks);
    MPI_Comm_rank(MPI_COMM_WORLD, &world_rank);
    const bool root = world_rank == 0;
    Tensor x, y;
    bench::random_batch(o.batch, o.seed + 1000 * static_cast<uint64_t>(world_rank), x, y);
    b.set_batch(x, y);
    const int64_t gradient_bytes = b.engine().allocated_bytes()[1];
    if (root) {
      parallel::MpiCommunicator& dp = grid.mpi_dp();
      std::printf(
          "strata bench_ddp_step: model %s, %d rank(s) x %d thread(s), batch %lld per rank (global %lld), "
          "%lld trainable parameters (%.2f MB of f32 gradients); train's step (StageEngine)\n",
          o.model.c_str(), ranks, ops::num_threads(), static_cast<long long>(o.batch),
          static_cast<long long>(o.batch * ranks), static_cast<long long>(b.engine().trainable_parameters()),
          1e-6 * static_cast<double>(gradient_bytes));
      std::printf("gradient sync: %s, --bucket-mb %g, ZeRO stage %d; one-node groups: %s\n",
                  o.sync ? "overlapped with backward" : "OFF (--no-sync)", o.bucket_mb, o.zero,
                  dp.node_local() && o.shared_memory ? "shared memory (collectives in place)"
                                                     : "ordinary memory (collectives through MPI)");
      const char* alg = std::getenv("OMPI_MCA_coll_libnbc_iallreduce_algorithm");
      std::printf("iallreduce algorithm (OMPI_MCA_coll_libnbc_iallreduce_algorithm): %s\n", alg ? alg : "default");
    }
    double first_loss = 0, last_loss = 0;
    for (int s = 0; s < o.warmup; ++s) {
      const double l = b.step();
      if (s == 0) first_loss = l;
    }
    std::vector<double> rates, exposed, total, exposed_max;
    for (int w = 0; w < o.windows; ++w) {
      MPI_Barrier(MPI_COMM_WORLD);
      const double blocked_before = blocked_in_collectives();
      const auto t0 = clock_type::now();
      for (int s = 0; s < o.steps; ++s) last_loss = b.step();
      const double sec = max_over(MPI_COMM_WORLD, seconds_since(t0));
      const double blocked = blocked_in_collectives() - blocked_before;
      rates.push_back(static_cast<double>(o.steps * o.batch * ranks) / sec);
      const double k = 1e3 / o.steps;
      exposed.push_back(blocked * k);
      exposed_max.push_back(max_over(MPI_COMM_WORLD, blocked) * k);
      total.push_back(sec * k);
    }
    // Blocking all-reduce of as many f32 as the gradients, in a buffer of the dp group (shared
    // memory where the step's are), the machine otherwise idle: the communication a step hides.
    double ar_alone = 0;
    if (o.sync && ranks > 1) {
      const Tensor grads = grid.dp().allocate(gradient_bytes / 4, DType::F32, Device::cpu());
      std::vector<double> ar;
      for (int r = 0; r < 11; ++r) {
        MPI_Barrier(MPI_COMM_WORLD);
        const auto t0 = clock_type::now();
        grid.dp().all_reduce(grads, parallel::ReduceOp::Sum);
        ar.push_back(max_over(MPI_COMM_WORLD, seconds_since(t0)) * 1e3);
      }
      ar_alone = median(ar);
    }
    if (root) {
      const double med = median(rates), step_ms = median(total), exposed_ms = median(exposed);
      std::printf("windows (global samples/s):");
      for (double r : rates) std::printf(" %.1f", r);
      std::printf("\nloss: first %.4f, last %.4f\n", first_loss, last_loss);
      std::printf(
          "per step, rank 0, median of windows (ms): compute %.3f  exposed comm %.3f (max over ranks %.3f)  step "
          "%.3f\n",
          step_ms - exposed_ms, exposed_ms, median(exposed_max), step_ms);
      if (ranks > 1 && o.sync) std::printf("all-reduce of the gradients alone (blocking, idle): %.3f ms\n", ar_alone);
      std::printf("median %.1f samples/s, %.3f ms/step\n", med, 1e3 * static_cast<double>(o.batch * ranks) / med);
      std::printf(
          "RESULT impl=strata-ddp model=%s ranks=%d batch=%lld threads=%d samples_per_s=%.2f compute_ms=%.3f "
          "exposed_ms=%.3f step_ms=%.3f exposed_frac=%.4f bucket_mb=%g allreduce_alone_ms=%.3f zero=%d\n",
          o.model.c_str(), ranks, static_cast<long long>(o.batch), o.threads, med, step_ms - exposed_ms, exposed_ms,
          step_ms, exposed_ms / std::max(step_ms, 1e-9), o.bucket_mb, ar_alone, o.zero);
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", parallel::format_error(e).c_str());
    code = 1;
  }
  return code;
}
