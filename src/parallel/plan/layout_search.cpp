// The layout search of `train --dry-run --plan` (layout_search.hpp).
#include "parallel/plan/layout_search.hpp"

#include <algorithm>
#include <map>
#include <memory>
#include <optional>
#include <utility>

#include "layers/parameter_store.hpp"
#include "parallel/data/zero.hpp"
#include "parallel/pipeline/partition.hpp"

namespace strata::parallel {

namespace {

std::vector<int> divisors(int n) {
  std::vector<int> d;
  for (int k = 1; k <= n; ++k)
    if (n % k == 0) d.push_back(k);
  return d;
}

// Micro-batch sizes for a replica's `local` samples: the powers of two that divide it, and
// `local` itself (no accumulation).
std::vector<int64_t> micro_sizes(int64_t local) {
  std::vector<int64_t> sizes;
  for (int64_t m = 1; m < local && local % m == 0; m *= 2) sizes.push_back(m);
  sizes.push_back(local);
  return sizes;
}

// The rows of a micro-batch's matrix products per sample: a language model's tokens, else one.
double gemm_rows_per_sample(const layers::Model& model) {
  return model.layer(0).takes_token_ids() ? static_cast<double>(shape_numel(model.shape(0))) : 1.0;
}

int64_t stage_macs(const layers::Model& model, StageRange r) {
  int64_t macs = 0;
  for (size_t i = r.begin; i < r.end; ++i) macs += model.layer(i).flops(model.shape(i));
  return macs;
}

}  // namespace

StepTime estimate_step_time(const layers::Model& model, const std::vector<StageRange>& stages,
                            const LayoutChoice& choice, int64_t global_batch, const Rates& rates) {
  const Layout& layout = choice.layout;
  const double samples = static_cast<double>(global_batch) / layout.dp;  // per replica and step
  const double forwards = choice.recompute == layers::Recompute::None ? 3.0 : 4.0;
  const auto dtype_bytes = static_cast<double>(dtype_size(layout.dtype));
  const double rate = rates.rate_at(static_cast<double>(layout.micro) * gemm_rows_per_sample(model));
  StepTime slowest;
  for (const StageRange& r : stages) {
    StepTime t;
    t.compute_s = 2.0 * forwards * static_cast<double>(stage_macs(model, r)) * samples / rate;
    t.bubble_s = t.compute_s * (layout.pp - 1) / layout.micro_batches;
    int64_t trainable = 0;
    for (const layers::ParamEntry& e : layers::ParameterStore::layout(model, r.begin, r.end))
      if (e.trainable) trainable += shape_numel(e.shape);
    const double dp_share = 2.0 * (layout.dp - 1) / layout.dp * (Ownership::shards_params(layout.zero) ? 1.5 : 1.0);
    t.dp_s = dp_share * 4.0 * static_cast<double>(trainable) / rates.bytes_per_s;
    int64_t tp_elements = 0;  // per sample
    for (size_t i = r.begin; i < r.end; ++i)
      tp_elements +=
          model.layer(i).tp_all_reduced_elements(model.shape(i), choice.recompute != layers::Recompute::None);
    t.tp_s = 2.0 * (layout.tp - 1) / layout.tp * static_cast<double>(tp_elements) * dtype_bytes * samples /
             rates.bytes_per_s;
    // What the stage sends per micro-batch: its output forward (not the last stage: its output
    // is the logits, which go nowhere) and its input's gradient back (not the first).
    int64_t sent = 0;
    if (&r != &stages.back()) sent += shape_numel(model.shape(r.end));
    if (&r != &stages.front()) sent += shape_numel(model.shape(r.begin));
    t.pp_s = static_cast<double>(layout.micro * sent) * dtype_bytes * layout.micro_batches / rates.bytes_per_s;
    if (t.total() > slowest.total()) slowest = t;
  }
  return slowest;
}

SearchResult search_layouts(const SearchSpace& space, const Rates& rates, const ModelFor& model_for) {
  STRATA_CHECK(rates.flops_per_s > 0 && rates.bytes_per_s > 0, "layout search without rates");
  SearchResult result;
  std::optional<LayoutChoice> smallest;
  std::vector<layers::Recompute> recomputes{layers::Recompute::None};
  if (space.can_recompute) recomputes.insert(recomputes.end(), {layers::Recompute::Block, layers::Recompute::Full});
  for (const int tp : divisors(space.world)) {
    if (tp > space.max_tp) break;
    // With tp, each layout with and without sequence parallelism (more bytes on tp, fewer activations).
    std::vector<std::pair<layers::Recompute, bool>> variants;
    for (const layers::Recompute recompute : recomputes)
      for (const bool sequence_parallel : {false, true})
        if (!sequence_parallel || tp > 1) variants.emplace_back(recompute, sequence_parallel);
    for (const auto& [recompute, sequence_parallel] : variants) {
      auto group = std::make_unique<PlannedTensorParallel>(tp);
      group->set_sequence_parallel(sequence_parallel);
      std::optional<layers::Model> model;
      try {
        model.emplace(model_for(tp, recompute, tp > 1 ? group.get() : nullptr));
      } catch (const Error& e) {
        if (e.kind() != ErrorKind::Input) throw;
        if (sequence_parallel) {  // the sequence does not cut into tp parts: the layouts without it stand
          if (recompute == layers::Recompute::None)
            result.skipped.push_back(detail::cat("tp ", tp, " sequence-parallel: ", e.message()));
          continue;
        }
        result.skipped.push_back(detail::cat("tp ", tp, ": ", e.message()));
        break;  // this width does not divide the model
      }
      for (const int pp : divisors(space.world / tp)) {
        std::vector<StageRange> stages;
        try {
          stages = partition_layers(*model, pp, space.partition);
        } catch (const Error& e) {
          if (e.kind() != ErrorKind::Input) throw;
          break;  // more stages than the model can be cut into
        }
        const int dp = space.world / (tp * pp);
        if (space.global_batch % dp != 0) continue;
        for (const int64_t micro : micro_sizes(space.global_batch / dp)) {
          LayoutChoice choice;
          choice.recompute = recompute;
          Layout& layout = choice.layout;
          layout = space.base;
          layout.pp = pp;
          layout.dp = dp;
          layout.tp = tp;
          layout.sequence_parallel = sequence_parallel;
          layout.micro = micro;
          layout.schedule = ScheduleKind::OneFOneB;
          layout.virtual_stages = 1;
          const int micro_batches = static_cast<int>(space.global_batch / dp / micro);
          // 1F1B's memory repeats once P micro-batches are in the pipeline (nothing is kept
          // from one to the next: test_memory_plan), so 2P of them plan any m at a fraction of
          // the time; the step's other bytes take the real m.
          layout.micro_batches = std::min(micro_batches, 2 * pp);
          std::vector<ActivationBytes> activations;  // per stage; the same for every ZeRO stage
          int64_t message_bytes = 0;
          for (int s = 0; s < pp; ++s) {
            activations.push_back(plan_activations(*model, stages, s, layout));
            message_bytes = std::max(message_bytes, activations.back().message_bytes);
          }
          layout.micro_batches = micro_batches;
          for (int zero = 0; zero <= (dp > 1 ? Ownership::kMaxStage : 0); ++zero) {
            layout.zero = zero;
            choice.bytes = 0;
            for (int s = 0; s < pp; ++s)  // replica 0 holds the largest shard
              choice.bytes =
                  std::max(choice.bytes, plan_rank(*model, stages, s, 0, layout, activations[static_cast<size_t>(s)],
                                                   message_bytes, space.runtime)
                                             .total());
            choice.time = estimate_step_time(*model, stages, choice, space.global_batch, rates);
            ++result.tried;
            if (!smallest || choice.bytes < smallest->bytes) smallest = choice;
            if (space.device_bytes == 0 || choice.bytes <= space.device_bytes) result.fitting.push_back(choice);
          }
        }
      }
    }
  }
  // Fastest first; of equally fast layouts, the one that leaves the most memory free.
  std::stable_sort(result.fitting.begin(), result.fitting.end(), [](const LayoutChoice& a, const LayoutChoice& b) {
    return std::pair(a.time.total(), a.bytes) < std::pair(b.time.total(), b.bytes);
  });
  if (smallest) result.smallest = *smallest;
  return result;
}

}  // namespace strata::parallel
