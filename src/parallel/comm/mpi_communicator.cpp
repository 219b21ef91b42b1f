// MpiCommunicator: Strata's collectives as MPI non-blocking calls over host memory. The MPI
// datatypes and sums of the dtypes are in mpi_types.cpp; device tensors are staged through
// pinned host memory by mpi_staging.cpp.
//
// How a started all-reduce makes progress while backward computes. Open MPI 4.1.4 runs
// MPI_Iallreduce & co. as libnbc schedules that advance only inside MPI calls. Measured with
// `mpirun -np 2 bench_collectives --overlap` on the 2-core development machine (2 ranks x 1
// compute thread, shared-memory BTL vader; compute = 192^3 GEMM chunks of ~0.1 ms, twice the
// all-reduce time, at least 10 ms; medians of 21 interleaved rounds; the machine was shared,
// so single numbers move by ~20%). exposed = total - compute alone:
//
//   f32 all-reduce, default libnbc algorithm        1 MiB     4 MiB    25 MiB
//   blocking all-reduce alone                      0.7 ms    3.0 ms   20.4 ms
//   exposed: blocking, then compute                0.4       2.1      17.6
//   exposed: async, no MPI call until wait()       0.7       2.8      22.0
//   exposed: async + progress() after each chunk   0.2       1.5      13.5   <- chosen
//   exposed: comm thread in blocking all_reduce    0.8       3.1      22.5
//   exposed: comm thread, test() + 50 us sleeps    0.5       2.3      19.0
//
// - Without progress() nothing happens until wait(): no overlap at all.
// - A communication thread that blocks in MPI spins (vader busy-polls) and steals the core
//   that compute needs: worse than not overlapping. A polite thread (MPI_Test, sleep 50 us)
//   helps less than progress() and needs MPI_THREAD_MULTIPLE (a lock on every MPI call).
// - progress() hides 35-55% of the all-reduce. Not more, because with both cores computing,
//   the copies and reductions of the shared-memory transport are CPU work that cannot hide;
//   only the waiting for the other rank can.
// Decision: no thread; the trainer calls progress() between layers (MPI_THREAD_FUNNELED stays).
//
// The algorithm matters more than overlap here: libnbc's ring all-reduce
// (OMPI_MCA_coll_libnbc_iallreduce_algorithm=1) takes the 25 MiB all-reduce from ~20 ms to
// ~7.8 ms and is 1.4-3.8x faster from 4 KiB to 256 MiB on 2 ranks, so MpiRuntime selects it
// unless the environment already chose. With ring, progress() hides less (4-10% at 4-25 MiB:
// the ring's copies are the CPU work that cannot hide) but still more than a thread.
#include "parallel/comm/mpi_communicator.hpp"

#include <sched.h>

#include <algorithm>
#include <climits>
#include <cstdio>
#include <cstring>
#include <functional>
#include <utility>

#include "core/log.hpp"
#include "parallel/comm/mpi_staging.hpp"
#include "parallel/comm/mpi_types.hpp"
#include "parallel/comm/shared_memory.hpp"
#include "parallel/runtime/mpi.hpp"
#include "parallel/runtime/watchdog.hpp"

