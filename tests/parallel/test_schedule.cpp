// Tests of pipeline schedules: generated GPipe/1F1B/interleaved programs pass the checker for
// many shapes, their memory and bubble are the textbook values, hand-made bad programs are
// rejected with a message that names the problem, and recorded timelines give their idle
// fractions.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <iostream>
#include <map>
#include <set>
#include <sstream>
#include <tuple>

#include "core/error.hpp"
#include "parallel/pipeline/schedule.hpp"

namespace strata::parallel {
namespace {

using A = Action;
constexpr Op RA = Op::RecvActivation, F = Op::Forward, SA = Op::SendActivation, RG = Op::RecvGrad, B = Op::Backward,
             SG = Op::SendGrad;

// Asserts that check_schedule rejects `programs` with an Internal error whose message contains
// every one of `parts`.
void expect_rejected(const std::vector<StageProgram>& programs, std::initializer_list<std::string> parts) {
  try {
    check_schedule(programs);
    ADD_FAILURE() << "accepted:\n" << to_string(programs);
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::Internal);
    for (const std::string& part : parts)
      EXPECT_NE(e.message().find(part), std::string::npos) << "message: " << e.message() << "\nmissing: " << part;
  }
}

double makespan(const std::vector<TimelineEvent>& events) {
  double t0 = events.front().start_s, t1 = events.front().end_s;
  for (const auto& e : events) t0 = std::min(t0, e.start_s), t1 = std::max(t1, e.end_s);
  return t1 - t0;
}

TEST(Schedule, EveryGeneratedSchedulePassesTheChecker) {
  for (ScheduleKind kind : {ScheduleKind::GPipe, ScheduleKind::OneFOneB}) {
    for (int p = 1; p <= 8; ++p) {
      for (int m = 1; m <= 16; ++m) {
        SCOPED_TRACE(to_string(kind) + " P=" + std::to_string(p) + " m=" + std::to_string(m));
        const auto programs = make_schedule(kind, p, m);
        ASSERT_EQ(programs.size(), static_cast<size_t>(p));
        EXPECT_NO_THROW(check_schedule(programs));
        for (int s = 0; s < p; ++s) {
          // Compute once per micro-batch and direction, plus one message per neighbour.
          const size_t expected = 2 * m + (s > 0 ? 2 * m : 0) + (s < p - 1 ? 2 * m : 0);
          EXPECT_EQ(programs[s].size(), expected) << "stage " << s;
        }
      }
    }
  }
}

TEST(Schedule, ExactProgramsForFourStagesSixMicroBatches) {
  const auto gpipe = make_schedule(ScheduleKind::GPipe, 4, 6);
  const auto one_f_one_b = make_schedule(ScheduleKind::OneFOneB, 4, 6);
  std::cout << "gpipe P=4 m=6\n" << to_string(gpipe) << "1f1b P=4 m=6\n" << to_string(one_f_one_b);
  EXPECT_EQ(to_string({one_f_one_b[0]}),
            "stage 0: F0 sendA0 F1 sendA1 F2 sendA2 F3 sendA3 recvG0 B0 F4 sendA4 recvG1 B1 F5 sendA5 recvG2 B2 "
            "recvG3 B3 recvG4 B4 recvG5 B5\n");
  EXPECT_EQ(to_string({one_f_one_b[3]}),
            "stage 0: recvA0 F0 B0 sendG0 recvA1 F1 B1 sendG1 recvA2 F2 B2 sendG2 recvA3 F3 B3 sendG3 recvA4 F4 B4 "
            "sendG4 recvA5 F5 B5 sendG5\n");
  EXPECT_EQ(to_string({gpipe[1]}),
            "stage 0: recvA0 F0 sendA0 recvA1 F1 sendA1 recvA2 F2 sendA2 recvA3 F3 sendA3 recvA4 F4 sendA4 recvA5 F5 "
            "sendA5 recvG0 B0 sendG0 recvG1 B1 sendG1 recvG2 B2 sendG2 recvG3 B3 sendG3 recvG4 B4 sendG4 recvG5 B5 "
            "sendG5\n");
}

TEST(Schedule, PeakInFlight) {
  for (int p = 1; p <= 8; ++p) {
    for (int m = 1; m <= 16; ++m) {
      const auto gpipe = make_schedule(ScheduleKind::GPipe, p, m);
      const auto one_f_one_b = make_schedule(ScheduleKind::OneFOneB, p, m);
      for (int s = 0; s < p; ++s) {
        EXPECT_EQ(peak_in_flight(gpipe[s]), m) << "P=" << p << " m=" << m << " s=" << s;
        EXPECT_EQ(peak_in_flight(one_f_one_b[s]), std::min(m, p - s)) << "P=" << p << " m=" << m << " s=" << s;
      }
    }
  }
  EXPECT_EQ(peak_in_flight({}), 0);
  EXPECT_EQ(peak_in_flight({{F, 0}, {F, 1}, {B, 1}, {F, 2}, {B, 0}, {B, 2}}), 2);
}

// Both schedules take (m + P - 1)(tf + tb) with free communication: the forward wave reaches
// the last stage after (P - 1) tf and the last gradient leaves it (P - 1) tb before the end,
// and in between every stage is busy whenever the stage it depends on has delivered. Each
// stage computes m (tf + tb), so its idle fraction is (P - 1) / (m + P - 1) — independent of
// the ratio tb / tf, hence the same formula for tb = tf and tb = 2 tf.
TEST(Schedule, SimulatedBubbleMatchesTheFormula) {
  for (ScheduleKind kind : {ScheduleKind::GPipe, ScheduleKind::OneFOneB}) {
    for (double tb : {1.0, 2.0}) {
      for (int p = 1; p <= 8; ++p) {
        for (int m = 1; m <= 16; ++m) {
          SCOPED_TRACE(to_string(kind) + " tb=" + std::to_string(tb) + " P=" + std::to_string(p) +
                       " m=" + std::to_string(m));
          const auto events = simulate_timeline(make_schedule(kind, p, m), 1.0, tb);
          ASSERT_EQ(events.size(), static_cast<size_t>(2 * p * m));
          EXPECT_NEAR(makespan(events), (m + p - 1) * (1.0 + tb), 1e-9);
          const double expected = static_cast<double>(p - 1) / (m + p - 1);
          for (double idle : bubble_fractions(events, p)) EXPECT_NEAR(idle, expected, 1e-12);
        }
      }
    }
  }
}

TEST(Schedule, SimulatedTimelineRespectsDependencies) {
  const auto events = simulate_timeline(make_schedule(ScheduleKind::OneFOneB, 3, 4), 1.0, 2.0);
  auto find = [&](int s, Op op, int i) {
    auto it = std::find_if(events.begin(), events.end(),
                           [&](const TimelineEvent& e) { return e.stage == s && e.op == op && e.micro_batch == i; });
    EXPECT_NE(it, events.end());
    return *it;
  };
  for (int i = 0; i < 4; ++i) {
    for (int s = 1; s < 3; ++s) EXPECT_GE(find(s, F, i).start_s, find(s - 1, F, i).end_s);
    for (int s = 0; s < 2; ++s) EXPECT_GE(find(s, B, i).start_s, find(s + 1, B, i).end_s);
  }
}

// Receiving the gradient before the steady-state forward is still deadlock-free (sends never
// block) but holds back the forward the next stage is waiting for: the step gets longer.
TEST(Schedule, RecvGradBeforeSteadyForwardIsValidButSlower) {
  auto programs = make_schedule(ScheduleKind::OneFOneB, 4, 8);
  StageProgram& s0 = programs[0];
  // Stage 0 steady state: F(3+k) sendA(3+k) recvG(k) B(k): move each recvG before its forward.
  for (size_t pos = 0; pos < s0.size(); ++pos) {
    if (s0[pos].op == RG && pos >= 2 && s0[pos - 1].op == SA && s0[pos - 2].op == F) {
      std::rotate(s0.begin() + pos - 2, s0.begin() + pos, s0.begin() + pos + 1);
    }
  }
  ASSERT_EQ(to_string(s0[6]), "recvG0");
  EXPECT_NO_THROW(check_schedule(programs));
  const double good = makespan(simulate_timeline(make_schedule(ScheduleKind::OneFOneB, 4, 8)));
  const double bad = makespan(simulate_timeline(programs));
  EXPECT_GT(bad, good);
}

TEST(Schedule, RejectsMissingReceive) {
  // Stage 1 never receives activation 1 that stage 0 sends.
  expect_rejected({{{F, 0}, {SA, 0}, {F, 1}, {SA, 1}, {RG, 0}, {B, 0}, {RG, 1}, {B, 1}},
                   {{RA, 0}, {F, 0}, {F, 1}, {B, 0}, {SG, 0}, {B, 1}, {SG, 1}}},
                  {"stage 0, position 3, SendActivation(micro-batch 1)", "no matching RecvActivation(micro-batch 1)",
                   "on stage 1"});
}

TEST(Schedule, RejectsMissingSend) {
  // Stage 1 waits for gradient 0 that stage 2 never sends.
  auto programs = make_schedule(ScheduleKind::GPipe, 3, 2);
  auto& last = programs[2];
  last.erase(std::find(last.begin(), last.end(), A{SG, 0}));
  expect_rejected(programs, {"stage 1", "RecvGrad(micro-batch 0)", "no matching SendGrad(micro-batch 0) on stage 2"});
}

TEST(Schedule, RejectsMissingReceiveAndSendTogether) {
  // Neither side has the message: the producer's forward has no send.
  auto programs = make_schedule(ScheduleKind::GPipe, 2, 2);
  std::erase(programs[0], A{SA, 1});
  std::erase(programs[1], A{RA, 1});
  expect_rejected(programs, {"stage 0, position 2, Forward(micro-batch 1)", "no SendActivation(micro-batch 1)"});
}

TEST(Schedule, RejectsDuplicatedForward) {
  expect_rejected({{{F, 0}, {F, 1}, {F, 0}, {B, 0}, {B, 1}}},
                  {"stage 0, position 2, Forward(micro-batch 0)", "duplicated, first at position 0"});
}

TEST(Schedule, RejectsMissingBackward) {
  expect_rejected({{{F, 0}, {F, 1}, {B, 1}}}, {"stage 0 never runs Backward(micro-batch 0)"});
}

TEST(Schedule, RejectsBackwardBeforeForward) {
  expect_rejected({{{B, 0}, {F, 0}}},
                  {"stage 0, position 0, Backward(micro-batch 0)", "before Forward(micro-batch 0) at position 1"});
}

TEST(Schedule, RejectsSendBeforeCompute) {
  expect_rejected({{{SA, 0}, {F, 0}, {RG, 0}, {B, 0}}, {{RA, 0}, {F, 0}, {B, 0}, {SG, 0}}},
                  {"stage 0, position 0, SendActivation(micro-batch 0)", "must come after Forward(micro-batch 0)"});
}

TEST(Schedule, RejectsCrossedOrderThatDeadlocks) {
  // Stage 0 waits for the gradient of micro-batch 1 before sending activation 1, which stage 1
  // needs before it can produce that gradient.
  expect_rejected({{{F, 0}, {SA, 0}, {F, 1}, {RG, 1}, {SA, 1}, {RG, 0}, {B, 0}, {B, 1}},
                   {{RA, 0}, {F, 0}, {RA, 1}, {F, 1}, {B, 1}, {SG, 1}, {B, 0}, {SG, 0}}},
                  {"deadlock", "stage 0 waits at position 3 on RecvGrad(micro-batch 1) from stage 1",
                   "stage 1 waits at position 2 on RecvActivation(micro-batch 1) from stage 0"});
}

TEST(Schedule, RejectsReceiveOnFirstStage) {
  auto programs = make_schedule(ScheduleKind::OneFOneB, 2, 2);
  programs[0].insert(programs[0].begin(), A{RA, 0});
  expect_rejected(programs, {"stage 0, position 0, RecvActivation(micro-batch 0)", "first stage"});
}

TEST(Schedule, RejectsSendOnLastStage) {
  auto programs = make_schedule(ScheduleKind::GPipe, 2, 1);
  programs[1].push_back({SA, 0});
  expect_rejected(programs, {"stage 1, position 4, SendActivation(micro-batch 0)", "last stage"});
}

TEST(Schedule, RejectsNegativeMicroBatchAndEmpty) {
  expect_rejected({{{F, -1}}}, {"negative micro-batch"});
  expect_rejected({}, {"no stages"});
  expect_rejected({{}, {}}, {"no stage has any action"});
}

TEST(Schedule, BadShapesAndNamesAreInputErrors) {
  for (auto [p, m] : {std::pair{0, 4}, std::pair{2, 0}}) {
    try {
      make_schedule(ScheduleKind::GPipe, p, m);
      ADD_FAILURE() << "accepted P=" << p << " m=" << m;
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::Input);
    }
  }
  for (ScheduleKind kind : {ScheduleKind::GPipe, ScheduleKind::OneFOneB, ScheduleKind::Interleaved})
    EXPECT_EQ(parse_schedule_kind(to_string(kind)), kind);
  EXPECT_EQ(to_string(ScheduleKind::Interleaved), "interleaved");
  try {
    parse_schedule_kind("zero-bubble");
    ADD_FAILURE();
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::Input);
    EXPECT_NE(e.message().find("\"gpipe\", \"1f1b\" or \"interleaved\", got \"zero-bubble\""), std::string::npos)
        << e.message();
  }
}

