// NcclCommunicator: the Communicator interface over NCCL and device memory (CUDA builds only).
// The ncclUniqueId is made by rank 0 of the group and broadcast over the group's MPI
// communicator: no MASTER_ADDR, no ports.
//
// Streams. Every operation runs on a non-blocking stream of this communicator, after that
// stream has waited for an event recorded on the device's compute stream when the operation
// was started, so NCCL sees everything the kernels before it wrote (e.g. backward's
// gradients). The returned Work records an event on that stream; wait() makes the COMPUTE
// stream wait for it (cudaStreamWaitEvent: the host does not block and the device does not
// synchronise), so kernels launched afterwards see the result; test() is cudaEventQuery. A
// host that must read the result copies it with ops::copy, which synchronises the compute
// stream. Collectives run on one stream and complete in the order they were started.
//
// Memory. Tensors passed to an operation are held until its Work is waited on (or found
// complete, or dropped): the CUDA caching allocator reuses blocks in compute-stream order, and
// after wait() the compute stream is ordered after the operation, so a block is never handed
// out while NCCL still reads or writes it. Until then the caller must not touch them.
//
// Host tensors. CPU tensors (metrics, norms, counts) go through a private MpiCommunicator over
// the same ranks, so code such as all_reduce_sum() works unchanged on this communicator. All
// ranks of one collective, and both sides of a send/recv, must pass the same kind of memory;
// host operations are ordered among themselves, device operations among themselves.
//
// Send/recv. NCCL has no tags: a send matches the peer's next receive from this rank, in the
// order started (the tag is not used). An NCCL send of more than its buffer (a few MiB) does
// not finish before the peer has started the matching receive, and NCCL runs a communicator's
// operations one after the other, so with one stream two pipeline stages that each queue a
// large send to the other before their receive would wait for each other forever (MPI's
// non-blocking sends do not). With `p2p` (the default), messages to a higher rank and to a
// lower rank therefore travel on two more NCCL communicators with streams of their own:
// activations flowing up and gradients flowing down never queue behind each other, and each
// direction completes in the order started. Without `p2p` (groups that never send, such as
// the data-parallel ones) send/recv share the collectives' stream.
#pragma once

#include <cuda_runtime.h>
#include <mpi.h>
#include <nccl.h>

#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "parallel/comm/communicator.hpp"
#include "parallel/comm/mpi_communicator.hpp"

