// NcclCommunicator: Strata's collectives as NCCL calls on a communication stream per
// communicator, ordered against the device's compute stream with events (see the header).
#include "parallel/comm/nccl_communicator.hpp"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <exception>
#include <mutex>
#include <string>
#include <thread>
#include <utility>

#include "core/cuda/check.hpp"
#include "core/cuda/runtime.hpp"
#include "parallel/runtime/mpi.hpp"
#include "parallel/runtime/watchdog.hpp"

namespace strata::parallel {

void CudaStreamDeleter::operator()(cudaStream_t stream) const noexcept {
  if (stream) CUDA_CHECK_NOTHROW(cudaStreamDestroy(stream));
}

void CudaEventDeleter::operator()(cudaEvent_t event) const noexcept {
  if (event) CUDA_CHECK_NOTHROW(cudaEventDestroy(event));
}

NcclComm& NcclComm::operator=(NcclComm&& other) noexcept {
  if (this != &other) {
    reset();
    comm_ = other.comm_;
    other.comm_ = nullptr;
  }
  return *this;
}

void NcclComm::abort() noexcept {
  if (comm_ == nullptr) return;
  NCCL_CHECK_NOTHROW(ncclCommAbort(comm_));
  comm_ = nullptr;
}

void NcclComm::reset() noexcept {
  if (comm_ == nullptr) return;
  ncclResult_t async = ncclSuccess;
  const bool failed = ncclCommGetAsyncError(comm_, &async) != ncclSuccess || async != ncclSuccess;
  // During unwinding a peer may have failed mid-collective; destroy would flush and wait for it.
  if (failed || std::uncaught_exceptions() > 0) return abort();
  NCCL_CHECK_NOTHROW(ncclCommDestroy(comm_));
  comm_ = nullptr;
}

// One started operation. `tensors` keep their storage alive until the compute stream is
// ordered after the operation (see "Memory" in the header).
struct NcclOpState {
  int device = 0;
  CudaEventPtr done;
  std::vector<Tensor> tensors;
  bool joined = false;  // the compute stream waits for `done`; tensors released
  std::string what;     // "all_reduce on dp", for errors
};

namespace {

bool is_float(DType t) { return t == DType::F32 || t == DType::BF16 || t == DType::F16; }

ncclDataType_t nccl_type(DType t) {
  switch (t) {
    case DType::F32:
      return ncclFloat32;
    case DType::BF16:
      return ncclBfloat16;
    case DType::F16:
      return ncclFloat16;
    case DType::I32:
      return ncclInt32;
    case DType::U8:
      return ncclUint8;
  }
  STRATA_THROW("unknown dtype ", static_cast<int>(t));
}

ncclRedOp_t nccl_op(DType t, ReduceOp op) {
  STRATA_CHECK(op == ReduceOp::Sum || is_float(t), "ReduceOp::Avg needs a float dtype, got ", dtype_name(t));
  return op == ReduceOp::Avg ? ncclAvg : ncclSum;
}

void check_nccl(ncclResult_t rc, const char* call, const std::string& what) {
  if (rc != ncclSuccess) [[unlikely]]
    STRATA_THROW(what, ": ", call, " failed: ", ncclGetErrorString(rc), " (", ncclGetLastError(nullptr), ")");
}

bool overlaps(const Tensor& a, const Tensor& b) {
  const char* pa = static_cast<const char*>(a.raw());
  const char* pb = static_cast<const char*>(b.raw());
  return pa < pb + b.nbytes() && pb < pa + a.nbytes() && a.nbytes() > 0 && b.nbytes() > 0;
}

// Orders the compute stream after the operation, then lets its tensors go.
void join(NcclOpState& s) {
  if (s.joined) return;
  CUDA_CHECK(cudaStreamWaitEvent(cuda::compute_stream(s.device), s.done.get(), 0));
  s.joined = true;
  s.tensors.clear();
}

class NcclWork final : public Work {
 public:
  explicit NcclWork(std::shared_ptr<NcclOpState> state) : state_(std::move(state)) {}
  // A dropped handle still orders the compute stream after the operation, so the memory of
  // its tensors is not reused while NCCL uses it. Never throws.
  ~NcclWork() override {
    if (state_->joined) return;
    try {
      join(*state_);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "[rank %d] %s: %s (ignored in a destructor)\n", process_rank(), state_->what.c_str(),
                   e.what());
    }
  }

