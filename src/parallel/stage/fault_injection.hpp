// Faults a test injects into a training step (train's --debug-* flags), in one place so the step
// reads as the step. Steps are numbered as logged: 1 is the first.
#pragma once

#include <cstdint>

#include "parallel/comm/communicator.hpp"

namespace strata::parallel {

struct FaultInjection {
  int64_t fail_step = -1;  // rank fail_rank throws during this step, after its backward
  int fail_rank = -1;
  int64_t overflow_step = -1;  // rank 0's gradients get an inf (a forced fp16 overflow)
  int64_t mismatch_step = -1;  // every rank issues one extra all-reduce, fail_rank an average
                               // where the others sum: the collective fingerprints differ
  double slow_ms = 0;          // rank fail_rank sleeps this long after every step's backward (a straggler)

  // After the step's backward: throws on the failing rank; sleeps on the slow one.
  void after_backward(int64_t step, int rank) const;
  // Whether this rank's gradients get an inf before the optimizer step.
  bool overflow(int64_t step, int rank) const { return step == overflow_step && rank == 0; }
  // Before the end-of-step agreement: the mismatched collective.
  void before_agreement(int64_t step, int rank, Communicator& world) const;
};

}  // namespace strata::parallel
