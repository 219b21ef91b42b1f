// Pipeline schedules: generation (GPipe, 1F1B, interleaved 1F1B), the checker that proves a set
// of stage programs matched and deadlock-free, the unit-cost timeline simulator, and the
// timeline renderers.
#include "parallel/pipeline/schedule.hpp"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <set>
#include <sstream>

#include "core/error.hpp"
#include "parallel/comm/communicator.hpp"

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

bool talks_to_next(Op op) { return op == Op::SendActivation || op == Op::RecvGrad; }

// "Forward(micro-batch 3)", with ", chunk 1" when the schedule has several chunks.
std::string item(Op op, int micro_batch, int chunk, int chunks) {
  return chunks > 1 ? detail::cat(to_string(op), "(micro-batch ", micro_batch, ", chunk ", chunk, ")")
                    : detail::cat(to_string(op), "(micro-batch ", micro_batch, ")");
}

std::string where(int stage, size_t position, const Action& a, int chunks) {
  return detail::cat("schedule: stage ", stage, ", position ", position, ", ",
                     item(a.op, a.micro_batch, a.chunk, chunks));
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
  if (name == "interleaved") return ScheduleKind::Interleaved;
  STRATA_THROW_INPUT("pipeline schedule: expected \"gpipe\", \"1f1b\" or \"interleaved\", got \"", name, "\"");
}

std::string to_string(ScheduleKind kind) {
  switch (kind) {
    case ScheduleKind::GPipe:
      return "gpipe";
    case ScheduleKind::OneFOneB:
      return "1f1b";
    case ScheduleKind::Interleaved:
      return "interleaved";
  }
  return "ScheduleKind(" + std::to_string(static_cast<int>(kind)) + ")";
}

StageChunk peer_of(Op send_or_recv, int stage, int chunk, int stages) {
  STRATA_CHECK(!is_compute(send_or_recv), "peer_of: ", to_string(send_or_recv), " talks to nobody");
  if (talks_to_next(send_or_recv)) return stage < stages - 1 ? StageChunk{stage + 1, chunk} : StageChunk{0, chunk + 1};
  return stage > 0 ? StageChunk{stage - 1, chunk} : StageChunk{stages - 1, chunk - 1};
}

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
  std::ostringstream os;
  os << name << a.micro_batch;
  if (a.chunk != 0) os << 'c' << a.chunk;
  return os.str();
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