TEST(Schedule, MessageTagsAreDistinctAndAgreeBetweenSendAndReceive) {
  std::set<int> tags;
  for (int i = 0; i < 16384; ++i) {
    EXPECT_EQ(message_tag(SA, i), message_tag(RA, i));
    EXPECT_EQ(message_tag(SG, i), message_tag(RG, i));
    tags.insert(message_tag(SA, i));
    tags.insert(message_tag(SG, i));
  }
  EXPECT_EQ(tags.size(), 2u * 16384);
  EXPECT_LE(*tags.rbegin(), 32767);
  EXPECT_GE(*tags.begin(), 0);
  EXPECT_THROW(message_tag(F, 0), Error);
  EXPECT_THROW(message_tag(SA, 16384), Error);
  EXPECT_THROW(message_tag(SA, -1), Error);
}

TEST(Schedule, ActionNames) {
  EXPECT_EQ(to_string(A{F, 3}), "F3");
  EXPECT_EQ(to_string(A{B, 0}), "B0");
  EXPECT_EQ(to_string(A{RA, 2}), "recvA2");
  EXPECT_EQ(to_string(A{SA, 2}), "sendA2");
  EXPECT_EQ(to_string(A{RG, 12}), "recvG12");
  EXPECT_EQ(to_string(A{SG, 1}), "sendG1");
  EXPECT_EQ(to_string(Op::RecvActivation), "RecvActivation");
}

