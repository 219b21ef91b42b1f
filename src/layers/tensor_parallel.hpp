// Tensor parallelism as the layers see it (Megatron-LM, Shoeybi et al. 2019): a layer's
// parameters split across the T ranks of a tensor-parallel group, each rank holding one shard,
// and the collectives that join the shards' results. The group is implemented in src/parallel
// over a Communicator (parallel::TensorParallel); layers see only this interface, so the layer
// stack does not depend on the transport.
#pragma once

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
};

// Which part of a full tensor a rank holds. parts == 1: all of it (a replicated parameter:
// LayerNorm, the bias of a row-parallel Linear, wpe). Otherwise dimension `dim` of the full
// tensor is cut into `segments` equal blocks (c_attn's q | k | v: 3; else 1) and each block
// into `parts` equal pieces; the rank holds piece `index` of every block, in block order.
struct TensorSplit {
  int parts = 1;
  int index = 0;
  int dim = 0;
  int segments = 1;
  bool split() const { return parts > 1; }
};

// The full tensor's shape for a shard of shape `local`.
Shape full_shape(const Shape& local, const TensorSplit& split);
// Copies between a full tensor and the shard `split` names (contiguous; any devices and float
// dtypes, converted as ops::copy does; a plain memcpy per run on the host with one dtype):
// take_shard fills `local` from `full`, put_shard writes `local` into its place in `full`.
// With parts == 1 both are plain copies.
void take_shard(const Tensor& full, const TensorSplit& split, const Tensor& local);
void put_shard(const Tensor& local, const TensorSplit& split, const Tensor& full);

}  // namespace strata::layers