std::vector<StageProgram> make_schedule(ScheduleKind kind, int stages, int micro_batches, int virtual_stages) {
  STRATA_REQUIRE(stages >= 1, "pipeline: need at least one stage, got ", stages);
  STRATA_REQUIRE(micro_batches >= 1, "pipeline: need at least one micro-batch, got ", micro_batches);
  const int p = stages, m = micro_batches, v = virtual_stages;
  if (kind == ScheduleKind::Interleaved) {
    STRATA_REQUIRE(v >= 1, "--virtual-stages must be at least 1, found ", v);
    STRATA_REQUIRE(m % p == 0, "--schedule interleaved needs the micro-batches per replica (", m,
                   ") to be a multiple of --pp (", p, ")");
    STRATA_REQUIRE(static_cast<int64_t>(v) * m <= kMaxTaggedMessages, "--schedule interleaved needs --virtual-stages (",
                   v, ") x micro-batches per replica (", m, ") <= ", kMaxTaggedMessages,
                   " to tag every message within MPI's tag range");
  } else {
    STRATA_REQUIRE(v == 1, "--virtual-stages ", v, " needs --schedule interleaved, found --schedule ", to_string(kind));
  }
  std::vector<StageProgram> programs(p);
  for (int s = 0; s < p; ++s) {
    StageProgram& prog = programs[s];
    // Receives right before the compute that needs them, sends right after the compute that
    // produced them: a send is never delayed behind a receive, so a neighbour waiting on it
    // is released as early as possible. Chunk c of stage s is virtual stage c*P + s.
    auto forward = [&](int i, int c) {
      if (s > 0 || c > 0) prog.push_back({Op::RecvActivation, i, c});
      prog.push_back({Op::Forward, i, c});
      if (s < p - 1 || c < v - 1) prog.push_back({Op::SendActivation, i, c});
    };
    auto backward = [&](int i, int c) {
      if (s < p - 1 || c < v - 1) prog.push_back({Op::RecvGrad, i, c});
      prog.push_back({Op::Backward, i, c});
      if (s > 0 || c > 0) prog.push_back({Op::SendGrad, i, c});
    };
    if (kind == ScheduleKind::GPipe) {
      // Backwards in micro-batch order 0..m-1, not reversed. With free communication both orders
      // take (m+P-1)(tf+tb) and hold m micro-batches, but this one accumulates gradients in the
      // same order as 1F1B and as a single stage with m accumulation steps, so the schedules
      // agree bit for bit (DESIGN.md, decision 5), and activations are freed first-in first-out.
      for (int i = 0; i < m; ++i) forward(i, 0);
      for (int i = 0; i < m; ++i) backward(i, 0);
      continue;
    }
    // 1F1B, and interleaved, which is 1F1B over the v*m (micro-batch, chunk) pairs, in
    // Megatron-LM's order (forward_backward_pipelining_with_interleaving): the k-th forward
    // runs micro-batch k/(P*v)*P + k%P of chunk k%(P*v)/P — chunk 0 forwards micro-batches
    // 0..P-1, then chunk 1 the same P (the last stage's chunk 0 has just handed micro-batch 0
    // back to stage 0's chunk 1), ..., then chunk 0 the next P; the k-th backward runs the same
    // micro-batch through the chunks in reverse (chunk v-1 first). With v = 1 both are k: 1F1B.
    const int total = v * m, group = p * v;
    const auto micro_of = [&](int k) { return k / group * p + k % p; };
    const auto forward_chunk = [&](int k) { return k % group / p; };
    const auto backward_chunk = [&](int k) { return v - 1 - k % group / p; };
    // Warm-up forwards before the first backward. 1F1B (v = 1): enough to fill the stages
    // below. Interleaved (v >= 2), Megatron's count: (v-1)*P, so that the last stage has
    // forwarded chunk v-1 of micro-batch 0 before its first backward, plus 2(P-s-1). With free
    // hand-offs P-s-1 would give the same step, but the extra forwards keep a stage busy while
    // a late message is on its way, so hand-off latency lengthens the step far less (a test
    // measures it), for P-s-1 more chunk micro-batches in flight. In steady state the forward
    // (and its SendActivation) comes before the RecvGrad: receiving first would still be
    // deadlock-free (sends never block) but would hold back the activation the next stage is
    // waiting for, lengthening the step (a test measures it); check_schedule proves the order
    // used here deadlock-free.
    const int warmup = std::min(v == 1 ? p - s - 1 : (v - 1) * p + 2 * (p - s - 1), total);
    for (int k = 0; k < warmup; ++k) forward(micro_of(k), forward_chunk(k));
    for (int k = 0; k < total - warmup; ++k) {
      forward(micro_of(warmup + k), forward_chunk(warmup + k));
      backward(micro_of(k), backward_chunk(k));
    }
    for (int k = total - warmup; k < total; ++k) backward(micro_of(k), backward_chunk(k));
  }
  check_schedule(programs);  // cheap, and generation bugs should never reach the executor
  return programs;
}