TEST(Timeline, BubbleFractionsOfAHandMadeTimeline) {
  const std::vector<TimelineEvent> events = {
      {0, F, 0, 0.0, 1.0},   {0, B, 0, 2.0, 4.0},  // stage 0 busy 3 of 4
      {1, F, 0, 1.0, 2.0},   {1, B, 0, 1.5, 2.5},  // overlapping: busy [1, 2.5]
      {1, RG, 0, 2.5, 3.5},                        // communication: not busy
      {2, F, 0, 10.0, 10.0},                       // zero length
  };
  // The window is [0, 10] because of the last event.
  const auto idle = bubble_fractions(events, 4);
  ASSERT_EQ(idle.size(), 4u);
  EXPECT_DOUBLE_EQ(idle[0], 1.0 - 3.0 / 10.0);
  EXPECT_DOUBLE_EQ(idle[1], 1.0 - 1.5 / 10.0);
  EXPECT_DOUBLE_EQ(idle[2], 1.0);
  EXPECT_DOUBLE_EQ(idle[3], 1.0);
  EXPECT_EQ(bubble_fractions({}, 2), (std::vector<double>{0.0, 0.0}));
  EXPECT_THROW(bubble_fractions({{5, F, 0, 0.0, 1.0}}, 2), Error);
}

