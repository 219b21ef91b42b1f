// PipelineExecutor under real MPI (2 and 4 ranks, one stage per rank of MPI_COMM_WORLD) with a
// toy model that knows no layers: a chain of J virtual stages, virtual stage j computing
// y = a_j x + b_j elementwise (a_j = 2 or -1, b_j = j + 1, so the order matters) with a scalar
// "weight" a_j and "bias" b_j whose gradients it accumulates, and a "loss" that returns
// dy = (i + 1) for micro-batch i. Every value any callback sees is then known from the
// non-pipelined computation (the chain run in one loop), exactly: all values are integers
// below 2^24 and the gradient sums are taken in double. Checked for GPipe, 1F1B and
// interleaved (v chunks per stage, virtual stage c·P + s on stage s), for fewer and more
// micro-batches than stages, over the shared-memory mailboxes and over plain MPI, and for two
// steps in a row through the same executor; interleaved also against 1F1B over the same chain.
#include <gtest/gtest.h>
#include <mpi.h>

#include <algorithm>
#include <cctype>
#include <ostream>
#include <string>
#include <vector>

#include "parallel/comm/mpi_communicator.hpp"
#include "parallel/pipeline/executor.hpp"
#include "parallel/pipeline/schedule.hpp"

namespace strata::parallel {
namespace {

constexpr int64_t kBatch = 2, kWidth = 3;  // a micro-batch: (2, 3) f32
const Shape kShape{kBatch, kWidth};

double scale(int j) { return j % 2 == 0 ? 2.0 : -1.0; }
double shift(int j) { return j + 1.0; }

// The first virtual stage's input of micro-batch `micro` in step `step`: distinct per element,
// micro-batch and step.
double input_value(int step, int micro, int64_t k) {
  return (step + 1) * 100 + micro * 10 + static_cast<double>(k) + 1;
}

// The non-pipelined computation. The activation entering virtual stage j (j = J: the loss's input).
double activation(int step, int micro, int64_t k, int j) {
  double x = input_value(step, micro, k);
  for (int l = 0; l < j; ++l) x = scale(l) * x + shift(l);
  return x;
}
// The gradient entering virtual stage j's backward, of a chain of J (j = -1: the input's).
double grad_into(int micro, int j, int virtual_stages) {
  double g = micro + 1;
  for (int l = virtual_stages - 1; l > j; --l) g *= scale(l);
  return g;
}
// The gradients of a_j and b_j summed over the step's micro-batches and elements.
double weight_grad(int step, int m, int j, int virtual_stages) {
  double sum = 0;
  for (int i = 0; i < m; ++i)
    for (int64_t k = 0; k < kBatch * kWidth; ++k) sum += grad_into(i, j, virtual_stages) * activation(step, i, k, j);
  return sum;
}
double bias_grad(int m, int j, int virtual_stages) {
  double sum = 0;
  for (int i = 0; i < m; ++i) sum += grad_into(i, j, virtual_stages) * static_cast<double>(kBatch * kWidth);
  return sum;
}

Tensor filled(float value) {
  Tensor t = Tensor::empty(kShape);
  for (int64_t k = 0; k < t.numel(); ++k) t.data<float>()[k] = value;
  return t;
}

// Counts the elements of `t` that differ from value(k).
template <class Value>
int count_wrong(const Tensor& t, Value value) {
  if (!t.defined() || t.numel() != kBatch * kWidth) return -1;
  int wrong = 0;
  for (int64_t k = 0; k < t.numel(); ++k)
    if (t.data<float>()[k] != static_cast<float>(value(k))) ++wrong;
  return wrong;
}

// Which virtual stages (in forward order) chunk c of stage s runs. Interleaved: c·P + s alone.
// "Contiguous": stage s's one chunk runs s·v .. s·v + v - 1, the 1F1B layout of the same chain.
struct Layout {
  int stages, chunks, maps_per_chunk;
  bool interleaved;
  int virtual_stages() const { return stages * chunks * maps_per_chunk; }
  std::vector<int> maps(int stage, int chunk) const {
    if (interleaved) return {chunk * stages + stage};
    std::vector<int> js;
    for (int l = 0; l < maps_per_chunk; ++l) js.push_back(stage * maps_per_chunk + l);
    return js;
  }
};
Layout interleaved_layout(int stages, int chunks) { return {stages, chunks, 1, true}; }
Layout contiguous_layout(int stages, int maps) { return {stages, 1, maps, false}; }

// What the toy stage saw in one step.
struct Seen {
  std::vector<std::vector<int>> forwards, backwards;  // calls per [chunk][micro-batch]
  std::vector<int> losses;                            // calls per micro-batch
  std::vector<std::vector<int>> flagged;              // per chunk: backward call numbers with last_of_step
  std::vector<int> last_call;                         // per chunk: its last backward call number
  int backward_calls = 0;
  int wrong = 0;  // values that differ from the non-pipelined computation
  std::vector<std::string> errors;
  std::vector<Tensor> loss_inputs, input_grads;  // per micro-batch: what loss got, what virtual stage 0 returned
  std::vector<double> weight_grads, bias_grads;  // per virtual stage (zero where another stage runs it)

