// Communicator: the collectives and point-to-point messages Strata needs, each with an async
// form that returns a handle to wait on, so gradient sync can overlap backward. Transports:
// MPI over host memory (mpi_communicator.hpp) and, with the GPU issue, NCCL over device
// memory. Operations on one communicator complete in the order they were started.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "core/tensor.hpp"

namespace strata::parallel {

enum class ReduceOp { Sum, Avg };

// The largest message tag every MPI implementation accepts (the standard's smallest MPI_TAG_UB).
constexpr int kMaxTag = 32767;  // Avg = Sum / size(), float dtypes only

// A started operation. wait() blocks until it is complete (and rethrows its error);
// test() returns whether it is complete without blocking (and may make progress).
class Work {
 public:
  virtual ~Work() = default;
  virtual void wait() = 0;
  virtual bool test() = 0;
};
using WorkPtr = std::unique_ptr<Work>;

class Communicator {
 public:
  virtual ~Communicator() = default;
  // e.g. "world", "dp", "pp": names scope errors and benchmark rows.
  virtual const std::string& name() const = 0;
  virtual int rank() const = 0;
  virtual int size() const = 0;

  // In place over t (f32, bf16, f16: reduced in f32 precision per pair; i32, u8: Sum only).
  virtual WorkPtr all_reduce_async(const Tensor& t, ReduceOp op) = 0;
  // in: size() * n elements; out: n elements = reduction over ranks of chunk rank() of in.
  virtual WorkPtr reduce_scatter_async(const Tensor& in, const Tensor& out, ReduceOp op) = 0;
  // in: n elements; out: size() * n elements, chunk r from rank r.
  virtual WorkPtr all_gather_async(const Tensor& in, const Tensor& out) = 0;
  // Reduction over ranks of t into t on `root` (in place); on other ranks t is only sent and
  // left unchanged. Same dtypes and ops as all_reduce.
  virtual WorkPtr reduce_async(const Tensor& t, int root, ReduceOp op) = 0;
  virtual WorkPtr broadcast_async(const Tensor& t, int root) = 0;
  // Point-to-point; a send matches the receive with the same (peer, tag), in order.
  virtual WorkPtr send_async(const Tensor& t, int peer, int tag) = 0;
  virtual WorkPtr recv_async(const Tensor& t, int peer, int tag) = 0;
  virtual WorkPtr barrier_async() = 0;
  // Lets started operations advance (for transports that progress only inside calls).
  virtual void progress() {}
  // A zeroed tensor for data this communicator will reduce or gather again and again (the
  // gradient and parameter buffers); collective. MPI with every rank on one node: shared memory
  // that its all-reduce, reduce and in-place all-gather read in place (shared_memory.hpp).
  // Otherwise ordinary memory.
  virtual Tensor allocate(int64_t numel, DType dtype, Device device) { return Tensor::zeros({numel}, dtype, device); }
  // Collective: point-to-point messages of at most `max_bytes`, about `slots` of them in flight
  // per peer, will follow. MPI with every rank on one node: they then go through mailboxes in
  // shared memory (shared_memory.hpp). Otherwise nothing changes.
  virtual void reserve_messages(int64_t max_bytes, int slots) {}
  // Bytes this rank has sent on this communicator so far, by the convention of the transport
  // (MpiCommunicator: what ring / direct algorithms send; see there); 0 if not counted.
  virtual int64_t bytes_sent() const { return 0; }

  // Blocking forms.
  void all_reduce(const Tensor& t, ReduceOp op) { all_reduce_async(t, op)->wait(); }
  void reduce_scatter(const Tensor& in, const Tensor& out, ReduceOp op) { reduce_scatter_async(in, out, op)->wait(); }
  void all_gather(const Tensor& in, const Tensor& out) { all_gather_async(in, out)->wait(); }
  void reduce(const Tensor& t, int root, ReduceOp op) { reduce_async(t, root, op)->wait(); }
  void broadcast(const Tensor& t, int root) { broadcast_async(t, root)->wait(); }
  void send(const Tensor& t, int peer, int tag) { send_async(t, peer, tag)->wait(); }
  void recv(const Tensor& t, int peer, int tag) { recv_async(t, peer, tag)->wait(); }
  void barrier() { barrier_async()->wait(); }
};

// Sums `values` element-wise over all ranks of `comm`, in double precision and identically on
// every rank: the values travel as bytes (the dtypes carry no f64) through an all-gather and
// are added in rank order. For norms and metrics, where f32 sums would round differently
// than a single rank's double sum.
void all_reduce_sum(Communicator& comm, std::vector<double>& values);

}  // namespace strata::parallel
