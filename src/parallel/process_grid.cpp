// ProcessGrid: splits the world into data-parallel and pipeline sub-communicators.
#include "parallel/process_grid.hpp"

#include "parallel/mpi.hpp"

namespace strata::parallel {

namespace {

// A communicator made by MPI_Comm_split, wrapped (MpiCommunicator keeps its own duplicate).
std::unique_ptr<MpiCommunicator> split(MPI_Comm world, int color, int key, const char* name) {
  MPI_Comm part = MPI_COMM_NULL;
  MPI_CHECK(MPI_Comm_split(world, color, key, &part));
  auto comm = std::make_unique<MpiCommunicator>(part, name);
  MPI_Comm_free(&part);
  return comm;
}

}  // namespace

ProcessGrid::ProcessGrid(MPI_Comm world, int pp) {
  int size = 1, rank = 0;
  MPI_CHECK(MPI_Comm_size(world, &size));
  MPI_CHECK(MPI_Comm_rank(world, &rank));
  // Every rank sees the same pp and size, so every rank throws the same error here, before
  // any collective: nobody is left waiting.
  STRATA_REQUIRE(pp >= 1, "--pp ", pp, " must be at least 1");
  STRATA_REQUIRE(size % pp == 0, "--pp ", pp, " does not divide the ", size, " ranks of the world");
  pp_size_ = pp;
  dp_size_ = size / pp;
  stage_ = rank / dp_size_;
  replica_ = rank % dp_size_;
  world_ = std::make_unique<MpiCommunicator>(world, "world");
  dp_ = split(world, /*color=*/stage_, /*key=*/replica_, "dp");
  pp_ = split(world, /*color=*/replica_, /*key=*/stage_, "pp");
}

int ProcessGrid::rank_of(int stage, int replica) const {
  STRATA_CHECK(stage >= 0 && stage < pp_size_ && replica >= 0 && replica < dp_size_, "no rank at stage ", stage,
               ", replica ", replica, " of a ", pp_size_, " x ", dp_size_, " grid");
  return stage * dp_size_ + replica;
}

}  // namespace strata::parallel