// ---- Interleaved 1F1B (v chunks per stage) ----

// The (P, m, v) the interleaved tests sweep: P in 1..6 and 8, m every multiple of P up to 4P,
// v in 1..4.
std::vector<std::tuple<int, int, int>> interleaved_shapes() {
  std::vector<std::tuple<int, int, int>> shapes;
  for (int p : {1, 2, 3, 4, 5, 6, 8})
    for (int m = p; m <= 4 * p; m += p)
      for (int v = 1; v <= 4; ++v) shapes.emplace_back(p, m, v);
  return shapes;
}

std::string shape_name(int p, int m, int v) {
  return "P=" + std::to_string(p) + " m=" + std::to_string(m) + " v=" + std::to_string(v);
}

// Asserts that make_schedule throws a one-line Input error whose message is exactly `message`.
void expect_refused(ScheduleKind kind, int p, int m, int v, const std::string& message) {
  try {
    make_schedule(kind, p, m, v);
    ADD_FAILURE() << "accepted " << to_string(kind) << " " << shape_name(p, m, v);
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::Input);
    EXPECT_EQ(e.message(), message);
    EXPECT_EQ(e.message().find('\n'), std::string::npos);
  }
}

TEST(Interleaved, EveryGeneratedSchedulePassesTheChecker) {
  for (auto [p, m, v] : interleaved_shapes()) {
    SCOPED_TRACE(shape_name(p, m, v));
    const auto programs = make_schedule(ScheduleKind::Interleaved, p, m, v);
    ASSERT_EQ(programs.size(), static_cast<size_t>(p));
    EXPECT_NO_THROW(check_schedule(programs));
    for (int s = 0; s < p; ++s) {
      // Compute once per (micro-batch, chunk) and direction, plus one message per direction for
      // every chunk with a virtual stage before it and every chunk with one after it.
      const size_t with_previous = v - (s == 0 ? 1 : 0), with_next = v - (s == p - 1 ? 1 : 0);
      EXPECT_EQ(programs[s].size(), 2 * v * m + 2 * m * with_previous + 2 * m * with_next) << "stage " << s;
      for (const Action& a : programs[s]) {
        EXPECT_GE(a.chunk, 0);
        EXPECT_LT(a.chunk, v);
      }
    }
  }
}

// The order Megatron-LM's forward_backward_pipelining_with_interleaving runs, worked out by hand
// for P = 2, m = 4, v = 2. Forwards in groups of P micro-batches per chunk: (0,c0) (1,c0) (0,c1)
// (1,c1) (2,c0) (3,c0) (2,c1) (3,c1); backwards the same with the chunks reversed. Stage 0 warms
// up with (v-1)P + 2(P-1) = 4 forwards, stage 1 with 2, then one forward, one backward.
TEST(Interleaved, ExactProgramsForTwoStagesFourMicroBatchesTwoChunks) {
  const auto programs = make_schedule(ScheduleKind::Interleaved, 2, 4, 2);
  std::cout << "interleaved P=2 m=4 v=2\n" << to_string(programs);
  EXPECT_EQ(to_string({programs[0]}),
            "stage 0: F0 sendA0 F1 sendA1 recvA0c1 F0c1 sendA0c1 recvA1c1 F1c1 sendA1c1 F2 sendA2 recvG0c1 B0c1 "
            "sendG0c1 F3 sendA3 recvG1c1 B1c1 sendG1c1 recvA2c1 F2c1 sendA2c1 recvG0 B0 recvA3c1 F3c1 sendA3c1 recvG1 "
            "B1 recvG2c1 B2c1 sendG2c1 recvG3c1 B3c1 sendG3c1 recvG2 B2 recvG3 B3\n");
  EXPECT_EQ(to_string({programs[1]}),
            "stage 0: recvA0 F0 sendA0 recvA1 F1 sendA1 recvA0c1 F0c1 B0c1 sendG0c1 recvA1c1 F1c1 B1c1 sendG1c1 "
            "recvA2 F2 sendA2 recvG0 B0 sendG0 recvA3 F3 sendA3 recvG1 B1 sendG1 recvA2c1 F2c1 B2c1 sendG2c1 recvA3c1 "
            "F3c1 B3c1 sendG3c1 recvG2 B2 sendG2 recvG3 B3 sendG3\n");
}

