// Pipeline schedules as data: the list of actions each pipeline stage runs for one training
// step, generated for GPipe, 1F1B (PipeDream-flush) or interleaved 1F1B (Megatron-LM's) and
// checked before anything runs — every send has its receive, every micro-batch goes forward
// and backward exactly once through every chunk, and the programs cannot deadlock under the
// executor's execution model (below). Also measures an event timeline's idle fractions and
// simulates one for tests (io/timeline.hpp renders them).
//
// Execution model (what the pipeline executor does, and what check_schedule proves safe):
//  - The model's layers are cut into P·v contiguous virtual stages; rank s of a pipeline group
//    of P holds v of them, its chunks: chunk c is virtual stage c·P + s. GPipe and 1F1B have
//    v = 1 (chunk 0 = the stage); interleaved has v >= 1. A step's batch is split into m
//    micro-batches, numbered 0..m-1.
//  - Activations go from virtual stage j to j+1: rank s chunk c -> rank s+1 chunk c for
//    s < P-1, rank P-1 chunk c -> rank 0 chunk c+1 (peer_of); gradients the reverse way.
//  - Each stage runs its program in order, one action at a time.
//  - Forward and Backward are local: they never wait on another rank.
//  - A send never blocks: it is an MPI_Isend from a buffer owned by that micro-batch and chunk
//    (so no later action overwrites it), completed lazily (waited on before the buffer is
//    reused, at the latest at the end of the step).
//  - A receive blocks until the neighbour has issued the matching send. Messages carry
//    message_tag(op, micro_batch, sending chunk, m), unique per (micro-batch, chunk,
//    direction), so a receive matches exactly its send whatever order the neighbour issues
//    them in. (With P = 1 and v > 1 a chunk's "message" to the next chunk of the same rank is
//    handed over in memory by the executor.)
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

// `chunk`: which of the stage's model chunks runs it (always 0 but for interleaved).
struct Action {
  Op op;
  int micro_batch;
  int chunk = 0;
  bool operator==(const Action&) const = default;
};

// GPipe: all forwards, then all backwards. OneFOneB: PipeDream-flush (warm-up forwards, one
// forward / one backward in steady state, cool-down backwards): same bubble, less memory.
// Interleaved: 1F1B over v chunks per stage in Megatron-LM's order (schedule.cpp): the bubble
// shrinks to (P-1)/(v·m+P-1) of the step for v times the messages.
enum class ScheduleKind { GPipe, OneFOneB, Interleaved };

// "gpipe", "1f1b" or "interleaved"; an Input error naming the accepted values otherwise.
ScheduleKind parse_schedule_kind(std::string_view name);
std::string to_string(ScheduleKind kind);

// The actions of one stage, in execution order.
using StageProgram = std::vector<Action>;

// The programs of all stages (index = stage) for P = stages, m = micro_batches and v =
// virtual_stages (chunks per stage), P and m >= 1 (an Input error otherwise; m < P and m == 1
// are fine but for interleaved). Each receive sits immediately before the compute that needs
// it, each send immediately after the compute that produced it. GPipe runs its backwards in
// micro-batch order 0..m-1 (see schedule.cpp for why). Interleaved needs m a multiple of P
// (Megatron's rule: its chunks take turns in groups of P micro-batches), v >= 1 and v·m <=
// kMaxTaggedMessages, one-line Input errors naming the flags otherwise; with v = 1 it is 1F1B,
// action for action. GPipe and 1F1B take only v = 1.
std::vector<StageProgram> make_schedule(ScheduleKind kind, int stages, int micro_batches, int virtual_stages = 1);

// The (stage, chunk) that a communication op of `chunk` on `stage` talks to, in a pipeline of
// `stages` stages: the next virtual stage for SendActivation/RecvGrad, the previous one for
// RecvActivation/SendGrad (see the execution model). The caller makes sure there is one.
struct StageChunk {
  int stage, chunk;
  bool operator==(const StageChunk&) const = default;
};
StageChunk peer_of(Op send_or_recv, int stage, int chunk, int stages);

