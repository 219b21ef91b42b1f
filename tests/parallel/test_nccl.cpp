// Communicators over device tensors under real MPI (1 and 2 ranks): every collective of the
// NcclCommunicator and of the MpiCommunicator staging through pinned memory, against sums
// computed locally from each rank's known contribution (small integers: exact in every dtype).
// Also device selection over MPI, which runs everywhere. Without a GPU the device tests skip,
// saying why, on every rank alike (the reason is agreed over the world: no rank waits in a
// collective that another skipped); NCCL tests also skip when a node has more ranks than
// GPUs, where the MPI tests share the GPU.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "core/ops.hpp"
#include "parallel/collective_values.hpp"
#include "parallel/comm/mpi_communicator.hpp"
#include "parallel/mpi_world.hpp"
#include "parallel/runtime/device.hpp"
#include "parallel/runtime/mpi.hpp"
#include "parallel/runtime/process_grid.hpp"
#if STRATA_WITH_CUDA
#include <cuda_runtime.h>

#include "core/cuda/runtime.hpp"
#include "parallel/comm/nccl_communicator.hpp"
#endif

namespace strata::parallel {
namespace {

// ---- device selection over MPI (runs on every machine) ---------------------------------------

TEST(DeviceSelection, CpuWithMpi) {
  EXPECT_TRUE(select_device(MPI_COMM_WORLD, DeviceKind::CPU, Transport::Mpi).is_cpu());
}

TEST(DeviceSelection, NcclOnTheCpuIsAnInputErrorOnEveryRank) {
  const int code =
      run_collectively(MPI_COMM_WORLD, [] { select_device(MPI_COMM_WORLD, DeviceKind::CPU, Transport::Nccl); });
  EXPECT_EQ(code, kExitBadInput);
}

TEST(DeviceSelection, CudaWithoutGpuIsOneClearInputError) {
  int gpus = 0;
#if STRATA_WITH_CUDA
  if (cudaGetDeviceCount(&gpus) != cudaSuccess) {
    (void)cudaGetLastError();
    gpus = 0;
  }
#endif
  int any = gpus;
  MPI_Allreduce(&gpus, &any, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  if (any > 0) GTEST_SKIP() << "this machine has a GPU (the error needs a machine without one)";
  std::string message;
  try {
    select_device(MPI_COMM_WORLD, DeviceKind::CUDA, Transport::Mpi);
    ADD_FAILURE() << "cuda was selected without a GPU";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::Input);
    message = e.message();
  }
  if (STRATA_WITH_CUDA)
    EXPECT_NE(message.find("--device cuda: no CUDA device on node"), std::string::npos) << message;
  else
    EXPECT_NE(message.find("--device cuda: this build of Strata has no CUDA"), std::string::npos) << message;
  // Inside run_collectively every rank agrees on exit code 2 (one line printed by rank 0).
  EXPECT_EQ(run_collectively(MPI_COMM_WORLD, [] { select_device(MPI_COMM_WORLD, DeviceKind::CUDA, Transport::Nccl); }),
            kExitBadInput);
}

TEST(DeviceSelection, GridRefusesNcclOnTheCpu) {
  const int code = run_collectively(MPI_COMM_WORLD, [] { ProcessGrid grid(MPI_COMM_WORLD, 1, Transport::Nccl); });
  EXPECT_EQ(code, kExitBadInput);
}

TEST(DeviceSelection, MpiGridKeepsMpiCommunicators) {
  ProcessGrid grid(MPI_COMM_WORLD, 1, Transport::Mpi, Device::cpu());
  EXPECT_EQ(&grid.dp(), &grid.mpi_dp());
  EXPECT_EQ(&grid.pp(), &grid.mpi_pp());
  EXPECT_EQ(&grid.world(), &grid.mpi_world());
  EXPECT_EQ(grid.transport(), Transport::Mpi);
}

#if STRATA_WITH_CUDA

using namespace testing_values;
using namespace testing_world;

// The first non-empty reason over the ranks (by rank), the same string on every rank.
std::string agreed(const std::string& mine) {
  const int size = world_size();
  const int me = mine.empty() ? size : world_rank();
  int lowest = size;
  MPI_Allreduce(&me, &lowest, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  if (lowest == size) return "";
  int length = static_cast<int>(mine.size());
  MPI_Bcast(&length, 1, MPI_INT, lowest, MPI_COMM_WORLD);
  std::string reason(static_cast<size_t>(length), ' ');
  if (world_rank() == lowest) reason = mine;
  MPI_Bcast(reason.data(), length, MPI_CHAR, lowest, MPI_COMM_WORLD);
  return strata::detail::cat("rank ", lowest, ": ", reason);
}

// A device copy of a host tensor, complete before anything else runs.
Tensor to_device(const Tensor& host, Device device) {
  Tensor d = Tensor::empty(host.shape(), host.dtype(), device);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);  // a reused block may still be in use
  if (host.nbytes() > 0) {
    EXPECT_EQ(cudaMemcpy(d.raw(), host.raw(), host.nbytes(), cudaMemcpyHostToDevice), cudaSuccess);
  }
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  return d;
}

// The device tensor as the compute stream sees it now: the copy is queued on that stream, so a
// result is visible only if the communicator's wait() ordered the stream after the operation.
Tensor to_host(const Tensor& d) {
  Tensor h = Tensor::empty(d.shape(), d.dtype());
  const cudaStream_t stream = cuda::compute_stream(d.device().index);
  if (d.nbytes() > 0) {
    EXPECT_EQ(cudaMemcpyAsync(h.raw(), d.raw(), d.nbytes(), cudaMemcpyDeviceToHost, stream), cudaSuccess);
  }
  EXPECT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  return h;
}

// On `device`: elements i = contribution(rank, offset + i).
Tensor filled(DType type, int64_t n, int rank, Device device, int64_t offset = 0) {
  return to_device(testing_values::filled(type, n, rank, offset), device);
}

// Mismatches of the device tensor against expected(i) (within `tolerance`); shows the first.
template <class Expected>
int64_t count_wrong_on_device(const Tensor& device, Expected expected, double tolerance = 0) {
  return count_wrong(to_host(device), expected, tolerance);
}

// The same tests over both transports of device memory.
class DeviceComm : public testing::TestWithParam<Transport> {
 protected:
  static void TearDownTestSuite() {
    for (auto& c : comms_) c.reset();
  }

