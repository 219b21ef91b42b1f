// Tensor parallelism as the layers see it (Megatron-LM, Shoeybi et al. 2019): a layer's
// parameters split across the T ranks of a tensor-parallel group, each rank holding one shard,
// and the collectives that join the shards' results. The group is implemented in src/parallel
// over a Communicator (parallel::TensorParallel); layers see only this interface, so the layer
// stack does not depend on the transport.
#pragma once

#include <functional>
#include <vector>

#include "core/tensor.hpp"

namespace strata::layers {

class TensorParallelGroup {
 public:
  virtual ~TensorParallelGroup() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // In place: t = sum over the group's ranks, the same bits on every rank (replicated layers
  // after a row-parallel one must stay identical on every rank).
  virtual void all_reduce_sum(const Tensor& t) = 0;
  // out (size() x in.numel() elements): block r is rank r's `in`.
  virtual void all_gather(const Tensor& in, const Tensor& out) = 0;
  // out (in.numel() / size() elements): block rank() of the sum over the group's ranks of `in`.
  virtual void reduce_scatter_sum(const Tensor& in, const Tensor& out) = 0;

  // Megatron's sequence parallelism (Korthikanti et al. 2022; --sequence-parallel): between the
  // tensor-parallel regions (the attention's and the MLP's maps, the vocabulary-parallel embedding
  // and head) the activations (B, T, D) are cut along T, rank r holding positions
  // [r T/size, (r+1) T/size), so the norms, dropouts and residual adds run on T/size of the
  // sequence and keep T/size of their activations. A region all-gathers its input along T
  // (gather_sequence) where it would have taken the replicated whole, and reduce-scatters its
  // output (scatter_sequence) where it would have all-reduced it; backward the other way round.
  // The layers built with this group read it at construction.
  bool sequence_parallel() const { return sequence_parallel_ && size() > 1; }
  void set_sequence_parallel(bool on) { sequence_parallel_ = on; }

