// Pipeline schedules: generation (GPipe, 1F1B), the checker that proves a set of stage programs
// matched and deadlock-free, the unit-cost timeline simulator, and the timeline renderers.
#include "parallel/schedule.hpp"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <set>
#include <sstream>

#include "core/error.hpp"
#include "parallel/communicator.hpp"

namespace strata::parallel {

namespace {

constexpr int kNumOps = 6;

bool is_compute(Op op) { return op == Op::Forward || op == Op::Backward; }
bool is_send(Op op) { return op == Op::SendActivation || op == Op::SendGrad; }
bool is_recv(Op op) { return op == Op::RecvActivation || op == Op::RecvGrad; }

// The op on the neighbour that completes a communication op.
Op matching_op(Op op) {
  switch (op) {
    case Op::SendActivation:
      return Op::RecvActivation;
    case Op::RecvActivation:
      return Op::SendActivation;
    case Op::SendGrad:
      return Op::RecvGrad;
    case Op::RecvGrad:
      return Op::SendGrad;
    default:
      STRATA_THROW("schedule: ", to_string(op), " is not a communication op");
  }
}

// The stage a communication op on stage s talks to: activations go down the pipe, grads up.
int peer_stage(Op op, int s) { return (op == Op::SendActivation || op == Op::RecvGrad) ? s + 1 : s - 1; }

std::string where(int stage, size_t position, const Action& a) {
  return detail::cat("schedule: stage ", stage, ", position ", position, ", ", to_string(a.op), "(micro-batch ",
                     a.micro_batch, ")");
}

void check_stage_range(const std::vector<TimelineEvent>& events, int stages) {
  STRATA_CHECK(stages >= 1, "timeline: need at least one stage, got ", stages);
  for (const TimelineEvent& e : events)
    STRATA_CHECK(e.stage >= 0 && e.stage < stages, "timeline: event on stage ", e.stage, " of ", stages);
}

}  // namespace

std::pair<double, double> timeline_window(const std::vector<TimelineEvent>& events) {
  if (events.empty()) return {0.0, 0.0};
  double t0 = events.front().start_s, t1 = events.front().end_s;
  for (const TimelineEvent& e : events) {
    t0 = std::min(t0, e.start_s);
    t1 = std::max(t1, e.end_s);
  }
  return {t0, t1};
}

ScheduleKind parse_schedule_kind(std::string_view name) {
  if (name == "gpipe") return ScheduleKind::GPipe;
  if (name == "1f1b") return ScheduleKind::OneFOneB;
  STRATA_THROW_INPUT("pipeline schedule: expected \"gpipe\" or \"1f1b\", got \"", name, "\"");
}

std::string to_string(ScheduleKind kind) { return kind == ScheduleKind::GPipe ? "gpipe" : "1f1b"; }

std::string to_string(Op op) {
  switch (op) {
    case Op::RecvActivation:
      return "RecvActivation";
    case Op::Forward:
      return "Forward";
    case Op::SendActivation:
      return "SendActivation";
    case Op::RecvGrad:
      return "RecvGrad";
    case Op::Backward:
      return "Backward";
    case Op::SendGrad:
      return "SendGrad";
  }
  return "Op(" + std::to_string(static_cast<int>(op)) + ")";
}

std::string to_string(const Action& a) {
  const char* name = "?";
  switch (a.op) {
    case Op::RecvActivation:
      name = "recvA";
      break;
    case Op::Forward:
      name = "F";
      break;
    case Op::SendActivation:
      name = "sendA";
      break;
    case Op::RecvGrad:
      name = "recvG";
      break;
    case Op::Backward:
      name = "B";
      break;
    case Op::SendGrad:
      name = "sendG";
      break;
  }
  return name + std::to_string(a.micro_batch);
}

std::string to_string(const std::vector<StageProgram>& programs) {
  std::ostringstream os;
  for (size_t s = 0; s < programs.size(); ++s) {
    os << "stage " << s << ":";
    for (const Action& a : programs[s]) os << ' ' << to_string(a);
    os << '\n';
  }
  return os.str();
}

std::vector<StageProgram> make_schedule(ScheduleKind kind, int stages, int micro_batches) {
  STRATA_REQUIRE(stages >= 1, "pipeline: need at least one stage, got ", stages);
  STRATA_REQUIRE(micro_batches >= 1, "pipeline: need at least one micro-batch, got ", micro_batches);
  const int p = stages, m = micro_batches;
  std::vector<StageProgram> programs(p);
  for (int s = 0; s < p; ++s) {
    StageProgram& prog = programs[s];
    // Receives right before the compute that needs them, sends right after the compute that
    // produced them: a send is never delayed behind a receive, so a neighbour waiting on it
    // is released as early as possible.
    auto forward = [&](int i) {
      if (s > 0) prog.push_back({Op::RecvActivation, i});
      prog.push_back({Op::Forward, i});
      if (s < p - 1) prog.push_back({Op::SendActivation, i});
    };
    auto backward = [&](int i) {
      if (s < p - 1) prog.push_back({Op::RecvGrad, i});
      prog.push_back({Op::Backward, i});
      if (s > 0) prog.push_back({Op::SendGrad, i});
    };
    if (kind == ScheduleKind::GPipe) {
      // Backwards in micro-batch order 0..m-1, not reversed. With free communication both orders
      // take (m+P-1)(tf+tb) and hold m micro-batches, but this one accumulates gradients in the
      // same order as 1F1B and as a single stage with m accumulation steps, so the schedules
      // agree bit for bit (DESIGN.md, decision 5), and activations are freed first-in first-out.
      for (int i = 0; i < m; ++i) forward(i);
      for (int i = 0; i < m; ++i) backward(i);
    } else {
      // PipeDream-flush: enough warm-up forwards to fill the stages below, then 1F1B, then the
      // cool-down backwards. In steady state the forward (and its SendActivation) comes before
      // the RecvGrad: receiving first would still be deadlock-free (sends never block) but would
      // hold back the activation the next stage is waiting for, lengthening the step (a test
      // measures it); check_schedule proves the order used here deadlock-free.
      const int warmup = std::min(p - s - 1, m);
      for (int i = 0; i < warmup; ++i) forward(i);
      for (int k = 0; k < m - warmup; ++k) {
        forward(warmup + k);
        backward(k);
      }
      for (int i = m - warmup; i < m; ++i) backward(i);
    }
  }
  check_schedule(programs);  // cheap, and generation bugs should never reach the executor
  return programs;
}

void check_schedule(const std::vector<StageProgram>& programs) {
  const int p = static_cast<int>(programs.size());
  STRATA_CHECK(p >= 1, "schedule: no stages");

  // Actions well formed; m = 1 + the largest micro-batch.
  int m = 0;
  for (int s = 0; s < p; ++s) {
    for (size_t pos = 0; pos < programs[s].size(); ++pos) {
      const Action& a = programs[s][pos];
      const int op = static_cast<int>(a.op);
      STRATA_CHECK(op >= 0 && op < kNumOps, "schedule: stage ", s, ", position ", pos, ": unknown op ", op);
      STRATA_CHECK(a.micro_batch >= 0, where(s, pos, a), ": negative micro-batch");
      m = std::max(m, a.micro_batch + 1);
    }
  }
  STRATA_CHECK(m >= 1, "schedule: no stage has any action");

  // at[s][op][i]: position of (op, i) on stage s, -1 when absent. Ends of the pipe first, then
  // duplicates.
  std::vector<std::array<std::vector<int>, kNumOps>> at(p);
  for (int s = 0; s < p; ++s) {
    for (auto& v : at[s]) v.assign(m, -1);
    for (size_t pos = 0; pos < programs[s].size(); ++pos) {
      const Action& a = programs[s][pos];
      if (s == 0)
        STRATA_CHECK(a.op != Op::RecvActivation && a.op != Op::SendGrad, where(s, pos, a),
                     ": the first stage has no previous stage to talk to");
      if (s == p - 1)
        STRATA_CHECK(a.op != Op::SendActivation && a.op != Op::RecvGrad, where(s, pos, a),
                     ": the last stage has no next stage to talk to");
      int& first = at[s][static_cast<int>(a.op)][a.micro_batch];
      STRATA_CHECK(first < 0, where(s, pos, a), ": duplicated, first at position ", first);
      first = static_cast<int>(pos);
    }
  }
  auto pos_of = [&](int s, Op op, int i) { return at[s][static_cast<int>(op)][i]; };

  // Every micro-batch forward and backward on every stage.
  for (int s = 0; s < p; ++s) {
    for (int i = 0; i < m; ++i) {
      STRATA_CHECK(pos_of(s, Op::Forward, i) >= 0, "schedule: stage ", s, " never runs Forward(micro-batch ", i,
                   ") of the ", m, " micro-batches");
      STRATA_CHECK(pos_of(s, Op::Backward, i) >= 0, "schedule: stage ", s, " never runs Backward(micro-batch ", i,
                   ") of the ", m, " micro-batches");
    }
  }

  // Every send has its receive on the neighbour and vice versa (uniqueness was checked above).
  for (int s = 0; s < p; ++s) {
    for (size_t pos = 0; pos < programs[s].size(); ++pos) {
      const Action& a = programs[s][pos];
      if (is_compute(a.op)) continue;
      const int peer = peer_stage(a.op, s);
      STRATA_CHECK(pos_of(peer, matching_op(a.op), a.micro_batch) >= 0, where(s, pos, a), ": no matching ",
                   to_string(matching_op(a.op)), "(micro-batch ", a.micro_batch, ") on stage ", peer);
    }
  }

  // Order on each stage: recvA < F < sendA, F < B, recvG < B < sendG.
  for (int s = 0; s < p; ++s) {
    const auto& prog = programs[s];
    for (int i = 0; i < m; ++i) {
      const int f = pos_of(s, Op::Forward, i), b = pos_of(s, Op::Backward, i);
      STRATA_CHECK(f < b, where(s, b, prog[b]), ": runs before Forward(micro-batch ", i, ") at position ", f);
      auto require_before = [&](Op op, int compute, const char* what) {
        const int c = pos_of(s, op, i);
        STRATA_CHECK(c >= 0, where(s, compute, prog[compute]), ": no ", to_string(op), "(micro-batch ", i, ") ", what);
        STRATA_CHECK(c < compute, where(s, c, prog[c]), ": must come before ", to_string(prog[compute].op),
                     "(micro-batch ", i, ") at position ", compute);
      };
      auto require_after = [&](Op op, int compute, const char* what) {
        const int c = pos_of(s, op, i);
        STRATA_CHECK(c >= 0, where(s, compute, prog[compute]), ": no ", to_string(op), "(micro-batch ", i, ") ", what);
        STRATA_CHECK(c > compute, where(s, c, prog[c]), ": must come after ", to_string(prog[compute].op),
                     "(micro-batch ", i, ") at position ", compute);
      };
      if (s > 0) {
        require_before(Op::RecvActivation, f, "receives its input");
        require_after(Op::SendGrad, b, "sends its result to the previous stage");
      }
      if (s < p - 1) {
        require_after(Op::SendActivation, f, "sends its result to the next stage");
        require_before(Op::RecvGrad, b, "receives its input");
      }
    }
  }

  // Deadlock: run every stage as far as it can go. Sends never block and compute is local, so
  // a stage stops only at a receive whose send its neighbour has not issued yet; if every
  // unfinished stage is stopped like that, the real run would hang there too.
  std::vector<size_t> pc(p, 0);
  std::vector<std::array<std::vector<char>, kNumOps>> issued(p);
  for (auto& ops : issued)
    for (auto& v : ops) v.assign(m, 0);
  for (bool progress = true; progress;) {
    progress = false;
    for (int s = 0; s < p; ++s) {
      const auto& prog = programs[s];
      for (; pc[s] < prog.size(); ++pc[s], progress = true) {
        const Action& a = prog[pc[s]];
        if (is_recv(a.op) && !issued[peer_stage(a.op, s)][static_cast<int>(matching_op(a.op))][a.micro_batch]) break;
        if (is_send(a.op)) issued[s][static_cast<int>(a.op)][a.micro_batch] = 1;
      }
    }
  }
  std::ostringstream blocked;
  for (int s = 0; s < p; ++s) {
    if (pc[s] == programs[s].size()) continue;
    const Action& a = programs[s][pc[s]];
    blocked << (blocked.tellp() > 0 ? "; " : "") << "stage " << s << " waits at position " << pc[s] << " on "
            << to_string(a.op) << "(micro-batch " << a.micro_batch << ") from stage " << peer_stage(a.op, s);
  }
  if (blocked.tellp() > 0) STRATA_THROW("schedule: deadlock: ", blocked.str());
}

int peak_in_flight(const StageProgram& program) {
  std::set<int> live;
  size_t peak = 0;
  for (const Action& a : program) {
    if (a.op == Op::Forward) live.insert(a.micro_batch);
    if (a.op == Op::Backward) live.erase(a.micro_batch);
    peak = std::max(peak, live.size());
  }
  return static_cast<int>(peak);
}

int message_tag(Op send_or_recv, int micro_batch) {
  STRATA_CHECK(!is_compute(send_or_recv), "message_tag: ", to_string(send_or_recv), " sends no message");
  STRATA_CHECK(micro_batch >= 0 && 2 * micro_batch + 1 <= kMaxTag, "message_tag: micro-batch ", micro_batch,
               " outside [0, ", (kMaxTag - 1) / 2, "]");
  const bool grad = send_or_recv == Op::SendGrad || send_or_recv == Op::RecvGrad;
  return 2 * micro_batch + (grad ? 1 : 0);
}

std::vector<TimelineEvent> simulate_timeline(const std::vector<StageProgram>& programs, double tf, double tb) {
  STRATA_CHECK(tf >= 0 && tb >= 0, "simulate_timeline: negative cost tf=", tf, " tb=", tb);
  check_schedule(programs);  // guarantees the loop below finishes
  const int p = static_cast<int>(programs.size());
  int m = 0;
  for (const auto& prog : programs)
    for (const Action& a : prog) m = std::max(m, a.micro_batch + 1);

  // Same progression as the deadlock check, carrying each stage's clock; a receive completes
  // when both the stage reaches it and the neighbour has sent (communication is free).
  std::vector<size_t> pc(p, 0);
  std::vector<double> clock(p, 0.0);
  std::vector<std::array<std::vector<double>, kNumOps>> sent_at(p);
  for (auto& ops : sent_at)
    for (auto& v : ops) v.assign(m, -1.0);
  std::vector<TimelineEvent> events;
  for (bool progress = true; progress;) {
    progress = false;
    for (int s = 0; s < p; ++s) {
      const auto& prog = programs[s];
      for (; pc[s] < prog.size(); ++pc[s], progress = true) {
        const Action& a = prog[pc[s]];
        if (is_recv(a.op)) {
          const double t = sent_at[peer_stage(a.op, s)][static_cast<int>(matching_op(a.op))][a.micro_batch];
          if (t < 0) break;
          clock[s] = std::max(clock[s], t);
        } else if (is_send(a.op)) {
          sent_at[s][static_cast<int>(a.op)][a.micro_batch] = clock[s];
        } else {
          const double cost = a.op == Op::Forward ? tf : tb;
          events.push_back({s, a.op, a.micro_batch, clock[s], clock[s] + cost});
          clock[s] += cost;
        }
      }
    }
  }
  std::stable_sort(events.begin(), events.end(), [](const TimelineEvent& x, const TimelineEvent& y) {
    return x.start_s != y.start_s ? x.start_s < y.start_s : x.stage < y.stage;
  });
  return events;
}

std::vector<double> bubble_fractions(const std::vector<TimelineEvent>& events, int stages) {
  check_stage_range(events, stages);
  std::vector<double> idle(stages, 0.0);
  const auto [t0, t1] = timeline_window(events);
  if (!(t1 > t0)) return idle;
  for (int s = 0; s < stages; ++s) {
    std::vector<std::pair<double, double>> busy;
    for (const TimelineEvent& e : events)
      if (e.stage == s && is_compute(e.op) && e.end_s > e.start_s) busy.emplace_back(e.start_s, e.end_s);
    std::sort(busy.begin(), busy.end());
    // Union of the intervals, so overlapping records (e.g. from two threads) count once.
    double total = 0, cur_begin = 0, cur_end = -1;
    bool open = false;
    for (const auto& [b, e] : busy) {
      if (open && b <= cur_end) {
        cur_end = std::max(cur_end, e);
        continue;
      }
      if (open) total += cur_end - cur_begin;
      cur_begin = b, cur_end = e, open = true;
    }
    if (open) total += cur_end - cur_begin;
    idle[s] = 1.0 - total / (t1 - t0);
  }
  return idle;
}

}  // namespace strata::parallel
