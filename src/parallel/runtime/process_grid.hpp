// ProcessGrid: the world as a grid of axes (plan/grid_layout.hpp: which rank sits where), with
// one communicator for the whole world and one per axis. An axis' communicator joins the ranks
// that differ only in that axis' coordinate, ranked by it: pp (pipeline stages: activations and
// gradients between stages), dp (data-parallel replicas: gradient sync) and tp (tensor
// parallelism: the layers' collectives). With ranks packed by node (mpirun's default) the
// fastest axis' groups stay inside a node: it should be the axis with the heaviest traffic.
//
// Transports. With Transport::Mpi every communicator is an MpiCommunicator (device tensors are
// staged through pinned host memory). With Transport::Nccl, every axis' comm() is an
// NcclCommunicator on this rank's GPU (its NCCL ids broadcast over the MPI communicator of the
// same group; only the pipeline axis has lanes for send/recv): they carry gradients, parameters
// and activations on the device and pass host tensors (norms, counts) to MPI. world() stays MPI
// in both: it carries host-side metrics, barriers and the checkpoint gather, where a device
// tensor sent by its owner is received into host memory by rank 0, which only MPI can pair.
// mpi_world() and mpi_comm(axis) (mpi_dp(), mpi_pp()) are always the MPI communicators of the
// groups, for raw MPI calls.
#pragma once

#include <mpi.h>

#include <memory>
#include <string>
#include <vector>

#include "parallel/comm/mpi_communicator.hpp"
#include "parallel/comm/tensor_parallel.hpp"
#include "parallel/plan/grid_layout.hpp"
#include "parallel/runtime/device.hpp"

namespace strata::parallel {

class ProcessGrid {
 public:
  // Collective over `world`. `axes`: slowest-varying first (GridLayout's Input errors, the same
  // on every rank, before any communication); also an Input error when NCCL is asked of a build
  // without CUDA or for a CPU device. `device` is this rank's (select_device). `shared_memory`
  // false keeps the axes' MPI communicators off shared memory.
  ProcessGrid(MPI_Comm world, std::vector<AxisSize> axes, Transport transport = Transport::Mpi,
              Device device = Device::cpu(), bool shared_memory = true);
  // The grid {pp, dp} with dp = world size / pp.
  ProcessGrid(MPI_Comm world, int pp, Transport transport = Transport::Mpi, Device device = Device::cpu(),
              bool shared_memory = true);
  ~ProcessGrid();
  ProcessGrid(const ProcessGrid&) = delete;
  ProcessGrid& operator=(const ProcessGrid&) = delete;

  const GridLayout& layout() const { return layout_; }
  // An axis the grid does not list has size 1 and coordinate 0 but no communicator.
  bool has(Axis axis) const { return layout_.has(axis); }
  int size(Axis axis) const { return layout_.size(axis); }
  // This rank's coordinate along `axis` (its rank in comm(axis)).
  int coord(Axis axis) const { return layout_.coord(axis, rank_); }
  // The ranks that differ from this one only along `axis`, ranked by their coordinate on it.
  Communicator& comm(Axis axis);
  // The same group over MPI, whatever the transport.
  MpiCommunicator& mpi_comm(Axis axis);
  std::string describe() const { return layout_.describe(); }

  Communicator& world() { return *world_; }
  // The dp_size() replicas of my stage, ranked by replica.
  Communicator& dp() { return comm(Axis::Data); }
  // The pp_size() stages of my replica, ranked by stage.
  Communicator& pp() { return comm(Axis::Pipeline); }
  // The same groups over MPI, whatever the transport (for raw MPI calls: .comm()).
  MpiCommunicator& mpi_world() { return *world_; }
  MpiCommunicator& mpi_dp() { return mpi_comm(Axis::Data); }
  MpiCommunicator& mpi_pp() { return mpi_comm(Axis::Pipeline); }
  // The tp axis as the layers' tensor-parallel group (Megatron's collectives), null without one.
  TensorParallel* tensor_parallel() { return tensor_parallel_.get(); }

  Transport transport() const { return transport_; }
  Device device() const { return device_; }

  int stage() const { return coord(Axis::Pipeline); }
  int replica() const { return coord(Axis::Data); }
  int tp_rank() const { return coord(Axis::Tensor); }
  int pp_size() const { return size(Axis::Pipeline); }
  int dp_size() const { return size(Axis::Data); }
  // World rank of (stage, replica), at this rank's coordinates along any other axis.
  int rank_of(int stage, int replica) const;

 private:
  int index_of(Axis axis) const;  // in the layout, checked

  GridLayout layout_;
  int rank_ = 0;
  Transport transport_ = Transport::Mpi;
  Device device_;
  std::unique_ptr<MpiCommunicator> world_;
  std::vector<std::unique_ptr<MpiCommunicator>> mpi_;  // per axis
  // NcclCommunicators per axis with Transport::Nccl (empty otherwise); destroyed before the MPI ones.
  std::vector<std::unique_ptr<Communicator>> nccl_;
  std::unique_ptr<TensorParallel> tensor_parallel_;  // over comm(Axis::Tensor); destroyed first
};

}  // namespace strata::parallel
