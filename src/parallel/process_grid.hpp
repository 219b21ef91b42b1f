// ProcessGrid: the world as pp pipeline stages x dp data-parallel replicas, with one
// communicator for the whole world, one for the replicas of my stage (gradient sync) and one
// for the stages of my replica (activations and gradients between stages).
//
// Layout: world rank = stage * dp + replica. Consecutive ranks form one data-parallel group,
// so the heavy gradient traffic stays inside a node when ranks are packed by node (mpirun's
// default); pipeline traffic (activations, smaller) crosses nodes. pp = 2, dp = 3:
//
//               replica 0   replica 1   replica 2
//   stage 0  [  rank 0      rank 1      rank 2   ]  <- dp() of stage 0
//   stage 1  [  rank 3      rank 4      rank 5   ]  <- dp() of stage 1
//                 ^ pp() of replica 0 = {0, 3}
//
// Transports. With Transport::Mpi every communicator is an MpiCommunicator (device tensors are
// staged through pinned host memory). With Transport::Nccl, dp() and pp() are
// NcclCommunicators on this rank's GPU (their NCCL ids broadcast over the MPI communicator of
// the same group): they carry gradients, parameters and activations on the device and pass
// host tensors (norms, counts) to MPI. world() stays MPI in both: it carries host-side
// metrics, barriers and the checkpoint gather, where a device tensor sent by its owner is
// received into host memory by rank 0, which only MPI can pair. mpi_world(), mpi_dp() and
// mpi_pp() are always the MPI communicators of the groups, for raw MPI calls.
#pragma once

#include <mpi.h>

#include <memory>

#include "parallel/device.hpp"
#include "parallel/mpi_communicator.hpp"

namespace strata::parallel {

class ProcessGrid {
 public:
  // Collective over `world`. Throws an Input error (the same on every rank, before any
  // communication) when pp < 1 or pp does not divide the world size, or when NCCL is asked of
  // a build without CUDA or for a CPU device. `device` is this rank's (select_device).
  // `shared_memory` false keeps the dp and pp groups' MPI communicators off shared memory.
  ProcessGrid(MPI_Comm world, int pp, Transport transport = Transport::Mpi, Device device = Device::cpu(),
              bool shared_memory = true);
  ~ProcessGrid();
  ProcessGrid(const ProcessGrid&) = delete;
  ProcessGrid& operator=(const ProcessGrid&) = delete;

  Communicator& world() { return *world_; }
  // The dp_size() replicas of my stage, ranked by replica.
  Communicator& dp() { return dp_nccl_ ? *dp_nccl_ : *dp_; }
  // The pp_size() stages of my replica, ranked by stage.
  Communicator& pp() { return pp_nccl_ ? *pp_nccl_ : *pp_; }
  // The same groups over MPI, whatever the transport (for raw MPI calls: .comm()).
  MpiCommunicator& mpi_world() { return *world_; }
  MpiCommunicator& mpi_dp() { return *dp_; }
  MpiCommunicator& mpi_pp() { return *pp_; }

  Transport transport() const { return transport_; }
  Device device() const { return device_; }

  int stage() const { return stage_; }
  int replica() const { return replica_; }
  int pp_size() const { return pp_size_; }
  int dp_size() const { return dp_size_; }
  // World rank of (stage, replica).
  int rank_of(int stage, int replica) const;

 private:
  int pp_size_ = 1, dp_size_ = 1, stage_ = 0, replica_ = 0;
  Transport transport_ = Transport::Mpi;
  Device device_;
  std::unique_ptr<MpiCommunicator> world_, dp_, pp_;
  // NcclCommunicators with Transport::Nccl (null otherwise); destroyed before the MPI ones.
  std::unique_ptr<Communicator> dp_nccl_, pp_nccl_;
};

}  // namespace strata::parallel
