// Tests of pipeline schedules: generated GPipe/1F1B programs pass the checker for many shapes,
// their memory and bubble are the textbook values, hand-made bad programs are rejected with a
// message that names the problem, and recorded timelines give their idle fractions.
#include <gtest/gtest.h>

#include <algorithm>
#include <iostream>
#include <set>
#include <sstream>

#include "core/error.hpp"
#include "parallel/schedule.hpp"

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
  EXPECT_EQ(parse_schedule_kind("gpipe"), ScheduleKind::GPipe);
  EXPECT_EQ(parse_schedule_kind("1f1b"), ScheduleKind::OneFOneB);
  try {
    parse_schedule_kind("interleaved");
    ADD_FAILURE();
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::Input);
    EXPECT_NE(e.message().find("\"gpipe\" or \"1f1b\", got \"interleaved\""), std::string::npos) << e.message();
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

}  // namespace
}  // namespace strata::parallel
