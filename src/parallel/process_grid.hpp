// ProcessGrid: the world as a grid of named axes, with one communicator for the whole world and
// one per axis. An axis' communicator joins the ranks that differ only in that axis' coordinate,
// ranked by it: "pp" (pipeline stages: activations and gradients between stages), "dp"
// (data-parallel replicas: gradient sync) and "tp" (tensor parallelism, the next step).
//
// Layout: the axes are listed slowest-varying first and world ranks count through the grid in
// row-major order, so the last (fastest-varying) axis joins consecutive ranks. With ranks packed
// by node (mpirun's default) that axis' groups stay inside a node: it should be the axis with the
// heaviest traffic. Today's grid is {pp, dp}: world rank = stage * dp + replica, so the gradient
// sync stays inside a node and pipeline traffic (activations, smaller) crosses nodes. pp = 2,
// dp = 3:
//
//               replica 0   replica 1   replica 2
//   stage 0  [  rank 0      rank 1      rank 2   ]  <- dp() of stage 0
//   stage 1  [  rank 3      rank 4      rank 5   ]  <- dp() of stage 1
//                 ^ pp() of replica 0 = {0, 3}
//
// With tensor parallelism the grid is {pp, dp, tp}, tp fastest: world rank =
// (stage * dp + replica) * tp + tp coordinate, so a tensor-parallel group (the chattiest, every
// layer) is tp consecutive ranks on one node. pp = 2, dp = 2, tp = 2: tp groups {0 1} {2 3}
// {4 5} {6 7}; dp groups {0 2} {1 3} {4 6} {5 7}; pp groups {0 4} {1 5} {2 6} {3 7}.
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

#include <array>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "parallel/device.hpp"
#include "parallel/mpi_communicator.hpp"

namespace strata::parallel {

// The axis names a grid knows (each one is the command-line flag --<name>).
inline constexpr std::array<std::string_view, 3> kGridAxes = {"pp", "dp", "tp"};

class ProcessGrid {
 public:
  // One axis of the grid. `size` empty: the world size divided by the product of the other
  // axes' sizes (at most one axis per grid).
  struct Axis {
    std::string name;
    std::optional<int> size;
  };

  // Collective over `world`. `axes`: slowest-varying first, names from kGridAxes, each at most
  // once. Throws an Input error (the same on every rank, before any communication) when the
  // list is empty, names an unknown axis or one twice, leaves more than one size open, has a
  // size below 1 ("--pp 0 must be at least 1"), or sizes that do not make up the world ("--pp 3
  // does not divide the 4 ranks of the world" with a size open, "--pp 2 x --dp 1 x --tp 1 does
  // not match the 4 ranks of the world" without), or when NCCL is asked of a build without CUDA
  // or for a CPU device. `device` is this rank's (select_device). `shared_memory` false keeps the
  // axes' MPI communicators off shared memory.
  ProcessGrid(MPI_Comm world, std::vector<Axis> axes, Transport transport = Transport::Mpi,
              Device device = Device::cpu(), bool shared_memory = true);
  // Today's grid: {pp, dp} with dp = world size / pp.
  ProcessGrid(MPI_Comm world, int pp, Transport transport = Transport::Mpi, Device device = Device::cpu(),
              bool shared_memory = true);
  ~ProcessGrid();
  ProcessGrid(const ProcessGrid&) = delete;
  ProcessGrid& operator=(const ProcessGrid&) = delete;

  // --- Any axis. A known axis the grid does not list has size 1 and coordinate 0 but no
  // communicator; an unknown name is an internal error.

  // The axes, slowest-varying first, every size filled in.
  const std::vector<Axis>& axes() const { return axes_; }
  bool has(std::string_view axis) const;
  int size(std::string_view axis) const;
  // This rank's coordinate along `axis` (its rank in comm(axis)).
  int coord(std::string_view axis) const;
  // This rank's coordinates, one per axis in axes() order.
  const std::vector<int>& coords() const { return coords_; }
  // The ranks that differ from this one only along `axis`, ranked by their coordinate on it.
  Communicator& comm(std::string_view axis);
  // The same group over MPI, whatever the transport.
  MpiCommunicator& mpi_comm(std::string_view axis);
  // World rank at `coords` (one per axis in axes() order), and back.
  int rank_of(const std::vector<int>& coords) const;
  std::vector<int> coords_of(int world_rank) const;
  // For rank 0 to print: the grid's shape, then per axis the world ranks of each of its groups,
  // e.g. for pp = 2, dp = 3 (lines separated by '\n', none at the end):
  //   process grid: pp 2 x dp 3 = 6 ranks, dp fastest
  //     pp groups: [0 3] [1 4] [2 5]
  //     dp groups: [0 1 2] [3 4 5]
  std::string describe() const;
  // The same for the grid `axes` would make of `world_size` ranks, without MPI (--dry-run
  // --world N); the constructor's Input errors for axes that do not fit.
  static std::string describe(std::vector<Axis> axes, int world_size);

  // --- Today's names for the world and the pp and dp axes.

  Communicator& world() { return *world_; }
  // The dp_size() replicas of my stage, ranked by replica.
  Communicator& dp() { return comm("dp"); }
  // The pp_size() stages of my replica, ranked by stage.
  Communicator& pp() { return comm("pp"); }
  // The same groups over MPI, whatever the transport (for raw MPI calls: .comm()).
  MpiCommunicator& mpi_world() { return *world_; }
  MpiCommunicator& mpi_dp() { return mpi_comm("dp"); }
  MpiCommunicator& mpi_pp() { return mpi_comm("pp"); }

  Transport transport() const { return transport_; }
  Device device() const { return device_; }

  int stage() const { return coord("pp"); }
  int replica() const { return coord("dp"); }
  int pp_size() const { return size("pp"); }
  int dp_size() const { return size("dp"); }
  // World rank of (stage, replica), at this rank's coordinates along any other axis.
  int rank_of(int stage, int replica) const;

 private:
  // Index of `axis` in axes_, -1 for a known axis the grid does not list.
  int index_of(std::string_view axis) const;

  std::vector<Axis> axes_;
  std::vector<int> coords_;
  std::vector<int> strides_;  // world ranks between neighbours along each axis
  Transport transport_ = Transport::Mpi;
  Device device_;
  std::unique_ptr<MpiCommunicator> world_;
  std::vector<std::unique_ptr<MpiCommunicator>> mpi_;  // per axis
  // NcclCommunicators per axis with Transport::Nccl (empty otherwise); destroyed before the MPI ones.
  std::vector<std::unique_ptr<Communicator>> nccl_;
};

}  // namespace strata::parallel