// The k-th forward of every stage runs micro-batch k/(Pv)*P + k%P of chunk k%(Pv)/P, the k-th
// backward the same micro-batch of chunk v-1-k%(Pv)/P, for every shape (Megatron's
// get_model_chunk_id and its per-chunk micro-batch counters).
TEST(Interleaved, ChunksTakeTurnsInGroupsOfPMicroBatches) {
  for (auto [p, m, v] : interleaved_shapes()) {
    SCOPED_TRACE(shape_name(p, m, v));
    const auto programs = make_schedule(ScheduleKind::Interleaved, p, m, v);
    for (int s = 0; s < p; ++s) {
      int forwards = 0, backwards = 0;
      for (const Action& a : programs[s]) {
        if (a.op != F && a.op != B) continue;
        int& k = a.op == F ? forwards : backwards;
        const int in_group = k % (p * v);
        EXPECT_EQ(a.micro_batch, k / (p * v) * p + in_group % p) << "stage " << s << " " << to_string(a);
        EXPECT_EQ(a.chunk, a.op == F ? in_group / p : v - 1 - in_group / p) << "stage " << s << " " << to_string(a);
        ++k;
      }
      EXPECT_EQ(forwards, v * m);
      EXPECT_EQ(backwards, v * m);
    }
  }
}

TEST(Interleaved, OneChunkIsOneFOneB) {
  for (int p = 1; p <= 8; ++p)
    for (int m = p; m <= 4 * p; m += p) {
      SCOPED_TRACE(shape_name(p, m, 1));
      EXPECT_EQ(make_schedule(ScheduleKind::Interleaved, p, m, 1), make_schedule(ScheduleKind::OneFOneB, p, m));
      EXPECT_EQ(make_schedule(ScheduleKind::Interleaved, p, m), make_schedule(ScheduleKind::OneFOneB, p, m));
    }
}

TEST(Interleaved, RefusesWithOneLineInputErrors) {
  // Megatron's rule: the chunks take turns in groups of P micro-batches.
  expect_refused(ScheduleKind::Interleaved, 4, 6, 2,
                 "--schedule interleaved needs the micro-batches per replica (6) to be a multiple of --pp (4)");
  expect_refused(ScheduleKind::Interleaved, 4, 2, 2,
                 "--schedule interleaved needs the micro-batches per replica (2) to be a multiple of --pp (4)");
  expect_refused(ScheduleKind::Interleaved, 3, 7, 1,
                 "--schedule interleaved needs the micro-batches per replica (7) to be a multiple of --pp (3)");
  expect_refused(ScheduleKind::Interleaved, 2, 4, 0, "--virtual-stages must be at least 1, found 0");
  expect_refused(ScheduleKind::Interleaved, 2, 4, -1, "--virtual-stages must be at least 1, found -1");
  expect_refused(ScheduleKind::OneFOneB, 2, 4, 2,
                 "--virtual-stages 2 needs --schedule interleaved, found --schedule 1f1b");
  expect_refused(ScheduleKind::GPipe, 2, 4, 3,
                 "--virtual-stages 3 needs --schedule interleaved, found --schedule gpipe");
  // Every (micro-batch, chunk, direction) needs its own tag below 32768.
  expect_refused(ScheduleKind::Interleaved, 2, 8194, 2,
                 "--schedule interleaved needs --virtual-stages (2) x micro-batches per replica (8194) <= 16384 to tag "
                 "every message within MPI's tag range");
  EXPECT_NO_THROW(make_schedule(ScheduleKind::Interleaved, 2, 8192, 2));
  // The existing rules stay first.
  expect_refused(ScheduleKind::Interleaved, 0, 4, 2, "pipeline: need at least one stage, got 0");
  expect_refused(ScheduleKind::Interleaved, 2, 0, 2, "pipeline: need at least one micro-batch, got 0");
}

// Megatron's warm-up, (v-1)P + 2(P-s-1) forwards before the first backward, bounds the chunk
// micro-batches in flight; the last stage holds the fewest.
TEST(Interleaved, PeakInFlight) {
  for (auto [p, m, v] : interleaved_shapes()) {
    if (v == 1) continue;  // 1F1B: Schedule.PeakInFlight
    const auto programs = make_schedule(ScheduleKind::Interleaved, p, m, v);
    for (int s = 0; s < p; ++s)
      EXPECT_EQ(peak_in_flight(programs[s]), std::min(v * m, (v - 1) * p + 2 * (p - s - 1) + 1))
          << shape_name(p, m, v) << " s=" << s;
  }
  // A micro-batch in flight in two chunks counts twice.
  EXPECT_EQ(peak_in_flight({{F, 0, 0}, {F, 0, 1}, {B, 0, 1}, {B, 0, 0}}), 2);
}