// NCCL_CHECK: a failed NCCL call becomes a strata::Error with NCCL's message and its last
// error text (ncclGetLastError); NCCL_CHECK_NOTHROW reports to stderr instead, for
// destructors.
#define NCCL_CHECK(expr)                                                                                          \
  do {                                                                                                            \
    const ncclResult_t strata_nccl_rc_ = (expr);                                                                  \
    if (strata_nccl_rc_ != ncclSuccess) [[unlikely]]                                                              \
      STRATA_THROW("NCCL error: ", ncclGetErrorString(strata_nccl_rc_), " (", ncclGetLastError(nullptr), ") in ", \
                   #expr);                                                                                        \
  } while (0)

#define NCCL_CHECK_NOTHROW(expr)                                                                                  \
  do {                                                                                                            \
    const ncclResult_t strata_nccl_rc_ = (expr);                                                                  \
    if (strata_nccl_rc_ != ncclSuccess)                                                                           \
      std::fprintf(stderr, "%s:%d [rank %d] NCCL error %s in %s (ignored in a destructor)\n", __FILE__, __LINE__, \
                   ::strata::process_rank(), ncclGetErrorString(strata_nccl_rc_), #expr);                         \
  } while (0)

namespace strata::parallel {

// Owns one ncclComm_t: destroyed normally, or aborted when an error is pending or the
// destructor runs during stack unwinding (a peer may be gone; destroy could then wait forever).
// Never throws.
class NcclComm {
 public:
  NcclComm() = default;
  explicit NcclComm(ncclComm_t comm) : comm_(comm) {}
  ~NcclComm() { reset(); }
  NcclComm(NcclComm&& other) noexcept : comm_(other.comm_) { other.comm_ = nullptr; }
  NcclComm& operator=(NcclComm&& other) noexcept;
  NcclComm(const NcclComm&) = delete;
  NcclComm& operator=(const NcclComm&) = delete;

  ncclComm_t get() const { return comm_; }
  // Aborts instead of destroying: for a communicator that may be inside a failed collective.
  void abort() noexcept;
  void reset() noexcept;

 private:
  ncclComm_t comm_ = nullptr;
};

struct NcclOpState;  // one started operation: its completion event and tensors (in the .cpp)

// Owners of a CUDA stream and event (never-throwing deleters).
struct CudaStreamDeleter {
  void operator()(cudaStream_t stream) const noexcept;
};
struct CudaEventDeleter {
  void operator()(cudaEvent_t event) const noexcept;
};
using CudaStreamPtr = std::unique_ptr<CUstream_st, CudaStreamDeleter>;
using CudaEventPtr = std::unique_ptr<CUevent_st, CudaEventDeleter>;

class NcclCommunicator final : public Communicator {
 public:
  // Collective over `comm`: duplicates it for host tensors (see MpiCommunicator), then rank 0
  // makes the NCCL ids and broadcasts them; every rank joins on `device` (one GPU per rank:
  // NCCL refuses two ranks of one communicator on the same GPU). `p2p`: see the header.
  NcclCommunicator(MPI_Comm comm, std::string name, Device device, bool p2p = true);
  // Waits for the operations in flight, then destroys the communicator; never throws.
  ~NcclCommunicator() override;
  NcclCommunicator(const NcclCommunicator&) = delete;
  NcclCommunicator& operator=(const NcclCommunicator&) = delete;

  const std::string& name() const override { return host_->name(); }
  int rank() const override { return host_->rank(); }
  int size() const override { return host_->size(); }
  Device device() const { return device_; }
  // The collectives' stream and communicator (for benchmarks), and the MPI side for host tensors.
  cudaStream_t stream() const { return lanes_[kCollectives].stream.get(); }
  ncclComm_t nccl() const { return lanes_[kCollectives].comm.get(); }
  MpiCommunicator& host() { return *host_; }

  // Device tensors (f32, bf16, f16: Sum and Avg; i32, u8: Sum) go through NCCL, host tensors
  // through host(). `in` of all_gather may be chunk rank() of `out` (gathers in place).
  WorkPtr all_reduce_async(const Tensor& t, ReduceOp op) override;
  WorkPtr reduce_scatter_async(const Tensor& in, const Tensor& out, ReduceOp op) override;
  WorkPtr all_gather_async(const Tensor& in, const Tensor& out) override;
  WorkPtr reduce_async(const Tensor& t, int root, ReduceOp op) override;
  WorkPtr broadcast_async(const Tensor& t, int root) override;
  WorkPtr send_async(const Tensor& t, int peer, int tag) override;
  WorkPtr recv_async(const Tensor& t, int peer, int tag) override;
  // A barrier of the ranks' hosts (an MPI barrier through host(), as MpiCommunicator's);
  // device operations in flight are not waited for.
  WorkPtr barrier_async() override { return host_->barrier_async(); }
  void progress() override { host_->progress(); }

  // Device bytes by MpiCommunicator's convention (what ring / direct algorithms send, counted
  // when an operation starts), plus the bytes host() sent for this communicator.
  int64_t bytes_sent() const override { return bytes_sent_ + host_->bytes_sent(); }

 private:
  // An NCCL communicator over the group and the stream its operations run on.
  struct Lane {
    NcclComm comm;
    CudaStreamPtr stream;
  };
  static constexpr size_t kCollectives = 0, kUp = 1, kDown = 2;  // lanes_ (kUp: to higher ranks)

  // Starts launch(comm, stream) on `lane` after the compute stream's work so far and returns
  // its Work, which holds `tensors` until it is waited on.
  template <class Launch>
  WorkPtr start(size_t lane, std::string what, std::vector<Tensor> tensors, Launch&& launch);
  // The lane of a message between this rank and `peer`, sent by this rank if `sending`.
  size_t p2p_lane(int peer, bool sending) const;
  // Checks that `t` is a defined tensor on this communicator's device.
  void check_tensor(const Tensor& t, const char* op) const;
  void count_sent(size_t bytes, int numerator, int denominator);

  std::unique_ptr<MpiCommunicator> host_;
  Device device_;
  std::vector<Lane> lanes_;     // collectives; with p2p also up and down
  CudaEventPtr compute_ready_;  // re-recorded per operation; a stream wait uses the latest record
  int64_t bytes_sent_ = 0;
};

}  // namespace strata::parallel
