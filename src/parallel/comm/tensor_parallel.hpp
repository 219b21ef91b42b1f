// The tensor-parallel group the layers see (layers::TensorParallelGroup), over the grid's "tp"
// communicator: the Megatron collectives inside a block run on it, blocking, in the order the
// layers call them (every rank of a tp group runs the same layers in the same order).
#pragma once

#include "layers/tensor_parallel.hpp"
#include "parallel/comm/communicator.hpp"

namespace strata::parallel {

class TensorParallel final : public layers::TensorParallelGroup {
 public:
  explicit TensorParallel(Communicator& comm) : comm_(comm) {}
  int rank() const override { return comm_.rank(); }
  int size() const override { return comm_.size(); }
  void all_reduce_sum(const Tensor& t) override { comm_.all_reduce(t, ReduceOp::Sum); }
  void all_gather(const Tensor& in, const Tensor& out) override { comm_.all_gather(in, out); }
  void reduce_scatter_sum(const Tensor& in, const Tensor& out) override {
    comm_.reduce_scatter(in, out, ReduceOp::Sum);
  }

 private:
  Communicator& comm_;
};

}  // namespace strata::parallel
