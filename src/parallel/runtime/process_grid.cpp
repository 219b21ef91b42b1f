// ProcessGrid: lays out the axes (GridLayout), then splits the world into one sub-communicator per axis.
#include "parallel/runtime/process_grid.hpp"

#include "parallel/runtime/mpi.hpp"
#if STRATA_WITH_CUDA
#include "parallel/comm/nccl_communicator.hpp"
#endif

namespace strata::parallel {

namespace {

// Frees an MPI communicator when it goes out of scope, whatever happened in between.
class CommGuard {
 public:
  CommGuard() = default;
  ~CommGuard() {
    if (comm_ != MPI_COMM_NULL) MPI_Comm_free(&comm_);
  }
  CommGuard(const CommGuard&) = delete;
  CommGuard& operator=(const CommGuard&) = delete;
  MPI_Comm* out() { return &comm_; }
  MPI_Comm get() const { return comm_; }

 private:
  MPI_Comm comm_ = MPI_COMM_NULL;
};

// A communicator made by MPI_Comm_split, wrapped (MpiCommunicator keeps its own duplicate; the
// split one is freed even when wrapping it throws).
std::unique_ptr<MpiCommunicator> split(MPI_Comm world, int color, int key, const std::string& name,
                                       bool shared_memory) {
  CommGuard part;
  MPI_CHECK(MPI_Comm_split(world, color, key, part.out()));
  return std::make_unique<MpiCommunicator>(part.get(), name, shared_memory);
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

ProcessGrid::~ProcessGrid() {
  // The NCCL communicators go before the MPI ones, each kind slowest axis first (the reverse of
  // their creation), the world last.
  tensor_parallel_.reset();
  for (auto& comm : nccl_) comm.reset();
  for (auto& comm : mpi_) comm.reset();
  world_.reset();
}

ProcessGrid::ProcessGrid(MPI_Comm world, int pp, Transport transport, Device device, bool shared_memory)
    : ProcessGrid(world, {{Axis::Pipeline, pp}, {Axis::Data, std::nullopt}}, transport, device, shared_memory) {}

namespace {

int world_size_of(MPI_Comm world) {
  int size = 1;
  MPI_CHECK(MPI_Comm_size(world, &size));
  return size;
}

}  // namespace

ProcessGrid::ProcessGrid(MPI_Comm world, std::vector<AxisSize> axis_sizes, Transport transport, Device device,
                         bool shared_memory)
    : layout_(std::move(axis_sizes), world_size_of(world)), transport_(transport), device_(device) {
  MPI_CHECK(MPI_Comm_rank(world, &rank_));
  STRATA_REQUIRE(transport == Transport::Mpi || device.is_cuda(), "--comm nccl needs --device cuda, found ",
                 device.str());
  STRATA_REQUIRE(transport == Transport::Mpi || STRATA_WITH_CUDA, "--comm nccl: this build of Strata has no CUDA");
  const std::vector<AxisSize>& axes = layout_.axes();
  const std::vector<int> coords = layout_.coords_of(rank_);
  const int n = static_cast<int>(axes.size());
  world_ = std::make_unique<MpiCommunicator>(world, "world");
  // Fastest axis first. An axis' groups are told apart by the other coordinates (color: their
  // row-major index over the other axes), and ranked by its own.
  mpi_.resize(n);
  for (int i = n - 1; i >= 0; --i) {
    int color = 0;
    for (int j = 0; j < n; ++j)
      if (j != i) color = color * *axes[j].size + coords[j];
    mpi_[i] = split(world, color, /*key=*/coords[i], axis_name(axes[i].axis), shared_memory);
  }
  if (transport == Transport::Nccl) {
    nccl_.resize(n);
    // Only the pipeline sends point-to-point (activations up, gradients down).
    for (int i = n - 1; i >= 0; --i) nccl_[i] = nccl_over(*mpi_[i], device, /*p2p=*/axes[i].axis == Axis::Pipeline);
  }
  if (has(Axis::Tensor)) tensor_parallel_ = std::make_unique<TensorParallel>(comm(Axis::Tensor));
}

int ProcessGrid::index_of(Axis axis) const {
  const int i = layout_.index_of(axis);
  STRATA_CHECK(i >= 0, "the process grid has no axis '", axis_name(axis), "'");
  return i;
}

Communicator& ProcessGrid::comm(Axis axis) {
  const int i = index_of(axis);
  return nccl_.empty() ? static_cast<Communicator&>(*mpi_[i]) : *nccl_[i];
}

MpiCommunicator& ProcessGrid::mpi_comm(Axis axis) { return *mpi_[index_of(axis)]; }

int ProcessGrid::rank_of(int stage, int replica) const {
  STRATA_CHECK(stage >= 0 && stage < pp_size() && replica >= 0 && replica < dp_size(), "no rank at stage ", stage,
               ", replica ", replica, " of a ", pp_size(), " x ", dp_size(), " grid");
  std::vector<int> coords = layout_.coords_of(rank_);
  if (const int pp = layout_.index_of(Axis::Pipeline); pp >= 0) coords[pp] = stage;
  if (const int dp = layout_.index_of(Axis::Data); dp >= 0) coords[dp] = replica;
  return layout_.rank_of(coords);
}

}  // namespace strata::parallel