namespace strata::parallel {

void all_reduce_sum(Communicator& comm, std::vector<double>& values) {
  const int n = comm.size();
  if (n == 1 || values.empty()) return;
  const int64_t bytes = static_cast<int64_t>(values.size() * sizeof(double));
  const Tensor all = Tensor::empty({n * bytes}, DType::U8);
  const Tensor mine = all.view(comm.rank() * bytes, {bytes});
  std::memcpy(mine.raw(), values.data(), static_cast<size_t>(bytes));
  comm.all_gather(mine, all);  // in place: this rank's chunk is already in `all`
  const auto* rows = static_cast<const double*>(all.raw());
  for (size_t i = 0; i < values.size(); ++i) {
    double sum = 0;
    for (int r = 0; r < n; ++r) sum += rows[static_cast<size_t>(r) * values.size() + i];
    values[i] = sum;
  }
}

// One started operation. The tensors are kept alive until MPI is done with their memory;
// `finish` (e.g. the 1/size scaling of Avg) runs once, after completion, on the caller's thread.
// Device tensors are staged through pinned host memory (mpi_staging.hpp); their results are
// copied back after `finish`.
struct MpiOpState {
  MPI_Request request = MPI_REQUEST_NULL;  // MPI_REQUEST_NULL once complete
  std::vector<Tensor> buffers;
  std::function<void()> finish;
  bool finished = false;
  std::string what;  // "all_reduce on dp", for errors
  DeviceStaging staging;
};

namespace {

// An MPI error on this communicator, naming the operation and the communicator.
void check_mpi(int rc, const char* call, const std::string& what) {
  if (rc != MPI_SUCCESS) [[unlikely]]
    STRATA_THROW(what, ": ", mpi_error_string(call, rc));
}

// The 1/size scaling of Avg, applied to the host memory MPI wrote for t.
std::function<void()> scale_after(const Tensor& t, void* host, int size) {
  return
      [host, dtype = t.dtype(), n = t.numel(), f = 1.0f / static_cast<float>(size)] { scale_host(host, dtype, n, f); };
}

int count_of(const Tensor& t) {
  STRATA_CHECK(t.defined(), "collective on an undefined tensor");
#if STRATA_WITH_CUDA
  STRATA_CHECK(t.device().is_cpu() || t.device().is_cuda(), "MpiCommunicator got a tensor on ", t.device().str());
#else
  STRATA_CHECK(t.device().is_cpu(), "MpiCommunicator moves host memory; got a tensor on ", t.device().str());
#endif
  STRATA_CHECK(t.numel() <= INT_MAX, t.str(), " has more elements than one MPI call takes");
  return static_cast<int>(t.numel());
}

bool overlaps(const Tensor& a, const Tensor& b) {
  const char* pa = static_cast<const char*>(a.raw());
  const char* pb = static_cast<const char*>(b.raw());
  return pa < pb + b.nbytes() && pb < pa + a.nbytes() && a.nbytes() > 0 && b.nbytes() > 0;
}

class MpiWork final : public Work {
 public:
  explicit MpiWork(std::shared_ptr<MpiOpState> state) : state_(std::move(state)) {}
  // A handle dropped before completion still waits: MPI must be done with the buffers'
  // memory before anything else may reuse it. A staged operation also delivers its result to
  // the device, as MPI would have to host memory. Never throws.
  ~MpiWork() override {
    for (int done = 0; state_->request != MPI_REQUEST_NULL && !done;) {
      if (MPI_Test(&state_->request, &done, MPI_STATUS_IGNORE) != MPI_SUCCESS) break;
      watchdog::poll();
    }
    if (!state_->finished && state_->staging.any()) {
      try {
        finish();
      } catch (const std::exception& e) {
        std::fprintf(stderr, "[rank %d] %s: %s (ignored in a destructor)\n", process_rank(), state_->what.c_str(),
                     e.what());
      }
    }
  }

  // MPI_Test in a loop rather than MPI_Wait (which spins the same way inside Open MPI), so the
  // watchdog sees the deadline pass; after a while it gives the core away, as the shared-memory
  // waits do (ranks may outnumber cores).
  void wait() override {
    uint64_t spins = 0;
    for (int done = 0; state_->request != MPI_REQUEST_NULL && !done;) {
      check_mpi(MPI_Test(&state_->request, &done, MPI_STATUS_IGNORE), "MPI_Test", state_->what);
      watchdog::poll();
      if (++spins > 2000) sched_yield();
    }
    finish();
  }

  bool test() override {
    if (state_->request != MPI_REQUEST_NULL) {
      int done = 0;
      check_mpi(MPI_Test(&state_->request, &done, MPI_STATUS_IGNORE), "MPI_Test", state_->what);
      if (!done) return false;
    }
    finish();
    return true;
  }

 private:
  void finish() {
    if (state_->finished) return;
    state_->finished = true;
    if (state_->finish) state_->finish();
    state_->staging.copy_back();
    state_->buffers.clear();
  }

