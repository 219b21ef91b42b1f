// The world as a grid of axes, MPI-free: which world rank sits at which coordinates. Axes are
// listed slowest-varying first and world ranks count through the grid in row-major order, so the
// last (fastest-varying) axis joins consecutive ranks. Train's grid is {pp, dp, tp}: world rank =
// (stage * dp + replica) * tp + tp coordinate, so a tensor-parallel group (the chattiest, every
// layer) is tp consecutive ranks on one node and the gradient sync stays inside a node before
// pipeline traffic does. pp = 2, dp = 2, tp = 2: tp groups {0 1} {2 3} {4 5} {6 7}; dp groups
// {0 2} {1 3} {4 6} {5 7}; pp groups {0 4} {1 5} {2 6} {3 7}.
//
// ProcessGrid (the communicators of a launched world) and the planner (--dry-run and --plan for
// any --world N) both take their rank arithmetic from here.
#pragma once

#include <optional>
#include <string>
#include <vector>

namespace strata::parallel {

// The axes a grid knows; each is the command-line flag --<axis_name>.
enum class Axis { Pipeline, Data, Tensor };
const char* axis_name(Axis axis);  // "pp", "dp", "tp"

struct AxisSize {
  Axis axis;
  std::optional<int> size;  // empty: the world size divided by the other axes' sizes
};

class GridLayout {
 public:
  // `axes` slowest-varying first, each at most once. Throws an Input error (the same on every
  // rank: it uses nothing but its arguments) when the list is empty, names an axis twice, leaves
  // more than one size open, has a size below 1 ("--pp 0 must be at least 1"), or sizes that do
  // not make up the world ("--pp 3 does not divide the 4 ranks of the world" with a size open,
  // "--pp 2 x --dp 1 x --tp 1 does not match the 4 ranks of the world" without).
  GridLayout(std::vector<AxisSize> axes, int world_size);
  // Train's grid: {pp, dp = the rest, tp}, tp only when above 1.
  static GridLayout train(int pp, int tp, int world_size);

  // The axes, slowest-varying first, every size filled in.
  const std::vector<AxisSize>& axes() const { return axes_; }
  int world_size() const { return world_size_; }
  // An axis the grid does not list has size 1 and coordinate 0.
  bool has(Axis axis) const { return index_of(axis) >= 0; }
  int size(Axis axis) const;
  // World rank `rank`'s coordinate along `axis`, and all of them in axes() order.
  int coord(Axis axis, int rank) const;
  std::vector<int> coords_of(int rank) const;
  // World rank at `coords` (one per axis in axes() order).
  int rank_of(const std::vector<int>& coords) const;
  // Position of `axis` in axes(), -1 when the grid does not list it.
  int index_of(Axis axis) const;

  int stage(int rank) const { return coord(Axis::Pipeline, rank); }
  int replica(int rank) const { return coord(Axis::Data, rank); }
  int tp_rank(int rank) const { return coord(Axis::Tensor, rank); }

  // For rank 0 to print: the grid's shape, then per axis the world ranks of each of its groups,
  // e.g. for pp = 2, dp = 3 (lines separated by '\n', none at the end):
  //   process grid: pp 2 x dp 3 = 6 ranks, dp fastest
  //     pp groups: [0 3] [1 4] [2 5]
  //     dp groups: [0 1 2] [3 4 5]
  std::string describe() const;

 private:
  std::vector<AxisSize> axes_;
  std::vector<int> strides_;  // world ranks between neighbours along each axis
  int world_size_;
};

}  // namespace strata::parallel
