// StateGather: full tensors to rank 0 (tensor by tensor, piece by piece) and back.
#include "parallel/state_gather.hpp"

#include "core/ops.hpp"

namespace strata::parallel {

namespace {

// Checkpoints hold f32 host tensors whatever the precision and device of the run.
Tensor host_f32(const Tensor& t) {
  if (!t.defined() || (t.dtype() == DType::F32 && t.device().is_cpu())) return t;
  const Tensor h = Tensor::empty(t.shape());
  ops::copy(t, h);
  return h;
}

}  // namespace

StateGather::StateGather(ProcessGrid& grid, const layers::Model& model, std::vector<StageRange> stages,
                         DataParallel& mine)
    : grid_(grid), model_(model), stages_(std::move(stages)), mine_(mine) {}

void StateGather::gather(const Write& write) {
  Communicator& world = grid_.world();
  const int rank = world.rank();
  // Model tensors: replica 0 of each stage sends each one whole; with sharded parameters every
  // replica of the stage takes part in gathering it first.
  for (int s = 0; s < grid_.pp_size(); ++s) {
    const int owner = grid_.rank_of(s, 0);
    const bool mine = grid_.stage() == s;
    if (rank != 0 && rank != owner && !(mine && mine_.ownership().shards_params())) continue;
    const StageRange r = stages_[static_cast<size_t>(s)];
    int tag = 0;
    for (const layers::ParamEntry& e : layers::ParameterStore::layout(model_, r.begin, r.end)) {
      tag = (tag + 1) % kMaxTag;
      const Tensor value = mine ? host_f32(mine_.full_value(e)) : Tensor();
      if (rank == owner && owner == 0) {
        write("", e, value);
      } else if (rank == owner) {
        world.send(value, 0, tag);
      } else if (rank == 0) {
        const Tensor t = Tensor::empty(e.shape);
        world.recv(t, owner, tag);
        write("", e, t);
      }
    }
  }

  // Optimizer state: every rank owning part of a tensor's flat range sends that piece; rank 0
  // assembles the full tensor. Everyone walks the same (stage, state, entry, replica) order, so
  // sends and receives pair up in order; the tags only need to differ between neighbours.
  const std::vector<std::pair<std::string, Tensor>> states = mine_.optimizer().state();
  int tag = 0;
  for (int s = 0; s < grid_.pp_size(); ++s) {
    const StageRange r = stages_[static_cast<size_t>(s)];
    const Ownership owners = mine_.ownership_of(r);
    for (const auto& [state, local] : states)
      for (const layers::ParamEntry& e : layers::ParameterStore::layout(model_, r.begin, r.end)) {
        if (!e.trainable) continue;
        const Tensor full = rank == 0 ? Tensor::empty(e.shape) : Tensor();
        for (int q = 0; q < owners.state_owners(); ++q) {
          const Shard range = owners.state(q);
          const layers::Overlap o = layers::overlap(e, range.begin, range.end);
          if (o.size == 0) continue;
          const int from = grid_.rank_of(s, q);
          tag = (tag + 1) % kMaxTag;
          if (from == rank && rank == 0)
            full.view(o.in_entry, {o.size}).copy_from(local.view(o.in_range, {o.size}));
          else if (from == rank)
            world.send(host_f32(local.view(o.in_range, {o.size})), 0, tag);
          else if (rank == 0)
            world.recv(full.view(o.in_entry, {o.size}), from, tag);
        }
        if (rank == 0) write(state, e, full);
      }
  }
}

void StateGather::load_model(const Read& read) {
  // Read whole (a checksum covers the whole tensor), kept whole or only this rank's part.
  for (const layers::ParamEntry& e : mine_.store().entries()) {
    const Tensor t = Tensor::empty(e.shape);
    read("", e, t);
    mine_.set_value(e, t);
  }
}

void StateGather::load_optimizer(const Read& read) {
  const Shard mine = mine_.ownership().state(grid_.replica());
  for (const auto& [state, local] : mine_.optimizer().state()) {
    if (state == "master") continue;  // set by load_model, also from checkpoints of f32 runs
    for (const layers::ParamEntry& e : mine_.store().entries()) {
      const layers::Overlap o = layers::overlap(e, mine.begin, mine.end);
      if (!e.trainable || o.size == 0) continue;
      const Tensor full = Tensor::empty(e.shape);
      read(state, e, full);
      local.view(o.in_range, {o.size}).copy_from(full.view(o.in_entry, {o.size}));
    }
  }
}

}  // namespace strata::parallel
