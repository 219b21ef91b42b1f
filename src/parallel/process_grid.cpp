// ProcessGrid: validates the axes, then splits the world into one sub-communicator per axis.
#include "parallel/process_grid.hpp"

#include <algorithm>
#include <sstream>

#include "parallel/mpi.hpp"
#if STRATA_WITH_CUDA
#include "parallel/nccl_communicator.hpp"
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

bool known_axis(std::string_view name) {
  return std::find(kGridAxes.begin(), kGridAxes.end(), name) != kGridAxes.end();
}

// "--pp 2 x --tp 2" for the given axes.
std::string flags_str(const std::vector<const ProcessGrid::Axis*>& axes) {
  std::ostringstream os;
  for (size_t i = 0; i < axes.size(); ++i) os << (i ? " x --" : "--") << axes[i]->name << ' ' << *axes[i]->size;
  return os.str();
}

// Checks `axes` against a world of `world_size` ranks and fills in the open size. Uses nothing
// but its arguments, so every rank throws the same error, before any collective: nobody is left
// waiting.
void resolve(std::vector<ProcessGrid::Axis>& axes, int world_size) {
  STRATA_REQUIRE(!axes.empty(), "a process grid needs at least one axis");
  ProcessGrid::Axis* open = nullptr;
  for (size_t i = 0; i < axes.size(); ++i) {
    ProcessGrid::Axis& axis = axes[i];
    STRATA_REQUIRE(known_axis(axis.name), "unknown process grid axis '", axis.name, "' (known: pp, dp, tp)");
    for (size_t j = 0; j < i; ++j)
      STRATA_REQUIRE(axes[j].name != axis.name, "process grid axis '", axis.name, "' is given twice");
    if (!axis.size) {
      STRATA_REQUIRE(open == nullptr, "process grid axes ", open ? open->name : "", " and ", axis.name,
                     " both take the rest of the world; at most one may");
      open = &axis;
    }
  }
  for (const ProcessGrid::Axis& axis : axes)
    if (axis.size) STRATA_REQUIRE(*axis.size >= 1, "--", axis.name, ' ', *axis.size, " must be at least 1");
  // Divide the world by each fixed size in turn: the product divides it iff every step does
  // (and nothing overflows).
  int rest = world_size;
  bool divides = true;
  for (const ProcessGrid::Axis& axis : axes) {
    if (!axis.size) continue;
    if (rest % *axis.size != 0) {
      divides = false;
      break;
    }
    rest /= *axis.size;
  }
  if (open) {
    if (!divides) {
      // Name the axes that can be at fault: those of size above 1.
      std::vector<const ProcessGrid::Axis*> fixed;
      for (const ProcessGrid::Axis& axis : axes)
        if (axis.size && *axis.size > 1) fixed.push_back(&axis);
      STRATA_THROW_INPUT(flags_str(fixed), " does not divide the ", world_size, " ranks of the world");
    }
    open->size = rest;
  } else if (!divides || rest != 1) {
    std::vector<const ProcessGrid::Axis*> all;
    for (const ProcessGrid::Axis& axis : axes) all.push_back(&axis);
    STRATA_THROW_INPUT(flags_str(all), " does not match the ", world_size, " ranks of the world");
  }
}

}  // namespace

ProcessGrid::~ProcessGrid() {
  // The NCCL communicators go before the MPI ones, each kind slowest axis first (the reverse of
  // their creation), the world last.
  for (auto& comm : nccl_) comm.reset();
  for (auto& comm : mpi_) comm.reset();
  world_.reset();
}

ProcessGrid::ProcessGrid(MPI_Comm world, int pp, Transport transport, Device device, bool shared_memory)
    : ProcessGrid(world, {{"pp", pp}, {"dp", std::nullopt}}, transport, device, shared_memory) {}

ProcessGrid::ProcessGrid(MPI_Comm world, std::vector<Axis> axes, Transport transport, Device device, bool shared_memory)
    : axes_(std::move(axes)), transport_(transport), device_(device) {
  int world_size = 1, rank = 0;
  MPI_CHECK(MPI_Comm_size(world, &world_size));
  MPI_CHECK(MPI_Comm_rank(world, &rank));
  resolve(axes_, world_size);
  STRATA_REQUIRE(transport == Transport::Mpi || device.is_cuda(), "--comm nccl needs --device cuda, found ",
                 device.str());
  STRATA_REQUIRE(transport == Transport::Mpi || STRATA_WITH_CUDA, "--comm nccl: this build of Strata has no CUDA");
  const int n = static_cast<int>(axes_.size());
  strides_.assign(n, 1);
  for (int i = n - 2; i >= 0; --i) strides_[i] = strides_[i + 1] * *axes_[i + 1].size;
  coords_ = coords_of(rank);

  world_ = std::make_unique<MpiCommunicator>(world, "world");
  // Fastest axis first (for {pp, dp}: dp, then pp, as before axes had names). An axis' groups
  // are told apart by the other coordinates (color: their row-major index over the other axes),
  // and ranked by its own.
  mpi_.resize(n);
  for (int i = n - 1; i >= 0; --i) {
    int color = 0;
    for (int j = 0; j < n; ++j)
      if (j != i) color = color * *axes_[j].size + coords_[j];
    mpi_[i] = split(world, color, /*key=*/coords_[i], axes_[i].name, shared_memory);
  }
  if (transport == Transport::Nccl) {
    nccl_.resize(n);
    // Only the pipeline sends point-to-point (activations up, gradients down).
    for (int i = n - 1; i >= 0; --i) nccl_[i] = nccl_over(*mpi_[i], device, /*p2p=*/axes_[i].name == "pp");
  }
}

