// StateGather: full tensors to rank 0 (tensor by tensor, piece by piece) and back.
#include "parallel/stage/state_gather.hpp"

#include <algorithm>

#include "core/allocator.hpp"
#include "core/ops.hpp"
#include "layers/parameter_store.hpp"

namespace strata::parallel {

namespace {

// Checkpoints hold f32 host tensors whatever the precision and device of the run.
Tensor host_f32(const Tensor& t) {
  if (!t.defined() || (t.dtype() == DType::F32 && t.device().is_cpu())) return t;
  const Tensor h = Tensor::empty(t.shape());
  ops::copy(t, h);
  return h;
}

// The same split, naming tensor-parallel rank `index`'s shard.
layers::TensorSplit with_index(layers::TensorSplit split, int index) {
  split.index = index;
  return split;
}

}  // namespace

namespace {

int64_t held_f32(const Shape& shape) {
  return static_cast<int64_t>(
      HostCachingAllocator::size_class(static_cast<size_t>(shape_numel(shape)) * sizeof(float)));
}

}  // namespace

int64_t StateGather::planned_bytes(const layers::Model& model) {
  int64_t most = 0;
  for (const layers::ParamEntry& e : layers::ParameterStore::layout(model, 0, model.size()))
    most = std::max(most, held_f32(e.full_shape()) + 3 * held_f32(e.shape));
  return most;
}

int64_t StateGather::snapshot_bytes(const layers::Model& model, const layers::OptimizerConfig& optimizer, DType dtype,
                                    bool size_classes) {
  const int states = layers::Optimizer::state_tensors(optimizer) + (dtype == DType::F32 ? 0 : 1);
  int64_t bytes = 0;
  for (const layers::ParamEntry& e : layers::ParameterStore::layout(model, 0, model.size())) {
    const Shape full = e.full_shape();
    const int64_t one = size_classes ? held_f32(full) : shape_numel(full) * static_cast<int64_t>(sizeof(float));
    bytes += one * (1 + (e.trainable ? states : 0));
  }
  return bytes;
}

StateGather::StateGather(ProcessGrid& grid, const layers::Model& model, std::vector<StageRange> stages,
                         std::vector<DataParallel*> mine)
    : grid_(grid), model_(model), stages_(std::move(stages)), mine_(std::move(mine)) {
  STRATA_CHECK(!mine_.empty() && stages_.size() == mine_.size() * static_cast<size_t>(grid_.pp_size()),
               "state gather: ", stages_.size(), " stages for ", grid_.pp_size(), " pipeline ranks of ", mine_.size(),
               " chunks");
}

int StateGather::rank_at(int stage, int replica, int tp_rank) const {
  std::vector<int> coords{stage, replica};
  if (grid_.has(Axis::Tensor)) coords.push_back(tp_rank);
  return grid_.layout().rank_of(coords);
}

void StateGather::gather(const Write& write) {
  Communicator& world = grid_.world();
  const int rank = world.rank();
  // Model tensors: replica 0 of each stage sends each one whole (each tensor-parallel rank its
  // shard; a parameter they all hold whole, tp rank 0 alone); with sharded parameters every
  // replica of the stage takes part in gathering it first.
  for (size_t vs = 0; vs < stages_.size(); ++vs) {
    const int s = pipeline_rank(vs);
    const bool mine = grid_.stage() == s;
    DataParallel& chunk = *mine_[chunk_of(vs)];
    const bool sends = mine && grid_.replica() == 0;
    if (rank != 0 && !sends && !(mine && chunk.ownership().shards_params())) continue;
    const StageRange r = stages_[vs];
    int tag = 0;
    for (const layers::ParamEntry& e : layers::ParameterStore::layout(model_, r.begin, r.end)) {
      tag = (tag + 1) % kMaxTag;
      const Tensor value = mine ? host_f32(chunk.full_value(e)) : Tensor();
      const Tensor full = rank == 0 ? Tensor::empty(e.full_shape()) : Tensor();
      for (int t = 0; t < e.split.parts; ++t) {
        const int owner = rank_at(s, 0, t);
        const layers::TensorSplit split = with_index(e.split, t);
        if (rank == owner && owner == 0) {
          layers::put_shard(value, split, full);
        } else if (rank == owner) {
          world.send(value, 0, tag);
        } else if (rank == 0) {
          const Tensor shard = Tensor::empty(e.shape);
          world.recv(shard, owner, tag);
          layers::put_shard(shard, split, full);
        }
      }
      if (rank == 0) write("", e, full);
    }
  }

  // Optimizer state: every rank owning part of a tensor's flat range sends that piece; rank 0
  // assembles each tensor-parallel shard, then the full tensor. Everyone walks the same
  // (stage, state, entry, tp rank, replica) order, so sends and receives pair up in order; the
  // tags only need to differ between neighbours.
  int tag = 0;
  for (size_t vs = 0; vs < stages_.size(); ++vs) {
    const int s = pipeline_rank(vs);
    const StageRange r = stages_[vs];
    DataParallel& chunk = *mine_[chunk_of(vs)];
    const Ownership owners = chunk.ownership_of(r);
    for (const auto& [state, local] : chunk.optimizer().state())
      for (const layers::ParamEntry& e : layers::ParameterStore::layout(model_, r.begin, r.end)) {
        if (!e.trainable) continue;
        const Tensor full = rank == 0 ? Tensor::empty(e.full_shape()) : Tensor();
        for (int t = 0; t < e.split.parts; ++t) {
          // An unsplit tensor is its only shard: assembled in place, without a second copy.
          const Tensor shard = rank != 0 ? Tensor() : e.split.split() ? Tensor::empty(e.shape) : full;
          for (int q = 0; q < owners.state_owners(); ++q) {
            const Shard range = owners.state(q);
            const layers::Overlap o = layers::overlap(e, range.begin, range.end);
            if (o.size == 0) continue;
            const int from = rank_at(s, q, t);
            tag = (tag + 1) % kMaxTag;
            if (from == rank && rank == 0)
              shard.view(o.in_entry, {o.size}).copy_from(local.view(o.in_range, {o.size}));
            else if (from == rank)
              world.send(host_f32(local.view(o.in_range, {o.size})), 0, tag);
            else if (rank == 0)
              world.recv(shard.view(o.in_entry, {o.size}), from, tag);
          }
          if (rank == 0 && e.split.split()) layers::put_shard(shard, with_index(e.split, t), full);
        }
        if (rank == 0) write(state, e, full);
      }
  }
}

void StateGather::write_parts(const WritePart& part) {
  const int tp_rank = grid_.has(Axis::Tensor) ? grid_.tp_rank() : 0;
  // Of a tensor every tensor-parallel rank holds whole, tp rank 0 writes; of a replicated shard, its first holder.
  const auto writes_shard = [&](const layers::ParamEntry& e) {
    return e.split.split() ? e.split.primary() : tp_rank == 0;
  };
  for (size_t vs = 0; vs < stages_.size(); ++vs) {
    const bool mine = grid_.stage() == pipeline_rank(vs);
    DataParallel& chunk = *mine_[chunk_of(vs)];
    const StageRange r = stages_[vs];
    for (const layers::ParamEntry& e : layers::ParameterStore::layout(model_, r.begin, r.end)) {
      const bool writes = mine && grid_.replica() == 0 && writes_shard(e);
      Tensor value;
      if (writes || (mine && chunk.ownership().shards_params())) value = chunk.full_value(e);  // ZeRO 3: collective
      part("", e, 0, writes ? shape_numel(e.shape) : 0, writes ? host_f32(value) : Tensor());
    }
  }
  for (size_t vs = 0; vs < stages_.size(); ++vs) {
    const bool mine = grid_.stage() == pipeline_rank(vs);
    DataParallel& chunk = *mine_[chunk_of(vs)];
    const StageRange r = stages_[vs];
    const Ownership owners = chunk.ownership_of(r);
    const Shard range = grid_.replica() < owners.state_owners() ? owners.state(grid_.replica()) : Shard{};
    for (const auto& [state, local] : chunk.optimizer().state())
      for (const layers::ParamEntry& e : layers::ParameterStore::layout(model_, r.begin, r.end)) {
        if (!e.trainable) continue;
        const layers::Overlap o =
            mine && writes_shard(e) ? layers::overlap(e, range.begin, range.end) : layers::Overlap{};
        part(state, e, o.in_entry, o.in_entry + o.size,
             o.size > 0 ? host_f32(local.view(o.in_range, {o.size})) : Tensor());
      }
  }
}

void StateGather::load_model(const Read& read) {
  for (DataParallel* chunk : mine_)
    for (const layers::ParamEntry& e : chunk->store().entries()) {
      const Tensor shard = Tensor::empty(e.shape);
      read("", e, 0, shard.numel(), shard);
      chunk->set_value(e, shard);
    }
}

void StateGather::load_optimizer(const Read& read) {
  for (DataParallel* chunk : mine_) {
    const Shard mine = chunk->ownership().state(grid_.replica());
    for (const auto& [state, local] : chunk->optimizer().state()) {
      if (state == "master") continue;  // set by load_model, also from checkpoints of f32 runs
      for (const layers::ParamEntry& e : chunk->store().entries()) {
        const layers::Overlap o = layers::overlap(e, mine.begin, mine.end);
        if (!e.trainable || o.size == 0) continue;
        const Tensor part = Tensor::empty({o.size});
        read(state, e, o.in_entry, o.in_entry + o.size, part);
        local.view(o.in_range, {o.size}).copy_from(part);
      }
    }
  }
}

}  // namespace strata::parallel