  void SetUp() override {
    const Transport transport = GetParam();
    const size_t slot = transport == Transport::Nccl ? 1 : 0;
    if (!checked_[slot]) {
      checked_[slot] = true;
      std::string why;
      try {
        device_[slot] = select_device(MPI_COMM_WORLD, DeviceKind::CUDA, transport);
      } catch (const Error& e) {
        why = e.message();
      }
      skip_[slot] = agreed(why);
      if (skip_[slot].empty()) {
        try {  // a failed creation fails every test of the transport, not a null pointer later
          if (transport == Transport::Nccl)
            comms_[slot] = std::make_unique<NcclCommunicator>(MPI_COMM_WORLD, "world", device_[slot]);
          else
            comms_[slot] = std::make_unique<MpiCommunicator>(MPI_COMM_WORLD, "world");
        } catch (const std::exception& e) {
          failed_[slot] = e.what();
        }
      }
    }
    if (!skip_[slot].empty()) GTEST_SKIP() << "no GPU for every rank (" << skip_[slot] << ")";
    if (!comms_[slot]) GTEST_FAIL() << "creating the communicator failed: " << failed_[slot];
    comm_ = comms_[slot].get();
    device_here_ = device_[slot];
    rank_ = comm_->rank();
    size_ = comm_->size();
  }

  Communicator* comm_ = nullptr;
  Device device_here_;
  int rank_ = 0, size_ = 1;