// The bubble: with every chunk's Forward taking 1 and Backward 2 (tb = tf = 1 as well) and free
// communication, the simulated step is (v·m + P - 1)(tf + tb) long, so every stage, which
// computes v·m(tf + tb), idles exactly (P - 1) / (v·m + P - 1) of the window [first start, last
// end] (bubble_fractions; to 1e-12, the sums of small integers being exact). Against 1F1B on the
// same model — a stage's forward is its v chunks', tf = v, tb = 2v — the step is shorter by
// (P - 1)(v - 1)(tf + tb) and the idle fraction lower for every v >= 2, P >= 2.
TEST(Interleaved, SimulatedBubbleMatchesTheFormula) {
  double worst_error = 0;
  for (double tb : {1.0, 2.0}) {
    for (auto [p, m, v] : interleaved_shapes()) {
      SCOPED_TRACE(shape_name(p, m, v) + " tb=" + std::to_string(tb));
      const auto events = simulate_timeline(make_schedule(ScheduleKind::Interleaved, p, m, v), 1.0, tb);
      ASSERT_EQ(events.size(), static_cast<size_t>(2 * p * m * v));
      EXPECT_NEAR(makespan(events), (v * m + p - 1) * (1.0 + tb), 1e-9);
      const double expected = static_cast<double>(p - 1) / (v * m + p - 1);
      const std::vector<double> idle_per_stage = bubble_fractions(events, p);
      for (double idle : idle_per_stage) worst_error = std::max(worst_error, std::abs(idle - expected));
      const double idle = idle_per_stage.front();

      const auto one_f_one_b = simulate_timeline(make_schedule(ScheduleKind::OneFOneB, p, m), v * 1.0, v * tb);
      const double one_f_one_b_idle = bubble_fractions(one_f_one_b, p).front();
      EXPECT_NEAR(one_f_one_b_idle, static_cast<double>(p - 1) / (m + p - 1), 1e-12);
      EXPECT_NEAR(makespan(one_f_one_b) - makespan(events), (p - 1) * (v - 1) * (1.0 + tb), 1e-9);
      if (v >= 2 && p >= 2) {
        EXPECT_LT(idle, one_f_one_b_idle - 1e-6);
      }
    }
  }
  EXPECT_LT(worst_error, 1e-12);
  // For the record, the P = 4, m = 8 case of docs/benchmarks.md: 27.3% with 1F1B.
  for (int v : {1, 2, 4}) {
    const auto events = simulate_timeline(make_schedule(ScheduleKind::Interleaved, 4, 8, v));
    std::cout << "interleaved P=4 m=8 v=" << v << ": idle " << bubble_fractions(events, 4).front() << " (formula "
              << 3.0 / (8 * v + 3) << ")\n";
  }
}

// Splits a 1F1B-shaped program into its forward and backward units (a compute with the receive
// before it and the send after it), in order; rebuilt with `warmup` forwards before the first
// backward and strict alternation after, it is the same schedule with another warm-up.
StageProgram with_warmup(const StageProgram& program, int warmup) {
  std::vector<StageProgram> forwards, backwards;
  StageProgram pending;  // a receive waiting for its compute
  for (const Action& a : program) {
    if (a.op == RA || a.op == RG) {
      pending.push_back(a);
    } else if (a.op == F || a.op == B) {
      pending.push_back(a);
      (a.op == F ? forwards : backwards).push_back(pending);
      pending.clear();
    } else {
      (a.op == SA ? forwards : backwards).back().push_back(a);
    }
  }
  StageProgram out;
  const auto emit = [&](const StageProgram& unit) { out.insert(out.end(), unit.begin(), unit.end()); };
  const size_t w = static_cast<size_t>(warmup);
  for (size_t k = 0; k < w; ++k) emit(forwards[k]);
  for (size_t k = 0; k + w < forwards.size(); ++k) {
    emit(forwards[k + w]);
    emit(backwards[k]);
  }
  for (size_t k = forwards.size() - w; k < backwards.size(); ++k) emit(backwards[k]);
  return out;
}

// Why Megatron's 2(P-s-1) extra warm-up forwards and not 1F1B's P-s-1: with free hand-offs both
// give the ideal step, but when every message takes 5% of a forward the smaller warm-up leaves
// the stages waiting on each late hand-off in steady state, the larger one only in the fill and
// drain. The price: P-s-1 more chunk micro-batches in flight.
TEST(Interleaved, MegatronsWarmupAbsorbsMessageLatency) {
  for (auto [p, m, v] : {std::tuple{4, 8, 2}, std::tuple{4, 16, 2}, std::tuple{2, 8, 3}, std::tuple{8, 16, 2}}) {
    SCOPED_TRACE(shape_name(p, m, v));
    const auto megatron = make_schedule(ScheduleKind::Interleaved, p, m, v);
    ASSERT_EQ(with_warmup(megatron[0], std::min(v * m, (v - 1) * p + 2 * (p - 1))), megatron[0]);
    auto smaller = megatron;
    for (int s = 0; s < p; ++s) smaller[s] = with_warmup(megatron[s], (v - 1) * p + p - s - 1);
    ASSERT_NO_THROW(check_schedule(smaller));
    const double ideal = (v * m + p - 1) * 3.0;
    EXPECT_NEAR(makespan(simulate_timeline(megatron)), ideal, 1e-9);
    EXPECT_NEAR(makespan(simulate_timeline(smaller)), ideal, 1e-9);
    const double late_megatron = makespan(simulate_timeline(megatron, 1.0, 2.0, 0.05)) - ideal;
    const double late_smaller = makespan(simulate_timeline(smaller, 1.0, 2.0, 0.05)) - ideal;
    std::cout << shape_name(p, m, v) << ": step longer by " << late_megatron << " (Megatron's warm-up) and "
              << late_smaller << " (P-s-1) with a latency of 0.05\n";
    EXPECT_LT(late_megatron, late_smaller);
    for (int s = 0; s + 1 < p; ++s) EXPECT_GT(peak_in_flight(megatron[s]), peak_in_flight(smaller[s])) << "s=" << s;
  }
}

