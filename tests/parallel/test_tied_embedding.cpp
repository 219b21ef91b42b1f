// TiedEmbedding under real MPI (2 and 4 ranks): a tiny GPT whose LM head is tied to the token
// embedding, cut into two pipeline stages (stage = rank % 2; with 4 ranks two replicas,
// replica = rank / 2), each stage a DataParallel replica under ZeRO 0-3, trained a few SGD steps
// by hand (stage 0 forward, send, stage 1 forward + loss + backward, send dx, stage 0 backward)
// as the trainer wires it. The reference is one rank and one stage, where the head shares the
// embedding's views: after every step the full wte must match it (so the head's gradient was
// added once, to the right rows), and so must the next step's loss (so the head's copy of wte
// was refreshed). Also one stage under ZeRO 2/3 (the head copies wte on its own stage).
#include <gtest/gtest.h>

#include <cmath>
#include <memory>
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
#include "parallel/mpi_world.hpp"
#include "parallel/stage/tied_embedding.hpp"

namespace strata::parallel {
namespace {

using namespace testing_world;

constexpr int64_t kGlobalBatch = 8, kSeqLen = 8;
constexpr int kVocab = 20, kSteps = 3;
constexpr uint64_t kSeed = 5;

layers::Model make_model(bool tied = true) {
  layers::ModelSpec s;
  s.name = "gpt";
  s.layers = 1;
  s.heads = 2;
  s.embed = 16;
  s.tie_embeddings = tied;
  return layers::build_model(s, {kSeqLen}, kVocab);
}

// Token windows: inputs and the next tokens, a fixed pattern.
Tensor tokens(int shift) {
  Tensor t = Tensor::empty({kGlobalBatch, kSeqLen}, DType::I32);
  for (int64_t i = 0; i < t.numel(); ++i) t.data<int32_t>()[i] = static_cast<int32_t>((i * 7 + shift + i / 5) % kVocab);
  return t;
}

struct TrainedRun {
  std::vector<double> losses;           // on the last stage: the global batch's mean loss per step
  std::vector<std::vector<float>> wte;  // on the first stage: wte after each step
};

std::vector<float> wte_of(DataParallel& replica) {
  for (const layers::ParamEntry& e : replica.store().entries())
    if (e.name == "wte/weight") {
      const Tensor v = replica.full_value(e);  // collective over dp under ZeRO 3
      return {v.data<float>(), v.data<float>() + v.numel()};
    }
  ADD_FAILURE() << "no wte/weight on this stage";
  return {};
}

// Trains kSteps steps as stage pp.rank() of pp.size(), replica dp.rank() of dp.size().
TrainedRun train(Communicator& pp, Communicator& dp, int zero) {
  const layers::Model model = make_model();
  const std::vector<StageRange> stages = partition_layers(model, pp.size(), "balanced");
  const StageRange mine = stages[static_cast<size_t>(pp.rank())];
  const bool first = pp.rank() == 0, last = pp.rank() == pp.size() - 1;
  TiedEmbedding tied(pp, model, stages, zero, DType::F32, Device::cpu());
  EXPECT_EQ(tied.copied(), pp.size() > 1);  // one stage: the ring pins wte's gradient, ZeRO 3 gathers wte for the head
  Layout layout;
  layout.zero = zero;
  layout.bucket_bytes = 512;  // many buckets: wte's is reduced last
  layout.optimizer.name = "sgd";
  layout.optimizer.momentum = 0.9f;
  DataParallel replica(dp, model, mine, layout, kSeed, Device::cpu());
  replica.set_before_reduce([&](size_t layer) { tied.add_head_gradient(layer); });
  replica.broadcast_parameters();
  tied.refresh(replica);
  if (last) {
    EXPECT_EQ(tied.parameter_bytes(), tied.copied() ? kVocab * 16 * 4 : 0);
  }

  const layers::SoftmaxCrossEntropy loss;
  layers::LossScaler no_scaling;
  const Tensor x = tokens(0), y = tokens(1);
  const int64_t local = kGlobalBatch / dp.size(), begin = dp.rank() * local;
  const Shape boundary = layers::batch_shape(local, model.shape(mine.end));
  TrainedRun run;
  for (int step = 0; step < kSteps; ++step) {
    replica.zero_grads();
    tied.zero_head_gradient();
    std::vector<layers::Context> ctx;
    const layers::StepInfo info{layers::Mode::Train, kSeed, step, begin};
    Tensor h =
        first ? x.slice(begin, begin + local) : Tensor::empty(layers::batch_shape(local, model.shape(mine.begin)));
    if (!first) pp.recv(h, pp.rank() - 1, 0);
    const Tensor out = replica.forward(h, ctx, info);
    Tensor dy;
    if (last) {
      layers::Context loss_ctx;
      std::vector<double> sum{loss.forward(out, y.slice(begin, begin + local), loss_ctx)};
      all_reduce_sum(dp, sum);
      run.losses.push_back(sum[0] / static_cast<double>(kGlobalBatch * kSeqLen));
      dy = loss.backward(loss_ctx, 1.0f / static_cast<float>(kGlobalBatch * kSeqLen));
    } else {
      pp.send(out, pp.rank() + 1, 0);
      dy = Tensor::empty(boundary);
      pp.recv(dy, pp.rank() + 1, 1);
    }
    const Tensor dx = replica.backward(dy, ctx, /*last_of_step=*/true, /*input_grad=*/!first);
    if (!first) pp.send(dx, pp.rank() - 1, 1);
    tied.send_head_gradient();
    EXPECT_TRUE(replica.step(0.5f, no_scaling, 0, dp, pp));
    tied.refresh(replica);
    if (first) run.wte.push_back(wte_of(replica));
  }
  return run;
}

TrainedRun reference() {
  MpiCommunicator self(MPI_COMM_SELF, "self"), self_dp(MPI_COMM_SELF, "self-dp");
  return train(self, self_dp, 0);
}

void expect_close(const std::vector<float>& got, const std::vector<float>& want, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  float top = 0;
  for (float v : want) top = std::max(top, std::fabs(v));
  double worst = 0;
  for (size_t i = 0; i < got.size(); ++i) worst = std::max(worst, static_cast<double>(std::fabs(got[i] - want[i])));
  EXPECT_LE(worst, 1e-6 * top) << what << ": worst difference " << worst << " of max " << top;
}

TEST(TiedEmbedding, TwoStagesTrainLikeOneStageThatSharesTheViews) {
  const int rank = world_rank(), replicas = world_size() / 2;
  ASSERT_EQ(world_size() % 2, 0);
  const TrainedRun want = reference();
  // Stage rank % 2 of replica rank / 2 (ranks beyond 2 * replicas do not exist: world is even).
  const auto pp = split_world(rank / 2, "pp");
  const auto dp = split_world(rank % 2, "dp");
  ASSERT_EQ(pp->size(), 2);
  ASSERT_EQ(dp->size(), replicas);
  for (int zero : {0, 1, 2, 3}) {
    SCOPED_TRACE("zero " + std::to_string(zero) + ", dp " + std::to_string(replicas));
    const TrainedRun got = train(*pp, *dp, zero);
    if (pp->rank() == 0) {
      ASSERT_EQ(got.wte.size(), want.wte.size());
      for (size_t s = 0; s < got.wte.size(); ++s)
        expect_close(got.wte[s], want.wte[s], "wte after step " + std::to_string(s + 1));
      // Not vacuous: wte moved.
      EXPECT_NE(got.wte.back(), want.wte.front());
    } else {
      ASSERT_EQ(got.losses.size(), want.losses.size());
      for (size_t s = 0; s < got.losses.size(); ++s)
        EXPECT_NEAR(got.losses[s], want.losses[s], 1e-6 * want.losses[s]) << "loss of step " << s + 1;
      EXPECT_LT(got.losses.back(), got.losses.front());  // it learns
    }
  }
}

TEST(TiedEmbedding, OneStageNeedsNoCopyUnderAnyZeroStage) {
  const TrainedRun want = reference();
  const int rank = world_rank();
  const auto dp = split_world(0, "dp");  // every rank: one stage, dp = world
  MpiCommunicator self(MPI_COMM_SELF, "pp");
  for (int zero : {1, 2, 3}) {
    SCOPED_TRACE("zero " + std::to_string(zero));
    const TrainedRun got = train(self, *dp, zero);
    for (size_t s = 0; s < got.wte.size(); ++s)
      expect_close(got.wte[s], want.wte[s], "wte after step " + std::to_string(s + 1));
    for (size_t s = 0; s < got.losses.size(); ++s)
      EXPECT_NEAR(got.losses[s], want.losses[s], 1e-6 * want.losses[s]) << "loss of step " << s + 1 << " rank " << rank;
  }
}

TEST(TiedEmbedding, UntiedModelsNeedNothing) {
  const layers::Model model = make_model(/*tied=*/false);
  MpiCommunicator self(MPI_COMM_SELF, "pp");
  for (int zero : {0, 3}) {
    const TiedEmbedding tied(self, model, partition_layers(model, 1, "balanced"), zero, DType::F32, Device::cpu());
    EXPECT_FALSE(tied.copied());
    EXPECT_EQ(tied.parameter_bytes() + tied.gradient_bytes(), 0);
  }
}

}  // namespace
}  // namespace strata::parallel