  std::shared_ptr<MpiOpState> state_;
};

// Records an operation in the flight recorder and runs its waits under the watchdog's deadline.
class WatchedWork final : public Work {
 public:
  WatchedWork(WorkPtr inner, uint64_t seq) : inner_(std::move(inner)), seq_(seq) {}
  ~WatchedWork() override {
    if (!done_) {
      watchdog::Wait deadline(seq_);
      inner_.reset();  // waits for completion
    }
    watchdog::completed(seq_);
  }
  void wait() override {
    if (done_) return;
    watchdog::Wait deadline(seq_);
    inner_->wait();
    done_ = true;
    watchdog::completed(seq_);
  }
  bool test() override {
    if (!done_ && inner_->test()) {
      done_ = true;
      watchdog::completed(seq_);
    }
    return done_;
  }

 private:
  WorkPtr inner_;
  uint64_t seq_;
  bool done_ = false;
};

}  // namespace

WorkPtr MpiCommunicator::watched(WorkPtr work, uint64_t seq) {
  return std::make_unique<WatchedWork>(std::move(work), seq);
}

MpiCommunicator::MpiCommunicator(MPI_Comm comm, std::string name, bool shared_memory)
    : name_(std::move(name)), use_shared_memory_(shared_memory) {
  MPI_CHECK(MPI_Comm_dup(comm, &comm_));
  MPI_CHECK(MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN));
  MPI_CHECK(MPI_Comm_set_name(comm_, name_.c_str()));
  MPI_CHECK(MPI_Comm_rank(comm_, &rank_));
  MPI_CHECK(MPI_Comm_size(comm_, &size_));
  channel_ = watchdog::open_channel(comm_, name_);
  create_half_types();  // created here, after MPI_Init, on the thread that calls MPI
}

MpiCommunicator::~MpiCommunicator() {
  shared_.reset();  // completes its operations
  for (auto& state : pending_)
    if (state->request != MPI_REQUEST_NULL) MPI_Wait(&state->request, MPI_STATUS_IGNORE);
  if (comm_ != MPI_COMM_NULL) MPI_Comm_free(&comm_);
}

void MpiCommunicator::count_sent(size_t bytes, int numerator, int denominator) {
  bytes_sent_ += static_cast<int64_t>(bytes) * numerator / denominator;
}

WorkPtr MpiCommunicator::track(std::shared_ptr<MpiOpState> state) {
  std::erase_if(pending_, [](const auto& s) { return s->request == MPI_REQUEST_NULL; });
  pending_.push_back(state);
  return std::make_unique<MpiWork>(std::move(state));
}

NodeSharedMemory* MpiCommunicator::node_group() {
  if (!use_shared_memory_ || size_ < 2) return nullptr;
  if (!shared_checked_) shared_ = NodeSharedMemory::create(comm_);
  shared_checked_ = true;
  return shared_.get();
}

bool MpiCommunicator::node_local() {
  if (shared_checked_) return shared_ != nullptr;
  if (one_node_ < 0) one_node_ = use_shared_memory_ && NodeSharedMemory::one_node(comm_);
  return one_node_ == 1;
}

Tensor MpiCommunicator::allocate(int64_t numel, DType dtype, Device device) {
  if (NodeSharedMemory* group = device.is_cpu() ? node_group() : nullptr) {
    std::string why_not;
    Tensor t = group->allocate(numel, dtype, why_not);
    if (t.defined()) return t;
    if (rank_ == 0)
      log::warn(name_, ": ", why_not, "; the buffer is ordinary memory and its all-reduce goes through MPI");
  }
  return Tensor::zeros({numel}, dtype, device);
}

bool MpiCommunicator::in_shared_memory(const Tensor& t) const { return shared_ && shared_->holds(t); }

void MpiCommunicator::reserve_messages(int64_t max_bytes, int slots) {
  std::string why_not;
  if (NodeSharedMemory* group = node_group(); group && !group->enable_messages(max_bytes, slots, why_not) && rank_ == 0)
    log::warn(name_, ": ", why_not, "; point-to-point messages go through MPI");
}