 private:
  bool sequence_parallel_ = false;
};

// The group if its layers cut the sequence (TensorParallelGroup::sequence_parallel), else null.
inline TensorParallelGroup* sequence_parallel_group(TensorParallelGroup* tp) {
  return tp != nullptr && tp->sequence_parallel() ? tp : nullptr;
}
// (B, T/size, ...) parts of the group's ranks -> the whole (B, T, ...), every rank's part in its
// place (positions [r T/size, (r+1) T/size) from rank r).
Tensor gather_sequence(TensorParallelGroup& tp, const Tensor& part);
// (B, T, ...) on every rank -> this rank's part (B, T/size, ...) of their sum.
Tensor scatter_sequence(TensorParallelGroup& tp, const Tensor& whole);
// Sequence parallelism: a replicated layer (a norm) that saw only this rank's part of the sequence
// has only that part's share of its parameters' gradients. backward(stand_ins) accumulates them
// into zeroed stand-ins of `grads` (same shapes); one all-reduce sums those over the group and
// they are added to `grads`, the same bits on every rank (per micro-batch, so accumulation over
// micro-batches and gradients streamed piece by piece stay right).
void sum_sequence_parallel_grads(TensorParallelGroup& tp, const std::vector<Tensor>& grads,
                                 const std::function<void(const std::vector<Tensor>& stand_ins)>& backward);
// The dropout key's part of each sample this rank holds of a sequence-parallel (B, T/size, ...)
// tensor `x` (ops::DropoutKey::sample_numel, part_offset).
void set_sequence_part(const TensorParallelGroup& tp, const Tensor& x, int64_t& sample_numel, int64_t& part_offset);

// Which part of a full tensor a rank holds. parts == 1: all of it (a replicated parameter:
// LayerNorm, the bias of a row-parallel Linear, wpe). Otherwise dimension `dim` of the full
// tensor is cut into `segments` equal blocks (c_attn's q | k | v: 3; else 1) and each block
// into `parts` equal pieces; the rank holds piece `index` of every block, in block order.
// replicas > 1: each piece is held by `replicas` consecutive ranks (the kv heads of grouped-query
// attention when the group has more ranks than kv heads: Megatron's replication), so the
// block is cut into parts / replicas pieces and rank `index` holds piece index / replicas; the
// replicas' values are equal (their gradients are summed by the layer).
// extent > 0: the full tensor has `extent` rows along dimension 0, fewer than the pieces hold
// (a vocabulary that tp does not divide, Megatron's padded vocabulary): every rank holds
// ceil(extent / parts) rows and the rows past `extent` are padding, zero and outside the full
// tensor, so the last pieces are shorter. Only whole rows (dim 0, one segment, no replicas).
struct TensorSplit {
  int parts = 1;
  int index = 0;
  int dim = 0;
  int segments = 1;
  int replicas = 1;
  int64_t extent = 0;
  bool split() const { return parts > 1; }
  int pieces() const { return parts / replicas; }  // distinct pieces of each block
  int piece() const { return index / replicas; }   // the one this rank holds
  // The first of the ranks holding this piece (the one that writes or counts it).
  bool primary() const { return index % replicas == 0; }
};

// Rows [0, rows) of a tensor cut into `parts` pieces of whole rows, this rank's piece `index`:
// even pieces, or ceil(rows / parts) each with the last ones padded (extent = rows).
TensorSplit row_split(int parts, int index, int64_t rows);
// The rows a piece of row_split(parts, *, rows) holds, padding included: ceil(rows / parts).
int64_t rows_per_piece(int64_t rows, int parts);
// Of those, the ones piece `index` holds of the `rows` (the rest padding): its first ones.
int64_t real_rows(int64_t rows, int parts, int index);

// The full tensor's shape for a shard of shape `local`.
Shape full_shape(const Shape& local, const TensorSplit& split);
// How many of the shard's first elements lie in the full tensor: all of them, or with padding
// rows (extent) the rows before them. Padding is always the shard's tail.
int64_t stored_elements(const Shape& local, const TensorSplit& split);
// Of the part [begin, end) of the shard, how many (its first ones) lie in the full tensor.
int64_t stored_part(const Shape& local, const TensorSplit& split, int64_t begin, int64_t end);
// Copies between a full tensor and the shard `split` names (contiguous; any devices and float
// dtypes, converted as ops::copy does; a plain memcpy per run on the host with one dtype):
// take_shard fills `local` from `full`, put_shard writes `local` into its place in `full`.
// With parts == 1 both are plain copies.
void take_shard(const Tensor& full, const TensorSplit& split, const Tensor& local);
void put_shard(const Tensor& local, const TensorSplit& split, const Tensor& full);

// With padding rows, take_shard zeroes them and put_shard leaves them out.

// Where a part of a shard lies in the full tensor, for reading and writing it in place (a
// parallel checkpoint: each rank its own hyperslabs of the file's full tensors). The part is
// elements [begin, end) of the shard (of shape `local`) in its row-major order, e.g. a ZeRO
// shard's overlap with the entry; of a padded shard, only its elements before
// stored_elements() (padding has no place in the full tensor), a prefix of the part.
struct Box {
  std::vector<int64_t> start, count;  // per dimension of the full tensor
};
// Disjoint boxes of the full tensor holding exactly the part; visited in the full tensor's
// row-major order, their elements are the part's, in order (the order HDF5 reads and writes a
// union of hyperslabs in). At most 2 x rank boxes per segment row.
std::vector<Box> shard_boxes(const Shape& local, const TensorSplit& split, int64_t begin, int64_t end);
// The same part as runs contiguous in the full tensor, {full offset, length} in elements, in the
// part's order (increasing offsets), neighbours merged.
std::vector<std::pair<int64_t, int64_t>> shard_runs(const Shape& local, const TensorSplit& split, int64_t begin,
                                                    int64_t end);

}  // namespace strata::layers