// Tags: every message of a step gets a tag in [0, 32767] that its send and its receive compute
// alike (the send from its own chunk, the receive from its peer_of's chunk), distinct among
// the messages between any two ranks.
TEST(Interleaved, SendAndReceiveAgreeOnDistinctTags) {
  for (auto [p, m, v] : interleaved_shapes()) {
    SCOPED_TRACE(shape_name(p, m, v));
    const auto programs = make_schedule(ScheduleKind::Interleaved, p, m, v);
    // (from, to, tag) -> messages; sends and receives counted separately.
    std::map<std::tuple<int, int, int>, int> sends, recvs;
    for (int s = 0; s < p; ++s) {
      for (const Action& a : programs[s]) {
        if (a.op == F || a.op == B) continue;
        const StageChunk peer = peer_of(a.op, s, a.chunk, p);
        ASSERT_GE(peer.chunk, 0);
        ASSERT_LT(peer.chunk, v);
        if (a.op == SA || a.op == SG) {
          const int tag = message_tag(a.op, a.micro_batch, a.chunk, m);
          ASSERT_GE(tag, 0);
          ASSERT_LE(tag, 32767);
          ++sends[{s, peer.stage, tag}];
        } else {
          ++recvs[{peer.stage, s, message_tag(a.op, a.micro_batch, peer.chunk, m)}];
        }
      }
    }
    EXPECT_EQ(sends, recvs);
    for (const auto& [key, count] : sends) EXPECT_EQ(count, 1) << "tag " << std::get<2>(key);
  }
}

TEST(Interleaved, MessageTagsUseTheWholeRange) {
  // v x m = 16384 (micro-batches x chunks): 32768 distinct tags, the largest 32767.
  for (auto [v, m] : {std::pair{1, 16384}, std::pair{2, 8192}, std::pair{4, 4096}, std::pair{16384, 1}}) {
    std::set<int> tags;
    for (int c = 0; c < v; ++c)
      for (int i = 0; i < m; ++i) {
        tags.insert(message_tag(SA, i, c, m));
        tags.insert(message_tag(SG, i, c, m));
        EXPECT_EQ(message_tag(RA, i, c, m), message_tag(SA, i, c, m));
        EXPECT_EQ(message_tag(RG, i, c, m), message_tag(SG, i, c, m));
      }
    EXPECT_EQ(tags.size(), 32768u) << "v=" << v << " m=" << m;
    EXPECT_EQ(*tags.begin(), 0);
    EXPECT_EQ(*tags.rbegin(), 32767);
    EXPECT_THROW(message_tag(SA, 0, v, m), Error);  // one chunk too many
  }
  // Chunk 0 is the two-argument tag.
  for (int i : {0, 1, 7, 16383}) EXPECT_EQ(message_tag(SG, i, 0, 16384), message_tag(SG, i));
  EXPECT_THROW(message_tag(SA, 4, 0, 4), Error);  // micro-batch past m
  EXPECT_THROW(message_tag(SA, 0, -1, 4), Error);
  EXPECT_THROW(message_tag(B, 0, 0, 4), Error);
}

TEST(Interleaved, PeerOf) {
  // Four stages: activations 3 -> 0 across chunks, gradients 0 -> 3.
  EXPECT_EQ(peer_of(SA, 1, 0, 4), (StageChunk{2, 0}));
  EXPECT_EQ(peer_of(SA, 3, 0, 4), (StageChunk{0, 1}));
  EXPECT_EQ(peer_of(RG, 3, 1, 4), (StageChunk{0, 2}));
  EXPECT_EQ(peer_of(RA, 0, 1, 4), (StageChunk{3, 0}));
  EXPECT_EQ(peer_of(SG, 0, 2, 4), (StageChunk{3, 1}));
  EXPECT_EQ(peer_of(RA, 2, 1, 4), (StageChunk{1, 1}));
  // One stage: the next chunk of itself.
  EXPECT_EQ(peer_of(SA, 0, 0, 1), (StageChunk{0, 1}));
  EXPECT_THROW(peer_of(F, 0, 0, 4), Error);
}