WorkPtr MpiCommunicator::all_reduce_async(const Tensor& t, ReduceOp op) {
  const uint64_t seq = watchdog::started(channel_, op == ReduceOp::Avg ? "all_reduce avg" : "all_reduce sum",
                                         t.nbytes(), t.dtype(), -1, true);
  if (shared_) {
    if (WorkPtr work = shared_->all_reduce_async(t, op == ReduceOp::Avg)) {
      count_sent(t.nbytes(), 2 * (size_ - 1), size_);  // what the ring would send: one convention
      return watched(std::move(work), seq);
    }
  }
  const int count = count_of(t);
  auto state = std::make_shared<MpiOpState>();
  state->what = "all_reduce on " + name_;
  state->buffers = {t};
  const MPI_Op mpi_op = mpi_sum(t.dtype(), op);
  void* data = state->staging.host_memory(t, /*copy_in=*/true, /*copy_out=*/true);
  if (op == ReduceOp::Avg) state->finish = scale_after(t, data, size_);
  count_sent(t.nbytes(), 2 * (size_ - 1), size_);
  state->staging.wait_for_copies_in();
  check_mpi(MPI_Iallreduce(MPI_IN_PLACE, data, count, mpi_type(t.dtype()), mpi_op, comm_, &state->request),
            "MPI_Iallreduce", state->what);
  return watched(track(std::move(state)), seq);
}

WorkPtr MpiCommunicator::reduce_scatter_async(const Tensor& in, const Tensor& out, ReduceOp op) {
  const uint64_t seq = watchdog::started(channel_, op == ReduceOp::Avg ? "reduce_scatter avg" : "reduce_scatter sum",
                                         in.nbytes(), in.dtype(), -1, true);
  const int count = count_of(out);
  count_of(in);
  STRATA_CHECK(in.dtype() == out.dtype(), "reduce_scatter of ", in.str(), " into ", out.str());
  STRATA_CHECK(in.numel() == out.numel() * size_, "reduce_scatter on ", name_, " (", size_, " ranks) of ", in.str(),
               " into ", out.str());
  STRATA_CHECK(!overlaps(in, out), "reduce_scatter needs separate input and output buffers");
  auto state = std::make_shared<MpiOpState>();
  state->what = "reduce_scatter on " + name_;
  state->buffers = {in, out};
  const MPI_Op mpi_op = mpi_sum(out.dtype(), op);
  void* send = state->staging.host_memory(in, /*copy_in=*/true, /*copy_out=*/false);
  void* recv = state->staging.host_memory(out, /*copy_in=*/false, /*copy_out=*/true);
  if (op == ReduceOp::Avg) state->finish = scale_after(out, recv, size_);
  count_sent(in.nbytes(), size_ - 1, size_);
  state->staging.wait_for_copies_in();
  check_mpi(MPI_Ireduce_scatter_block(send, recv, count, mpi_type(out.dtype()), mpi_op, comm_, &state->request),
            "MPI_Ireduce_scatter_block", state->what);
  return watched(track(std::move(state)), seq);
}