  Seen(int m, const Layout& layout)
      : forwards(layout.chunks, std::vector<int>(m)),
        backwards(layout.chunks, std::vector<int>(m)),
        losses(m),
        flagged(layout.chunks),
        last_call(layout.chunks, -1),
        loss_inputs(m),
        input_grads(m),
        weight_grads(layout.virtual_stages()),
        bias_grads(layout.virtual_stages()) {}

  void expect(int wrong_values, const std::string& what) {
    if (wrong_values != 0) errors.push_back(what);
    wrong += wrong_values != 0;
  }
};

StageCallbacks toy_stage(int stage, const Layout& layout, int step, Seen& seen) {
  const int total = layout.virtual_stages();
  StageCallbacks w;
  w.input = [=](int micro) {
    Tensor x = Tensor::empty(kShape);
    for (int64_t k = 0; k < x.numel(); ++k) x.data<float>()[k] = static_cast<float>(input_value(step, micro, k));
    return x;
  };
  w.forward = [=, &seen](int micro, int chunk, const Tensor& x, std::vector<layers::Context>& ctx) {
    ++seen.forwards[chunk][micro];
    const std::vector<int> js = layout.maps(stage, chunk);
    seen.expect(count_wrong(x, [&](int64_t k) { return activation(step, micro, k, js.front()); }),
                "forward input of micro-batch " + std::to_string(micro) + " chunk " + std::to_string(chunk));
    ctx.assign(1, layers::Context{});
    Tensor y = x.clone();
    for (int j : js) {
      ctx[0].saved.push_back(y.clone());  // each map's input, for its weight's gradient
      for (int64_t k = 0; k < y.numel(); ++k)
        y.data<float>()[k] = static_cast<float>(scale(j) * y.data<float>()[k] + shift(j));
    }
    return y;
  };
  w.loss = [=, &seen](int micro, const Tensor& y) {
    ++seen.losses[micro];
    seen.expect(count_wrong(y, [&](int64_t k) { return activation(step, micro, k, total); }),
                "loss input of micro-batch " + std::to_string(micro));
    seen.loss_inputs[micro] = y.clone();
    return filled(static_cast<float>(micro + 1));
  };
  w.backward = [=, &seen](int micro, int chunk, const Tensor& dy, std::vector<layers::Context>& ctx,
                          bool last_of_step) {
    ++seen.backwards[chunk][micro];
    if (last_of_step) seen.flagged[chunk].push_back(seen.backward_calls);
    seen.last_call[chunk] = seen.backward_calls++;
    const std::vector<int> js = layout.maps(stage, chunk);
    const std::string what = " of micro-batch " + std::to_string(micro) + " chunk " + std::to_string(chunk);
    seen.expect(count_wrong(dy, [&](int64_t) { return grad_into(micro, js.back(), total); }), "backward dy" + what);
    if (ctx.size() != 1 || ctx[0].saved.size() != js.size()) {
      seen.expect(1, "backward context" + what);
      return Tensor();
    }
    Tensor dx = dy.clone();
    for (size_t l = js.size(); l-- > 0;) {
      const int j = js[l];
      const Tensor& x = ctx[0].saved[l];
      // The context forward saved for this micro-batch and map.
      seen.expect(count_wrong(x, [&](int64_t k) { return activation(step, micro, k, j); }), "backward context" + what);
      for (int64_t k = 0; k < dx.numel(); ++k) {
        seen.weight_grads[j] += static_cast<double>(dx.data<float>()[k]) * x.data<float>()[k];
        seen.bias_grads[j] += dx.data<float>()[k];
        dx.data<float>()[k] = static_cast<float>(scale(j) * dx.data<float>()[k]);
      }
    }
    if (js.front() == 0) seen.input_grads[micro] = dx;
    return dx;
  };
  return w;
}

// Checks what one stage saw in a step against the non-pipelined computation: every
// (micro-batch, chunk) forward and backward once, the loss once per micro-batch on the last
// stage, every value, last_of_step once per chunk on its final backward, the gradients of the
// stage's maps and, on the first stage, the input's gradients.
void expect_step_right(const Seen& seen, int stage, const Layout& layout, int m, int step) {
  const int total = layout.virtual_stages();
  for (int c = 0; c < layout.chunks; ++c) {
    for (int i = 0; i < m; ++i) {
      EXPECT_EQ(seen.forwards[c][i], 1) << "micro-batch " << i << " chunk " << c;
      EXPECT_EQ(seen.backwards[c][i], 1) << "micro-batch " << i << " chunk " << c;
    }
    EXPECT_EQ(seen.flagged[c], std::vector<int>{seen.last_call[c]}) << "chunk " << c;
  }
  const bool last = stage == layout.stages - 1;
  for (int i = 0; i < m; ++i) EXPECT_EQ(seen.losses[i], last ? 1 : 0) << "micro-batch " << i;
  EXPECT_EQ(seen.wrong, 0) << ::testing::PrintToString(seen.errors);
  for (int c = 0; c < layout.chunks; ++c) {
    for (int j : layout.maps(stage, c)) {
      EXPECT_EQ(seen.weight_grads[j], weight_grad(step, m, j, total)) << "virtual stage " << j;
      EXPECT_EQ(seen.bias_grads[j], bias_grad(m, j, total)) << "virtual stage " << j;
    }
  }
  if (stage == 0) {
    for (int i = 0; i < m; ++i)
      EXPECT_EQ(count_wrong(seen.input_grads[i], [&](int64_t) { return grad_into(i, -1, total); }), 0)
          << "micro-batch " << i;
  }
}

struct Case {
  ScheduleKind kind;
  int micro_batches;
  bool shared_memory;
};

std::string label(const Case& c) {
  return to_string(c.kind) + " m=" + std::to_string(c.micro_batches) + (c.shared_memory ? " shm" : " mpi");
}

void PrintTo(const Case& c, std::ostream* os) { *os << label(c); }

std::vector<Case> all_cases() {
  std::vector<Case> cases;
  for (ScheduleKind kind : {ScheduleKind::GPipe, ScheduleKind::OneFOneB})
    for (int m : {1, 2, 3, 5})
      for (bool shm : {true, false}) cases.push_back({kind, m, shm});
  return cases;
}

std::string test_name(std::string name) {
  for (char& ch : name)
    if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
  return name;
}

class Pipeline : public testing::TestWithParam<Case> {};

TEST_P(Pipeline, EveryMicroBatchForwardAndBackwardOnceWithTheRightValues) {
  const Case c = GetParam();
  MpiCommunicator pp(MPI_COMM_WORLD, "pp", c.shared_memory);
  const int stage = pp.rank(), stages = pp.size(), m = c.micro_batches;
  PipelineExecutor exec(pp, c.kind, m, kShape, kShape, DType::F32, Device::cpu());
  ASSERT_EQ(exec.stage(), stage);
  ASSERT_EQ(exec.stages(), stages);
  EXPECT_EQ(exec.first_stage(), stage == 0);
  EXPECT_EQ(exec.last_stage(), stage == stages - 1);
  EXPECT_EQ(exec.micro_batches(), m);
  EXPECT_EQ(exec.virtual_stages(), 1);
  EXPECT_EQ(exec.kind(), c.kind);
  EXPECT_EQ(exec.program(), make_schedule(c.kind, stages, m)[static_cast<size_t>(stage)]);

  // Two steps through the same executor: its buffers are reused, its values must not leak.
  const Layout layout = interleaved_layout(stages, 1);  // one chunk: stage s is virtual stage s
  for (int step = 0; step < 2; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    Seen seen(m, layout);
    exec.run_step(toy_stage(stage, layout, step, seen));
    expect_step_right(seen, stage, layout, m, step);
    // last_of_step: once per stage and step, on the stage's final backward.
    EXPECT_EQ(seen.flagged[0], std::vector<int>{m - 1});
  }

  // Activation memory: what the schedule promises (GPipe m; 1F1B min(m, P - s)).
  EXPECT_EQ(exec.peak_in_flight(), peak_in_flight(exec.program()));
  EXPECT_EQ(exec.peak_in_flight(), c.kind == ScheduleKind::GPipe ? m : std::min(m, stages - stage));
}

TEST_P(Pipeline, GatheredTimelineHasEveryStagesEvents) {
  const Case c = GetParam();
  MpiCommunicator pp(MPI_COMM_WORLD, "pp", c.shared_memory);
  const int stage = pp.rank(), stages = pp.size(), m = c.micro_batches;
  PipelineExecutor exec(pp, c.kind, m, kShape, kShape, DType::F32, Device::cpu());
  const Layout layout = interleaved_layout(stages, 1);
  Seen first(m, layout);
  exec.run_step(toy_stage(stage, layout, 0, first), /*record=*/true);
  EXPECT_EQ(first.wrong, 0);
  ASSERT_EQ(exec.timeline().size(), static_cast<size_t>(2 * m));
  // A step without recording leaves the recorded one in place.
  Seen second(m, layout);
  exec.run_step(toy_stage(stage, layout, 1, second));
  EXPECT_EQ(second.wrong, 0);
  EXPECT_EQ(exec.timeline().size(), static_cast<size_t>(2 * m));

  const std::vector<TimelineEvent> all = exec.gather_timeline(pp);
  if (stage != 0) {
    EXPECT_TRUE(all.empty());
    return;
  }
  ASSERT_EQ(all.size(), static_cast<size_t>(2 * m * stages));
  // events[s][op][i]: how often stage s recorded op on micro-batch i.
  std::vector<std::vector<std::vector<int>>> events(static_cast<size_t>(stages),
                                                    std::vector<std::vector<int>>(2, std::vector<int>(m)));
  for (const TimelineEvent& e : all) {
    ASSERT_GE(e.stage, 0);
    ASSERT_LT(e.stage, stages);
    ASSERT_TRUE(e.op == Op::Forward || e.op == Op::Backward) << to_string(e.op);
    ASSERT_GE(e.micro_batch, 0);
    ASSERT_LT(e.micro_batch, m);
    EXPECT_EQ(e.chunk, 0);
    EXPECT_LE(e.start_s, e.end_s);
    EXPECT_GE(e.start_s, 0.0);
    ++events[static_cast<size_t>(e.stage)][e.op == Op::Forward ? 0 : 1][static_cast<size_t>(e.micro_batch)];
  }
  for (int s = 0; s < stages; ++s)
    for (int op = 0; op < 2; ++op)
      EXPECT_EQ(events[static_cast<size_t>(s)][static_cast<size_t>(op)], std::vector<int>(m, 1))
          << "stage " << s << (op == 0 ? " forwards" : " backwards");
  // A stage's own events are in program order: each starts after the one before it ended.
  for (size_t k = 1; k < static_cast<size_t>(2 * m); ++k) EXPECT_LE(all[k - 1].end_s, all[k].start_s);
}

INSTANTIATE_TEST_SUITE_P(Schedules, Pipeline, testing::ValuesIn(all_cases()),
                         [](const testing::TestParamInfo<Case>& p) { return test_name(label(p.param)); });

// ---- Interleaved: v chunks per stage ----

struct InterleavedCase {
  int chunks;
  int groups;  // m = groups x P
  bool shared_memory;
};

std::string label(const InterleavedCase& c) {
  return "v=" + std::to_string(c.chunks) + " m=" + std::to_string(c.groups) + "P" + (c.shared_memory ? " shm" : " mpi");
}

void PrintTo(const InterleavedCase& c, std::ostream* os) { *os << label(c); }

std::vector<InterleavedCase> interleaved_cases() {
  std::vector<InterleavedCase> cases;
  for (int v : {1, 2, 3})
    for (int groups : {1, 2})
      for (bool shm : {true, false}) cases.push_back({v, groups, shm});
  return cases;
}

// Sums a per-virtual-stage vector over the ranks: each entry is computed on one rank.
std::vector<double> summed(std::vector<double> values) {
  MPI_Allreduce(MPI_IN_PLACE, values.data(), static_cast<int>(values.size()), MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
  return values;
}

class Interleaved : public testing::TestWithParam<InterleavedCase> {};

TEST_P(Interleaved, MatchesTheNonPipelinedChainAndOneFOneB) {
  const InterleavedCase c = GetParam();
  MpiCommunicator pp(MPI_COMM_WORLD, "pp", c.shared_memory);
  const int stage = pp.rank(), stages = pp.size(), v = c.chunks, m = c.groups * stages;
  PipelineExecutor exec(pp, ScheduleKind::Interleaved, m, v, std::vector<Shape>(v, kShape),
                        std::vector<Shape>(v, kShape), DType::F32, Device::cpu());
  EXPECT_EQ(exec.virtual_stages(), v);
  EXPECT_EQ(exec.program(), make_schedule(ScheduleKind::Interleaved, stages, m, v)[static_cast<size_t>(stage)]);
  for (int chunk = 0; chunk < v; ++chunk) {
    EXPECT_EQ(exec.first_virtual_stage(chunk), stage == 0 && chunk == 0);
    EXPECT_EQ(exec.last_virtual_stage(chunk), stage == stages - 1 && chunk == v - 1);
  }
  // The same chain of v·P maps under 1F1B, v contiguous maps per stage (its own communicator:
  // one executor per communicator reserves the mailboxes).
  MpiCommunicator pp_1f1b(MPI_COMM_WORLD, "pp 1f1b", c.shared_memory);
  PipelineExecutor reference(pp_1f1b, ScheduleKind::OneFOneB, m, kShape, kShape, DType::F32, Device::cpu());

  const Layout layout = interleaved_layout(stages, v), contiguous = contiguous_layout(stages, v);
  for (int step = 0; step < 2; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    Seen seen(m, layout), seen_1f1b(m, contiguous);
    exec.run_step(toy_stage(stage, layout, step, seen));
    reference.run_step(toy_stage(stage, contiguous, step, seen_1f1b));
    expect_step_right(seen, stage, layout, m, step);
    expect_step_right(seen_1f1b, stage, contiguous, m, step);
    // Interleaved and 1F1B agree on every map's gradients, the loss's inputs and the input's
    // gradients (all exact, so equal).
    EXPECT_EQ(summed(seen.weight_grads), summed(seen_1f1b.weight_grads));
    EXPECT_EQ(summed(seen.bias_grads), summed(seen_1f1b.bias_grads));
    for (int i = 0; i < m; ++i) {
      const auto same_as = [](const Tensor& t) { return [&t](int64_t k) { return t.data<float>()[k]; }; };
      if (stage == stages - 1) {
        EXPECT_EQ(count_wrong(seen.loss_inputs[i], same_as(seen_1f1b.loss_inputs[i])), 0) << "micro-batch " << i;
      }
      if (stage == 0) {
        EXPECT_EQ(count_wrong(seen.input_grads[i], same_as(seen_1f1b.input_grads[i])), 0) << "micro-batch " << i;
      }
    }
  }
  // Activation memory, in chunk micro-batches: what the schedule promises.
  EXPECT_EQ(exec.peak_in_flight(), peak_in_flight(exec.program()));
}

TEST_P(Interleaved, GatheredTimelineKeepsTheChunks) {
  const InterleavedCase c = GetParam();
  MpiCommunicator pp(MPI_COMM_WORLD, "pp", c.shared_memory);
  const int stage = pp.rank(), stages = pp.size(), v = c.chunks, m = c.groups * stages;
  PipelineExecutor exec(pp, ScheduleKind::Interleaved, m, v, std::vector<Shape>(v, kShape),
                        std::vector<Shape>(v, kShape), DType::F32, Device::cpu());
  const Layout layout = interleaved_layout(stages, v);
  Seen seen(m, layout);
  exec.run_step(toy_stage(stage, layout, 0, seen), /*record=*/true);
  EXPECT_EQ(seen.wrong, 0);
  const std::vector<TimelineEvent> all = exec.gather_timeline(pp);
  if (stage != 0) return;
  // events[s][chunk][op][i]
  std::vector<int> count(static_cast<size_t>(stages * v * 2 * m));
  for (const TimelineEvent& e : all) {
    ASSERT_TRUE(e.stage >= 0 && e.stage < stages && e.chunk >= 0 && e.chunk < v && e.micro_batch >= 0 &&
                e.micro_batch < m);
    ++count[static_cast<size_t>(((e.stage * v + e.chunk) * 2 + (e.op == Op::Forward ? 0 : 1)) * m + e.micro_batch)];
  }
  EXPECT_EQ(count, std::vector<int>(count.size(), 1));
}

INSTANTIATE_TEST_SUITE_P(Chunks, Interleaved, testing::ValuesIn(interleaved_cases()),
                         [](const testing::TestParamInfo<InterleavedCase>& p) { return test_name(label(p.param)); });

TEST(InterleavedShapes, EachChunkReceivesItsOwnShape) {
  // Chunk c's activations are (2, 3 + c): the receive buffers follow the per-chunk shapes.
  MpiCommunicator pp(MPI_COMM_WORLD, "pp");
  const int stage = pp.rank(), stages = pp.size(), v = 2, m = stages;
  const auto width = [&](int j) { return static_cast<int64_t>(3 + j); };  // of virtual stage j's input
  std::vector<Shape> in, out;
  for (int c = 0; c < v; ++c) {
    in.push_back({kBatch, width(c * stages + stage)});
    out.push_back({kBatch, width(c * stages + stage + 1)});
  }
  PipelineExecutor exec(pp, ScheduleKind::Interleaved, m, v, in, out, DType::F32, Device::cpu());
  int wrong = 0;
  StageCallbacks w;
  w.input = [&](int) { return Tensor::zeros({kBatch, width(0)}); };
  // Each virtual stage widens by one column (zeros) and checks what it receives.
  w.forward = [&](int, int chunk, const Tensor& x, std::vector<layers::Context>&) {
    const int j = chunk * stages + stage;
    wrong += x.shape() != Shape{kBatch, width(j)};
    return Tensor::zeros({kBatch, width(j + 1)});
  };
  w.loss = [&](int, const Tensor& y) { return Tensor::zeros(y.shape()); };
  w.backward = [&](int, int chunk, const Tensor& dy, std::vector<layers::Context>&, bool) {
    const int j = chunk * stages + stage;
    wrong += dy.shape() != Shape{kBatch, width(j + 1)};
    return Tensor::zeros({kBatch, width(j)});
  };
  exec.run_step(w);
  EXPECT_EQ(wrong, 0);
}

// forward_only (evaluation) through the chain: one chunk per stage with the old signature,
// v chunks in virtual-stage order with the new one.
TEST(PipelineForwardOnly, ThroughEveryChunkInOrder) {
  int stage = 0, stages = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &stage);
  MPI_Comm_size(MPI_COMM_WORLD, &stages);
  const auto input = [] {
    Tensor x = Tensor::empty(kShape);
    for (int64_t k = 0; k < x.numel(); ++k) x.data<float>()[k] = static_cast<float>(input_value(5, 0, k));
    return x;
  };
  const auto apply = [](const Tensor& x, int j) {
    Tensor y = Tensor::empty(x.shape());
    for (int64_t k = 0; k < y.numel(); ++k)
      y.data<float>()[k] = static_cast<float>(scale(j) * x.data<float>()[k] + shift(j));
    return y;
  };
  for (int v : {1, 3}) {
    SCOPED_TRACE("v=" + std::to_string(v));
    MpiCommunicator pp(MPI_COMM_WORLD, "pp");  // one executor per communicator
    PipelineExecutor exec(pp, ScheduleKind::Interleaved, stages, v, std::vector<Shape>(v, kShape),
                          std::vector<Shape>(v, kShape), DType::F32, Device::cpu());
    int wrong = 0;
    Tensor out = exec.forward_only(
        input, [](int) { return kShape; },
        [&](int chunk, const Tensor& x) {
          const int j = chunk * stages + stage;
          wrong += count_wrong(x, [&](int64_t k) { return activation(5, 0, k, j); }) != 0;
          return apply(x, j);
        });
    EXPECT_EQ(wrong, 0);
    EXPECT_EQ(out.defined(), stage == stages - 1);
    if (stage == stages - 1) {
      EXPECT_EQ(count_wrong(out, [&](int64_t k) { return activation(5, 0, k, v * stages); }), 0);
    }
    if (v == 1) {
      out = exec.forward_only(input, kShape, [&](const Tensor& x) { return apply(x, stage); });
      EXPECT_EQ(out.defined(), stage == stages - 1);
      if (stage == stages - 1) {
        EXPECT_EQ(count_wrong(out, [&](int64_t k) { return activation(5, 0, k, stages); }), 0);
      }
    }
  }
}

// One stage (a pipeline of one rank): forward, loss and backward of every micro-batch locally;
// with chunks, each hands its output to the next chunk in memory.
TEST(PipelineOneStage, RunsLocally) {
  MpiCommunicator self(MPI_COMM_SELF, "self");
  for (ScheduleKind kind : {ScheduleKind::GPipe, ScheduleKind::OneFOneB}) {
    SCOPED_TRACE(to_string(kind));
    PipelineExecutor exec(self, kind, 3, kShape, kShape, DType::F32, Device::cpu());
    const Layout layout = interleaved_layout(1, 1);
    Seen seen(3, layout);
    exec.run_step(toy_stage(0, layout, 0, seen));
    expect_step_right(seen, 0, layout, 3, 0);
    EXPECT_EQ(seen.flagged[0], std::vector<int>{2});
    EXPECT_EQ(exec.peak_in_flight(), kind == ScheduleKind::GPipe ? 3 : 1);
  }
  for (int v : {2, 3}) {
    for (int m : {1, 3}) {
      SCOPED_TRACE("interleaved v=" + std::to_string(v) + " m=" + std::to_string(m));
      PipelineExecutor exec(self, ScheduleKind::Interleaved, m, v, std::vector<Shape>(v, kShape),
                            std::vector<Shape>(v, kShape), DType::F32, Device::cpu());
      const Layout layout = interleaved_layout(1, v);
      for (int step = 0; step < 2; ++step) {
        Seen seen(m, layout);
        exec.run_step(toy_stage(0, layout, step, seen));
        expect_step_right(seen, 0, layout, m, step);
      }
      EXPECT_EQ(exec.peak_in_flight(), peak_in_flight(exec.program()));
    }
  }
}

// Tensor parallelism (2 stages x tp = world / 2 ranks, tp fastest as in ProcessGrid): every tp
// rank of a stage holds the same tensors, sends only its 1/tp of each message to its peer tp
// rank, and the receiving tp group all-gathers the parts. The values are those of the chain
// (exact), for forward_only too, and each rank's pipeline traffic is 1/tp of the messages.
TEST(PipelineTensorParallel, EachTpRankSendsItsPartAndTheGroupGathers) {
  int rank = 0, world = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  const int tp = world / 2, m = 3;
  for (ScheduleKind kind : {ScheduleKind::GPipe, ScheduleKind::OneFOneB}) {
    SCOPED_TRACE(to_string(kind));
    MPI_Comm pp_comm = MPI_COMM_NULL, tp_comm = MPI_COMM_NULL;  // new ones: an executor reserves mailboxes
    ASSERT_EQ(MPI_Comm_split(MPI_COMM_WORLD, rank % tp, rank, &pp_comm), MPI_SUCCESS);
    ASSERT_EQ(MPI_Comm_split(MPI_COMM_WORLD, rank / tp, rank, &tp_comm), MPI_SUCCESS);
    MpiCommunicator pp(pp_comm, "pp"), tensor_parallel(tp_comm, "tp");
    MPI_Comm_free(&pp_comm);
    MPI_Comm_free(&tp_comm);
    const int stage = pp.rank();
    PipelineExecutor exec(pp, kind, m, kShape, kShape, DType::F32, Device::cpu());
    exec.set_tensor_parallel(&tensor_parallel);
    const Layout layout = interleaved_layout(2, 1);
    const int64_t sent_before = pp.bytes_sent();
    Seen seen(m, layout);
    exec.run_step(toy_stage(stage, layout, 0, seen));
    expect_step_right(seen, stage, layout, m, 0);
    // Stage 0 sends m activations, stage 1 m gradients: kBatch x kWidth f32 each, 1/tp of it.
    EXPECT_EQ(pp.bytes_sent() - sent_before, m * kBatch * kWidth * 4 / tp);

    // forward_only: stage 1 returns what it received, element k of it k + 1.
    const Tensor y = exec.forward_only(
        [] {
          Tensor x = filled(0.0f);
          for (int64_t k = 0; k < x.numel(); ++k) x.data<float>()[k] = static_cast<float>(k + 1);
          return x;
        },
        kShape, [](const Tensor& x) { return x; });
    if (stage == 1) {
      EXPECT_EQ(count_wrong(y, [](int64_t k) { return k + 1; }), 0);
    }
  }
}

}  // namespace
}  // namespace strata::parallel