void check_schedule(const std::vector<StageProgram>& programs) {
  const int p = static_cast<int>(programs.size());
  STRATA_CHECK(p >= 1, "schedule: no stages");

  // Actions well formed; m = 1 + the largest micro-batch, v = 1 + the largest chunk.
  int m = 0, v = 0;
  for (int s = 0; s < p; ++s) {
    for (size_t pos = 0; pos < programs[s].size(); ++pos) {
      const Action& a = programs[s][pos];
      const int op = static_cast<int>(a.op);
      STRATA_CHECK(op >= 0 && op < kNumOps, "schedule: stage ", s, ", position ", pos, ": unknown op ", op);
      STRATA_CHECK(a.micro_batch >= 0, where(s, pos, a, 1), ": negative micro-batch");
      STRATA_CHECK(a.chunk >= 0, where(s, pos, a, 2), ": negative chunk");
      m = std::max(m, a.micro_batch + 1);
      v = std::max(v, a.chunk + 1);
    }
  }
  STRATA_CHECK(m >= 1, "schedule: no stage has any action");
  // Chunk c of stage s is virtual stage c*P + s; the pipe's ends are (0, 0) and (P-1, v-1).
  const auto first_virtual = [&](int s, int c) { return s == 0 && c == 0; };
  const auto last_virtual = [&](int s, int c) { return s == p - 1 && c == v - 1; };
  const std::string first_name = v > 1 ? "chunk 0 of the first stage" : "the first stage";
  const std::string last_name = v > 1 ? detail::cat("chunk ", v - 1, " of the last stage") : "the last stage";

  // at[s][op][c*m + i]: position of (op, i, c) on stage s, -1 when absent. Ends of the pipe
  // first, then duplicates.
  std::vector<std::array<std::vector<int>, kNumOps>> at(p);
  const auto slot = [&](int i, int c) { return static_cast<size_t>(c) * m + i; };
  for (int s = 0; s < p; ++s) {
    for (auto& ops : at[s]) ops.assign(static_cast<size_t>(v) * m, -1);
    for (size_t pos = 0; pos < programs[s].size(); ++pos) {
      const Action& a = programs[s][pos];
      if (first_virtual(s, a.chunk))
        STRATA_CHECK(a.op != Op::RecvActivation && a.op != Op::SendGrad, where(s, pos, a, v), ": ", first_name,
                     " has no previous stage to talk to");
      if (last_virtual(s, a.chunk))
        STRATA_CHECK(a.op != Op::SendActivation && a.op != Op::RecvGrad, where(s, pos, a, v), ": ", last_name,
                     " has no next stage to talk to");
      int& first = at[s][static_cast<int>(a.op)][slot(a.micro_batch, a.chunk)];
      STRATA_CHECK(first < 0, where(s, pos, a, v), ": duplicated, first at position ", first);
      first = static_cast<int>(pos);
    }
  }
  auto pos_of = [&](int s, Op op, int i, int c) { return at[s][static_cast<int>(op)][slot(i, c)]; };
  const std::string of_all = v > 1 ? detail::cat(" of the ", m, " micro-batches x ", v, " chunks")
                                   : detail::cat(" of the ", m, " micro-batches");

  // Every micro-batch forward and backward through every chunk of every stage.
  for (int s = 0; s < p; ++s) {
    for (int c = 0; c < v; ++c) {
      for (int i = 0; i < m; ++i) {
        STRATA_CHECK(pos_of(s, Op::Forward, i, c) >= 0, "schedule: stage ", s, " never runs ",
                     item(Op::Forward, i, c, v), of_all);
        STRATA_CHECK(pos_of(s, Op::Backward, i, c) >= 0, "schedule: stage ", s, " never runs ",
                     item(Op::Backward, i, c, v), of_all);
      }
    }
  }

  // Every send has its receive on the peer and vice versa (uniqueness was checked above; the
  // peer exists: the ends of the pipe were checked above).
  for (int s = 0; s < p; ++s) {
    for (size_t pos = 0; pos < programs[s].size(); ++pos) {
      const Action& a = programs[s][pos];
      if (is_compute(a.op)) continue;
      const StageChunk peer = peer_of(a.op, s, a.chunk, p);
      STRATA_CHECK(pos_of(peer.stage, matching_op(a.op), a.micro_batch, peer.chunk) >= 0, where(s, pos, a, v),
                   ": no matching ", item(matching_op(a.op), a.micro_batch, peer.chunk, v), " on stage ", peer.stage);
    }
  }

  // Order on each stage and chunk: recvA < F < sendA, F < B, recvG < B < sendG.
  for (int s = 0; s < p; ++s) {
    const auto& prog = programs[s];
    for (int c = 0; c < v; ++c) {
      for (int i = 0; i < m; ++i) {
        const int f = pos_of(s, Op::Forward, i, c), b = pos_of(s, Op::Backward, i, c);
        STRATA_CHECK(f < b, where(s, b, prog[b], v), ": runs before ", item(Op::Forward, i, c, v), " at position ", f);
        auto require_before = [&](Op op, int compute, const char* what) {
          const int x = pos_of(s, op, i, c);
          STRATA_CHECK(x >= 0, where(s, compute, prog[compute], v), ": no ", item(op, i, c, v), " ", what);
          STRATA_CHECK(x < compute, where(s, x, prog[x], v), ": must come before ", item(prog[compute].op, i, c, v),
                       " at position ", compute);
        };
        auto require_after = [&](Op op, int compute, const char* what) {
          const int x = pos_of(s, op, i, c);
          STRATA_CHECK(x >= 0, where(s, compute, prog[compute], v), ": no ", item(op, i, c, v), " ", what);
          STRATA_CHECK(x > compute, where(s, x, prog[x], v), ": must come after ", item(prog[compute].op, i, c, v),
                       " at position ", compute);
        };
        if (!first_virtual(s, c)) {
          require_before(Op::RecvActivation, f, "receives its input");
          require_after(Op::SendGrad, b, "sends its result to the previous stage");
        }
        if (!last_virtual(s, c)) {
          require_after(Op::SendActivation, f, "sends its result to the next stage");
          require_before(Op::RecvGrad, b, "receives its input");
        }
      }
    }
  }

  // Deadlock: run every stage as far as it can go. Sends never block and compute is local, so
  // a stage stops only at a receive whose send its peer has not issued yet; if every
  // unfinished stage is stopped like that, the real run would hang there too.
  std::vector<size_t> pc(p, 0);
  std::vector<std::array<std::vector<char>, kNumOps>> issued(p);
  for (auto& ops : issued)
    for (auto& x : ops) x.assign(static_cast<size_t>(v) * m, 0);
  const auto sent = [&](int s, const Action& a) -> char& {
    const StageChunk peer = peer_of(a.op, s, a.chunk, p);
    return issued[peer.stage][static_cast<int>(matching_op(a.op))][slot(a.micro_batch, peer.chunk)];
  };
  for (bool progress = true; progress;) {
    progress = false;
    for (int s = 0; s < p; ++s) {
      const auto& prog = programs[s];
      for (; pc[s] < prog.size(); ++pc[s], progress = true) {
        const Action& a = prog[pc[s]];
        if (is_recv(a.op) && !sent(s, a)) break;
        if (is_send(a.op)) issued[s][static_cast<int>(a.op)][slot(a.micro_batch, a.chunk)] = 1;
      }
    }
  }
  std::ostringstream blocked;
  for (int s = 0; s < p; ++s) {
    if (pc[s] == programs[s].size()) continue;
    const Action& a = programs[s][pc[s]];
    blocked << (blocked.tellp() > 0 ? "; " : "") << "stage " << s << " waits at position " << pc[s] << " on "
            << item(a.op, a.micro_batch, a.chunk, v) << " from stage " << peer_of(a.op, s, a.chunk, p).stage;
  }
  if (blocked.tellp() > 0) STRATA_THROW("schedule: deadlock: ", blocked.str());
}

