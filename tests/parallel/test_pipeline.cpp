// PipelineExecutor under real MPI (2 and 4 ranks, one stage per rank of MPI_COMM_WORLD) with a
// toy stage that knows no model: stage s multiplies its input by (s + 2) going forward and its
// output gradient by (s + 2) going backward, and the last stage's "loss" returns dy = (i + 1)
// for micro-batch i. So every value any callback sees is known in closed form, for both
// schedules, for fewer and more micro-batches than stages, over the shared-memory mailboxes
// and over plain MPI, and for two steps in a row through the same executor.
#include <gtest/gtest.h>

#include <algorithm>
#include <cctype>
#include <string>
#include <vector>

#include "parallel/mpi_communicator.hpp"
#include "parallel/pipeline.hpp"
#include "parallel/schedule.hpp"

namespace strata::parallel {
namespace {

constexpr int64_t kBatch = 2, kWidth = 3;  // a micro-batch: (2, 3) f32
const Shape kShape{kBatch, kWidth};

double factor(int stage) { return stage + 2.0; }

// The product of the factors of stages [begin, end).
double product(int begin, int end) {
  double p = 1;
  for (int s = begin; s < end; ++s) p *= factor(s);
  return p;
}

// The first stage's input of micro-batch `micro` in step `step`: distinct per element,
// micro-batch and step.
float input_value(int step, int micro, int64_t k) {
  return static_cast<float>((step + 1) * 100 + micro * 10) + static_cast<float>(k) + 1.0f;
}

Tensor filled(float value) {
  Tensor t = Tensor::empty(kShape);
  for (int64_t k = 0; k < t.numel(); ++k) t.data<float>()[k] = value;
  return t;
}

Tensor times(const Tensor& x, double f) {
  Tensor y = Tensor::empty(x.shape());
  for (int64_t k = 0; k < x.numel(); ++k) y.data<float>()[k] = static_cast<float>(x.data<float>()[k] * f);
  return y;
}

// Counts the elements of `t` that differ from value(k); all values here are small integers
// times small integers, exact in f32.
template <class Value>
int count_wrong(const Tensor& t, Value value) {
  if (!t.defined() || t.numel() != kBatch * kWidth) return -1;
  int wrong = 0;
  for (int64_t k = 0; k < t.numel(); ++k)
    if (t.data<float>()[k] != static_cast<float>(value(k))) ++wrong;
  return wrong;
}

// What the toy stage saw in one step.
struct Seen {
  std::vector<int> forwards, backwards, losses;  // calls per micro-batch
  std::vector<int> last_of_step_calls;           // the order numbers of backward calls with last_of_step
  int backward_calls = 0;
  int wrong = 0;                    // values that differ from the closed form
  std::vector<Tensor> input_grads;  // what backward returned, per micro-batch
  std::vector<std::string> errors;

