// bench_collectives: MpiCommunicator bandwidth, nccl-tests style, and the measurement behind
// its overlap design.
//
//   mpirun -np 2 build/bench_collectives            # table: all_reduce (MPI, and in shared
//                                                   # memory: all_reduce_shm), reduce_scatter,
//                                                   # all_gather (and in place in shared memory:
//                                                   # all_gather_shm), broadcast, 4 KiB .. 256 MiB
//   mpirun -np 2 build/bench_collectives --overlap  # can an async all-reduce hide behind compute?
//
// Table columns follow nccl-tests (doc/PERFORMANCE.md): size is the full buffer in bytes,
// algbw = size / time, busbw = algbw * 2(n-1)/n for all-reduce and (n-1)/n for reduce-scatter
// and all-gather (1 for broadcast); #wrong counts elements of a checked run that differ from
// the serial reference. `memcpy` is one core copying the same number of bytes: the ceiling a
// shared-memory transport works against. Run with OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1.
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "bench_common.hpp"
#include "core/ops.hpp"
#include "parallel/comm/mpi_communicator.hpp"
#include "parallel/runtime/mpi.hpp"

namespace {

using strata::DType;
using strata::Tensor;
using strata::bench::median;
using strata::parallel::Communicator;
using strata::parallel::MpiCommunicator;
using strata::parallel::ReduceOp;
using strata::parallel::WorkPtr;

double now() { return MPI_Wtime(); }

// The slowest rank's time: a collective is done when the last rank is.
double max_over_ranks(Communicator& comm, double t) {
  Tensor v = Tensor::empty({1});
  v.data<float>()[0] = static_cast<float>(t);
  MPI_Allreduce(MPI_IN_PLACE, v.raw(), 1, MPI_FLOAT, MPI_MAX, static_cast<MpiCommunicator&>(comm).comm());
  return v.data<float>()[0];
}

// Small integers: sums over ranks are exact, so a result is right or wrong, not close.
float value(int rank, int64_t i) { return static_cast<float>((i * 7 + rank * 5) % 17); }

void fill(const Tensor& t, int rank, int64_t offset = 0) {
  float* p = t.data<float>();
  for (int64_t i = 0; i < t.numel(); ++i) p[i] = value(rank, offset + i);
}

// Single-core memcpy bandwidth (GB/s) for `bytes`.
double memcpy_gbs(size_t bytes, int iters) {
  std::vector<char> a(bytes, 1), b(bytes, 2);
  std::memcpy(b.data(), a.data(), bytes);
  const double t0 = now();
  for (int i = 0; i < iters; ++i) std::memcpy(b.data(), a.data(), bytes);
  const double t = (now() - t0) / iters;
  if (b[bytes / 2] != 1) std::printf("memcpy went wrong\n");
  return static_cast<double>(bytes) / t / 1e9;
}

struct Row {
  const char* op;
  double bus_factor;
};

// One table row: times `iters` runs of the operation (after `warmup`), then runs it once more
// on fresh data and counts wrong elements.
void bench_op(MpiCommunicator& comm, const std::string& op, size_t bytes, int warmup, int iters, double memcpy_bw) {
  const int n = comm.size(), rank = comm.rank();
  const int64_t count = static_cast<int64_t>(bytes / sizeof(float));  // full buffer elements
  const int64_t chunk = count / n;
  // *_shm: the buffer from allocate() (shared memory on one node), as train's gradients and
  // parameters; the all-gather is then in place, as ZeRO's.
  const bool shm = op == "all_reduce_shm" || op == "all_gather_shm";
  const bool all_reduce = op == "all_reduce" || op == "all_reduce_shm";
  const bool all_gather = op == "all_gather" || op == "all_gather_shm";
  Tensor full = shm ? comm.allocate(count, DType::F32, strata::Device::cpu()) : Tensor::empty({count});
  Tensor part = Tensor::empty({chunk});
  fill(full, rank);
  fill(part, rank, rank * chunk);
  auto run = [&] {
    if (all_reduce)
      comm.all_reduce(full, ReduceOp::Sum);
    else if (op == "reduce_scatter")
      comm.reduce_scatter(full.view(0, {chunk * n}), part, ReduceOp::Sum);
    else if (op == "all_gather_shm")  // this rank's chunk holds its values already (fill)
      comm.all_gather(full.view(rank * chunk, {chunk}), full.view(0, {chunk * n}));
    else if (op == "all_gather")
      comm.all_gather(part, full.view(0, {chunk * n}));
    else
      comm.broadcast(full, 0);
  };
  for (int i = 0; i < warmup; ++i) run();
  comm.barrier();
  const double t0 = now();
  for (int i = 0; i < iters; ++i) run();
  const double t = max_over_ranks(comm, (now() - t0) / iters);

  // Checked run on fresh data (the timed runs kept summing into the same buffer).
  fill(full, rank);
  fill(part, rank, rank * chunk);
  run();
  int64_t wrong = 0;
  const float* f = full.data<float>();
  const float* p = part.data<float>();
  for (int64_t i = 0; i < count; ++i) {
    float want = 0;
    if (all_reduce) {
      for (int r = 0; r < n; ++r) want += value(r, i);
    } else if (all_gather) {
      if (i >= chunk * n) break;
      want = value(static_cast<int>(i / chunk), i);
    } else if (op == "broadcast") {
      want = value(0, i);
    } else {
      break;
    }
    wrong += f[i] != want;
  }
  if (op == "reduce_scatter")
    for (int64_t i = 0; i < chunk; ++i) {
      float want = 0;
      for (int r = 0; r < n; ++r) want += value(r, rank * chunk + i);
      wrong += p[i] != want;
    }
  Tensor w = Tensor::empty({1});
  w.data<float>()[0] = static_cast<float>(wrong);
  MPI_Allreduce(MPI_IN_PLACE, w.raw(), 1, MPI_FLOAT, MPI_SUM, comm.comm());

  const double factor = all_reduce ? 2.0 * (n - 1) / n : op == "broadcast" ? 1.0 : double(n - 1) / n;
  const double algbw = static_cast<double>(bytes) / t / 1e9;
  if (rank == 0)
    std::printf("%-14s %12zu %11lld %5s %12.1f %9.2f %9.2f %7.0f %10.2f\n", op.c_str(), bytes,
                static_cast<long long>(count), "f32", t * 1e6, algbw, algbw * factor, w.data<float>()[0], memcpy_bw);
}

void run_table(MpiCommunicator& comm, size_t min_bytes, size_t max_bytes) {
  if (comm.rank() == 0) {
    std::printf("# bench_collectives: %d ranks, communicator '%s', in place, times = slowest rank\n", comm.size(),
                comm.name().c_str());
    std::printf("%-14s %12s %11s %5s %12s %9s %9s %7s %10s\n", "op", "size(B)", "count", "type", "time(us)", "algbw",
                "busbw", "#wrong", "memcpy");
    std::printf("%-14s %12s %11s %5s %12s %9s %9s %7s %10s\n", "", "", "(elements)", "", "", "(GB/s)", "(GB/s)", "",
                "(GB/s)");
  }
  for (const char* op :
       {"all_reduce", "all_reduce_shm", "reduce_scatter", "all_gather", "all_gather_shm", "broadcast"}) {
    for (size_t bytes = min_bytes; bytes <= max_bytes; bytes *= 4) {
      // About 0.5 GiB moved per row, at least 3 and at most 200 timed runs.
      const int iters = static_cast<int>(std::clamp<size_t>((size_t{512} << 20) / bytes, 3, 200));
      const double mc = memcpy_gbs(bytes, std::max(3, iters / 4));
      bench_op(comm, op, bytes, std::min(iters, 5), iters, mc);
    }
    if (comm.rank() == 0) std::printf("\n");
  }
}

// ---- overlap -----------------------------------------------------------------------------

// A GEMM-sized unit of backward compute (~0.2-0.5 ms on one core).
struct Compute {
  Tensor a = Tensor::empty({192, 192}), b = Tensor::empty({192, 192}), c = Tensor::empty({192, 192});
  Compute() {
    fill(a, 1);
    fill(b, 2);
  }
  void chunk() const { strata::ops::gemm(a, false, b, false, c, 1e-3f, 0.0f); }
};

// How each variant drives the all-reduce while the compute chunks run.
enum class Mode { ComputeOnly, AllReduceOnly, Blocking, WaitOnly, Progress, ThreadBlocking, ThreadPoll };
const char* mode_name(Mode m) {
  switch (m) {
    case Mode::ComputeOnly:
      return "compute alone";
    case Mode::AllReduceOnly:
      return "blocking all_reduce alone";
    case Mode::Blocking:
      return "blocking all_reduce, then compute";
    case Mode::WaitOnly:
      return "async, no MPI calls until wait";
    case Mode::Progress:
      return "async + progress() per chunk";
    case Mode::ThreadBlocking:
      return "comm thread, blocking all_reduce";
    case Mode::ThreadPoll:
      return "comm thread, test() + 50us sleep";
  }
  return "";
}

// One run: start the all-reduce, do `chunks` compute chunks, wait. Returns the slowest rank's
// time from start to the end of the wait.
double overlap_once(MpiCommunicator& comm, MpiCommunicator& thread_comm, const Tensor& buf, const Compute& work,
                    int chunks, Mode mode) {
  auto compute_all = [&](bool progress) {
    for (int i = 0; i < chunks; ++i) {
      work.chunk();
      if (progress) comm.progress();
    }
  };
  comm.barrier();
  const double t0 = now();
  switch (mode) {
    case Mode::ComputeOnly:
      compute_all(false);
      break;
    case Mode::AllReduceOnly:
      comm.all_reduce(buf, ReduceOp::Sum);
      break;
    case Mode::Blocking:
      comm.all_reduce(buf, ReduceOp::Sum);
      compute_all(false);
      break;
    case Mode::WaitOnly: {
      WorkPtr w = comm.all_reduce_async(buf, ReduceOp::Sum);
      compute_all(false);
      w->wait();
      break;
    }
    case Mode::Progress: {
      WorkPtr w = comm.all_reduce_async(buf, ReduceOp::Sum);
      compute_all(true);
      w->wait();
      break;
    }
    case Mode::ThreadBlocking:
    case Mode::ThreadPoll: {
      // The thread alone uses thread_comm while the main thread computes (MPI_THREAD_MULTIPLE).
      std::thread t([&] {
        if (mode == Mode::ThreadBlocking) {
          thread_comm.all_reduce(buf, ReduceOp::Sum);
        } else {
          WorkPtr w = thread_comm.all_reduce_async(buf, ReduceOp::Sum);
          while (!w->test()) std::this_thread::sleep_for(std::chrono::microseconds(50));
        }
      });
      compute_all(false);
      t.join();
      break;
    }
  }
  return max_over_ranks(comm, now() - t0);
}

// Variants run round-robin, `reps` rounds, medians reported: the machine is shared, and
// interleaving spreads drifting background load over all variants alike.
void run_overlap(MpiCommunicator& comm, bool threads, int reps) {
  MpiCommunicator thread_comm(comm.comm(), "comm-thread");
  Compute work;
  for (int i = 0; i < 20; ++i) work.chunk();
  double c0 = now();
  for (int i = 0; i < 50; ++i) work.chunk();
  const double chunk_s = max_over_ranks(comm, (now() - c0) / 50);
  if (comm.rank() == 0) {
    std::printf("# overlap: %d ranks x 1 compute thread, compute chunk = 192^3 GEMM = %.3f ms, median of %d rounds\n",
                comm.size(), chunk_s * 1e3, reps);
    std::printf("# exposed = total - compute alone; hidden = 1 - exposed / blocking all_reduce alone\n");
    std::printf("%6s  %-34s %10s %11s %8s\n", "MiB", "variant", "total(ms)", "exposed(ms)", "hidden");
  }
  std::vector<Mode> modes = {Mode::ComputeOnly, Mode::AllReduceOnly, Mode::Blocking, Mode::WaitOnly, Mode::Progress};
  if (threads) modes.insert(modes.end(), {Mode::ThreadBlocking, Mode::ThreadPoll});
  for (int mib : {1, 4, 25}) {
    Tensor buf = Tensor::empty({int64_t{mib} << 18});  // MiB of f32
    fill(buf, comm.rank());
    // Compute long enough to hide the all-reduce twice over (at least 10 ms).
    std::vector<double> ar;
    for (int r = 0; r < 3; ++r) ar.push_back(overlap_once(comm, thread_comm, buf, work, 0, Mode::AllReduceOnly));
    const int chunks = static_cast<int>(std::max(10e-3, 2 * median(ar)) / chunk_s) + 1;
    std::vector<std::vector<double>> times(modes.size());
    for (int r = 0; r < reps + 1; ++r)
      for (size_t m = 0; m < modes.size(); ++m) {
        const double t = overlap_once(comm, thread_comm, buf, work, chunks, modes[m]);
        if (r > 0) times[m].push_back(t);  // round 0 warms up
      }
    const double compute = median(times[0]), blocking = median(times[1]);
    if (comm.rank() == 0)
      for (size_t m = 0; m < modes.size(); ++m) {
        const double total = median(times[m]);
        if (m < 2)
          std::printf("%6d  %-34s %10.2f\n", mib, mode_name(modes[m]), total * 1e3);
        else
          std::printf("%6d  %-34s %10.2f %11.2f %7.0f%%\n", mib, mode_name(modes[m]), total * 1e3,
                      (total - compute) * 1e3, 100.0 * (1.0 - (total - compute) / blocking));
      }
    if (comm.rank() == 0) std::printf("\n");
  }
}

}  // namespace

