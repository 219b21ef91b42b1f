// Tensor-parallel layers under real MPI, tp = the world (2 and 4 ranks): every rank builds the
// split model (parallel::TensorParallel over the world) and the same model unsplit, and
// checks the split one against the unsplit one: initial shards are exact slices, the
// all-gathered logits, the loss, every gradient shard and the accuracy count match, and
// replicated parameters' gradients are bitwise the same on every rank. Also Linear's column
// and row modes alone, the parallel cross-entropy on hard logits, and the bad-input lines.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "core/allocator.hpp"
#include "core/ops.hpp"
#include "expect_error.hpp"
#include "layers/basic.hpp"
#include "layers/loss.hpp"
#include "layers/model.hpp"
#include "layers/parameter_store.hpp"
#include "layers/zoo.hpp"
#include "parallel/comm/tensor_parallel.hpp"
#include "parallel/mpi_world.hpp"

namespace strata::parallel {
namespace {

using namespace testing_world;
using layers::ParamEntry;
using layers::TensorSplit;

constexpr int64_t kBatch = 3, kSeq = 16;
constexpr int kVocab = 64;
constexpr uint64_t kSeed = 11;

struct World {
  std::unique_ptr<MpiCommunicator> comm = split_world(0, "tp");
  TensorParallel tp{*comm};
};

double max_abs(const Tensor& t) {
  double m = 0;
  for (int64_t i = 0; i < t.numel(); ++i) m = std::max(m, std::abs(static_cast<double>(t.data<float>()[i])));
  return m;
}

// The largest max |a - b| / max |b| seen per check kind (the text before the first space),
// printed by rank 0 at the end of the GPT test.
std::map<std::string, double>& worst() {
  static std::map<std::string, double> w;
  return w;
}

// max |a - b| <= rel * max |b| (and the same shape).
void expect_close(const std::string& what, const Tensor& a, const Tensor& b, double rel) {
  ASSERT_EQ(shape_str(a.shape()), shape_str(b.shape())) << what;
  const double scale = max_abs(b);
  double diff = 0;
  for (int64_t i = 0; i < a.numel(); ++i) {
    ASSERT_TRUE(std::isfinite(a.data<float>()[i])) << what << "[" << i << "]";
    diff = std::max(diff, std::abs(static_cast<double>(a.data<float>()[i]) - b.data<float>()[i]));
  }
  EXPECT_LE(diff, rel * scale) << what << ": max |diff| " << diff << " vs max |ref| " << scale;
  double& w = worst()[what.substr(0, what.find(' '))];
  w = std::max(w, scale > 0 ? diff / scale : diff);
}

bool same_bits(const Tensor& a, const Tensor& b) {
  return a.numel() == b.numel() && std::memcmp(a.raw(), b.raw(), a.nbytes()) == 0;
}

// True when `t` holds the same bits on every rank of `comm`.
bool same_on_every_rank(Communicator& comm, const Tensor& t) {
  Tensor all = Tensor::empty({comm.size(), t.numel()}, t.dtype());
  comm.all_gather(t.reshape({t.numel()}), all);
  for (int r = 0; r < comm.size(); ++r)
    if (std::memcmp(all.slice(r, r + 1).raw(), t.raw(), t.nbytes()) != 0) return false;
  return true;
}

bool same_double_on_every_rank(double v) {
  double lo = v, hi = v;
  MPI_Allreduce(MPI_IN_PLACE, &lo, 1, MPI_DOUBLE, MPI_MIN, MPI_COMM_WORLD);
  MPI_Allreduce(MPI_IN_PLACE, &hi, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  return std::memcmp(&lo, &v, sizeof v) == 0 && std::memcmp(&hi, &v, sizeof v) == 0;
}

// The full (N, V) logits from every rank's (N, ceil(V/T)) columns, less the padding columns of
// a vocabulary that T does not divide.
Tensor gather_columns(Communicator& comm, const Tensor& local, int64_t vocab) {
  const int64_t cols = local.shape().back(), n = local.numel() / cols, t = comm.size();
  Tensor all = Tensor::empty({t, n * cols});
  comm.all_gather(local.reshape({n * cols}), all);
  Tensor full = Tensor::empty({n, vocab});
  for (int64_t i = 0; i < n; ++i)
    for (int64_t c = 0; c < vocab; ++c)
      full.data<float>()[i * vocab + c] = all.data<float>()[(c / cols * n + i) * cols + c % cols];
  return full;
}

Tensor shard_of(const Tensor& full, const TensorSplit& split, const Shape& local) {
  Tensor t = Tensor::empty(local);
  layers::take_shard(full, split, t);
  return t;
}

Tensor random_tensor(const Shape& shape, uint32_t seed, float scale = 1.0f) {
  Tensor t = Tensor::empty(shape);
  uint32_t s = seed * 2654435761u + 1;
  for (int64_t i = 0; i < t.numel(); ++i) {
    s = s * 1664525u + 1013904223u;
    t.data<float>()[i] = scale * (static_cast<float>(s >> 8) / 16777216.0f * 2.0f - 1.0f);
  }
  return t;
}

// ---- Linear alone ----------------------------------------------------------------------------

struct BoundLinear {
  std::unique_ptr<layers::Linear> layer;
  Tensor w, b, dw, db;
};

// A Linear bound to copies of (this rank's shards of) w_full and b_full.
BoundLinear bound_linear(int64_t in, int64_t out, layers::TensorParallelMode mode, layers::TensorParallelGroup* tp,
                         int segments, const Tensor& w_full, const Tensor& b_full) {
  BoundLinear l;
  l.layer = std::make_unique<layers::Linear>("fc", in, out);
  l.layer->set_tensor_parallel(mode, tp, segments);
  const std::vector<layers::ParamSpec> specs = l.layer->param_specs();
  l.w = shard_of(w_full, specs[0].split, specs[0].shape);
  l.b = shard_of(b_full, specs[1].split, specs[1].shape);
  l.dw = Tensor::zeros(specs[0].shape);
  l.db = Tensor::zeros(specs[1].shape);
  const std::vector<Tensor> params{l.w, l.b}, grads{l.dw, l.db};
  l.layer->bind(params, grads);
  return l;
}

TEST(TensorParallelLinear, ColumnAndRowMatchTheWholeLayer) {
  World world;
  const int t = world.tp.size(), r = world.tp.rank();
  const int64_t n = 5, in = 24, out = 12 * t;
  const layers::StepInfo info;
  for (const int segments : {1, 3}) {
    // Column: the input whole, the output this rank's columns (piece r of each segment).
    const Tensor w = random_tensor({out, in}, 1), b = random_tensor({out}, 2), x = random_tensor({2, n, in}, 3);
    BoundLinear whole = bound_linear(in, out, layers::TensorParallelMode::None, nullptr, 1, w, b);
    BoundLinear col = bound_linear(in, out, layers::TensorParallelMode::Column, &world.tp, segments, w, b);
    EXPECT_EQ(shape_str(col.layer->output_shape({n, in})), shape_str({n, out / t}));
    layers::Context cw, cc;
    const Tensor yw = whole.layer->forward(x, cw, info), yc = col.layer->forward(x, cc, info);
    const TensorSplit out_split{t, r, 2, segments};  // (2, n, out): the outputs along dim 2
    expect_close("column y", yc, shard_of(yw, out_split, yc.shape()), 1e-6);
    const Tensor dy = random_tensor(yw.shape(), 4);
    const Tensor dxw = whole.layer->backward(dy, cw);
    const Tensor dxc = col.layer->backward(shard_of(dy, out_split, yc.shape()), cc);
    expect_close("column dx", dxc, dxw, 1e-5);
    EXPECT_TRUE(same_on_every_rank(*world.comm, dxc)) << "column dx differs across tp ranks";
    expect_close("column dW", col.dw, shard_of(whole.dw, {t, r, 0, segments}, col.dw.shape()), 1e-6);
    expect_close("column db", col.db, shard_of(whole.db, {t, r, 0, segments}, col.db.shape()), 1e-6);
  }
  {
    // Row: the input this rank's slice of the features, the output whole (all-reduced).
    const int64_t rin = 8 * t, rout = 10;
    const Tensor w = random_tensor({rout, rin}, 5), b = random_tensor({rout}, 6), x = random_tensor({n, rin}, 7);
    BoundLinear whole = bound_linear(rin, rout, layers::TensorParallelMode::None, nullptr, 1, w, b);
    BoundLinear row = bound_linear(rin, rout, layers::TensorParallelMode::Row, &world.tp, 1, w, b);
    EXPECT_EQ(row.w.dim(1), rin / t);
    EXPECT_EQ(row.b.numel(), rout);  // the bias is replicated
    const TensorSplit in_split{t, r, 1, 1};
    const Tensor x_local = shard_of(x, in_split, {n, rin / t});
    layers::Context cw, cr;
    const Tensor yw = whole.layer->forward(x, cw, info), yr = row.layer->forward(x_local, cr, info);
    expect_close("row y", yr, yw, 1e-5);
    EXPECT_TRUE(same_on_every_rank(*world.comm, yr)) << "row y differs across tp ranks";
    const Tensor dy = random_tensor(yw.shape(), 8);
    const Tensor dxw = whole.layer->backward(dy, cw), dxr = row.layer->backward(dy, cr);
    expect_close("row dx", dxr, shard_of(dxw, in_split, dxr.shape()), 1e-6);
    expect_close("row dW", row.dw, shard_of(whole.dw, in_split, row.dw.shape()), 1e-6);
    EXPECT_TRUE(same_bits(row.db, whole.db)) << "row db: the column sums of dy, as the whole layer's";
  }
}

// ---- parallel cross-entropy ------------------------------------------------------------------

TEST(TensorParallelLoss, MatchesTheFullCrossEntropy) {
  World world;
  const int t = world.tp.size(), r = world.tp.rank();
  const int64_t n = 37, v = 16 * t;
  // Large logits (softmax far from uniform, the maximum on various ranks) and ties across
  // slices for the argmax: rows 0..7 hold their maximum at two columns of different ranks.
  Tensor logits = random_tensor({n, v}, 21, 12.0f);
  Tensor labels = Tensor::empty({n}, DType::I32);
  for (int64_t i = 0; i < n; ++i) {
    labels.data<int32_t>()[i] = static_cast<int32_t>((i * 13 + 5) % v);
    if (i < 8) {
      const int64_t a = (i * 5) % 16, b = 16 * (1 + i % (t - 1 + (t == 1))) + i % 16;  // b on rank >= 1
      logits.data<float>()[i * v + a] = 40.0f;
      logits.data<float>()[i * v + b] = 40.0f;
      labels.data<int32_t>()[i] = static_cast<int32_t>(i % 4 ? a : b);  // the lowest index wins: a
    } else if (i < 20) {
      // Labels at the argmax, so the count is not trivially 0.
      const float* row = logits.data<float>() + i * v;
      labels.data<int32_t>()[i] = static_cast<int32_t>(std::max_element(row, row + v) - row);
    }
  }
  const Tensor local = shard_of(logits, {t, r, 1, 1}, {n, v / t});
  const layers::SoftmaxCrossEntropy whole, split(&world.tp);
  layers::Context cw, cs;
  const double lw = whole.forward(logits, labels, cw), ls = split.forward(local, labels, cs);
  EXPECT_NEAR(ls, lw, 1e-6 * std::abs(lw));
  EXPECT_TRUE(same_double_on_every_rank(ls)) << "the loss differs across tp ranks";
  const float scale = 1.0f / static_cast<float>(n);
  const Tensor dw = whole.backward(cw, scale), ds = split.backward(cs, scale);
  expect_close("dlogits", ds, shard_of(dw, {t, r, 1, 1}, ds.shape()), 1e-6);
  const int64_t expected = ops::count_correct(logits, labels);
  EXPECT_GE(expected, 12);  // rows 8..19 and the tied rows with label a
  EXPECT_EQ(split.count_correct(local, labels), expected);
  EXPECT_EQ(whole.count_correct(logits, labels), expected);
  // Labels are checked against the full vocabulary, as without tp.
  labels.data<int32_t>()[3] = static_cast<int32_t>(v);
  layers::Context bad;
  try {
    split.forward(local, labels, bad);
    ADD_FAILURE() << "label " << v << " was accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::Input);
    EXPECT_NE(e.message().find(detail::cat("outside [0, ", v, ")")), std::string::npos) << e.message();
  }
}

// bf16 logits: the slice's rows are widened one at a time (ops::row_max, softmax_slice_stats,
// softmax_slice), never into a whole f32 copy, and the loss matches the whole bf16 loss's.
TEST(TensorParallelLoss, Bf16LogitsMatchTheFullLossWithoutF32Copies) {
  World world;
  const int t = world.tp.size(), r = world.tp.rank();
  const int64_t n = 29, v = 1000 * t;
  const Tensor logits32 = random_tensor({n, v}, 5, 8.0f);
  Tensor labels = Tensor::empty({n}, DType::I32);
  for (int64_t i = 0; i < n; ++i) labels.data<int32_t>()[i] = static_cast<int32_t>((i * 331 + 7) % v);
  const Tensor logits = Tensor::empty({n, v}, DType::BF16), local = Tensor::empty({n, v / t}, DType::BF16);
  ops::cast(logits32, logits);
  ops::cast(shard_of(logits32, {t, r, 1, 1}, {n, v / t}), local);
  const layers::SoftmaxCrossEntropy whole, split(&world.tp);
  layers::Context cw, cs;
  const double lw = whole.forward(logits, labels, cw);
  const float scale = 1.0f / static_cast<float>(n);
  const Tensor dw = whole.backward(cw, scale);
  const size_t before = host_allocator().stats().bytes_in_use;
  host_allocator().reset_peak();
  const double ls = split.forward(local, labels, cs);
  const Tensor ds = split.backward(cs, scale);
  // What the split loss may hold at once: its bf16 probabilities and gradient (in the
  // allocator's size classes) and per-row statistics; one f32 copy of the slice would add twice
  // the probabilities' bytes.
  const size_t grown = host_allocator().stats().peak_in_use - before;
  EXPECT_LT(grown, 2 * HostCachingAllocator::size_class(local.nbytes()) + 8192)
      << "the split loss held " << grown << " bytes for a bf16 slice of " << local.nbytes();
  // The slices' sums are added in another order than the whole row's: rounding-level
  // differences, which may move a gradient across one bf16 rounding boundary (2^-8 relative).
  EXPECT_NEAR(ls, lw, 1e-6 * std::abs(lw));
  EXPECT_TRUE(same_double_on_every_rank(ls)) << "the loss differs across tp ranks";
  const Tensor ds32 = Tensor::empty(ds.shape()), dw32 = Tensor::empty(dw.shape());
  ops::cast(ds, ds32);
  ops::cast(dw, dw32);
  expect_close("dlogits-bf16", ds32, shard_of(dw32, {t, r, 1, 1}, ds.shape()), 1.0 / 256);
}

// ---- the GPT -------------------------------------------------------------------------------

layers::ModelSpec tiny_gpt(float dropout, const std::string& attention, bool tied) {
  layers::ModelSpec s;
  s.name = "gpt";
  s.layers = 2;
  s.heads = 4;
  s.embed = 32;
  s.dropout = dropout;
  s.attention = attention;
  s.tie_embeddings = tied;
  return s;
}

// MFU's numerator and the partition's costs: the shards' FLOPs add up to the whole model's,
// layer by layer.
void expect_shard_flops_add_up(World& world, const layers::Model& whole, const layers::Model& split) {
  for (size_t i = 0; i < whole.size(); ++i) {
    int64_t shards = split.layer(i).flops(split.shape(i));
    MPI_Allreduce(MPI_IN_PLACE, &shards, 1, MPI_INT64_T, MPI_SUM, world.comm->comm());
    EXPECT_EQ(shards, whole.layer(i).flops(whole.shape(i))) << whole.layer(i).name();
  }
}

Tensor tokens(int shift, int vocab = kVocab) {
  Tensor t = Tensor::empty({kBatch, kSeq}, DType::I32);
  for (int64_t i = 0; i < t.numel(); ++i) t.data<int32_t>()[i] = static_cast<int32_t>((i * 7 + shift + i / 5) % vocab);
  return t;
}

struct StepResult {
  Tensor logits;  // the model's output (the full (B, T, V), or this rank's (B, T, V/T))
  double loss;
  int64_t correct;
};

// One training forward and backward of the batch with `loss`.
StepResult step(const layers::Model& model, const layers::SoftmaxCrossEntropy& loss, const Tensor& x, const Tensor& y) {
  std::vector<layers::Context> ctx;
  layers::StepInfo info;
  info.seed = kSeed;
  info.step = 3;
  info.first_sample = 6;
  StepResult run;
  run.logits = model.forward(x, ctx, info).clone();
  layers::Context lc;
  run.loss = loss.forward(run.logits, y, lc);
  run.correct = loss.count_correct(run.logits, y);
  model.backward(loss.backward(lc, 1.0f / (kBatch * kSeq)), ctx);
  return run;
}

// Also with a vocabulary that tp does not divide (61 = 64 - 3, prime: tp 2 pads 1 row, tp 4
// pads 3): the padding rows stay zero, their logits -inf, and everything else is as above.
// With sequence parallelism as well (the activations between the regions cut along T: the
// dropout masks, the norms' summed gradients, the gathers and scatters).
TEST(TensorParallelGpt, MatchesTheWholeModel) {
  World world;
  const int t = world.tp.size();
  for (const bool sequence_parallel : {false, true})
    for (const int vocab : {kVocab, kVocab - 3})
      for (const float dropout : {0.0f, 0.1f})
        for (const std::string attention : {"flash", "plain"})
          for (const bool tied : {true, false}) {
            if (vocab != kVocab && dropout == 0.0f) continue;  // the padded paths do not depend on dropout
            SCOPED_TRACE(detail::cat("vocab ", vocab, ", dropout ", dropout, ", ", attention,
                                     tied ? ", tied" : ", untied", ", tp ", t,
                                     sequence_parallel ? ", sequence-parallel" : ""));
            world.tp.set_sequence_parallel(sequence_parallel);
            const Tensor x = tokens(0, vocab), y = tokens(1, vocab);
            const int64_t slice = (vocab + t - 1) / t,
                          real = std::clamp<int64_t>(vocab - world.tp.rank() * slice, 0, slice);
            const layers::ModelSpec spec = tiny_gpt(dropout, attention, tied);
            const layers::Model whole = layers::build_model(spec, {kSeq}, vocab);
            const layers::Model split = layers::build_model(spec, {kSeq}, vocab, &world.tp);
            EXPECT_EQ(split.tensor_parallel(), &world.tp);
            EXPECT_EQ(split.num_classes(), vocab);
            EXPECT_EQ(shape_str(split.shape(split.size())), shape_str({kSeq, slice}));
            const layers::ParameterStore ws(whole, kSeed), ss(split, kSeed);

            // Initial values: every shard is exactly its slice of the whole model's tensor.
            std::map<std::string, const ParamEntry*> by_name;
            for (const ParamEntry& e : ws.entries()) by_name[e.name] = &e;
            ASSERT_EQ(ss.entries().size(), ws.entries().size());
            int64_t split_entries = 0;
            for (const ParamEntry& e : ss.entries()) {
              ASSERT_TRUE(by_name.count(e.name)) << e.name;
              const ParamEntry& we = *by_name[e.name];
              ASSERT_EQ(shape_str(e.full_shape()), shape_str(we.shape)) << e.name;
              EXPECT_TRUE(same_bits(ss.value(e), shard_of(ws.value(we), e.split, e.shape))) << e.name;
              split_entries += e.split.split();
            }
            // Per block: c_attn weight and bias, attn c_proj weight, c_fc weight and bias, mlp
            // c_proj weight; wte; lm_head when untied.
            EXPECT_EQ(split_entries, 6 * spec.layers + 1 + (tied ? 0 : 1));
            expect_shard_flops_add_up(world, whole, split);

            const StepResult rw = step(whole, layers::SoftmaxCrossEntropy(), x, y);
            const StepResult rs = step(split, layers::SoftmaxCrossEntropy(&world.tp), x, y);
            ASSERT_EQ(shape_str(rs.logits.shape()), shape_str({kBatch, kSeq, slice}));
            for (int64_t i = 0; i < rs.logits.numel(); ++i)
              if (i % slice >= real) {
                ASSERT_EQ(rs.logits.data<float>()[i], -INFINITY) << "padding logit " << i;
              }
            expect_close("logits", gather_columns(*world.comm, rs.logits, vocab),
                         rw.logits.reshape({kBatch * kSeq, vocab}), 1e-5);
            EXPECT_NEAR(rs.loss, rw.loss, 1e-6 * std::abs(rw.loss));
            worst()["loss(rel)"] = std::max(worst()["loss(rel)"], std::abs(rs.loss - rw.loss) / std::abs(rw.loss));
            EXPECT_TRUE(same_double_on_every_rank(rs.loss)) << "the loss differs across tp ranks";
            EXPECT_EQ(rs.correct, rw.correct);

            for (const ParamEntry& e : ss.entries()) {
              const Tensor g = ss.grad(e);
              expect_close("gradient of " + e.name, g, shard_of(ws.grad(*by_name[e.name]), e.split, e.shape), 1e-5);
              if (!e.split.split()) {
                EXPECT_TRUE(same_on_every_rank(*world.comm, g))
                    << e.name << ": a replicated gradient differs across ranks";
              }
            }
          }
  if (world_rank() == 0)
    for (const auto& [what, w] : worst())
      std::printf("[ worst   ] %s: max |diff| / max |ref| = %.2e\n", what.c_str(), w);
}

// A group of one rank is the whole model, bit for bit.
TEST(TensorParallelGpt, OneRankGroupIsTheWholeModel) {
  const std::unique_ptr<MpiCommunicator> alone = split_world(world_rank(), "tp1");
  TensorParallel tp(*alone);
  const layers::ModelSpec spec = tiny_gpt(0.1f, "flash", true);
  const layers::Model whole = layers::build_model(spec, {kSeq}, kVocab);
  const layers::Model one = layers::build_model(spec, {kSeq}, kVocab, &tp);
  EXPECT_EQ(one.tensor_parallel(), nullptr);
  const layers::ParameterStore ws(whole, kSeed), os(one, kSeed);
  const StepResult rw = step(whole, layers::SoftmaxCrossEntropy(), tokens(0), tokens(1));
  const StepResult ro = step(one, layers::SoftmaxCrossEntropy(&tp), tokens(0), tokens(1));
  EXPECT_TRUE(same_bits(ro.logits, rw.logits));
  EXPECT_EQ(ro.loss, rw.loss);
  EXPECT_TRUE(same_bits(os.grads(), ws.grads()));
}

using test::expect_input_error;

// ---- Llama -----------------------------------------------------------------------------------

// 8 query heads of 8 over kv heads 8, 2 and 1: with 4 ranks, kv heads 2 and 1 are replicated
// (each on 2 or 4 ranks), with 2 ranks kv heads 1; flash and plain attention, tied and untied.
TEST(TensorParallelLlama, MatchesTheWholeModelIncludingReplicatedKvHeads) {
  World world;
  const int t = world.tp.size();
  const Tensor x = tokens(0), y = tokens(1);
  for (const bool sequence_parallel : {false, true})
    for (const int kv : {8, 2, 1})
      for (const std::string attention : {"flash", "plain"})
        for (const bool tied : {false, true}) {
          SCOPED_TRACE(detail::cat("kv heads ", kv, ", ", attention, tied ? ", tied" : ", untied", ", tp ", t,
                                   sequence_parallel ? ", sequence-parallel" : ""));
          world.tp.set_sequence_parallel(sequence_parallel);
          layers::ModelSpec spec;
          spec.name = "llama";
          spec.layers = 2;
          spec.heads = 8;
          spec.kv_heads = kv;
          spec.embed = 64;
          spec.ffn_hidden = 96;
          spec.rope_theta = 100;  // pairs turn visibly over 16 positions
          spec.attention = attention;
          spec.tie_embeddings = tied;
          const layers::Model whole = layers::build_model(spec, {kSeq}, kVocab);
          const layers::Model split = layers::build_model(spec, {kSeq}, kVocab, &world.tp);
          const layers::ParameterStore ws(whole, kSeed), ss(split, kSeed);
          // Larger weights than the init's 0.02 so that attention is far from uniform: the same
          // values in both (the whole model's, sliced).
          std::map<std::string, const ParamEntry*> by_name;
          for (const ParamEntry& e : ws.entries()) {
            by_name[e.name] = &e;
            if (!e.name.ends_with("norm/weight")) ops::scale(ws.value(e), 10.0f);
          }
          ASSERT_EQ(ss.entries().size(), ws.entries().size());
          int64_t replicated = 0;
          for (const ParamEntry& e : ss.entries()) {
            ASSERT_TRUE(by_name.count(e.name)) << e.name;
            const ParamEntry& we = *by_name[e.name];
            ASSERT_EQ(shape_str(e.full_shape()), shape_str(we.shape)) << e.name;
            ss.value(e).copy_from(shard_of(ws.value(we), e.split, e.shape));
            replicated += e.split.replicas > 1;
          }
          EXPECT_EQ(replicated, kv < t ? 2 * spec.layers : 0) << "k_proj and v_proj of each block";
          expect_shard_flops_add_up(world, whole, split);

          const StepResult rw = step(whole, layers::SoftmaxCrossEntropy(), x, y);
          const StepResult rs = step(split, layers::SoftmaxCrossEntropy(&world.tp), x, y);
          expect_close("llama-logits", gather_columns(*world.comm, rs.logits, kVocab),
                       rw.logits.reshape({kBatch * kSeq, kVocab}), 1e-5);
          EXPECT_NEAR(rs.loss, rw.loss, 1e-6 * std::abs(rw.loss));
          EXPECT_TRUE(same_double_on_every_rank(rs.loss)) << "the loss differs across tp ranks";
          for (const ParamEntry& e : ss.entries()) {
            const Tensor g = ss.grad(e);
            expect_close("llama-gradient of " + e.name, g, shard_of(ws.grad(*by_name[e.name]), e.split, e.shape), 1e-5);
            if (!e.split.split()) {
              EXPECT_TRUE(same_on_every_rank(*world.comm, g))
                  << e.name << ": a replicated gradient differs across ranks";
            }
          }
        }
  if (world_rank() == 0)
    for (const auto& [what, w] : worst())
      if (what.starts_with("llama")) std::printf("[ worst   ] %s: max |diff| / max |ref| = %.2e\n", what.c_str(), w);
}

TEST(TensorParallelLlama, BadInputsAreOneLine) {
  World world;
  const int t = world.tp.size();
  layers::ModelSpec s;
  s.name = "llama";
  s.layers = 1;
  s.heads = 3 * t;  // kv heads 3: neither divisible by tp nor dividing it
  s.kv_heads = 3;
  s.embed = 8 * s.heads;
  s.ffn_hidden = 8 * t;
  expect_input_error([&] { layers::build_model(s, {kSeq}, kVocab, &world.tp); },
                     {"--kv-heads (3) must be divisible by --tp", "or divide it"});
  s.kv_heads = t;
  s.heads = 2 * t + 1;  // not divisible by tp
  s.kv_heads = 1;
  s.embed = 8 * s.heads;
  expect_input_error([&] { layers::build_model(s, {kSeq}, kVocab, &world.tp); },
                     {detail::cat("--heads (", 2 * t + 1, ") must be divisible by --tp (", t, ")")});
  s.heads = 2 * t;
  s.embed = 8 * s.heads;
  s.ffn_hidden = 8 * t + 1;
  expect_input_error([&] { layers::build_model(s, {kSeq}, kVocab, &world.tp); },
                     {detail::cat("--ffn-hidden (", 8 * t + 1, ") must be divisible by --tp (", t, ")")});
}

// ---- bad input -------------------------------------------------------------------------------

TEST(TensorParallelGpt, BadInputsAreOneLine) {
  World world;
  const int t = world.tp.size();
  layers::ModelSpec s = tiny_gpt(0.0f, "flash", true);
  s.heads = t + 1;  // divides the width, not by t
  s.embed = 8 * (t + 1);
  expect_input_error([&] { layers::build_model(s, {kSeq}, kVocab, &world.tp); },
                     {detail::cat("--heads (", t + 1, ") must be divisible by --tp (", t, ")")});
  for (const std::string model : {"mlp", "cnn", "resnet"}) {
    layers::ModelSpec m;
    m.name = model;
    expect_input_error(
        [&] {
          layers::build_model(m, {3, 8, 8}, 10, &world.tp);
        },
        {"--tp applies to the gpt models", detail::cat("--model ", model, " runs with --tp 1")});
  }
}

}  // namespace
}  // namespace strata::parallel
