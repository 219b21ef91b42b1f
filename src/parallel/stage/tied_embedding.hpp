// TiedEmbedding: GPT-2's LM head multiplies by the token embedding's weight wte (the head is a
// layer whose tied_weight() names the embedding, layers::TiedWeight). On one stage the head
// simply uses the Embedding's views, whatever the ZeRO stage (ZeRO 2 and 3 pin the Embedding's
// gradient in their ring, ZeRO 3 gathers wte into the head's window).
// Where it cannot (the head on another pipeline stage, or another chunk, than the embedding)
// this class gives the head its own copy of wte and of its gradient, as Megatron's last stage
// does, and keeps the two in step:
//   - after the step's backwards, the head's gradient (summed over the step's micro-batches) is
//     added to the Embedding's just before the Embedding's bucket is reduced over the
//     replicas, so the replicas reduce, clip and step one gradient, the sum of both uses;
//   - after each optimizer step, and after loading, the head's copy takes wte's new value.
// There is one optimizer state and one checkpoint tensor (wte/weight). Across stages the
// gradient and the weight travel between the same replica of the two stages, in chunks of at
// most kChunkElements so the receiver needs no V x D buffer.
#pragma once

#include <utility>
#include <vector>

#include "layers/model.hpp"
#include "parallel/comm/communicator.hpp"
#include "parallel/data/data_parallel.hpp"
#include "parallel/pipeline/partition.hpp"

namespace strata::parallel {

class TiedEmbedding {
 public:
  static constexpr int64_t kChunkElements = int64_t{1} << 22;  // 16 MiB of f32

  // `pp`: this replica's pipeline communicator (rank = stage); `stages`: every (virtual)
  // stage's layers, virtual stage vs on pipeline rank vs % P (interleaved; else vs itself). Gives
  // the tied head a copy where needed; call before the stage's DataParallel binds the layers.
  TiedEmbedding(Communicator& pp, const layers::Model& model, const std::vector<StageRange>& stages, int zero,
                DType dtype, Device device);
  TiedEmbedding(const TiedEmbedding&) = delete;
  TiedEmbedding& operator=(const TiedEmbedding&) = delete;

  // Whether the head keeps a copy (false also for models without a tied head).
  bool copied() const { return head_ != nullptr; }

  // The head's stage, after the step's pipeline schedule: sends the head's gradient to the
  // embedding's stage (nothing to send on one stage).
  void send_head_gradient();
  // The embedding's stage, in the step's last backward, once layer `layer` has written its
  // gradients and before they are reduced: adds the head's gradient to the Embedding's.
  void add_head_gradient(size_t layer);
  // Both stages, after an optimizer step that stepped and after loading a model: the head's
  // copy takes wte's value. Collective over the embedding stage's replicas (ZeRO 3 gathers it).
  void refresh(DataParallel& replica);
  // The head's stage, before a step's backwards: the copy's gradient starts from zero.
  void zero_head_gradient();

  // Bytes of the copy on this rank (weight in the compute dtype, gradient in f32) and of the
  // embedding stage's receive chunk (counted with the gradients).
  int64_t parameter_bytes() const;
  int64_t gradient_bytes() const;
  // What a TiedEmbedding on pipeline rank `stage` of `pipeline_ranks` allocates, without making
  // one: {parameter, gradient} bytes.
  static std::pair<int64_t, int64_t> planned_bytes(const layers::Model& model, const std::vector<StageRange>& stages,
                                                   int pipeline_ranks, int stage, int zero, DType dtype);

 private:
  // The tied head and its embedding, and whether the head needs a copy.
  struct Pair {
    layers::TiedWeight* head = nullptr;  // null: no tied head
    size_t embedding_layer = 0;
    int embedding_stage = 0, head_stage = 0;
    bool copy = false;
  };
  static Pair find(const layers::Model& model, const std::vector<StageRange>& stages, int pipeline_ranks, int zero);

  bool holds_embedding() const { return pp_.rank() == embedding_stage_; }
  bool holds_head() const { return pp_.rank() == head_stage_; }
  // Messages of `t` to / from the other stage, kChunkElements at a time; both block.
  void send_chunks(const Tensor& t, int tag);
  void receive_chunks(const Tensor& t, int tag, bool add_to);

  Communicator& pp_;
  layers::TiedWeight* head_ = nullptr;  // set when the head keeps a copy
  size_t embedding_layer_ = 0;
  int embedding_stage_ = 0, head_stage_ = 0;
  Tensor weight_, grad_;  // the head's copy (on the head's stage)
  Tensor chunk_;          // receive buffer (on the embedding's stage, across stages)
};

}  // namespace strata::parallel
