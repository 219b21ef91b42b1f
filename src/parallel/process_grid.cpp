// ProcessGrid: splits the world into data-parallel and pipeline sub-communicators.
#include "parallel/process_grid.hpp"

#include "parallel/mpi.hpp"
#if STRATA_WITH_CUDA
#include "parallel/nccl_communicator.hpp"
#endif

namespace strata::parallel {

namespace {

// A communicator made by MPI_Comm_split, wrapped (MpiCommunicator keeps its own duplicate).
std::unique_ptr<MpiCommunicator> split(MPI_Comm world, int color, int key, const char* name, bool shared_memory) {
  MPI_Comm part = MPI_COMM_NULL;
  MPI_CHECK(MPI_Comm_split(world, color, key, &part));
  auto comm = std::make_unique<MpiCommunicator>(part, name, shared_memory);
  MPI_Comm_free(&part);
  return comm;
}

// An NCCL communicator over the ranks of `group` (its ids travel over that MPI group); with
// lanes of its own for send/recv where `p2p`.
std::unique_ptr<Communicator> nccl_over(const MpiCommunicator& group, Device device, bool p2p) {
#if STRATA_WITH_CUDA
  return std::make_unique<NcclCommunicator>(group.comm(), group.name(), device, p2p);
#else
  (void)group;
  (void)device;
  (void)p2p;
  STRATA_THROW_INPUT("--comm nccl: this build of Strata has no CUDA");
#endif
}

}  // namespace

ProcessGrid::~ProcessGrid() = default;

ProcessGrid::ProcessGrid(MPI_Comm world, int pp, Transport transport, Device device, bool shared_memory)
    : transport_(transport), device_(device) {
  int size = 1, rank = 0;
  MPI_CHECK(MPI_Comm_size(world, &size));
  MPI_CHECK(MPI_Comm_rank(world, &rank));
  // Every rank sees the same pp and size, so every rank throws the same error here, before
  // any collective: nobody is left waiting.
  STRATA_REQUIRE(pp >= 1, "--pp ", pp, " must be at least 1");
  STRATA_REQUIRE(size % pp == 0, "--pp ", pp, " does not divide the ", size, " ranks of the world");
  STRATA_REQUIRE(transport == Transport::Mpi || device.is_cuda(), "--comm nccl needs --device cuda, found ",
                 device.str());
  STRATA_REQUIRE(transport == Transport::Mpi || STRATA_WITH_CUDA, "--comm nccl: this build of Strata has no CUDA");
  pp_size_ = pp;
  dp_size_ = size / pp;
  stage_ = rank / dp_size_;
  replica_ = rank % dp_size_;
  world_ = std::make_unique<MpiCommunicator>(world, "world");
  dp_ = split(world, /*color=*/stage_, /*key=*/replica_, "dp", shared_memory);
  pp_ = split(world, /*color=*/replica_, /*key=*/stage_, "pp", shared_memory);
  if (transport == Transport::Nccl) {
    // Only the pipeline sends point-to-point (activations up, gradients down).
    dp_nccl_ = nccl_over(*dp_, device, /*p2p=*/false);
    pp_nccl_ = nccl_over(*pp_, device, /*p2p=*/true);
  }
}

int ProcessGrid::rank_of(int stage, int replica) const {
  STRATA_CHECK(stage >= 0 && stage < pp_size_ && replica >= 0 && replica < dp_size_, "no rank at stage ", stage,
               ", replica ", replica, " of a ", pp_size_, " x ", dp_size_, " grid");
  return stage * dp_size_ + replica;
}

}  // namespace strata::parallel
