// Copies between a full tensor and a tensor-parallel shard (TensorSplit): the arithmetic that
// initialisation and checkpoints share, so a shard is always a slice of the tp = 1 tensor.
#include "layers/tensor_parallel.hpp"

#include <cstring>

#include "core/ops.hpp"

namespace strata::layers {

namespace {

void check_split(const Shape& local, const TensorSplit& split) {
  STRATA_CHECK(split.parts >= 1 && split.index >= 0 && split.index < split.parts && split.segments >= 1,
               "tensor split: piece ", split.index, " of ", split.parts, " in ", split.segments, " segments");
  if (!split.split()) return;
  STRATA_CHECK(split.dim >= 0 && split.dim < static_cast<int>(local.size()), "tensor split along dimension ", split.dim,
               " of a shard ", shape_str(local));
  STRATA_CHECK(local[split.dim] % split.segments == 0, "a shard ", shape_str(local), " does not hold ", split.segments,
               " equal segments along dimension ", split.dim);
}

// Copies the shard's runs: for each outer index (the dimensions before `dim`) and segment, the
// shard's `piece` rows of dimension `dim` (times the inner dimensions) sit at the full tensor's
// segment start + index * piece. to_local: full -> local, else local -> full.
void copy_runs(const Tensor& full, const TensorSplit& split, const Tensor& local, bool to_local) {
  check_split(local.shape(), split);
  STRATA_CHECK(full.shape() == full_shape(local.shape(), split), "a full tensor ", full.str(),
               " does not hold a shard ", local.str(), " split ", split.parts, " ways along dimension ", split.dim);
  if (!split.split()) {
    to_local ? ops::copy(full, local) : ops::copy(local, full);
    return;
  }
  const Shape& s = local.shape();
  int64_t outer = 1, inner = 1;
  for (int i = 0; i < split.dim; ++i) outer *= s[i];
  for (size_t i = split.dim + 1; i < s.size(); ++i) inner *= s[i];
  const int64_t piece = s[split.dim] / split.segments;  // rows of one segment this rank holds
  const int64_t segment = piece * split.parts;          // rows of one segment in the full tensor
  const int64_t run = piece * inner;                    // contiguous elements per copy
  // Same dtype on the host: plain memcpy per run; otherwise ops::copy converts per run.
  const bool host = full.device().is_cpu() && local.device().is_cpu() && full.dtype() == local.dtype();
  const size_t esize = dtype_size(local.dtype());
  for (int64_t o = 0; o < outer; ++o)
    for (int64_t g = 0; g < split.segments; ++g) {
      const int64_t at_local = (o * split.segments + g) * run;
      const int64_t at_full = ((o * split.segments + g) * segment + split.index * piece) * inner;
      if (host) {
        char* l = static_cast<char*>(local.raw()) + at_local * esize;
        char* f = static_cast<char*>(full.raw()) + at_full * esize;
        to_local ? std::memcpy(l, f, run * esize) : std::memcpy(f, l, run * esize);
      } else {
        const Tensor l = local.view(at_local, {run}), f = full.view(at_full, {run});
        to_local ? ops::copy(f, l) : ops::copy(l, f);
      }
    }
}

}  // namespace

Shape full_shape(const Shape& local, const TensorSplit& split) {
  check_split(local, split);
  Shape full = local;
  if (split.split()) full[split.dim] *= split.parts;
  return full;
}

void take_shard(const Tensor& full, const TensorSplit& split, const Tensor& local) {
  copy_runs(full, split, local, true);
}

void put_shard(const Tensor& local, const TensorSplit& split, const Tensor& full) {
  copy_runs(full, split, local, false);
}

}  // namespace strata::layers