int ProcessGrid::index_of(std::string_view axis) const {
  for (size_t i = 0; i < axes_.size(); ++i)
    if (axes_[i].name == axis) return static_cast<int>(i);
  STRATA_CHECK(known_axis(axis), "unknown process grid axis '", axis, "'");
  return -1;
}

bool ProcessGrid::has(std::string_view axis) const { return index_of(axis) >= 0; }

int ProcessGrid::size(std::string_view axis) const {
  const int i = index_of(axis);
  return i < 0 ? 1 : *axes_[i].size;
}

int ProcessGrid::coord(std::string_view axis) const {
  const int i = index_of(axis);
  return i < 0 ? 0 : coords_[i];
}

Communicator& ProcessGrid::comm(std::string_view axis) {
  const int i = index_of(axis);
  STRATA_CHECK(i >= 0, "the process grid has no axis '", axis, "'");
  return nccl_.empty() ? static_cast<Communicator&>(*mpi_[i]) : *nccl_[i];
}

MpiCommunicator& ProcessGrid::mpi_comm(std::string_view axis) {
  const int i = index_of(axis);
  STRATA_CHECK(i >= 0, "the process grid has no axis '", axis, "'");
  return *mpi_[i];
}

int ProcessGrid::rank_of(const std::vector<int>& coords) const {
  STRATA_CHECK(coords.size() == axes_.size(), coords.size(), " coordinates for a grid of ", axes_.size(), " axes");
  int rank = 0;
  for (size_t i = 0; i < axes_.size(); ++i) {
    STRATA_CHECK(coords[i] >= 0 && coords[i] < *axes_[i].size, "no rank at ", axes_[i].name, " ", coords[i],
                 " of a grid with ", axes_[i].name, " ", *axes_[i].size);
    rank += coords[i] * strides_[i];
  }
  return rank;
}

std::vector<int> ProcessGrid::coords_of(int world_rank) const {
  const int n = static_cast<int>(axes_.size());
  STRATA_CHECK(world_rank >= 0 && world_rank < (n ? strides_[0] * *axes_[0].size : 1), "no world rank ", world_rank,
               " in the grid");
  std::vector<int> coords(n);
  for (int i = 0; i < n; ++i) coords[i] = world_rank / strides_[i] % *axes_[i].size;
  return coords;
}

int ProcessGrid::rank_of(int stage, int replica) const {
  const int pp = index_of("pp"), dp = index_of("dp");
  STRATA_CHECK(stage >= 0 && stage < pp_size() && replica >= 0 && replica < dp_size(), "no rank at stage ", stage,
               ", replica ", replica, " of a ", pp_size(), " x ", dp_size(), " grid");
  std::vector<int> coords = coords_;
  if (pp >= 0) coords[pp] = stage;
  if (dp >= 0) coords[dp] = replica;
  return rank_of(coords);
}

std::string ProcessGrid::describe() const { return describe(axes_, strides_[0] * *axes_[0].size); }

std::string ProcessGrid::describe(std::vector<Axis> axes, int world_size) {
  resolve(axes, world_size);
  const int n = static_cast<int>(axes.size());
  std::vector<int> strides(n, 1);
  for (int i = n - 2; i >= 0; --i) strides[i] = strides[i + 1] * *axes[i + 1].size;
  std::ostringstream os;
  os << "process grid: ";
  for (int i = 0; i < n; ++i) os << (i ? " x " : "") << axes[i].name << ' ' << *axes[i].size;
  os << " = " << world_size << (world_size == 1 ? " rank" : " ranks");
  if (n > 1) os << ", " << axes.back().name << " fastest";
  for (int i = 0; i < n; ++i) {
    os << "\n  " << axes[i].name << " groups:";
    // Each group once, by its first member (coordinate 0 on this axis), in world rank order.
    for (int first = 0; first < world_size; ++first) {
      if (first / strides[i] % *axes[i].size != 0) continue;
      os << " [";
      for (int c = 0; c < *axes[i].size; ++c) os << (c ? " " : "") << first + c * strides[i];
      os << ']';
    }
  }
  return os.str();
}

}  // namespace strata::parallel