// Throws strata::Error (Internal) naming stage, position, op, micro-batch (and chunk, when
// there are several) unless the programs (P = programs.size() stages, m = 1 + the largest
// micro-batch seen, v = 1 + the largest chunk seen) satisfy:
//  - each stage runs Forward and Backward of every (micro-batch, chunk) exactly once, Forward
//    first;
//  - every chunk but the first virtual stage's (stage 0, chunk 0) receives activation i before
//    Forward(i) and sends gradient i after Backward(i); every chunk but the last virtual
//    stage's (stage P-1, chunk v-1) sends activation i after Forward(i) and receives gradient
//    i before Backward(i); the first virtual stage has no RecvActivation/SendGrad, the last no
//    SendActivation/RecvGrad; no communication action is duplicated;
//  - every send has exactly one matching receive on its peer_of (stage, chunk) and vice versa;
//  - running the programs under the execution model above cannot deadlock; otherwise the
//    message lists, for every blocked stage, the receive it waits on.
void check_schedule(const std::vector<StageProgram>& programs);

// Activation memory of a stage, in chunk micro-batches: the peak number of (micro-batch, chunk)
// pairs whose Forward has run but whose Backward has not. GPipe: m; 1F1B: min(m, P - s) on
// stage s; interleaved (v >= 2): min(v·m, (v-1)·P + 2(P - s - 1) + 1), each holding about 1/v
// of the stage's activations.
int peak_in_flight(const StageProgram& program);

// The MPI tag of a communication op for a micro-batch of chunk 0 (GPipe, 1F1B): 2*mb for
// activations, 2*mb+1 for gradients, so tags are distinct per (micro-batch, direction) and the
// send and receive of one message agree. Within the MPI-guaranteed tag range (32767) for
// micro-batches < 16384.
int message_tag(Op send_or_recv, int micro_batch);
// With chunks: 2(chunk·m + mb) for activations, one more for gradients, where `chunk` is the
// SENDING chunk (a receive passes its peer_of's chunk) and m = micro_batches; equal to the above
// for chunk 0. Between two ranks the sending chunk fixes the receiving one, so tags are
// distinct per (micro-batch, chunk, direction). The largest is 2·v·m - 1, within MPI's 32767
// while v·m <= kMaxTaggedMessages.
int message_tag(Op send_or_recv, int micro_batch, int chunk, int micro_batches);
constexpr int kMaxTaggedMessages = 16384;  // (32767 + 1) / 2 directions

// "F3", "B0", "recvA2", "sendA2", "recvG2", "sendG2"; a chunk other than 0 is appended:
// "F3c1", "sendG2c1".
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
  int chunk = 0;
};

// [first start, last end] over all events; {0, 0} when there are none.
std::pair<double, double> timeline_window(const std::vector<TimelineEvent>& events);

// Idle (bubble) fraction of each stage over [first start, last end] of all events: 1 minus the
// stage's Forward/Backward time (overlaps counted once) over the window. All zeros when there
// are no events or the window is empty.
std::vector<double> bubble_fractions(const std::vector<TimelineEvent>& events, int stages);

// The timeline of a (checked) schedule when every Forward (of one chunk) takes tf, every
// Backward tb and a message arrives `latency` after its send (a send itself takes no time):
// each action starts as soon as its stage is done with the previous one and, for a receive,
// the message has arrived. With free communication GPipe and 1F1B take (m + P - 1)(tf + tb)
// per step, so every stage idles (P - 1) / (m + P - 1) of it; interleaved takes
// (v·m + P - 1)(tf + tb), idling (P - 1) / (v·m + P - 1) (test_schedule).
std::vector<TimelineEvent> simulate_timeline(const std::vector<StageProgram>& programs, double tf = 1.0,
                                             double tb = 2.0, double latency = 0.0);

}  // namespace strata::parallel
