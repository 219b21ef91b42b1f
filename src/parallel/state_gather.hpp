// StateGather: a model's training state as full tensors, whatever the layout. For a
// checkpoint, every tensor is assembled on rank 0 from the pipeline stage that holds it, from
// the tensor-parallel shards of its tp ranks and, for sharded parameters and optimizer state,
// from the ZeRO shards of that stage's replicas; on resume each rank reads the full tensors of
// its stage and keeps what it owns. Who owns what
// is DataParallel's answer (Ownership), never recomputed here. Tensors are named by their
// entry's stable name and an optimizer state ("" for the model's own values); the file's
// schema is io's (io/training_state.hpp).
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "parallel/data_parallel.hpp"
#include "parallel/partition.hpp"
#include "parallel/process_grid.hpp"

namespace strata::parallel {

class StateGather {
 public:
  // `state`: "" for a parameter or buffer, else the optimizer state ("momentum", "master", ...).
  using Write = std::function<void(const std::string& state, const layers::ParamEntry& e, const Tensor& full)>;
  // Fills `out` (a host f32 tensor of e's full_shape()) with the full value.
  using Read = std::function<void(const std::string& state, const layers::ParamEntry& e, const Tensor& out)>;

  // `stages`: every (virtual) stage's layers, P x v of them for P pipeline ranks; `mine`: the
  // DataParallel of each of this rank's v chunks (virtual stage c·P + stage is chunk c).
  StateGather(ProcessGrid& grid, const layers::Model& model, std::vector<StageRange> stages,
              std::vector<DataParallel*> mine);

  // Collective over the world: rank 0 gets every model tensor (stage by stage, in layout
  // order), then every optimizer state tensor, as full f32 host tensors, one at a time, so no
  // rank holds more than its own stage plus one full tensor (unless `write` keeps them: each is
  // a fresh tensor that nothing else refers to, as --async-save's CheckpointSaver relies on).
  void gather(const Write& write);
  // This rank's parameters, buffers and f32 master weights from the full tensors of its stage.
  void load_model(const Read& read);
  // This rank's part of the optimizer state (all but the master weights, set by load_model).
  void load_optimizer(const Read& read);

 private:
  // The pipeline rank holding virtual stage vs, and which of its chunks it is.
  int pipeline_rank(size_t vs) const { return static_cast<int>(vs % static_cast<size_t>(grid_.pp_size())); }
  size_t chunk_of(size_t vs) const { return vs / static_cast<size_t>(grid_.pp_size()); }
  // World rank of (stage, replica, tensor-parallel rank).
  int rank_at(int stage, int replica, int tp_rank) const;
  // This rank's tensor-parallel shard of e's full tensor as `read` gives it (all of it unless split).
  static Tensor read_shard(const Read& read, const std::string& state, const layers::ParamEntry& e);

  ProcessGrid& grid_;
  const layers::Model& model_;
  std::vector<StageRange> stages_;
  std::vector<DataParallel*> mine_;
};

}  // namespace strata::parallel
