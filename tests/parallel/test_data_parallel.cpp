// DataParallel and ZeRO under real MPI (2 and 4 ranks).
//  - Ownership / shard_of: the shards of all replicas are disjoint, contiguous, 16-aligned and
//    cover the used elements exactly; the flags per ZeRO stage (arithmetic, no MPI).
//  - Every ZeRO stage's step is the replicated step: MPI_COMM_WORLD is split into
//    data-parallel groups of 1, 2 and 4 ranks; each replica forwards and backwards its slice
//    of one fixed global batch (as StageEngine::step does) and after every step the full
//    parameters must equal a one-rank ZeRO 0 reference that trains on the whole batch locally.
//  - ZeRO 3's set_value / full_value round trip, and a forward through the gathered windows.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "core/ops.hpp"
#include "layers/loss.hpp"
#include "layers/loss_scaler.hpp"
#include "layers/model.hpp"
#include "layers/parameter_store.hpp"
#include "layers/zoo.hpp"
#include "parallel/comm/mpi_communicator.hpp"
#include "parallel/data/data_parallel.hpp"

namespace strata::parallel {
namespace {

// ---- Ownership (arithmetic) ------------------------------------------------------------------

const std::vector<int64_t> kUsed{0, 1, 15, 16, 17, 100, 192, 1000, 4097, 65536 + 48};

TEST(Ownership, ZeroZeroReplicatesTheState) {
  for (int dp : {1, 2, 3, 4, 8})
    for (int64_t used : kUsed) {
      SCOPED_TRACE("dp " + std::to_string(dp) + " used " + std::to_string(used));
      const Ownership o(0, dp, used);
      EXPECT_EQ(o.zero(), 0);
      EXPECT_EQ(o.dp(), dp);
      EXPECT_EQ(o.used(), used);
      EXPECT_FALSE(o.shards_state());
      EXPECT_FALSE(o.shards_grads());
      EXPECT_FALSE(o.shards_params());
      EXPECT_FALSE(o.gathers_params_after_step());
      EXPECT_EQ(o.pad_multiple(), kShardAlign);
      EXPECT_EQ(o.state_owners(), 1);
      for (int r = 0; r < dp; ++r) {
        const Shard s = o.state(r);
        EXPECT_EQ(s.size, used);
        EXPECT_EQ(s.begin, 0);
        EXPECT_EQ(s.end, used);
      }
    }
}

TEST(Ownership, ShardsAreDisjointContiguousAlignedAndCoverEverything) {
  for (int zero : {1, 2, 3})
    for (int dp : {1, 2, 3, 4, 5, 8})
      for (int64_t used : kUsed) {
        SCOPED_TRACE("zero " + std::to_string(zero) + " dp " + std::to_string(dp) + " used " + std::to_string(used));
        const Ownership o(zero, dp, used);
        EXPECT_TRUE(o.shards_state());
        EXPECT_EQ(o.shards_grads(), zero >= 2);
        EXPECT_EQ(o.shards_params(), zero == 3);
        EXPECT_EQ(o.gathers_params_after_step(), zero == 1 || zero == 2);
        EXPECT_EQ(o.state_owners(), dp);
        EXPECT_EQ(o.pad_multiple(), kShardAlign * dp);
        EXPECT_EQ(o.pad_multiple(), shard_pad_multiple(dp));
        const int64_t size = shard_of(used, dp, 0).size;
        EXPECT_EQ(size % kShardAlign, 0);
        // The smallest aligned S with dp * S >= used.
        EXPECT_GE(size * dp, used);
        EXPECT_LT(size - kShardAlign, (used + dp - 1) / dp);
        // The store's padded length: align_up(used, 16 * dp) == dp * S.
        EXPECT_EQ((used + o.pad_multiple() - 1) / o.pad_multiple() * o.pad_multiple(), dp * size);
        int64_t next = 0;  // shards follow each other with no gap or overlap
        for (int r = 0; r < dp; ++r) {
          const Shard s = o.shard(r);
          EXPECT_EQ(s.size, size) << "replica " << r;
          EXPECT_EQ(s.begin, next) << "replica " << r;
          EXPECT_LE(s.begin, s.end) << "replica " << r;
          EXPECT_LE(s.numel(), s.size) << "replica " << r;
          EXPECT_EQ(s.begin, std::min(r * size, used)) << "replica " << r;
          const Shard st = o.state(r);
          EXPECT_EQ(st.begin, s.begin);
          EXPECT_EQ(st.end, s.end);
          EXPECT_EQ(st.size, s.size);
          const Shard direct = shard_of(used, dp, r);
          EXPECT_EQ(direct.begin, s.begin);
          EXPECT_EQ(direct.end, s.end);
          next = s.end;
        }
        EXPECT_EQ(next, used);
      }
}

TEST(Ownership, RejectsUnknownStages) {
  EXPECT_THROW(Ownership(4, 2, 100), Error);
  EXPECT_THROW(Ownership(-1, 2, 100), Error);
  EXPECT_THROW(Ownership(1, 0, 100), Error);
}

// ---- ZeRO 0-3 against the replicated step ----------------------------------------------------

constexpr int64_t kGlobalBatch = 16, kFeatures = 6;
constexpr int kClasses = 3, kSteps = 3;
constexpr uint64_t kSeed = 11;

layers::ModelSpec mlp_spec() {
  layers::ModelSpec s;
  s.name = "mlp";
  s.hidden = {8, 8};
  return s;
}

layers::Model make_model() { return layers::build_model(mlp_spec(), {kFeatures}, kClasses); }

// The fixed global batch.
const Tensor& batch_x() {
  static const Tensor x = [] {
    std::mt19937 g(3);
    std::normal_distribution<float> d;
    Tensor t = Tensor::empty({kGlobalBatch, kFeatures});
    for (int64_t i = 0; i < t.numel(); ++i) t.data<float>()[i] = d(g);
    return t;
  }();
  return x;
}

const Tensor& batch_y() {
  static const Tensor y = [] {
    Tensor t = Tensor::empty({kGlobalBatch}, DType::I32);
    for (int64_t i = 0; i < kGlobalBatch; ++i) t.data<int32_t>()[i] = static_cast<int32_t>((i * 7 + 3) % kClasses);
    return t;
  }();
  return y;
}

Tensor to_dtype(const Tensor& x, DType dtype) {
  if (x.dtype() == dtype) return x;
  Tensor y = Tensor::empty(x.shape(), dtype);
  ops::copy(x, y);
  return y;
}

// How one run trains (the reference trains the same way on one rank).
struct Recipe {
  std::string name;
  layers::OptimizerConfig optimizer;
  float lr = 0.05f;
  int micro_batches = 1;  // per replica and step
  int64_t bucket_bytes = 25 << 20;
  float clip = 0;
  double loss_scale = 0;  // > 0: a fixed loss scale (a power of two: exact in f32)
};

std::vector<Recipe> recipes() {
  layers::OptimizerConfig sgd;
  sgd.name = "sgd";
  sgd.momentum = 0.9f;
  sgd.weight_decay = 0.01f;
  layers::OptimizerConfig adamw;
  adamw.name = "adamw";
  adamw.weight_decay = 0.01f;
  // 64-byte buckets are 16 elements: every layer (64, 80 and 48 elements with padding) spans
  // several, and under ZeRO 2/3 each streams its gradients in pieces of two rows (at most 16
  // elements) through a ring of 32, which wraps several times per backward.
  return {
      {"sgd", sgd, 0.05f, 1, 25 << 20, 0, 0},
      {"sgd_2micro_small_buckets_clip", sgd, 0.05f, 2, 64, 0.05f, 0},
      {"adamw", adamw, 0.01f, 1, 25 << 20, 0, 0},
      {"adamw_2micro_small_buckets_clip_scaled", adamw, 0.01f, 2, 64, 0.05f, 256},
  };
}

// The full parameters (and buffers) after every step, in f32, entry by entry.
using Snapshots = std::vector<std::vector<float>>;

std::vector<float> full_values(DataParallel& replica) {
  std::vector<float> all;
  for (const layers::ParamEntry& e : replica.store().entries()) {
    const Tensor f = to_dtype(replica.full_value(e), DType::F32);  // collective under ZeRO 3
    all.insert(all.end(), f.data<float>(), f.data<float>() + f.numel());
  }
  return all;
}

// Trains kSteps steps of `recipe` as replica dp.rank() of dp.size(), on its slice of the batch.
Snapshots train(Communicator& dp, Communicator& pipeline, int zero, DType dtype, const Recipe& recipe) {
  const layers::Model model = make_model();
  Layout layout;
  layout.zero = zero;
  layout.bucket_bytes = recipe.bucket_bytes;
  layout.dtype = dtype;
  layout.optimizer = recipe.optimizer;
  DataParallel replica(dp, model, StageRange{0, model.size()}, layout, kSeed, Device::cpu());

  // What this replica owns, as its Ownership says.
  const Ownership& o = replica.ownership();
  EXPECT_EQ(o.zero(), zero);
  EXPECT_EQ(o.dp(), dp.size());
  EXPECT_EQ(o.used(), replica.store().used_numel());
  const Shard mine = o.shard(dp.rank());
  if (o.shards_state()) {
    EXPECT_EQ(replica.optimizer().shard().begin, mine.begin);
    EXPECT_EQ(replica.optimizer().shard().end, mine.end);
    EXPECT_EQ(replica.store().flat_numel(), dp.size() * mine.size);
    for (const auto& [name, t] : replica.optimizer().state()) EXPECT_EQ(t.numel(), mine.numel()) << name;
  }
  EXPECT_EQ(replica.store().params().numel(), o.shards_params() ? mine.size : replica.store().flat_numel());
  EXPECT_EQ(replica.store().grads().defined(), !o.shards_grads());
  if (o.shards_grads()) {  // the paper's gradient shard + two buckets (a tile may hold < 16 elements of
                           // alignment padding besides its piece): every layer here streams
    const int64_t ring_bound = std::min(2 * bucket_elements(recipe.bucket_bytes) + 15, replica.store().flat_numel());
    EXPECT_LE(replica.gradient_bytes(), 4 * (mine.size + ring_bound));
  }

  const layers::SoftmaxCrossEntropy loss;
  layers::LossScaler scaler = recipe.loss_scale > 0
                                  ? layers::LossScaler(layers::LossScaler::Mode::Fixed, recipe.loss_scale)
                                  : layers::LossScaler();
  const int64_t local = kGlobalBatch / dp.size(), micro = local / recipe.micro_batches;
  const std::vector<float> initial = full_values(replica);
  Snapshots snapshots;
  for (int step = 0; step < kSteps; ++step) {
    replica.zero_grads();
    const float scale = static_cast<float>(scaler.scale() / static_cast<double>(kGlobalBatch));
    for (int mb = 0; mb < recipe.micro_batches; ++mb) {
      const int64_t first = dp.rank() * local + mb * micro;
      std::vector<layers::Context> ctx;
      const Tensor y = replica.forward(to_dtype(batch_x().slice(first, first + micro), dtype), ctx,
                                       {layers::Mode::Train, kSeed, step, first});
      layers::Context loss_ctx;
      loss.forward(y, batch_y().slice(first, first + micro), loss_ctx);
      replica.backward(loss.backward(loss_ctx, scale), ctx, mb == recipe.micro_batches - 1, /*input_grad=*/false);
    }
    EXPECT_TRUE(replica.step(recipe.lr, scaler, recipe.clip, dp, pipeline)) << "step " << step;
    snapshots.push_back(full_values(replica));
  }
  // Not vacuous: the steps moved most parameters (in bf16, some updates round away).
  size_t moved = 0;
  for (size_t i = 0; i < initial.size(); ++i) moved += snapshots.back()[i] != initial[i];
  EXPECT_GT(moved, initial.size() / 2) << "of " << initial.size();
  return snapshots;
}

// A data-parallel group of `dp` consecutive ranks of the world (this rank's).
struct Group {
  explicit Group(int dp) {
    int rank = 0;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm split = MPI_COMM_NULL;
    EXPECT_EQ(MPI_Comm_split(MPI_COMM_WORLD, rank / dp, rank, &split), MPI_SUCCESS);
    comm = std::make_unique<MpiCommunicator>(split, "dp" + std::to_string(dp));
    MPI_Comm_free(&split);  // the communicator holds its own duplicate
  }
  std::unique_ptr<MpiCommunicator> comm;
};

int world_size() {
  int size = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  return size;
}

// Elementwise |a - b| <= rel * max(|b|, kFloor): relative, except that values below kFloor
// (a tenth of the initial weights' scale) are held to kFloor's absolute tolerance, since an
// element near zero would otherwise demand more than f32's resolution of its neighbours.
// rel 0: equal. Returns the first offending index, or -1; `worst`: the largest |a - b| / max(|b|, kFloor).
constexpr double kFloor = 0.1;

int64_t first_mismatch(const std::vector<float>& a, const std::vector<float>& b, double rel, double& worst) {
  worst = 0;
  int64_t first = -1;
  for (size_t i = 0; i < a.size(); ++i) {
    const double d = std::fabs(static_cast<double>(a[i]) - b[i]);
    const double r = d / std::max(std::fabs(static_cast<double>(b[i])), kFloor);
    worst = std::max(worst, r);
    if (r > rel && first < 0) first = static_cast<int64_t>(i);
  }
  return first;
}

void expect_matches(const Snapshots& got, const Snapshots& want, double rel, const std::string& what) {
  ASSERT_EQ(got.size(), want.size());
  double worst_of_all = 0;
  for (size_t s = 0; s < got.size(); ++s) {
    ASSERT_EQ(got[s].size(), want[s].size());
    double worst = 0;
    const int64_t bad = first_mismatch(got[s], want[s], rel, worst);
    worst_of_all = std::max(worst_of_all, worst);
    EXPECT_LT(bad, 0) << "after step " << s + 1 << ": element " << bad << " is "
                      << got[s][static_cast<size_t>(std::max<int64_t>(bad, 0))] << ", the reference "
                      << want[s][static_cast<size_t>(std::max<int64_t>(bad, 0))] << "; worst relative difference "
                      << worst << " > " << rel;
  }
  if (std::getenv("STRATA_TEST_VERBOSE"))
    std::printf("%s: worst relative difference %.3g\n", what.c_str(), worst_of_all);
}

// The one-rank ZeRO 0 reference on the whole batch, one micro-batch.
Snapshots reference(DType dtype, const Recipe& recipe) {
  MpiCommunicator self(MPI_COMM_SELF, "self");
  Recipe whole = recipe;
  whole.micro_batches = 1;
  whole.loss_scale = 0;
  return train(self, self, /*zero=*/0, dtype, whole);
}

class ZeroStage : public testing::TestWithParam<int> {};

TEST_P(ZeroStage, StepEqualsTheReplicatedStepF32) {
  const int zero = GetParam();
  MpiCommunicator self(MPI_COMM_SELF, "self");
  for (const Recipe& recipe : recipes()) {
    const Snapshots want = reference(DType::F32, recipe);
    for (int dp : {1, 2, 4}) {
      if (world_size() % dp != 0) continue;
      SCOPED_TRACE(recipe.name + " dp " + std::to_string(dp));
      Group group(dp);
      const Snapshots got = train(*group.comm, self, zero, DType::F32, recipe);
      // One replica on one micro-batch is the reference's arithmetic exactly; more replicas or
      // micro-batches add the gradients up in another order: rounding only.
      expect_matches(got, want, dp == 1 && recipe.micro_batches == 1 ? 0.0 : 1e-6,
                     "f32 zero " + std::to_string(zero) + " " + recipe.name + " dp " + std::to_string(dp));
    }
  }
}

// bf16 parameters with f32 gradients and master weights. The replicas' gradients add up in
// another order than the reference's, so a master weight may round to the neighbouring bf16
// value: the tolerance is one bf16 step, 2^-7 relative.
TEST_P(ZeroStage, StepEqualsTheReplicatedStepBf16) {
  const int zero = GetParam();
  MpiCommunicator self(MPI_COMM_SELF, "self");
  for (const Recipe& recipe : recipes()) {
    const Snapshots want = reference(DType::BF16, recipe);
    for (int dp : {1, 2, 4}) {
      if (world_size() % dp != 0) continue;
      SCOPED_TRACE(recipe.name + " dp " + std::to_string(dp));
      Group group(dp);
      const Snapshots got = train(*group.comm, self, zero, DType::BF16, recipe);
      expect_matches(got, want, dp == 1 && recipe.micro_batches == 1 ? 0.0 : std::ldexp(1.0, -7),
                     "bf16 zero " + std::to_string(zero) + " " + recipe.name + " dp " + std::to_string(dp));
    }
  }
}

// The recipes' clipping bites (so the sharded global norm is tested), and a fixed loss scale
// that is a power of two changes nothing.
TEST(ZeroReference, ClippingChangesTheResultAndScalingDoesNot) {
  for (const Recipe& recipe : recipes()) {
    if (recipe.clip <= 0) continue;
    SCOPED_TRACE(recipe.name);
    MpiCommunicator self(MPI_COMM_SELF, "self");
    Recipe unclipped = recipe;
    unclipped.clip = 0;
    EXPECT_NE(reference(DType::F32, recipe).back(), reference(DType::F32, unclipped).back());
    if (recipe.loss_scale > 0) {
      Recipe unscaled = recipe;
      unscaled.loss_scale = 0;
      EXPECT_EQ(train(self, self, 0, DType::F32, recipe), train(self, self, 0, DType::F32, unscaled));
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Zero, ZeroStage, testing::Values(0, 1, 2, 3),
                         [](const testing::TestParamInfo<int>& p) { return "zero" + std::to_string(p.param); });

// ---- ZeRO 3: set_value / full_value ----------------------------------------------------------

// A value for element k of entry e, distinct over entries and elements.
float known_value(const layers::ParamEntry& e, int64_t k) {
  return 0.001f * static_cast<float>(e.offset + k) - 0.25f + (e.trainable ? 0.0f : 3.0f);
}

Tensor known_full(const layers::ParamEntry& e) {
  Tensor t = Tensor::empty(e.shape);
  for (int64_t k = 0; k < t.numel(); ++k) t.data<float>()[k] = known_value(e, k);
  return t;
}

TEST(ZeroThree, SetValueThenFullValueRoundTrips) {
  for (DType dtype : {DType::F32, DType::BF16})
    for (int dp : {1, 2, 4}) {
      if (world_size() % dp != 0) continue;
      SCOPED_TRACE(std::string(dtype_name(dtype)) + " dp " + std::to_string(dp));
      Group group(dp);
      const layers::Model model = make_model();
      Layout layout;
      layout.zero = 3;
      layout.dtype = dtype;
      DataParallel replica(*group.comm, model, StageRange{0, model.size()}, layout, kSeed, Device::cpu());
      const std::vector<layers::ParamEntry>& entries = replica.store().entries();
      for (const layers::ParamEntry& e : entries) replica.set_value(e, known_full(e));

      const Shard mine = replica.ownership().shard(group.comm->rank());
      const Tensor shard = to_dtype(replica.store().params(), DType::F32);
      const Tensor& master = replica.optimizer().master();
      EXPECT_EQ(master.defined(), dtype != DType::F32);
      for (const layers::ParamEntry& e : entries) {
        SCOPED_TRACE(e.name);
        // Every replica gets the full value back, rounded to the stored dtype.
        const Tensor want = to_dtype(to_dtype(known_full(e), dtype), DType::F32);
        const Tensor got = to_dtype(replica.full_value(e), DType::F32);
        ASSERT_EQ(got.shape(), e.shape);
        int wrong = 0;
        for (int64_t k = 0; k < got.numel(); ++k) wrong += got.data<float>()[k] != want.data<float>()[k];
        EXPECT_EQ(wrong, 0);
        if (!e.trainable) continue;
        // The store holds exactly the owned part, at flat element rank * S onwards; the f32
        // master copy holds it unrounded.
        int wrong_shard = 0, wrong_master = 0;
        const int64_t n = shape_numel(e.shape);
        for (int64_t k = 0; k < n; ++k) {
          const int64_t flat = e.offset + k;
          if (flat < mine.begin || flat >= mine.end) continue;
          wrong_shard += shard.data<float>()[flat - mine.begin] != want.data<float>()[k];
          if (master.defined()) wrong_master += master.data<float>()[flat - mine.begin] != known_value(e, k);
        }
        EXPECT_EQ(wrong_shard, 0);
        EXPECT_EQ(wrong_master, 0);
      }

      // The forward through the gathered windows computes with the values set: the same
      // logits as a one-rank model holding them in full.
      MpiCommunicator self(MPI_COMM_SELF, "self");
      const layers::Model ref_model = make_model();
      Layout ref_layout = layout;
      ref_layout.zero = 0;
      DataParallel ref(self, ref_model, StageRange{0, ref_model.size()}, ref_layout, kSeed, Device::cpu());
      for (const layers::ParamEntry& e : ref.store().entries()) ref.set_value(e, known_full(e));
      std::vector<layers::Context> ctx, ref_ctx;
      const Tensor x = to_dtype(batch_x(), dtype);
      const Tensor y = to_dtype(replica.forward(x, ctx, {layers::Mode::Eval, kSeed, 0, 0}), DType::F32);
      const Tensor ref_y = to_dtype(ref.forward(x, ref_ctx, {layers::Mode::Eval, kSeed, 0, 0}), DType::F32);
      ASSERT_EQ(y.shape(), ref_y.shape());
      int wrong = 0;
      for (int64_t k = 0; k < y.numel(); ++k) wrong += y.data<float>()[k] != ref_y.data<float>()[k];
      EXPECT_EQ(wrong, 0);
    }
}

}  // namespace
}  // namespace strata::parallel