// The executor gives each sender 2P + 1 mailbox slots with interleaved: the most messages one
// rank can have sent another and the other not yet received, over every timing — each
// receiver frozen at each point of its program while all others run as far as they can — is at
// most 2P - 1 (2P for P = 2, where one neighbour sends both directions).
TEST(Interleaved, MessagesInFlightPerSenderFitTheMailboxes) {
  for (auto [p, m, v] : interleaved_shapes()) {
    if (v == 1 || p == 1 || p > 6 || m > 2 * p) continue;  // keep the exhaustive search short
    SCOPED_TRACE(shape_name(p, m, v));
    const auto programs = make_schedule(ScheduleKind::Interleaved, p, m, v);
    int worst = 0;
    for (int r = 0; r < p; ++r) {
      std::map<std::tuple<Op, int, int>, size_t> position;  // of r's receives
      for (size_t k = 0; k < programs[r].size(); ++k)
        position[{programs[r][k].op, programs[r][k].micro_batch, programs[r][k].chunk}] = k;
      for (size_t freeze = 0; freeze <= programs[r].size(); ++freeze) {
        std::vector<size_t> pc(p, 0);
        std::set<std::tuple<int, Op, int, int>> sent;  // (stage, send op, micro-batch, chunk)
        for (bool progress = true; progress;) {
          progress = false;
          for (int s = 0; s < p; ++s) {
            const size_t end = s == r ? freeze : programs[s].size();
            for (; pc[s] < end; ++pc[s], progress = true) {
              const Action& a = programs[s][pc[s]];
              if (a.op == RA || a.op == RG) {
                const StageChunk from = peer_of(a.op, s, a.chunk, p);
                if (!sent.count({from.stage, a.op == RA ? SA : SG, a.micro_batch, from.chunk})) break;
              }
              if (a.op == SA || a.op == SG) sent.insert({s, a.op, a.micro_batch, a.chunk});
            }
          }
        }
        // Messages to r not received by r, per sender.
        std::map<int, int> unreceived;
        for (const auto& [s, op, i, c] : sent) {
          const StageChunk to = peer_of(op, s, c, p);
          if (to.stage != r) continue;
          if (position.at({op == SA ? RA : RG, i, to.chunk}) >= pc[r]) ++unreceived[s];
        }
        for (const auto& [s, n] : unreceived) worst = std::max(worst, n);
      }
    }
    EXPECT_LE(worst, p == 2 ? 2 * p : 2 * p - 1);
    EXPECT_GE(worst, p);  // the bound is not vacuous
  }
}

TEST(Interleaved, ActionNamesShowTheChunk) {
  EXPECT_EQ(to_string(A{F, 3, 1}), "F3c1");
  EXPECT_EQ(to_string(A{SG, 2, 3}), "sendG2c3");
  EXPECT_EQ(to_string(A{RA, 0, 0}), "recvA0");
}

TEST(Interleaved, RejectsMissingReceiveAcrossTheChunkBoundary) {
  // Stage 1 (the last) sends chunk 0's activation 0 to stage 0's chunk 1, which never receives it.
  auto programs = make_schedule(ScheduleKind::Interleaved, 2, 2, 2);
  std::erase(programs[0], A{RA, 0, 1});
  expect_rejected(programs, {"stage 1", "SendActivation(micro-batch 0, chunk 0)",
                             "no matching RecvActivation(micro-batch 0, chunk 1) on stage 0"});
}

TEST(Interleaved, RejectsWaitingForTheWrapBeforeSendingIntoIt) {
  // Stage 0 waits for chunk 1's input of micro-batch 0 before sending chunk 0's output of
  // micro-batch 0, from which stage 1 makes that input.
  auto programs = make_schedule(ScheduleKind::Interleaved, 2, 2, 2);
  auto& s0 = programs[0];
  s0.erase(std::find(s0.begin(), s0.end(), A{RA, 0, 1}));
  s0.insert(std::find(s0.begin(), s0.end(), A{SA, 0, 0}), A{RA, 0, 1});
  expect_rejected(programs, {"deadlock", "stage 0 waits at position 1 on RecvActivation(micro-batch 0, chunk 1)",
                             "stage 1 waits at position 0 on RecvActivation(micro-batch 0, chunk 0) from stage 0"});
}

TEST(Interleaved, RejectsTalkingPastTheEndsOfThePipe) {
  auto programs = make_schedule(ScheduleKind::Interleaved, 2, 2, 2);
  programs[1].push_back({SA, 0, 1});
  expect_rejected(programs, {"stage 1", "SendActivation(micro-batch 0, chunk 1)", "chunk 1 of the last stage"});
  programs = make_schedule(ScheduleKind::Interleaved, 2, 2, 2);
  programs[0].insert(programs[0].begin(), A{RA, 1, 0});
  expect_rejected(programs, {"stage 0, position 0, RecvActivation(micro-batch 1, chunk 0)",
                             "chunk 0 of the first stage has no previous stage"});
}

TEST(Interleaved, RejectsMissingChunkBackwardAndNegativeChunk) {
  auto programs = make_schedule(ScheduleKind::Interleaved, 2, 2, 2);
  std::erase(programs[1], A{B, 1, 1});
  expect_rejected(programs, {"stage 1 never runs Backward(micro-batch 1, chunk 1) of the 2 micro-batches x 2 chunks"});
  expect_rejected({{{F, 0, -1}}}, {"negative chunk"});
}

TEST(Interleaved, SimulatedEventsCarryTheirChunk) {
  const auto events = simulate_timeline(make_schedule(ScheduleKind::Interleaved, 2, 2, 3));
  std::set<std::tuple<int, Op, int, int>> seen;
  for (const TimelineEvent& e : events) seen.insert({e.stage, e.op, e.micro_batch, e.chunk});
  EXPECT_EQ(seen.size(), 2u * 2 * 2 * 3);
  // Chunk 1 of stage 0 starts micro-batch 0 once the last stage's chunk 0 has finished it.
  auto find = [&](int s, Op op, int i, int c) {
    return *std::find_if(events.begin(), events.end(), [&](const TimelineEvent& e) {
      return e.stage == s && e.op == op && e.micro_batch == i && e.chunk == c;
    });
  };
  EXPECT_GE(find(0, F, 0, 1).start_s, find(1, F, 0, 0).end_s);
  EXPECT_GE(find(1, B, 0, 0).start_s, find(0, B, 0, 1).end_s);
}

}  // namespace
}  // namespace strata::parallel
