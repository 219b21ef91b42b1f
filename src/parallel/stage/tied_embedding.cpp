#include "parallel/stage/tied_embedding.hpp"

#include <algorithm>

#include "core/ops.hpp"
#include "layers/parameter_store.hpp"

namespace strata::parallel {

namespace {

// Tags above the pipeline executor's (which are micro-batch indices).
constexpr int kGradientTag = kMaxTag;
constexpr int kWeightTag = kMaxTag - 1;

// The (virtual) stage holding `layer`.
int stage_of(const std::vector<StageRange>& stages, size_t layer) {
  for (size_t s = 0; s < stages.size(); ++s)
    if (layer >= stages[s].begin && layer < stages[s].end) return static_cast<int>(s);
  STRATA_THROW("layer ", layer, " is on no pipeline stage");
}

}  // namespace

TiedEmbedding::Pair TiedEmbedding::find(const layers::Model& model, const std::vector<StageRange>& stages,
                                        int pipeline_ranks, int zero) {
  Pair pair;
  for (size_t i = 0; i < model.size(); ++i) {
    layers::TiedWeight* head = model.layer(i).tied_weight();
    if (!head) continue;
    pair.head = head;
    while (&model.layer(pair.embedding_layer) != &head->weight_owner()) ++pair.embedding_layer;
    // Virtual stage vs is chunk vs / P of pipeline rank vs % P (one chunk per rank: vs itself).
    const int embedding_vs = stage_of(stages, pair.embedding_layer), head_vs = stage_of(stages, i);
    pair.embedding_stage = embedding_vs % pipeline_ranks;
    pair.head_stage = head_vs % pipeline_ranks;
    // Another chunk has another DataParallel. On one chunk the head reads the Embedding's views
    // whatever the ZeRO stage: ZeRO 2 and 3's gradient ring keeps the Embedding's gradient bound
    // for the whole backward (gradient_ring.hpp, pinned), and ZeRO 3 gathers wte into the head's
    // window when the head runs (ParameterGather::visits).
    pair.copy = embedding_vs != head_vs;
    STRATA_CHECK(!pair.copy || pair.embedding_stage != pair.head_stage || embedding_vs == head_vs,
                 "a tied head on another chunk of its embedding's pipeline rank");
    break;
  }
  return pair;
}

std::pair<int64_t, int64_t> TiedEmbedding::planned_bytes(const layers::Model& model,
                                                         const std::vector<StageRange>& stages, int pipeline_ranks,
                                                         int stage, int zero, DType dtype) {
  const Pair pair = find(model, stages, pipeline_ranks, zero);
  if (!pair.copy) return {0, 0};
  const int64_t numel = shape_numel(pair.head->weight_shape());  // this tp rank's rows
  if (stage == pair.head_stage)
    return {numel * static_cast<int64_t>(dtype_size(dtype)), numel * static_cast<int64_t>(sizeof(float))};
  if (stage == pair.embedding_stage) return {0, std::min(numel, kChunkElements) * static_cast<int64_t>(sizeof(float))};
  return {0, 0};
}

TiedEmbedding::TiedEmbedding(Communicator& pp, const layers::Model& model, const std::vector<StageRange>& stages,
                             int zero, DType dtype, Device device)
    : pp_(pp) {
  const Pair pair = find(model, stages, pp.size(), zero);
  if (!pair.copy) return;
  head_ = pair.head;
  embedding_layer_ = pair.embedding_layer;
  embedding_stage_ = pair.embedding_stage;
  head_stage_ = pair.head_stage;
  const Shape shape = head_->weight_shape();  // this tp rank's rows of wte
  if (holds_head()) {
    weight_ = Tensor::zeros(shape, dtype, device);
    grad_ = Tensor::zeros(shape, DType::F32, device);
    head_->use_copy(weight_, grad_);
  }
  if (holds_embedding() && !holds_head())
    chunk_ = Tensor::empty({std::min(shape_numel(shape), kChunkElements)}, DType::F32, device);
}

void TiedEmbedding::send_chunks(const Tensor& t, int tag) {
  const Tensor flat = t.reshape({t.numel()});
  const int peer = tag == kGradientTag ? embedding_stage_ : head_stage_;
  std::vector<WorkPtr> sends;
  for (int64_t at = 0; at < flat.numel(); at += kChunkElements)
    sends.push_back(pp_.send_async(flat.view(at, {std::min(kChunkElements, flat.numel() - at)}), peer, tag));
  for (WorkPtr& w : sends) w->wait();
}

void TiedEmbedding::receive_chunks(const Tensor& t, int tag, bool add_to) {
  const Tensor flat = t.reshape({t.numel()});
  const int peer = tag == kGradientTag ? head_stage_ : embedding_stage_;
  for (int64_t at = 0; at < flat.numel(); at += kChunkElements) {
    const Tensor part = flat.view(at, {std::min(kChunkElements, flat.numel() - at)});
    if (!add_to) {
      pp_.recv(part, peer, tag);
      continue;
    }
    const Tensor buffer = chunk_.view(0, {part.numel()});
    pp_.recv(buffer, peer, tag);
    ops::axpy(1.0f, buffer, part);
  }
}

void TiedEmbedding::send_head_gradient() {
  if (!head_ || !holds_head() || holds_embedding()) return;
  // Called after this stage's pipeline step, whose messages are all delivered: the embedding's
  // stage is at most finishing its last backward, where it receives this (no cycle of waits).
  send_chunks(grad_, kGradientTag);
}

void TiedEmbedding::add_head_gradient(size_t layer) {
  if (!head_ || layer != embedding_layer_ || !holds_embedding()) return;
  const Tensor& dwte = head_->owner_weight_grad();
  STRATA_CHECK(dwte.defined(), "the tied embedding's gradient is not bound when its layer finishes");
  if (holds_head())
    ops::axpy(1.0f, grad_, dwte);
  else
    receive_chunks(dwte, kGradientTag, /*add_to=*/true);
}

void TiedEmbedding::refresh(DataParallel& replica) {
  if (!head_) return;
  Tensor value;
  if (holds_embedding()) {
    const std::vector<layers::ParamEntry>& entries = replica.store().entries();
    const auto e = std::find_if(entries.begin(), entries.end(), [&](const layers::ParamEntry& p) {
      return p.layer == embedding_layer_ && p.name == head_->weight_name();
    });
    STRATA_CHECK(e != entries.end(), "the embedding's stage holds no wte/weight");
    value = replica.full_value(*e);  // collective over the replicas with ZeRO 3
  }
  if (holds_head() && holds_embedding()) {
    ops::copy(value, weight_);
  } else if (holds_embedding()) {
    send_chunks(value, kWeightTag);
  } else if (holds_head()) {
    receive_chunks(weight_, kWeightTag, /*add_to=*/false);
  }
}

void TiedEmbedding::zero_head_gradient() {
  if (head_ && holds_head()) grad_.fill_zero();
}

int64_t TiedEmbedding::parameter_bytes() const {
  return weight_.defined() ? static_cast<int64_t>(weight_.nbytes()) : 0;
}

int64_t TiedEmbedding::gradient_bytes() const {
  return (grad_.defined() ? static_cast<int64_t>(grad_.nbytes()) : 0) +
         (chunk_.defined() ? static_cast<int64_t>(chunk_.nbytes()) : 0);
}

}  // namespace strata::parallel
