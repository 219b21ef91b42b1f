// Pipeline schedules as data: the list of actions each pipeline stage runs for one training
// step, generated for GPipe or 1F1B (PipeDream-flush) and checked before anything runs —
// every send has its receive, every micro-batch goes forward and backward exactly once, and
// the programs cannot deadlock under the executor's execution model (below). Also measures an
// event timeline's idle fractions and simulates one for tests (io/timeline.hpp renders them).
//
// Execution model (what the pipeline executor does, and what check_schedule proves safe):
//  - The model's layers are cut into P contiguous stages, one per rank of a pipeline group;
//    a step's batch is split into m micro-batches, numbered 0..m-1.
//  - Each stage runs its program in order, one action at a time.
//  - Forward and Backward are local: they never wait on another rank.
//  - A send never blocks: it is an MPI_Isend from a buffer owned by that micro-batch (so no
//    later action overwrites it), completed lazily (waited on before the buffer is reused, at
//    the latest at the end of the step).
//  - A receive blocks until the neighbour has issued the matching send. Messages carry
//    message_tag(op, micro_batch), unique per (micro-batch, direction), so a receive matches
//    exactly its send whatever order the neighbour issues them in.
// Hence a program can only hang on a cycle of receives, which check_schedule finds by running
// all stages with program counters.
#pragma once

#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace strata::parallel {

// Activations flow from stage s to s+1, gradients from s+1 to s.
enum class Op { RecvActivation, Forward, SendActivation, RecvGrad, Backward, SendGrad };

struct Action {
  Op op;
  int micro_batch;
  bool operator==(const Action&) const = default;
};

// GPipe: all forwards, then all backwards. OneFOneB: PipeDream-flush (warm-up forwards, one
// forward / one backward in steady state, cool-down backwards): same bubble, less memory.
enum class ScheduleKind { GPipe, OneFOneB };

// "gpipe" or "1f1b"; an Input error naming the accepted values otherwise.
ScheduleKind parse_schedule_kind(std::string_view name);
std::string to_string(ScheduleKind kind);

// The actions of one stage, in execution order.
using StageProgram = std::vector<Action>;

// The programs of all stages (index = stage) for P = stages and m = micro_batches, both >= 1
// (an Input error otherwise; m < P and m == 1 are fine). Each receive sits immediately before
// the compute that needs it, each send immediately after the compute that produced it.
// GPipe runs its backwards in micro-batch order 0..m-1 (see schedule.cpp for why).
std::vector<StageProgram> make_schedule(ScheduleKind kind, int stages, int micro_batches);

// Throws strata::Error (Internal) naming stage, position, op and micro-batch unless the
// programs (P = programs.size() stages, m = 1 + the largest micro-batch seen) satisfy:
//  - each stage runs Forward and Backward of every micro-batch exactly once, Forward first;
//  - stage s > 0 receives activation i before Forward(i) and sends gradient i after
//    Backward(i); stage s < P-1 sends activation i after Forward(i) and receives gradient i
//    before Backward(i); the first stage has no RecvActivation/SendGrad, the last stage no
//    SendActivation/RecvGrad; no communication action is duplicated;
//  - every send has exactly one matching receive on the neighbour and vice versa;
//  - running the programs under the execution model above cannot deadlock; otherwise the
//    message lists, for every blocked stage, the receive it waits on.
void check_schedule(const std::vector<StageProgram>& programs);

// Activation memory of a stage, in micro-batches: the peak number whose Forward has run but
// whose Backward has not. GPipe: m; 1F1B: min(m, P - s) on stage s.
int peak_in_flight(const StageProgram& program);

// The MPI tag of a communication op for a micro-batch: 2*mb for activations, 2*mb+1 for
// gradients, so tags are distinct per (micro-batch, direction) and the send and receive of one
// message agree. Within the MPI-guaranteed tag range (32767) for micro-batches < 16384.
int message_tag(Op send_or_recv, int micro_batch);

// "F3", "B0", "recvA2", "sendA2", "recvG2", "sendG2".
std::string to_string(const Action& action);
// "Forward", "RecvActivation", ...
std::string to_string(Op op);
// One line per stage: "stage 0: F0 sendA0 F1 sendA1 recvG0 B0 ...".
std::string to_string(const std::vector<StageProgram>& programs);

// A recorded (or simulated) interval of work on a stage, in seconds. Only Forward and
// Backward events are drawn and count as busy time; others are allowed and ignored.
struct TimelineEvent {
  int stage;
  Op op;
  int micro_batch;
  double start_s, end_s;
};

// [first start, last end] over all events; {0, 0} when there are none.
std::pair<double, double> timeline_window(const std::vector<TimelineEvent>& events);

// Idle (bubble) fraction of each stage over [first start, last end] of all events: 1 minus the
// stage's Forward/Backward time (overlaps counted once) over the window. All zeros when there
// are no events or the window is empty.
std::vector<double> bubble_fractions(const std::vector<TimelineEvent>& events, int stages);

// The timeline of a (checked) schedule when every Forward takes tf, every Backward tb and
// communication is free: each action starts as soon as its stage is done with the previous
// one and, for a compute, its input has arrived. With these costs both GPipe and 1F1B take
// (m + P - 1)(tf + tb) per step, so every stage idles (P - 1) / (m + P - 1) of it.
std::vector<TimelineEvent> simulate_timeline(const std::vector<StageProgram>& programs, double tf = 1.0,
                                             double tb = 2.0);

}  // namespace strata::parallel
