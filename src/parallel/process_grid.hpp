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
#pragma once

#include <mpi.h>

#include <memory>

#include "parallel/mpi_communicator.hpp"

namespace strata::parallel {

class ProcessGrid {
 public:
  // Collective over `world`. Throws an Input error (the same on every rank, before any
  // communication) when pp < 1 or pp does not divide the world size.
  ProcessGrid(MPI_Comm world, int pp);
  ProcessGrid(const ProcessGrid&) = delete;
  ProcessGrid& operator=(const ProcessGrid&) = delete;

  Communicator& world() { return *world_; }
  // The dp_size() replicas of my stage, ranked by replica.
  Communicator& dp() { return *dp_; }
  // The pp_size() stages of my replica, ranked by stage.
  Communicator& pp() { return *pp_; }

  int stage() const { return stage_; }
  int replica() const { return replica_; }
  int pp_size() const { return pp_size_; }
  int dp_size() const { return dp_size_; }
  // World rank of (stage, replica).
  int rank_of(int stage, int replica) const;

 private:
  int pp_size_ = 1, dp_size_ = 1, stage_ = 0, replica_ = 0;
  std::unique_ptr<MpiCommunicator> world_, dp_, pp_;
};

}  // namespace strata::parallel
