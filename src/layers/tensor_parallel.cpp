// Copies between a full tensor and a tensor-parallel shard (TensorSplit): the arithmetic that
// initialisation and checkpoints share, so a shard is always a slice of the tp = 1 tensor.
#include "layers/tensor_parallel.hpp"

#include <algorithm>
#include <cstring>

#include "core/ops.hpp"

namespace strata::layers {

namespace {

void check_split(const Shape& local, const TensorSplit& split) {
  STRATA_CHECK(split.parts >= 1 && split.index >= 0 && split.index < split.parts && split.segments >= 1 &&
                   split.replicas >= 1 && split.parts % split.replicas == 0,
               "tensor split: piece ", split.index, " of ", split.parts, " in ", split.segments, " segments, ",
               split.replicas, " replicas");
  if (!split.split()) return;
  STRATA_CHECK(split.dim >= 0 && split.dim < static_cast<int>(local.size()), "tensor split along dimension ", split.dim,
               " of a shard ", shape_str(local));
  STRATA_CHECK(local[split.dim] % split.segments == 0, "a shard ", shape_str(local), " does not hold ", split.segments,
               " equal segments along dimension ", split.dim);
  if (split.extent > 0)
    STRATA_CHECK(split.dim == 0 && split.segments == 1 && split.replicas == 1 &&
                     local[0] == rows_per_piece(split.extent, split.parts),
                 "a shard ", shape_str(local), " of ", split.extent, " rows padded over ", split.parts, " pieces");
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
  const int64_t segment = piece * split.pieces();       // rows of one segment in the full tensor
  const int64_t run = piece * inner;                    // contiguous elements per copy
  // Padding rows (the shard's tail, with extent) are copied from nowhere: zeroed in the shard.
  const int64_t stored = stored_elements(s, split);
  // Same dtype on the host: plain memcpy per run; otherwise ops::copy converts per run.
  const bool host = full.device().is_cpu() && local.device().is_cpu() && full.dtype() == local.dtype();
  const size_t esize = dtype_size(local.dtype());
  for (int64_t o = 0; o < outer; ++o)
    for (int64_t g = 0; g < split.segments; ++g) {
      const int64_t at_local = (o * split.segments + g) * run;
      const int64_t at_full = ((o * split.segments + g) * segment + split.piece() * piece) * inner;
      const int64_t n = std::clamp<int64_t>(stored - at_local, 0, run);
      if (n > 0 && host) {
        char* l = static_cast<char*>(local.raw()) + at_local * esize;
        char* f = static_cast<char*>(full.raw()) + at_full * esize;
        to_local ? std::memcpy(l, f, n * esize) : std::memcpy(f, l, n * esize);
      } else if (n > 0) {
        const Tensor l = local.view(at_local, {n}), f = full.view(at_full, {n});
        to_local ? ops::copy(f, l) : ops::copy(l, f);
      }
      if (to_local && n < run) ops::fill(local.view(at_local + n, {run - n}), 0.0f);
    }
}

// Boxes of elements [a, b) of the row-major array `s` from dimension k on (the dimensions before
// k fixed at `prefix`), in order: a partial first row, whole rows, a partial last row.
void decompose(const Shape& s, std::vector<int64_t>& prefix, int64_t a, int64_t b, std::vector<Box>& out) {
  if (a >= b) return;
  const size_t k = prefix.size(), n = s.size();
  if (n == 0) {  // a scalar: one element, no dimensions
    out.push_back({});
    return;
  }
  int64_t inner = 1;
  for (size_t i = k + 1; i < n; ++i) inner *= s[i];
  const auto within_row = [&](int64_t row, int64_t lo, int64_t hi) {
    prefix.push_back(row);
    decompose(s, prefix, lo, hi, out);
    prefix.pop_back();
  };
  int64_t row = a / inner;
  if (a % inner != 0) {
    const int64_t stop = std::min(b, (row + 1) * inner);
    within_row(row, a - row * inner, stop - row * inner);
    a = stop;
    ++row;
  }
  const int64_t rows = b / inner - row;
  if (a < b && rows > 0) {
    Box box{prefix, std::vector<int64_t>(k, 1)};
    box.start.push_back(row);
    box.count.push_back(rows);
    for (size_t i = k + 1; i < n; ++i) {
      box.start.push_back(0);
      box.count.push_back(s[i]);
    }
    out.push_back(std::move(box));
    a += rows * inner;
    row += rows;
  }
  if (a < b) within_row(row, 0, b - a);
}

}  // namespace

std::vector<Box> shard_boxes(const Shape& local, const TensorSplit& split, int64_t begin, int64_t end) {
  check_split(local, split);
  STRATA_CHECK(0 <= begin && begin <= end && end <= shape_numel(local), "elements [", begin, ", ", end, ") of a shard ",
               shape_str(local));
  end = begin + stored_part(local, split, begin, end);
  std::vector<Box> boxes;
  std::vector<int64_t> prefix;
  decompose(local, prefix, begin, end, boxes);
  if (!split.split()) return boxes;
  // Along the split dimension a shard's rows are pieces of each segment: cut each box at the
  // pieces' ends and move each cut to its place in the full tensor (a monotone map, so the
  // order of elements is kept).
  const size_t d = static_cast<size_t>(split.dim);
  const int64_t piece = local[d] / split.segments, segment = piece * split.pieces();
  std::vector<Box> placed;
  for (const Box& box : boxes)
    for (int64_t r = box.start[d], stop = box.start[d] + box.count[d]; r < stop;) {
      const int64_t g = r / piece, w = r % piece, take = std::min(stop - r, piece - w);
      Box cut = box;
      cut.start[d] = g * segment + split.piece() * piece + w;
      cut.count[d] = take;
      placed.push_back(std::move(cut));
      r += take;
    }
  return placed;
}

std::vector<std::pair<int64_t, int64_t>> shard_runs(const Shape& local, const TensorSplit& split, int64_t begin,
                                                    int64_t end) {
  check_split(local, split);
  STRATA_CHECK(0 <= begin && begin <= end && end <= shape_numel(local), "elements [", begin, ", ", end, ") of a shard ",
               shape_str(local));
  end = begin + stored_part(local, split, begin, end);
  std::vector<std::pair<int64_t, int64_t>> runs;
  const auto add = [&](int64_t at, int64_t n) {
    if (!runs.empty() && runs.back().first + runs.back().second == at)
      runs.back().second += n;
    else
      runs.emplace_back(at, n);
  };
  if (begin == end) return runs;
  if (!split.split()) {
    add(begin, end - begin);
    return runs;
  }
  // As copy_runs: the shard is blocks of `run` elements, block (o, g) at the full tensor's
  // ((o * segments + g) * segment + index * piece) * inner.
  int64_t inner = 1;
  for (size_t i = static_cast<size_t>(split.dim) + 1; i < local.size(); ++i) inner *= local[i];
  const int64_t piece = local[static_cast<size_t>(split.dim)] / split.segments, segment = piece * split.pieces();
  const int64_t run = piece * inner;
  for (int64_t at = begin; at < end;) {
    const int64_t block = at / run, within = at % run, take = std::min(end - at, run - within);
    add((block * segment + split.piece() * piece) * inner + within, take);
    at += take;
  }
  return runs;
}

TensorSplit row_split(int parts, int index, int64_t rows) {
  TensorSplit split{parts, index, 0, 1, 1, 0};
  if (rows % parts != 0) split.extent = rows;
  return split;
}

int64_t rows_per_piece(int64_t rows, int parts) { return (rows + parts - 1) / parts; }

int64_t real_rows(int64_t rows, int parts, int index) {
  const int64_t per_piece = rows_per_piece(rows, parts);
  return std::clamp<int64_t>(rows - index * per_piece, 0, per_piece);
}

Shape full_shape(const Shape& local, const TensorSplit& split) {
  check_split(local, split);
  Shape full = local;
  if (split.extent > 0)
    full[0] = split.extent;
  else if (split.split())
    full[split.dim] *= split.pieces();
  return full;
}

int64_t stored_elements(const Shape& local, const TensorSplit& split) {
  check_split(local, split);
  const int64_t numel = shape_numel(local);
  if (split.extent == 0) return numel;
  // check_split made local[0] the rows_per_piece of the extent.
  return local[0] == 0 ? 0 : numel / local[0] * real_rows(split.extent, split.parts, split.index);
}

int64_t stored_part(const Shape& local, const TensorSplit& split, int64_t begin, int64_t end) {
  return std::clamp<int64_t>(stored_elements(local, split) - begin, 0, end - begin);
}

void take_shard(const Tensor& full, const TensorSplit& split, const Tensor& local) {
  copy_runs(full, split, local, true);
}

void put_shard(const Tensor& local, const TensorSplit& split, const Tensor& full) {
  copy_runs(full, split, local, false);
}

// The collectives move contiguous blocks, one per rank, while rank r's part of a (B, T, ...)
// tensor is B runs (its positions in each sample): the parts are laid out as (size, B, T/size,
// ...) for the wire, which is merge_heads' and split_heads' (B', H, T', Dh) <-> (B', T', H Dh)
// permutation with B' = 1, H = size, T' = B and Dh = a part of a sample.
Tensor gather_sequence(TensorParallelGroup& tp, const Tensor& part) {
  const int64_t t = tp.size(), b = part.dim(0), per_sample = part.numel() / std::max<int64_t>(b, 1);
  Shape shape = part.shape();
  shape.at(1) *= t;
  Tensor whole = Tensor::empty(shape, part.dtype(), part.device());
  if (b == 1) {
    tp.all_gather(part, whole);
    return whole;
  }
  const Tensor wire = Tensor::empty({1, t, b, per_sample}, part.dtype(), part.device());
  tp.all_gather(part, wire);
  ops::merge_heads(wire, whole.reshape({1, b, t * per_sample}));
  return whole;
}

Tensor scatter_sequence(TensorParallelGroup& tp, const Tensor& whole) {
  const int64_t t = tp.size(), b = whole.dim(0);
  STRATA_CHECK(whole.ndim() >= 2 && whole.dim(1) % t == 0, "a sequence of ", whole.str(), " cut into ", t, " parts");
  Shape shape = whole.shape();
  shape.at(1) /= t;
  Tensor part = Tensor::empty(shape, whole.dtype(), whole.device());
  if (b == 1) {
    tp.reduce_scatter_sum(whole, part);
    return part;
  }
  const int64_t per_sample = part.numel() / b;
  const Tensor wire = Tensor::empty({1, t, b, per_sample}, whole.dtype(), whole.device());
  ops::split_heads(whole.reshape({1, b, t * per_sample}), wire);
  tp.reduce_scatter_sum(wire, part);
  return part;
}

void sum_sequence_parallel_grads(TensorParallelGroup& tp, const std::vector<Tensor>& grads,
                                 const std::function<void(const std::vector<Tensor>& stand_ins)>& backward) {
  int64_t total = 0;
  for (const Tensor& g : grads) total += g.numel();
  const Tensor all = Tensor::zeros({total}, grads.at(0).dtype(), grads.at(0).device());
  std::vector<Tensor> stand_ins;
  int64_t at = 0;
  for (const Tensor& g : grads) {
    stand_ins.push_back(all.view(at, g.shape()));
    at += g.numel();
  }
  backward(stand_ins);
  tp.all_reduce_sum(all);
  for (size_t i = 0; i < grads.size(); ++i) ops::axpy(1.0f, stand_ins[i], grads[i]);
}

void set_sequence_part(const TensorParallelGroup& tp, const Tensor& x, int64_t& sample_numel, int64_t& part_offset) {
  const int64_t part = x.numel() / std::max<int64_t>(x.dim(0), 1);
  sample_numel = part * tp.size();
  part_offset = part * tp.rank();
}

}  // namespace strata::layers