  static inline bool checked_[2] = {false, false};
  static inline std::string skip_[2];
  static inline std::string failed_[2];
  static inline Device device_[2];
  static inline std::unique_ptr<Communicator> comms_[2];
};

std::string transport_label(const testing::TestParamInfo<Transport>& info) {
  return info.param == Transport::Nccl ? "Nccl" : "MpiStaged";
}

TEST_P(DeviceComm, AllReduceSumEveryDtype) {
  for (DType type : kAllTypes)
    for (int64_t n : kSizes) {
      SCOPED_TRACE(strata::detail::cat(dtype_name(type), " n=", n));
      Tensor t = filled(type, n, rank_, device_here_);
      comm_->all_reduce(t, ReduceOp::Sum);
      EXPECT_EQ(count_wrong_on_device(t, [&](int64_t i) { return reference_sum(type, size_, 0, i); }), 0);
    }
}

TEST_P(DeviceComm, AllReduceAvgFloats) {
  for (DType type : kFloatTypes) {
    SCOPED_TRACE(dtype_name(type));
    Tensor t = filled(type, 1000, rank_, device_here_);
    comm_->all_reduce_async(t, ReduceOp::Avg)->wait();
    // The mean of small integers over <= 2 ranks is a multiple of 1/2: exact in every dtype.
    EXPECT_EQ(count_wrong_on_device(
                  t, [&](int64_t i) { return reference_sum(type, size_, 0, i) / size_; }, 1e-6),
              0);
  }
}

TEST_P(DeviceComm, AvgOfIntegersIsRefused) {
  Tensor t = filled(DType::I32, 10, rank_, device_here_);
  EXPECT_THROW(comm_->all_reduce(t, ReduceOp::Avg), Error);
}

TEST_P(DeviceComm, ReduceScatterPlacesChunkOfRank) {
  for (DType type : kAllTypes) {
    SCOPED_TRACE(dtype_name(type));
    const int64_t n = 1001;
    Tensor in = filled(type, n * size_, rank_, device_here_);
    Tensor out = Tensor::empty({n}, type, device_here_);
    comm_->reduce_scatter(in, out, ReduceOp::Sum);
    EXPECT_EQ(count_wrong_on_device(out, [&](int64_t i) { return reference_sum(type, size_, rank_ * n, i); }), 0);
  }
  Tensor in = filled(DType::F32, 8 * size_, rank_, device_here_), out = Tensor::empty({8}, DType::F32, device_here_);
  comm_->reduce_scatter(in, out, ReduceOp::Avg);
  EXPECT_EQ(count_wrong_on_device(
                out, [&](int64_t i) { return reference_sum(DType::F32, size_, rank_ * 8, i) / size_; }, 1e-6),
            0);
}

TEST_P(DeviceComm, AllGatherPlacesChunkFromEachRankAlsoInPlace) {
  for (DType type : kAllTypes)
    for (bool in_place : {false, true}) {
      SCOPED_TRACE(strata::detail::cat(dtype_name(type), in_place ? " in place" : ""));
      const int64_t n = 1003;
      Tensor out = Tensor::zeros({n * size_}, type, device_here_);
      Tensor mine = filled(type, n, rank_, device_here_, 0);
      Tensor in = in_place ? out.view(rank_ * n, {n}) : mine;
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);  // zeros() is queued on the compute stream
      if (in_place) {
        ASSERT_EQ(cudaMemcpy(in.raw(), mine.raw(), mine.nbytes(), cudaMemcpyDeviceToDevice), cudaSuccess);
      }
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      comm_->all_gather(in, out);
      EXPECT_EQ(
          count_wrong_on_device(out, [&](int64_t i) { return contribution(type, static_cast<int>(i / n), i % n); }), 0);
    }
}

TEST_P(DeviceComm, ReduceToEveryRootLeavesOthersUnchanged) {
  for (DType type : kAllTypes)
    for (int root = 0; root < size_; ++root) {
      SCOPED_TRACE(strata::detail::cat(dtype_name(type), " root ", root));
      Tensor t = filled(type, 777, rank_, device_here_);
      comm_->reduce(t, root, ReduceOp::Sum);
      if (rank_ == root)
        EXPECT_EQ(count_wrong_on_device(t, [&](int64_t i) { return reference_sum(type, size_, 0, i); }), 0);
      else
        EXPECT_EQ(count_wrong_on_device(t, [&](int64_t i) { return contribution(type, rank_, i); }), 0);
    }
}

TEST_P(DeviceComm, BroadcastFromEveryRoot) {
  for (DType type : kAllTypes)
    for (int root = 0; root < size_; ++root) {
      SCOPED_TRACE(strata::detail::cat(dtype_name(type), " root ", root));
      Tensor t = filled(type, 100003, rank_, device_here_);
      comm_->broadcast(t, root);
      EXPECT_EQ(count_wrong_on_device(t, [&](int64_t i) { return contribution(type, root, i); }), 0);
    }
}

TEST_P(DeviceComm, SendRecvRing) {
  if (size_ == 1) GTEST_SKIP() << "send/recv needs 2 ranks";
  const int next = (rank_ + 1) % size_, prev = (rank_ + size_ - 1) % size_;
  for (DType type : kAllTypes) {
    SCOPED_TRACE(dtype_name(type));
    for (int64_t n : {int64_t{3}, int64_t{1000003}}) {
      Tensor out = filled(type, n, rank_, device_here_);
      Tensor in = Tensor::zeros({n}, type, device_here_);
      // NCCL matches by order and a large send waits for its receive: even ranks send first,
      // odd ranks receive first, so no two sends wait for each other.
      std::vector<WorkPtr> work;
      if (rank_ % 2 == 0) {
        work.push_back(comm_->send_async(out, next, 0));
        work.push_back(comm_->recv_async(in, prev, 0));
      } else {
        work.push_back(comm_->recv_async(in, prev, 0));
        work.push_back(comm_->send_async(out, next, 0));
      }
      for (auto& w : work) w->wait();
      EXPECT_EQ(count_wrong_on_device(in, [&](int64_t i) { return contribution(type, prev, i); }), 0) << "n " << n;
    }
  }
}

TEST_P(DeviceComm, PipelineOneForwardOneBackwardWithLargeMessages) {
  // The link between two 1F1B stages (P = 2, m = 4): stage 0 sends activations 0 and 1 before it
  // receives gradient 0, which stage 1 sends before it receives activation 1. With 32 MiB
  // messages, far above NCCL's buffers, this finishes only if sends up and sends down do not
  // queue behind each other (NcclCommunicator's p2p lanes; MPI's non-blocking sends).
  if (size_ != 2) GTEST_SKIP() << "needs exactly 2 ranks";
  const int64_t n = int64_t{8} << 20;
  const int m = 4;
  std::vector<Tensor> act(m), grad(m);
  std::vector<WorkPtr> work;
  for (int i = 0; i < m; ++i) {
    act[static_cast<size_t>(i)] =
        rank_ == 0 ? filled(DType::F32, n, 0, device_here_, i) : Tensor::zeros({n}, DType::F32, device_here_);
    grad[static_cast<size_t>(i)] =
        rank_ == 1 ? filled(DType::F32, n, 1, device_here_, i) : Tensor::zeros({n}, DType::F32, device_here_);
  }
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  if (rank_ == 0) {  // F0 F1 B0 F2 B1 F3 B2 B3
    const char* program = "FFBFBFBB";
    int f = 0, b = 0;
    for (const char* a = program; *a; ++a) {
      if (*a == 'F')
        work.push_back(comm_->send_async(act[static_cast<size_t>(f++)], 1, 0));
      else
        work.push_back(comm_->recv_async(grad[static_cast<size_t>(b++)], 1, 1));
    }
  } else {  // F0 B0 F1 B1 F2 B2 F3 B3
    for (int i = 0; i < m; ++i) {
      work.push_back(comm_->recv_async(act[static_cast<size_t>(i)], 0, 0));
      work.push_back(comm_->send_async(grad[static_cast<size_t>(i)], 0, 1));
    }
  }
  for (auto& w : work) w->wait();
  for (int i = 0; i < m; ++i) {
    const Tensor& got = rank_ == 0 ? grad[static_cast<size_t>(i)] : act[static_cast<size_t>(i)];
    const int from = 1 - rank_;
    const Tensor h = to_host(got);
    int64_t wrong = 0;
    for (int64_t k = 0; k < n; k += 997) wrong += get(h, k) != contribution(DType::F32, from, i + k);
    EXPECT_EQ(wrong, 0) << "message " << i;
  }
}

TEST_P(DeviceComm, ManyAsyncOpsWaitedInAnyOrder) {
  std::vector<Tensor> tensors;
  std::vector<WorkPtr> work;
  for (int k = 0; k < 8; ++k) {
    tensors.push_back(filled(DType::F32, 4096 + k, rank_, device_here_, k));
    work.push_back(comm_->all_reduce_async(tensors.back(), ReduceOp::Sum));
  }
  for (int k = 7; k >= 0; --k) work[static_cast<size_t>(k)]->wait();
  for (int k = 0; k < 8; ++k)
    EXPECT_EQ(count_wrong_on_device(tensors[static_cast<size_t>(k)],
                                    [&](int64_t i) { return reference_sum(DType::F32, size_, k, i); }),
              0)
        << "op " << k;
}

TEST_P(DeviceComm, TestPollsUntilComplete) {
  Tensor t = filled(DType::F32, 1 << 20, rank_, device_here_);
  WorkPtr w = comm_->all_reduce_async(t, ReduceOp::Sum);
  while (!w->test()) comm_->progress();
  EXPECT_TRUE(w->test());
  EXPECT_EQ(count_wrong_on_device(t, [&](int64_t i) { return reference_sum(DType::F32, size_, 0, i); }), 0);
}

TEST_P(DeviceComm, SeesWhatTheComputeStreamWroteJustBefore) {
  // A fill kernel queued on the compute stream right before the all-reduce, no synchronisation:
  // the operation must start after it (64 Mi elements make a race visible).
  const int64_t n = int64_t{1} << 26;
  Tensor t = Tensor::empty({n}, DType::F32, device_here_);
  ops::fill(t, 0.0f);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  ops::fill(t, static_cast<float>(rank_ + 1));
  comm_->all_reduce(t, ReduceOp::Sum);
  ops::scale(t, 2.0f);  // a kernel after wait(): must see the reduced values
  const double want = 2.0 * size_ * (size_ + 1) / 2;
  const Tensor h = to_host(t);
  int64_t wrong = 0;
  for (int64_t i = 0; i < n; i += 4099) wrong += h.data<float>()[i] != want;
  EXPECT_EQ(h.data<float>()[n - 1], want);
  EXPECT_EQ(wrong, 0);
}

TEST_P(DeviceComm, DroppedHandleStillDelivers) {
  Tensor t = filled(DType::F32, 100000, rank_, device_here_);
  comm_->all_reduce_async(t, ReduceOp::Sum).reset();
  EXPECT_EQ(count_wrong_on_device(t, [&](int64_t i) { return reference_sum(DType::F32, size_, 0, i); }), 0);
}

TEST_P(DeviceComm, HostTensorsStillWork) {
  // Norms and metrics: all_reduce_sum allocates host tensors (an NcclCommunicator hands them
  // to its MPI side).
  std::vector<double> values{1.0 + rank_, 0.5};
  all_reduce_sum(*comm_, values);
  EXPECT_EQ(values[0], size_ * (size_ + 1) / 2.0);
  EXPECT_EQ(values[1], 0.5 * size_);
  Tensor h = Tensor::empty({3}, DType::I32);
  for (int i = 0; i < 3; ++i) h.data<int32_t>()[i] = rank_ + i;
  comm_->all_reduce(h, ReduceOp::Sum);
  EXPECT_EQ(h.data<int32_t>()[2], size_ * (size_ - 1) / 2 + 2 * size_);
}

TEST_P(DeviceComm, BytesSentFollowMpiCommunicatorsConvention) {
  const int64_t before = comm_->bytes_sent();
  Tensor t = filled(DType::F32, 1024, rank_, device_here_);
  comm_->all_reduce(t, ReduceOp::Sum);
  EXPECT_EQ(comm_->bytes_sent() - before, 4096 * 2 * (size_ - 1) / size_);
  const int64_t mid = comm_->bytes_sent();
  comm_->broadcast(t, 0);
  EXPECT_EQ(comm_->bytes_sent() - mid, rank_ == 0 && size_ > 1 ? 4096 : 0);
}

TEST_P(DeviceComm, BarrierReturnsOnEveryRank) { comm_->barrier(); }

INSTANTIATE_TEST_SUITE_P(Transports, DeviceComm, testing::Values(Transport::Mpi, Transport::Nccl), transport_label);

// With Transport::Nccl the grid's dp() and pp() are NCCL over device memory; world() and the
// mpi_*() accessors stay MPI.
TEST(NcclGrid, DpAndPpAreNcclWorldIsMpi) {
  std::string why;
  Device device;
  try {
    device = select_device(MPI_COMM_WORLD, DeviceKind::CUDA, Transport::Nccl);
  } catch (const Error& e) {
    why = e.message();
  }
  why = agreed(why);
  if (!why.empty()) GTEST_SKIP() << "no GPU for every rank (" << why << ")";
  ProcessGrid grid(MPI_COMM_WORLD, 1, Transport::Nccl, device);
  EXPECT_NE(dynamic_cast<NcclCommunicator*>(&grid.dp()), nullptr);
  EXPECT_NE(dynamic_cast<NcclCommunicator*>(&grid.pp()), nullptr);
  EXPECT_EQ(&grid.world(), &grid.mpi_world());
  EXPECT_EQ(grid.device(), device);
  Tensor t = filled(DType::F32, 4097, grid.dp().rank(), device);
  grid.dp().all_reduce(t, ReduceOp::Sum);
  EXPECT_EQ(count_wrong_on_device(t, [&](int64_t i) { return reference_sum(DType::F32, grid.dp_size(), 0, i); }), 0);
  // The checkpoint gather's pattern: a device tensor sent over world() into host memory.
  if (world_size() > 1) {
    if (world_rank() == 1) grid.world().send(t, 0, 7);
    if (world_rank() == 0) {
      Tensor h = Tensor::empty({4097});
      grid.world().recv(h, 1, 7);
      EXPECT_EQ(h.data<float>()[5], reference_sum(DType::F32, grid.dp_size(), 0, 5));
    }
  }
}

#else

TEST(DeviceComm, SkippedInABuildWithoutCuda) { GTEST_SKIP() << "this build has no CUDA (-DSTRATA_CUDA=OFF)"; }

#endif  // STRATA_WITH_CUDA

}  // namespace
}  // namespace strata::parallel