  // No host block: kernels started after this see the result.
  void wait() override { join(*state_); }

  bool test() override {
    if (state_->joined) return true;
    const cudaError_t rc = cudaEventQuery(state_->done.get());
    if (rc == cudaErrorNotReady) return false;
    CUDA_CHECK(rc);
    join(*state_);
    return true;
  }

 private:
  std::shared_ptr<NcclOpState> state_;
};

// NCCL's waits do not block the host (they order streams); a stopped peer shows up later as a
// host blocked in a copy or a synchronisation that no deadline covers. So, as PyTorch's
// ProcessGroupNCCL watchdog, a thread polls the operations in flight every 100 ms: an operation
// whose NCCL communicator reports an asynchronous error (ncclCommGetAsyncError), or which is not
// complete by its deadline (watchdog::timeout() when it started), is reported in one line, its
// communicator aborted (ncclCommAbort frees the spinning kernels) and the job aborted (exit 5).
class NcclWatchdog {
 public:
  static NcclWatchdog& get() {
    static NcclWatchdog w;
    return w;
  }
  void add(std::shared_ptr<NcclOpState> op, ncclComm_t comm, const void* owner) {
    const auto deadline = watchdog::Clock::now() + std::chrono::duration_cast<watchdog::Clock::duration>(
                                                       std::chrono::duration<double>(watchdog::timeout()));
    const std::lock_guard lock(mutex_);
    entries_.push_back({std::move(op), comm, owner, watchdog::Clock::now(), deadline});
  }
  // The communicator `owner` goes: its operations are no longer watched.
  void forget(const void* owner) {
    const std::lock_guard lock(mutex_);
    std::erase_if(entries_, [owner](const Entry& e) { return e.owner == owner; });
  }

 private:
  struct Entry {
    std::shared_ptr<NcclOpState> op;
    ncclComm_t comm;
    const void* owner;
    watchdog::Clock::time_point start, deadline;
  };
  NcclWatchdog() : thread_([this] { run(); }) {}
  ~NcclWatchdog() {
    {
      const std::lock_guard lock(mutex_);
      stop_ = true;
    }
    wake_.notify_all();
    thread_.join();
  }
  void run() {
    std::unique_lock lock(mutex_);
    while (!wake_.wait_for(lock, std::chrono::milliseconds(100), [this] { return stop_; })) {
      const auto now = watchdog::Clock::now();
      std::erase_if(entries_, [&](const Entry& e) {
        cudaSetDevice(e.op->device);
        const cudaError_t rc = cudaEventQuery(e.op->done.get());
        if (rc == cudaSuccess) return true;
        ncclResult_t async = ncclSuccess;
        ncclCommGetAsyncError(e.comm, &async);
        if (async != ncclSuccess && async != ncclInProgress)
          fail(e, detail::cat("NCCL error ", ncclGetErrorString(async)));
        else if (rc != cudaErrorNotReady)
          fail(e, detail::cat("CUDA error ", cudaGetErrorString(rc)));
        else if (now >= e.deadline)
          fail(e, detail::cat("not complete after ", std::chrono::duration<double>(now - e.start).count(),
                              " s (--timeout ", watchdog::timeout(), ")"));
        return false;
      });
    }
  }
  [[noreturn]] static void fail(const Entry& e, const std::string& why) {
    std::fprintf(stderr, "[rank %d] watchdog: %s (NCCL) %s; aborting the job\n", process_rank(), e.op->what.c_str(),
                 why.c_str());
    std::fflush(stderr);
    ncclCommAbort(e.comm);  // the kernels waiting for the peer return
    MPI_Abort(MPI_COMM_WORLD, kExitTimeout);
    _exit(kExitTimeout);
  }

