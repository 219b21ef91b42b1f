// StateGather: a model's training state as full tensors, whatever the layout. For a
// checkpoint, every tensor is assembled on rank 0 from the pipeline stage that holds it, from
// the tensor-parallel shards of its tp ranks and, for sharded parameters and optimizer state,
// from the ZeRO shards of that stage's replicas; on resume each rank reads the full tensors of
// its stage and keeps what it owns. Who owns what
// is DataParallel's answer (Ownership), never recomputed here. A checkpoint is also written by
// every rank at once (write_parts: each its own part), and read that way on resume. Tensors are named by their
// entry's stable name and an optimizer state ("" for the model's own values); the file's
// schema is io's (io/checkpoint/run_state.hpp).
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "layers/parameter_store.hpp"
#include "parallel/data/data_parallel.hpp"
#include "parallel/pipeline/partition.hpp"
#include "parallel/runtime/process_grid.hpp"

namespace strata::parallel {

class StateGather {
 public:
  // `state`: "" for a parameter or buffer, else the optimizer state ("momentum", "master", ...).
  using Write = std::function<void(const std::string& state, const layers::ParamEntry& e, const Tensor& full)>;
  // Fills `out` (host f32, end - begin elements) with elements [begin, end) of e's tensor-parallel
  // shard (io::CheckpointReader::read_part): each rank reads only what it keeps.
  using Read = std::function<void(const std::string& state, const layers::ParamEntry& e, int64_t begin, int64_t end,
                                  const Tensor& out)>;

  // The most bytes a save or a resume holds at once on a rank of `model`'s layout beside the
  // training state: one full f32 tensor and three of its shards (rank 0 assembling: a received
  // shard beside its own value, gathered under ZeRO 3 and widened to f32), in the host
  // allocator's size classes. For the memory plan.
  static int64_t planned_bytes(const layers::Model& model);
  // What --async-save's rank 0 holds until the write ends (--checkpoint-io rank0): every full
  // f32 tensor of the checkpoint (parameters, buffers, each optimizer state and, below f32, the
  // master weights); `size_classes`: as the host allocator holds them, else their bytes.
  static int64_t snapshot_bytes(const layers::Model& model, const layers::OptimizerConfig& optimizer, DType dtype,
                                bool size_classes);

  // `stages`: every (virtual) stage's layers, P x v of them for P pipeline ranks; `mine`: the
  // DataParallel of each of this rank's v chunks (virtual stage c·P + stage is chunk c).
  StateGather(ProcessGrid& grid, const layers::Model& model, std::vector<StageRange> stages,
              std::vector<DataParallel*> mine);

  // Collective over the world: rank 0 gets every model tensor (stage by stage, in layout
  // order), then every optimizer state tensor, as full f32 host tensors, one at a time, so no
  // rank holds more than its own stage plus one full tensor (unless `write` keeps them: each is
  // a fresh tensor that nothing else refers to, as --async-save's CheckpointSaver relies on).
  void gather(const Write& write);
  // Every rank's own part of every tensor, for a checkpoint that all ranks write at once
  // (io::ParallelCheckpointFile). Collective over the world: `part` is called on every rank for
  // every tensor, in gather()'s order, with elements [begin, end) of e's tensor-parallel shard
  // that this rank writes and their values (f32, host; begin == end and undefined: none). Each
  // element is written by one rank: the ZeRO owner of optimizer state, replica 0 for model
  // tensors (with sharded parameters, after gathering them in the stage's group), tp rank 0 for
  // a tensor every tp rank holds whole.
  using WritePart = std::function<void(const std::string& state, const layers::ParamEntry& e, int64_t begin,
                                       int64_t end, const Tensor& values)>;
  void write_parts(const WritePart& part);
  // This rank's parameters, buffers and f32 master weights: its tensor-parallel shards of its
  // stage's tensors, whole (a replica with sharded parameters keeps its part of them).
  void load_model(const Read& read);
  // This rank's part of the optimizer state (all but the master weights, set by load_model):
  // only the elements its ZeRO shard holds are read.
  void load_optimizer(const Read& read);

 private:
  // The pipeline rank holding virtual stage vs, and which of its chunks it is.
  int pipeline_rank(size_t vs) const { return static_cast<int>(vs % static_cast<size_t>(grid_.pp_size())); }
  size_t chunk_of(size_t vs) const { return vs / static_cast<size_t>(grid_.pp_size()); }
  // World rank of (stage, replica, tensor-parallel rank).
  int rank_at(int stage, int replica, int tp_rank) const;

  ProcessGrid& grid_;
  const layers::Model& model_;
  std::vector<StageRange> stages_;
  std::vector<DataParallel*> mine_;
};

}  // namespace strata::parallel