int peak_in_flight(const StageProgram& program) {
  std::set<std::pair<int, int>> live;  // (micro-batch, chunk)
  size_t peak = 0;
  for (const Action& a : program) {
    if (a.op == Op::Forward) live.insert({a.micro_batch, a.chunk});
    if (a.op == Op::Backward) live.erase({a.micro_batch, a.chunk});
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

int message_tag(Op send_or_recv, int micro_batch, int chunk, int micro_batches) {
  STRATA_CHECK(micro_batch >= 0 && micro_batch < micro_batches, "message_tag: micro-batch ", micro_batch,
               " outside [0, ", micro_batches, ")");
  STRATA_CHECK(chunk >= 0, "message_tag: negative chunk ", chunk);
  const int64_t index = static_cast<int64_t>(chunk) * micro_batches + micro_batch;
  STRATA_CHECK(index < kMaxTaggedMessages, "message_tag: chunk ", chunk, " x ", micro_batches,
               " micro-batches + micro-batch ", micro_batch, " is past the ", kMaxTaggedMessages,
               " messages per direction that tags up to ", kMaxTag, " tell apart");
  return message_tag(send_or_recv, static_cast<int>(index));
}

std::vector<TimelineEvent> simulate_timeline(const std::vector<StageProgram>& programs, double tf, double tb,
                                             double latency) {
  STRATA_CHECK(tf >= 0 && tb >= 0 && latency >= 0, "simulate_timeline: negative cost tf=", tf, " tb=", tb,
               " latency=", latency);
  check_schedule(programs);  // guarantees the loop below finishes
  const int p = static_cast<int>(programs.size());
  int m = 0, v = 0;
  for (const auto& prog : programs)
    for (const Action& a : prog) m = std::max(m, a.micro_batch + 1), v = std::max(v, a.chunk + 1);

  // Same progression as the deadlock check, carrying each stage's clock; a receive completes
  // when both the stage reaches it and the message has arrived.
  std::vector<size_t> pc(p, 0);
  std::vector<double> clock(p, 0.0);
  // sent_at[s][op][c*m + i]: when stage s issued that send, -1 before.
  std::vector<std::array<std::vector<double>, kNumOps>> sent_at(p);
  for (auto& ops : sent_at)
    for (auto& x : ops) x.assign(static_cast<size_t>(v) * m, -1.0);
  const auto slot = [&](int i, int c) { return static_cast<size_t>(c) * m + i; };
  std::vector<TimelineEvent> events;
  for (bool progress = true; progress;) {
    progress = false;
    for (int s = 0; s < p; ++s) {
      const auto& prog = programs[s];
      for (; pc[s] < prog.size(); ++pc[s], progress = true) {
        const Action& a = prog[pc[s]];
        if (is_recv(a.op)) {
          const StageChunk peer = peer_of(a.op, s, a.chunk, p);
          const double t = sent_at[peer.stage][static_cast<int>(matching_op(a.op))][slot(a.micro_batch, peer.chunk)];
          if (t < 0) break;
          clock[s] = std::max(clock[s], t + latency);
        } else if (is_send(a.op)) {
          sent_at[s][static_cast<int>(a.op)][slot(a.micro_batch, a.chunk)] = clock[s];
        } else {
          const double cost = a.op == Op::Forward ? tf : tb;
          events.push_back({s, a.op, a.micro_batch, clock[s], clock[s] + cost, a.chunk});
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
