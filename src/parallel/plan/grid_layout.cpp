#include "parallel/plan/grid_layout.hpp"

#include <sstream>

#include "core/error.hpp"

namespace strata::parallel {

const char* axis_name(Axis axis) {
  switch (axis) {
    case Axis::Pipeline:
      return "pp";
    case Axis::Data:
      return "dp";
    case Axis::Tensor:
      return "tp";
  }
  return "?";
}

namespace {

// "--pp 2 x --tp 2" for the given axes.
std::string flags_str(const std::vector<const AxisSize*>& axes) {
  std::ostringstream os;
  for (size_t i = 0; i < axes.size(); ++i)
    os << (i ? " x --" : "--") << axis_name(axes[i]->axis) << ' ' << *axes[i]->size;
  return os.str();
}

// Checks `axes` against a world of `world_size` ranks and fills in the open size.
void resolve(std::vector<AxisSize>& axes, int world_size) {
  STRATA_REQUIRE(!axes.empty(), "a process grid needs at least one axis");
  AxisSize* open = nullptr;
  for (size_t i = 0; i < axes.size(); ++i) {
    AxisSize& axis = axes[i];
    for (size_t j = 0; j < i; ++j)
      STRATA_REQUIRE(axes[j].axis != axis.axis, "process grid axis '", axis_name(axis.axis), "' is given twice");
    if (!axis.size) {
      STRATA_REQUIRE(open == nullptr, "process grid axes ", open ? axis_name(open->axis) : "", " and ",
                     axis_name(axis.axis), " both take the rest of the world; at most one may");
      open = &axis;
    }
  }
  for (const AxisSize& axis : axes)
    if (axis.size) STRATA_REQUIRE(*axis.size >= 1, "--", axis_name(axis.axis), ' ', *axis.size, " must be at least 1");
  // Divide the world by each fixed size in turn: the product divides it iff every step does
  // (and nothing overflows).
  int rest = world_size;
  bool divides = true;
  for (const AxisSize& axis : axes) {
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
      std::vector<const AxisSize*> fixed;
      int64_t product = 1;
      for (const AxisSize& axis : axes)
        if (axis.size && *axis.size > 1) {
          fixed.push_back(&axis);
          product *= *axis.size;
        }
      // What would work: a world of a multiple of the product, or sizes dividing this world.
      std::string divisors;
      for (int d = 1; d <= world_size && divisors.size() < 60; ++d)
        if (world_size % d == 0) divisors += (divisors.empty() ? "" : ", ") + std::to_string(d);
      STRATA_THROW_INPUT(flags_str(fixed), " does not divide the ", world_size,
                         " ranks of the world: launch a multiple of ", product, " ranks (", product, ", ", 2 * product,
                         ", ", 3 * product, ", ...), or give sizes ", "whose product divides ", world_size, " (",
                         divisors, ")");
    }
    open->size = rest;
  } else if (!divides || rest != 1) {
    std::vector<const AxisSize*> all;
    for (const AxisSize& axis : axes) all.push_back(&axis);
    STRATA_THROW_INPUT(flags_str(all), " does not match the ", world_size, " ranks of the world");
  }
}

}  // namespace

GridLayout::GridLayout(std::vector<AxisSize> axes, int world_size) : axes_(std::move(axes)), world_size_(world_size) {
  resolve(axes_, world_size);
  const int n = static_cast<int>(axes_.size());
  strides_.assign(n, 1);
  for (int i = n - 2; i >= 0; --i) strides_[i] = strides_[i + 1] * *axes_[i + 1].size;
}

GridLayout GridLayout::train(int pp, int tp, int world_size) {
  std::vector<AxisSize> axes{{Axis::Pipeline, pp}, {Axis::Data, std::nullopt}};
  if (tp > 1) axes.push_back({Axis::Tensor, tp});
  return GridLayout(std::move(axes), world_size);
}

int GridLayout::index_of(Axis axis) const {
  for (size_t i = 0; i < axes_.size(); ++i)
    if (axes_[i].axis == axis) return static_cast<int>(i);
  return -1;
}

int GridLayout::size(Axis axis) const {
  const int i = index_of(axis);
  return i < 0 ? 1 : *axes_[i].size;
}

int GridLayout::coord(Axis axis, int rank) const {
  const int i = index_of(axis);
  STRATA_CHECK(rank >= 0 && rank < world_size_, "no world rank ", rank, " in a grid of ", world_size_);
  return i < 0 ? 0 : rank / strides_[i] % *axes_[i].size;
}

std::vector<int> GridLayout::coords_of(int rank) const {
  std::vector<int> coords;
  for (const AxisSize& a : axes_) coords.push_back(coord(a.axis, rank));
  return coords;
}

int GridLayout::rank_of(const std::vector<int>& coords) const {
  STRATA_CHECK(coords.size() == axes_.size(), coords.size(), " coordinates for a grid of ", axes_.size(), " axes");
  int rank = 0;
  for (size_t i = 0; i < axes_.size(); ++i) {
    const char* name = axis_name(axes_[i].axis);
    STRATA_CHECK(coords[i] >= 0 && coords[i] < *axes_[i].size, "no rank at ", name, " ", coords[i], " of a grid with ",
                 name, " ", *axes_[i].size);
    rank += coords[i] * strides_[i];
  }
  return rank;
}

std::string GridLayout::describe() const {
  const int n = static_cast<int>(axes_.size());
  std::ostringstream os;
  os << "process grid: ";
  for (int i = 0; i < n; ++i) os << (i ? " x " : "") << axis_name(axes_[i].axis) << ' ' << *axes_[i].size;
  os << " = " << world_size_ << (world_size_ == 1 ? " rank" : " ranks");
  if (n > 1) os << ", " << axis_name(axes_.back().axis) << " fastest";
  for (int i = 0; i < n; ++i) {
    os << "\n  " << axis_name(axes_[i].axis) << " groups:";
    // Each group once, by its first member (coordinate 0 on this axis), in world rank order.
    for (int first = 0; first < world_size_; ++first) {
      if (first / strides_[i] % *axes_[i].size != 0) continue;
      os << " [";
      for (int c = 0; c < *axes_[i].size; ++c) os << (c ? " " : "") << first + c * strides_[i];
      os << ']';
    }
  }
  return os.str();
}

}  // namespace strata::parallel