int main(int argc, char** argv) {
  bool overlap = false, threads = true;
  size_t min_bytes = 4 << 10, max_bytes = size_t{256} << 20;
  int reps = 15;
  bool no_threads = false;
  namespace po = strata::bench::po;
  po::options_description desc(
      "usage: mpirun -np N bench_collectives [--min-bytes B] [--max-bytes B] | --overlap [--no-threads] [--reps N]\n"
      "options");
  // clang-format off
  desc.add_options()
    ("help,h", "print this help")
    ("min-bytes", po::value(&min_bytes)->default_value(min_bytes), "table: smallest buffer, bytes")
    ("max-bytes", po::value(&max_bytes)->default_value(max_bytes), "table: largest buffer, bytes")
    ("overlap", po::bool_switch(&overlap), "measure whether an async all-reduce hides behind compute")
    ("no-threads", po::bool_switch(&no_threads), "--overlap: skip the comm-thread variants")
    ("reps", po::value(&reps)->default_value(reps), "--overlap: rounds, medians reported");
  // clang-format on
  strata::bench::parse_or_exit(argc, argv, desc);
  threads = !no_threads;
  // The comm-thread variants of --overlap need MPI_THREAD_MULTIPLE; everything else runs as the
  // trainer does (FUNNELED: only the main thread calls MPI).
  const int wanted = overlap && threads ? MPI_THREAD_MULTIPLE : MPI_THREAD_FUNNELED;
  int provided = 0;
  MPI_Init_thread(&argc, &argv, wanted, &provided);
  MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  strata::set_process_rank(rank);
  int code = 0;
  try {
    if (provided < wanted) STRATA_THROW("MPI provides thread level ", provided, ", wanted ", wanted);
    MpiCommunicator world(MPI_COMM_WORLD, "world");
    if (overlap)
      run_overlap(world, threads, reps);
    else
      run_table(world, min_bytes, max_bytes);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", strata::parallel::format_error(e).c_str());
    code = 1;
  }
  MPI_Finalize();
  return code;
}