  std::mutex mutex_;
  std::condition_variable wake_;
  std::vector<Entry> entries_;
  bool stop_ = false;
  std::thread thread_;  // last: starts once the rest exists
};

}  // namespace

NcclCommunicator::NcclCommunicator(MPI_Comm comm, std::string name, Device device, bool p2p)
    : host_(std::make_unique<MpiCommunicator>(comm, std::move(name))), device_(device) {
  STRATA_CHECK(device.is_cuda(), "NcclCommunicator ", host_->name(), " needs a CUDA device, got ", device.str());
  cuda::DeviceGuard guard(device.index);
  cuda::compute_stream(device.index);  // the device's context exists before NCCL's
  // One lane for collectives; two more for point-to-point (see the header) when the group has
  // peers to send to.
  const size_t lanes = p2p && size() > 1 ? 3 : 1;
  // Rank 0 makes the ids and sends them with its outcome, so a failure there fails every rank
  // here instead of leaving them waiting in ncclCommInitRank.
  struct {
    ncclUniqueId ids[3];
    int ok;
  } hello{};
  if (rank() == 0) {
    hello.ok = 1;
    for (size_t i = 0; i < lanes; ++i)
      if (ncclGetUniqueId(&hello.ids[i]) != ncclSuccess) hello.ok = 0;
  }
  MPI_CHECK(MPI_Bcast(&hello, sizeof hello, MPI_BYTE, 0, host_->comm()));
  STRATA_CHECK(hello.ok == 1, "ncclGetUniqueId failed on rank 0 of ", host_->name(), ": ", ncclGetLastError(nullptr));
  lanes_.resize(lanes);
  for (size_t i = 0; i < lanes; ++i) {  // the same order on every rank
    ncclComm_t raw = nullptr;
    check_nccl(ncclCommInitRank(&raw, size(), hello.ids[i], rank()), "ncclCommInitRank", "creating " + host_->name());
    lanes_[i].comm = NcclComm(raw);
    cudaStream_t stream = nullptr;
    CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    lanes_[i].stream.reset(stream);
  }
  cudaEvent_t event = nullptr;
  CUDA_CHECK(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
  compute_ready_.reset(event);
}

NcclCommunicator::~NcclCommunicator() {
  NcclWatchdog::get().forget(this);
  // Normal end: let the operations in flight finish, then destroy (the lanes' NcclComm). During
  // unwinding NcclComm aborts instead (a failed peer would make this wait forever).
  if (std::uncaught_exceptions() > 0 || lanes_.empty()) return;
  int previous = 0;
  CUDA_CHECK_NOTHROW(cudaGetDevice(&previous));
  CUDA_CHECK_NOTHROW(cudaSetDevice(device_.index));
  for (const Lane& lane : lanes_)
    if (lane.stream) CUDA_CHECK_NOTHROW(cudaStreamSynchronize(lane.stream.get()));
  CUDA_CHECK_NOTHROW(cudaSetDevice(previous));
}

void NcclCommunicator::count_sent(size_t bytes, int numerator, int denominator) {
  bytes_sent_ += static_cast<int64_t>(bytes) * numerator / denominator;
}

void NcclCommunicator::check_tensor(const Tensor& t, const char* op) const {
  STRATA_CHECK(t.defined(), op, " on ", name(), " of an undefined tensor");
  STRATA_CHECK(t.device() == device_, op, " on ", name(), " (NCCL on ", device_.str(), ") of a tensor on ",
               t.device().str());
}

size_t NcclCommunicator::p2p_lane(int peer, bool sending) const {
  if (lanes_.size() == 1) return kCollectives;
  // A message from a lower to a higher rank travels up, on both its ends.
  const bool up = sending ? peer > rank() : peer < rank();
  return up ? kUp : kDown;
}

template <class Launch>
WorkPtr NcclCommunicator::start(size_t lane, std::string what, std::vector<Tensor> tensors, Launch&& launch) {
  cuda::DeviceGuard guard(device_.index);
  auto state = std::make_shared<NcclOpState>();
  state->device = device_.index;
  state->what = std::move(what);
  // Nothing to move (every rank passes the same sizes): complete at once, without NCCL.
  if (std::all_of(tensors.begin(), tensors.end(), [](const Tensor& t) { return t.nbytes() == 0; })) {
    state->joined = true;
    return std::make_unique<NcclWork>(std::move(state));
  }
  state->tensors = std::move(tensors);
  cudaEvent_t done = nullptr;
  CUDA_CHECK(cudaEventCreateWithFlags(&done, cudaEventDisableTiming));
  state->done.reset(done);
  // The lane's stream starts after what the compute stream has queued so far (the producer of
  // the data); the event can be re-recorded at once, a wait keeps the record it saw.
  const cudaStream_t stream = lanes_[lane].stream.get();
  CUDA_CHECK(cudaEventRecord(compute_ready_.get(), cuda::compute_stream(device_.index)));
  CUDA_CHECK(cudaStreamWaitEvent(stream, compute_ready_.get(), 0));
  launch(lanes_[lane].comm.get(), stream);
  CUDA_CHECK(cudaEventRecord(done, stream));
  NcclWatchdog::get().add(state, lanes_[lane].comm.get(), this);
  return std::make_unique<NcclWork>(std::move(state));
}

WorkPtr NcclCommunicator::all_reduce_async(const Tensor& t, ReduceOp op) {
  if (t.defined() && t.device().is_cpu()) return host_->all_reduce_async(t, op);
  check_tensor(t, "all_reduce");
  const ncclRedOp_t nop = nccl_op(t.dtype(), op);
  count_sent(t.nbytes(), 2 * (size() - 1), size());
  const std::string what = "all_reduce on " + name();
  return start(kCollectives, what, {t}, [&](ncclComm_t c, cudaStream_t stream) {
    check_nccl(ncclAllReduce(t.raw(), t.raw(), static_cast<size_t>(t.numel()), nccl_type(t.dtype()), nop, c, stream),
               "ncclAllReduce", what);
  });
}

WorkPtr NcclCommunicator::reduce_scatter_async(const Tensor& in, const Tensor& out, ReduceOp op) {
  if (in.defined() && in.device().is_cpu()) return host_->reduce_scatter_async(in, out, op);
  check_tensor(in, "reduce_scatter");
  check_tensor(out, "reduce_scatter");
  STRATA_CHECK(in.dtype() == out.dtype(), "reduce_scatter of ", in.str(), " into ", out.str());
  STRATA_CHECK(in.numel() == out.numel() * size(), "reduce_scatter on ", name(), " (", size(), " ranks) of ", in.str(),
               " into ", out.str());
  STRATA_CHECK(!overlaps(in, out), "reduce_scatter needs separate input and output buffers");
  const ncclRedOp_t nop = nccl_op(out.dtype(), op);
  count_sent(in.nbytes(), size() - 1, size());
  const std::string what = "reduce_scatter on " + name();
  return start(kCollectives, what, {in, out}, [&](ncclComm_t c, cudaStream_t stream) {
    check_nccl(ncclReduceScatter(in.raw(), out.raw(), static_cast<size_t>(out.numel()), nccl_type(out.dtype()), nop, c,
                                 stream),
               "ncclReduceScatter", what);
  });
}

WorkPtr NcclCommunicator::all_gather_async(const Tensor& in, const Tensor& out) {
  if (in.defined() && in.device().is_cpu()) return host_->all_gather_async(in, out);
  check_tensor(in, "all_gather");
  check_tensor(out, "all_gather");
  STRATA_CHECK(in.dtype() == out.dtype(), "all_gather of ", in.str(), " into ", out.str());
  STRATA_CHECK(out.numel() == in.numel() * size(), "all_gather on ", name(), " (", size(), " ranks) of ", in.str(),
               " into ", out.str());
  // NCCL gathers in place when the input is exactly this rank's chunk of the output.
  const char* my_chunk = static_cast<const char*>(out.raw()) + static_cast<size_t>(rank()) * in.nbytes();
  STRATA_CHECK(in.raw() == my_chunk || !overlaps(in, out), "all_gather input overlaps the output other than as chunk ",
               rank());
  count_sent(out.nbytes(), size() - 1, size());
  const std::string what = "all_gather on " + name();
  return start(kCollectives, what, {in, out}, [&](ncclComm_t c, cudaStream_t stream) {
    check_nccl(ncclAllGather(in.raw(), out.raw(), static_cast<size_t>(in.numel()), nccl_type(in.dtype()), c, stream),
               "ncclAllGather", what);
  });
}

WorkPtr NcclCommunicator::reduce_async(const Tensor& t, int root, ReduceOp op) {
  if (t.defined() && t.device().is_cpu()) return host_->reduce_async(t, root, op);
  check_tensor(t, "reduce");
  STRATA_CHECK(root >= 0 && root < size(), "reduce root ", root, " outside ", name(), " of ", size(), " ranks");
  const ncclRedOp_t nop = nccl_op(t.dtype(), op);
  if (rank() != root) count_sent(t.nbytes(), 1, 1);
  const std::string what = "reduce on " + name();
  // In place: NCCL writes the receive buffer on the root only, so t is left unchanged elsewhere.
  return start(kCollectives, what, {t}, [&](ncclComm_t c, cudaStream_t stream) {
    check_nccl(ncclReduce(t.raw(), t.raw(), static_cast<size_t>(t.numel()), nccl_type(t.dtype()), nop, root, c, stream),
               "ncclReduce", what);
  });
}

WorkPtr NcclCommunicator::broadcast_async(const Tensor& t, int root) {
  if (t.defined() && t.device().is_cpu()) return host_->broadcast_async(t, root);
  check_tensor(t, "broadcast");
  STRATA_CHECK(root >= 0 && root < size(), "broadcast root ", root, " outside ", name(), " of ", size(), " ranks");
  if (rank() == root) count_sent(t.nbytes(), size() > 1 ? 1 : 0, 1);
  const std::string what = "broadcast on " + name();
  return start(kCollectives, what, {t}, [&](ncclComm_t c, cudaStream_t stream) {
    check_nccl(ncclBroadcast(t.raw(), t.raw(), static_cast<size_t>(t.numel()), nccl_type(t.dtype()), root, c, stream),
               "ncclBroadcast", what);
  });
}

WorkPtr NcclCommunicator::send_async(const Tensor& t, int peer, int tag) {
  if (t.defined() && t.device().is_cpu()) return host_->send_async(t, peer, tag);
  check_tensor(t, "send");
  STRATA_CHECK(peer >= 0 && peer < size() && peer != rank(), "send to rank ", peer, " on ", name(), " of ", size(),
               " ranks from rank ", rank());
  STRATA_CHECK(tag >= 0, "send with negative tag ", tag);
  count_sent(t.nbytes(), 1, 1);
  const std::string what = strata::detail::cat("send to ", peer, " on ", name());
  return start(p2p_lane(peer, /*sending=*/true), what, {t}, [&](ncclComm_t c, cudaStream_t stream) {
    check_nccl(ncclSend(t.raw(), static_cast<size_t>(t.numel()), nccl_type(t.dtype()), peer, c, stream), "ncclSend",
               what);
  });
}

WorkPtr NcclCommunicator::recv_async(const Tensor& t, int peer, int tag) {
  if (t.defined() && t.device().is_cpu()) return host_->recv_async(t, peer, tag);
  check_tensor(t, "recv");
  STRATA_CHECK(peer >= 0 && peer < size() && peer != rank(), "recv from rank ", peer, " on ", name(), " of ", size(),
               " ranks on rank ", rank());
  STRATA_CHECK(tag >= 0, "recv with negative tag ", tag);
  const std::string what = strata::detail::cat("recv from ", peer, " on ", name());
  return start(p2p_lane(peer, /*sending=*/false), what, {t}, [&](ncclComm_t c, cudaStream_t stream) {
    check_nccl(ncclRecv(t.raw(), static_cast<size_t>(t.numel()), nccl_type(t.dtype()), peer, c, stream), "ncclRecv",
               what);
  });
}

}  // namespace strata::parallel