WorkPtr MpiCommunicator::all_gather_async(const Tensor& in, const Tensor& out) {
  const uint64_t seq = watchdog::started(channel_, "all_gather", in.nbytes(), in.dtype(), -1, true);
  const int count = count_of(in);
  count_of(out);
  STRATA_CHECK(in.dtype() == out.dtype(), "all_gather of ", in.str(), " into ", out.str());
  STRATA_CHECK(out.numel() == in.numel() * size_, "all_gather on ", name_, " (", size_, " ranks) of ", in.str(),
               " into ", out.str());
  // In place when `in` is exactly this rank's chunk of `out` (ZeRO gathers parameter shards so).
  const char* my_chunk = static_cast<const char*>(out.raw()) + static_cast<size_t>(rank_) * in.nbytes();
  const bool in_place = in.raw() == my_chunk;
  STRATA_CHECK(in_place || !overlaps(in, out), "all_gather input overlaps the output other than as chunk ", rank_);
  if (shared_ && in_place) {
    if (WorkPtr work = shared_->all_gather_async(in, out)) {
      count_sent(out.nbytes(), size_ - 1, size_);  // what MPI's ring would send
      return watched(std::move(work), seq);
    }
  }
  auto state = std::make_shared<MpiOpState>();
  state->what = "all_gather on " + name_;
  state->buffers = {in, out};
  const MPI_Datatype type = mpi_type(in.dtype());
  void* recv = state->staging.host_memory(out, /*copy_in=*/false, /*copy_out=*/true);
  void* send = MPI_IN_PLACE;
  if (!in_place)
    send = state->staging.host_memory(in, /*copy_in=*/true, /*copy_out=*/false);
  else if (recv != out.raw())  // staged in place: only this rank's chunk needs to reach the host
    state->staging.stage_part(in, static_cast<char*>(recv) + static_cast<size_t>(rank_) * in.nbytes());
  count_sent(out.nbytes(), size_ - 1, size_);
  state->staging.wait_for_copies_in();
  check_mpi(MPI_Iallgather(send, count, type, recv, count, type, comm_, &state->request), "MPI_Iallgather",
            state->what);
  return watched(track(std::move(state)), seq);
}

WorkPtr MpiCommunicator::reduce_async(const Tensor& t, int root, ReduceOp op) {
  const uint64_t seq =
      watchdog::started(channel_, op == ReduceOp::Avg ? "reduce avg" : "reduce sum", t.nbytes(), t.dtype(), root, true);
  STRATA_CHECK(root >= 0 && root < size_, "reduce root ", root, " outside ", name_, " of ", size_, " ranks");
  if (shared_) {
    if (WorkPtr work = shared_->reduce_async(t, root, op == ReduceOp::Avg)) {
      if (rank_ != root) count_sent(t.nbytes(), 1, 1);
      return watched(std::move(work), seq);
    }
  }
  const int count = count_of(t);
  auto state = std::make_shared<MpiOpState>();
  state->what = "reduce on " + name_;
  state->buffers = {t};
  const MPI_Op mpi_op = mpi_sum(t.dtype(), op);
  const bool is_root = rank_ == root;
  void* data = state->staging.host_memory(t, /*copy_in=*/true, /*copy_out=*/is_root);
  // Only the root receives the result, so only it scales for Avg.
  if (op == ReduceOp::Avg && is_root) state->finish = scale_after(t, data, size_);
  if (!is_root) count_sent(t.nbytes(), 1, 1);
  state->staging.wait_for_copies_in();
  // MPI_IN_PLACE is legal only on the root; elsewhere t is the send buffer and no receive
  // buffer is used.
  check_mpi(MPI_Ireduce(is_root ? MPI_IN_PLACE : data, is_root ? data : nullptr, count, mpi_type(t.dtype()), mpi_op,
                        root, comm_, &state->request),
            "MPI_Ireduce", state->what);
  return watched(track(std::move(state)), seq);
}

WorkPtr MpiCommunicator::broadcast_async(const Tensor& t, int root) {
  const uint64_t seq = watchdog::started(channel_, "broadcast", t.nbytes(), t.dtype(), root, true);
  const int count = count_of(t);
  STRATA_CHECK(root >= 0 && root < size_, "broadcast root ", root, " outside ", name_, " of ", size_, " ranks");
  auto state = std::make_shared<MpiOpState>();
  state->what = "broadcast on " + name_;
  state->buffers = {t};
  if (rank_ == root) count_sent(t.nbytes(), size_ > 1 ? 1 : 0, 1);
  void* data = state->staging.host_memory(t, /*copy_in=*/rank_ == root, /*copy_out=*/rank_ != root);
  state->staging.wait_for_copies_in();
  check_mpi(MPI_Ibcast(data, count, mpi_type(t.dtype()), root, comm_, &state->request), "MPI_Ibcast", state->what);
  return watched(track(std::move(state)), seq);
}

