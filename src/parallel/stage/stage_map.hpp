// The one map between virtual stages and (pipeline rank, chunk). A model cut into P x v virtual
// stages runs on P pipeline ranks with v chunks each (v > 1: the interleaved schedule): chunk c
// of pipeline rank s is virtual stage c·P + s, so virtual stage vs lives on rank vs % P as its
// chunk vs / P. Everything that asks where a layer runs asks this map. MPI-free: the planner
// uses it for worlds that were not launched.
#pragma once

#include <cstddef>
#include <utility>
#include <vector>

#include "core/error.hpp"
#include "parallel/pipeline/partition.hpp"

namespace strata::parallel {

class StageMap {
 public:
  // `stages`: every virtual stage's layers in model order, a multiple of `pipeline_ranks` of them.
  StageMap(std::vector<StageRange> stages, int pipeline_ranks) : stages_(std::move(stages)), ranks_(pipeline_ranks) {
    STRATA_CHECK(ranks_ > 0 && !stages_.empty() && stages_.size() % static_cast<size_t>(ranks_) == 0,
                 "StageMap: ", stages_.size(), " virtual stages do not cut evenly over ", ranks_, " pipeline ranks");
  }

  int pipeline_ranks() const { return ranks_; }
  // Chunks per pipeline rank (v).
  int chunks() const { return static_cast<int>(stages_.size() / static_cast<size_t>(ranks_)); }
  size_t virtual_stages() const { return stages_.size(); }
  const std::vector<StageRange>& stages() const { return stages_; }

  int rank_of(size_t vs) const { return static_cast<int>(vs % static_cast<size_t>(ranks_)); }
  int chunk_of(size_t vs) const { return static_cast<int>(vs / static_cast<size_t>(ranks_)); }
  size_t virtual_stage(int rank, int chunk) const {
    return static_cast<size_t>(chunk) * static_cast<size_t>(ranks_) + static_cast<size_t>(rank);
  }
  StageRange range(size_t vs) const { return stages_.at(vs); }
  // The layers of chunk `chunk` of pipeline rank `rank`.
  StageRange range(int rank, int chunk) const { return range(virtual_stage(rank, chunk)); }
  // The virtual stage holding layer `layer`.
  size_t stage_of_layer(size_t layer) const {
    for (size_t vs = 0; vs < stages_.size(); ++vs)
      if (layer >= stages_[vs].begin && layer < stages_[vs].end) return vs;
    STRATA_THROW("StageMap: layer ", layer, " is in no stage");
  }

 private:
  std::vector<StageRange> stages_;
  int ranks_;
};

}  // namespace strata::parallel