  explicit Seen(int m) : forwards(m), backwards(m), losses(m), input_grads(m) {}
};

StageWork toy_stage(int stage, int stages, int step, Seen& seen) {
  StageWork w;
  w.input = [=](int micro) {
    Tensor x = Tensor::empty(kShape);
    for (int64_t k = 0; k < x.numel(); ++k) x.data<float>()[k] = input_value(step, micro, k);
    return x;
  };
  w.forward = [=, &seen](int micro, const Tensor& x, std::vector<layers::Context>& ctx) {
    ++seen.forwards[micro];
    // Stage s receives the input times the factors of the stages before it.
    const int wrong = count_wrong(x, [&](int64_t k) { return input_value(step, micro, k) * product(0, stage); });
    if (wrong != 0) seen.errors.push_back("forward input of micro-batch " + std::to_string(micro));
    seen.wrong += wrong != 0;
    ctx.assign(1, layers::Context{});
    ctx[0].saved = {x.clone()};
    return times(x, factor(stage));
  };
  w.loss = [=, &seen](int micro, const Tensor& y) {
    ++seen.losses[micro];
    const int wrong = count_wrong(y, [&](int64_t k) { return input_value(step, micro, k) * product(0, stages); });
    if (wrong != 0) seen.errors.push_back("loss input of micro-batch " + std::to_string(micro));
    seen.wrong += wrong != 0;
    return filled(static_cast<float>(micro + 1));
  };
  w.backward = [=, &seen](int micro, const Tensor& dy, std::vector<layers::Context>& ctx, bool last_of_step) {
    ++seen.backwards[micro];
    if (last_of_step) seen.last_of_step_calls.push_back(seen.backward_calls);
    ++seen.backward_calls;
    // The gradient reaching stage s: the loss's (i + 1) times the factors of the stages after s.
    int wrong = count_wrong(dy, [&](int64_t) { return (micro + 1) * product(stage + 1, stages); });
    // The context forward saved for this micro-batch.
    wrong += ctx.size() != 1 || ctx[0].saved.size() != 1 ? 1 : count_wrong(ctx[0].saved[0], [&](int64_t k) {
      return input_value(step, micro, k) * product(0, stage);
    });
    if (wrong != 0) seen.errors.push_back("backward of micro-batch " + std::to_string(micro));
    seen.wrong += wrong != 0;
    Tensor dx = times(dy, factor(stage));
    seen.input_grads[micro] = dx;
    return dx;
  };
  return w;
}

struct Case {
  ScheduleKind kind;
  int micro_batches;
  bool shared_memory;
};

std::string label(const Case& c) {
  return to_string(c.kind) + " m=" + std::to_string(c.micro_batches) + (c.shared_memory ? " shm" : " mpi");
}

std::vector<Case> all_cases() {
  std::vector<Case> cases;
  for (ScheduleKind kind : {ScheduleKind::GPipe, ScheduleKind::OneFOneB})
    for (int m : {1, 2, 3, 5})
      for (bool shm : {true, false}) cases.push_back({kind, m, shm});
  return cases;
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
  EXPECT_EQ(exec.kind(), c.kind);
  EXPECT_EQ(exec.program(), make_schedule(c.kind, stages, m)[static_cast<size_t>(stage)]);

  // Two steps through the same executor: its buffers are reused, its values must not leak.
  for (int step = 0; step < 2; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    Seen seen(m);
    exec.run_step(toy_stage(stage, stages, step, seen));
    for (int i = 0; i < m; ++i) {
      EXPECT_EQ(seen.forwards[i], 1) << "micro-batch " << i;
      EXPECT_EQ(seen.backwards[i], 1) << "micro-batch " << i;
      EXPECT_EQ(seen.losses[i], exec.last_stage() ? 1 : 0) << "micro-batch " << i;
    }
    EXPECT_EQ(seen.wrong, 0) << ::testing::PrintToString(seen.errors);
    // last_of_step: once per stage and step, on the stage's final backward.
    EXPECT_EQ(seen.last_of_step_calls, std::vector<int>{m - 1});
    if (exec.first_stage()) {
      // The first stage's input gradient: dy (i + 1) times every stage's factor.
      for (int i = 0; i < m; ++i)
        EXPECT_EQ(count_wrong(seen.input_grads[i], [&](int64_t) { return (i + 1) * product(0, stages); }), 0)
            << "micro-batch " << i;
    }
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
  Seen first(m);
  exec.run_step(toy_stage(stage, stages, 0, first), /*record=*/true);
  EXPECT_EQ(first.wrong, 0);
  ASSERT_EQ(exec.timeline().size(), static_cast<size_t>(2 * m));
  // A step without recording leaves the recorded one in place.
  Seen second(m);
  exec.run_step(toy_stage(stage, stages, 1, second));
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
                         [](const testing::TestParamInfo<Case>& p) {
                           std::string name = label(p.param);
                           for (char& ch : name)
                             if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
                           return name;
                         });

// One stage (a pipeline of one rank): forward, loss and backward of every micro-batch locally.
TEST(PipelineOneStage, RunsLocally) {
  MpiCommunicator self(MPI_COMM_SELF, "self");
  for (ScheduleKind kind : {ScheduleKind::GPipe, ScheduleKind::OneFOneB}) {
    SCOPED_TRACE(to_string(kind));
    PipelineExecutor exec(self, kind, 3, kShape, kShape, DType::F32, Device::cpu());
    Seen seen(3);
    exec.run_step(toy_stage(0, 1, 0, seen));
    EXPECT_EQ(seen.forwards, std::vector<int>(3, 1));
    EXPECT_EQ(seen.losses, std::vector<int>(3, 1));
    EXPECT_EQ(seen.backwards, std::vector<int>(3, 1));
    EXPECT_EQ(seen.wrong, 0);
    EXPECT_EQ(seen.last_of_step_calls, std::vector<int>{2});
    EXPECT_EQ(exec.peak_in_flight(), kind == ScheduleKind::GPipe ? 3 : 1);
  }
}

}  // namespace
}  // namespace strata::parallel