WorkPtr MpiCommunicator::send_async(const Tensor& t, int peer, int tag) {
  const uint64_t seq = watchdog::started(channel_, "send", t.nbytes(), t.dtype(), peer, false, tag);
  const int count = count_of(t);
  STRATA_CHECK(peer >= 0 && peer < size_, "send to rank ", peer, " outside ", name_, " of ", size_, " ranks");
  STRATA_CHECK(tag >= 0, "send with negative tag ", tag);
  if (shared_) {
    if (WorkPtr work = shared_->send_async(t, peer, tag)) {
      count_sent(t.nbytes(), 1, 1);
      return watched(std::move(work), seq);
    }
  }
  auto state = std::make_shared<MpiOpState>();
  state->what = strata::detail::cat("send to ", peer, " on ", name_);
  state->buffers = {t};
  count_sent(t.nbytes(), 1, 1);
  void* data = state->staging.host_memory(t, /*copy_in=*/true, /*copy_out=*/false);
  state->staging.wait_for_copies_in();
  check_mpi(MPI_Isend(data, count, mpi_type(t.dtype()), peer, tag, comm_, &state->request), "MPI_Isend", state->what);
  return watched(track(std::move(state)), seq);
}

WorkPtr MpiCommunicator::recv_async(const Tensor& t, int peer, int tag) {
  const uint64_t seq = watchdog::started(channel_, "recv", t.nbytes(), t.dtype(), peer, false, tag);
  const int count = count_of(t);
  STRATA_CHECK(peer >= 0 && peer < size_, "recv from rank ", peer, " outside ", name_, " of ", size_, " ranks");
  STRATA_CHECK(tag >= 0, "recv with negative tag ", tag);
  if (shared_) {
    if (WorkPtr work = shared_->recv_async(t, peer, tag)) return watched(std::move(work), seq);
  }
  auto state = std::make_shared<MpiOpState>();
  state->what = strata::detail::cat("recv from ", peer, " on ", name_);
  state->buffers = {t};
  void* data = state->staging.host_memory(t, /*copy_in=*/false, /*copy_out=*/true);
  check_mpi(MPI_Irecv(data, count, mpi_type(t.dtype()), peer, tag, comm_, &state->request), "MPI_Irecv", state->what);
  return watched(track(std::move(state)), seq);
}

WorkPtr MpiCommunicator::barrier_async() {
  const uint64_t seq = watchdog::started(channel_, "barrier", 0, DType::U8, -1, true);
  auto state = std::make_shared<MpiOpState>();
  state->what = "barrier on " + name_;
  check_mpi(MPI_Ibarrier(comm_, &state->request), "MPI_Ibarrier", state->what);
  return watched(track(std::move(state)), seq);
}

void MpiCommunicator::progress() {
  if (shared_) shared_->progress();
  std::erase_if(pending_, [](const auto& s) { return s->request == MPI_REQUEST_NULL; });
  if (pending_.empty()) return;
  // One MPI_Testsome over all outstanding requests: a single trip through Open MPI's progress
  // engine (libnbc schedules and the shared-memory transport), and completed requests are
  // retired (set to MPI_REQUEST_NULL) so their Work's wait() returns at once.
  std::vector<MPI_Request> requests;
  requests.reserve(pending_.size());
  for (const auto& s : pending_) requests.push_back(s->request);
  std::vector<int> indices(requests.size());
  int completed = 0;
  check_mpi(
      MPI_Testsome(static_cast<int>(requests.size()), requests.data(), &completed, indices.data(), MPI_STATUSES_IGNORE),
      "MPI_Testsome", "progress on " + name_);
  if (completed == MPI_UNDEFINED) return;
  for (int i = 0; i < completed; ++i) pending_[indices[i]]->request = MPI_REQUEST_NULL;
}

int MpiCommunicator::in_flight() const {
  return static_cast<int>(std::count_if(pending_.begin(), pending_.end(),
                                        [](const auto& s) { return s->request != MPI_REQUEST_NULL; })) +
         (shared_ ? shared_->in_flight() : 0);
}

}  // namespace strata::parallel
