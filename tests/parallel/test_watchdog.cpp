// Tests of the watchdog's parts that need no MPI: the flight recorder ring, the deadline of a
// wait (tiny timeouts, the expired hook instead of MPI_Abort), the collective fingerprints and
// the report of the first differing collective. The whole job (SIGSTOP, mismatch) is tested by
// tests/integration/cases_watchdog.py.
#include <gtest/gtest.h>

#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "core/error.hpp"
#include "core/trace.hpp"
#include "parallel/runtime/watchdog.hpp"

namespace strata::parallel::watchdog {
namespace {

std::shared_ptr<Channel> channel(const std::string& name, uint64_t key) {
  auto c = std::make_shared<Channel>();
  c->name = name;
  c->key = key;
  return c;
}

TEST(FlightRecorder, KeepsTheLast64InOrder) {
  FlightRecorder ring;
  const auto dp = channel("dp", 3);
  for (int i = 0; i < 100; ++i)
    ring.start(dp, i % 2 ? "all_reduce sum" : "send", 4 * i, DType::F32, i % 2 ? -1 : 1, i % 2);
  const std::vector<Record> all = ring.entries();
  ASSERT_EQ(all.size(), static_cast<size_t>(kRecorderSize));
  EXPECT_EQ(all.front().seq, 100u - kRecorderSize + 1);
  EXPECT_EQ(all.back().seq, 100u);
  EXPECT_EQ(all.back().bytes, 4 * 99);
  EXPECT_EQ(ring.find(10), nullptr);  // overwritten
  ASSERT_NE(ring.find(99), nullptr);
  EXPECT_FALSE(ring.find(99)->done);
  ring.complete(99);
  ring.complete(10);  // gone: no effect on the slot that now holds 74
  EXPECT_TRUE(ring.find(99)->done);
  EXPECT_FALSE(ring.find(74)->done);
  EXPECT_EQ(dp->collectives, 50u);  // only collectives count
  EXPECT_EQ(ring.find(100)->collective, 50u);
  EXPECT_EQ(ring.find(99)->collective, 0u);  // a message
  const std::string dump = ring.dump();
  EXPECT_NE(dump.find("#100 all_reduce sum of 396 B f32 on dp (collective 50 there)"), std::string::npos) << dump;
  EXPECT_NE(dump.find("#99 send of 392 B f32 on dp peer 1 started at"), std::string::npos) << dump;
  EXPECT_NE(dump.find("NOT completed"), std::string::npos);
  set_step(1411);
  {
    const InBucket bucket(3);
    ring.start(dp, "all_reduce sum", 4 << 20, DType::F32, -1, true);
  }
  ring.start(dp, "all_reduce sum", 8, DType::F32, -1, true);
  set_step(-1);
  EXPECT_EQ(describe(*ring.find(101)),
            "#101 all_reduce sum of 4.00 MiB f32 on dp (collective 51 there, bucket 3 of step 1412)");
  EXPECT_EQ(describe(*ring.find(102)), "#102 all_reduce sum of 8 B f32 on dp (collective 52 there, step 1412)");
}

TEST(Fingerprint, DependsOnEveryFieldAndTheOrder) {
  const auto hash_of = [](std::vector<std::tuple<const char*, int64_t, DType, int>> ops) {
    FlightRecorder ring;
    const auto c = channel("dp", 1);
    for (auto [op, bytes, dtype, root] : ops) ring.start(c, op, bytes, dtype, root, true);
    return c->hash;
  };
  const uint64_t base = hash_of({{"all_reduce sum", 64, DType::F32, -1}, {"broadcast", 8, DType::I32, 0}});
  EXPECT_EQ(base, hash_of({{"all_reduce sum", 64, DType::F32, -1}, {"broadcast", 8, DType::I32, 0}}));
  EXPECT_NE(base, hash_of({{"broadcast", 8, DType::I32, 0}, {"all_reduce sum", 64, DType::F32, -1}}));
  EXPECT_NE(base, hash_of({{"all_reduce avg", 64, DType::F32, -1}, {"broadcast", 8, DType::I32, 0}}));
  EXPECT_NE(base, hash_of({{"all_reduce sum", 32, DType::F32, -1}, {"broadcast", 8, DType::I32, 0}}));
  EXPECT_NE(base, hash_of({{"all_reduce sum", 64, DType::BF16, -1}, {"broadcast", 8, DType::I32, 0}}));
  EXPECT_NE(base, hash_of({{"all_reduce sum", 64, DType::F32, -1}, {"broadcast", 8, DType::I32, 1}}));
}

// Rows of 3 ranks: rank 0 and 1 share channel 5 (dp of stage 0), rank 2 has channel 7 alone, all
// three share channel 9 (world).
std::vector<double> rows(double hash_of_rank1_on_5) {
  std::vector<double> r(3 * kFingerprintValues, 0.0);
  const auto put = [&](int rank, int slot, double key, double hash, double count) {
    double* v = &r[static_cast<size_t>(rank * kFingerprintValues + 3 * slot)];
    v[0] = key, v[1] = hash, v[2] = count;
  };
  put(0, 0, 9, 111, 4), put(1, 0, 9, 111, 4), put(2, 0, 9, 111, 4);
  put(0, 1, 5, 222, 10), put(1, 1, 5, hash_of_rank1_on_5, 10);
  put(2, 1, 7, 333, 12);  // a different group may do anything
  return r;
}

TEST(Fingerprint, ComparesMembersOfTheSameCommunicatorOnly) {
  uint64_t key = 0;
  int a = -1, b = -1;
  EXPECT_FALSE(compare_fingerprints(rows(222), 3, key, a, b));
  ASSERT_TRUE(compare_fingerprints(rows(223), 3, key, a, b));
  EXPECT_EQ(key, 5u);
  EXPECT_EQ(a, 0);
  EXPECT_EQ(b, 1);
}

TEST(Fingerprint, ReportsTheFirstDifferingCollectiveOfBothSides) {
  const auto side = [](const char* fourth) {
    FlightRecorder ring;
    const auto world = channel("world", 9);
    set_step(6);
    for (int i = 0; i < 6; ++i) ring.start(world, i == 3 ? fourth : "all_gather", 16, DType::U8, -1, true);
    set_step(-1);
    return ring.entries();
  };
  const std::string report = first_difference(side("all_gather"), 0, side("all_reduce avg"), 1);
  EXPECT_EQ(report,
            "collective 4 on world differs: rank 0 #4 all_gather of 16 B u8 on world (collective 4 there, step 7); "
            "rank 1 #4 all_reduce avg of 16 B u8 on world (collective 4 there, step 7)");
  std::vector<Record> shorter = side("all_gather");
  shorter.pop_back();
  const std::string extra = first_difference(shorter, 0, side("all_gather"), 1);
  EXPECT_NE(extra.find("collective 6 on world differs: rank 1 #6 all_gather"), std::string::npos) << extra;
  EXPECT_NE(extra.find("rank 0 issued no collective 6 there"), std::string::npos) << extra;
}

// A message's flow id is computed alike by its sender and its receiver (here one process playing
// world ranks 0 and 1), differs from message to message, and is exact in a JSON number; while
// recording, a completed operation is a trace event, a wait a span, and waits add up per group.
TEST(Trace, MessagesShareFlowIdsAndWaitsAreCounted) {
  auto pp = channel("pp", 9);
  pp->world_ranks = {0, 1};
  const int saved = process_rank();
  set_process_rank(0);
  const uint64_t send1 = started(pp, "send", 64, DType::F32, 1, false, 4);
  const uint64_t send2 = started(pp, "send", 64, DType::F32, 1, false, 4);
  const uint64_t other_tag = started(pp, "send", 64, DType::F32, 1, false, 5);
  const uint64_t flow1 = recorder().find(send1)->flow, flow2 = recorder().find(send2)->flow;
  set_process_rank(1);
  trace::take();
  trace::set_recording(true);
  const uint64_t recv1 = started(pp, "recv", 64, DType::F32, 0, false, 4);
  {
    Wait wait(recv1);
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  completed(recv1);
  completed(recv1);  // a second completion (a handle's wait, then its destructor) adds nothing
  const uint64_t recv2 = started(pp, "recv", 64, DType::F32, 0, false, 4);
  trace::set_recording(false);
  set_process_rank(saved);
  EXPECT_NE(flow1, flow2);
  EXPECT_NE(recorder().find(other_tag)->flow, flow1);
  EXPECT_EQ(recorder().find(recv1)->flow, flow1);
  EXPECT_EQ(recorder().find(recv2)->flow, flow2);
  EXPECT_LT(flow1, uint64_t{1} << 53);
  const uint64_t collective = started(pp, "all_reduce sum", 64, DType::F32, -1, true);
  EXPECT_EQ(recorder().find(collective)->flow, 0u);  // collectives have none

  const std::vector<trace::Event> events = trace::take();
  ASSERT_EQ(events.size(), 2u);  // the wait's span, then the receive in flight
  EXPECT_EQ(events[0].track, trace::Track::Wait);
  EXPECT_EQ(events[0].name, "wait: recv pp");
  EXPECT_GE(events[0].end_ns - events[0].begin_ns, 20'000'000);
  EXPECT_EQ(events[1].track, trace::Track::Communication);
  EXPECT_EQ(events[1].name, "recv pp from rank 0");
  EXPECT_EQ(events[1].flow, flow1);
  EXPECT_FALSE(events[1].flow_out);
  EXPECT_NE(events[1].args.find("\"peer\":0"), std::string::npos) << events[1].args;
  EXPECT_GE(pp->waited_s, 0.02);  // what waited_seconds() sums over the registered channels
}

std::vector<std::string> g_expired;
void on_expired(const std::string& line) { g_expired.push_back(line); }

TEST(Deadline, FiresOnceAfterTheTimeoutAndNotBefore) {
  set_expired_hook(on_expired);
  set_timeout(0.2);
  const uint64_t seq = started(channel("pp", 2), "recv", 4096, DType::F32, 1, false);
  using clock = std::chrono::steady_clock;
  {  // completes in time: nothing
    Wait wait(seq);
    const auto until = clock::now() + std::chrono::milliseconds(50);
    while (clock::now() < until) poll();
  }
  EXPECT_TRUE(g_expired.empty());
  EXPECT_EQ(current_wait(), nullptr);
  const auto start = clock::now();
  {
    Wait wait(seq);
    while (g_expired.empty() && clock::now() - start < std::chrono::seconds(5)) poll();
    for (int i = 0; i < 1000; ++i) poll();  // past the deadline: still one report
  }
  const double waited = std::chrono::duration<double>(clock::now() - start).count();
  ASSERT_EQ(g_expired.size(), 1u);
  EXPECT_GE(waited, 0.2);
  EXPECT_LT(waited, 1.0);
  EXPECT_NE(g_expired[0].find("watchdog: #" + std::to_string(seq) + " recv of 4.00 KiB f32 on pp peer 1"),
            std::string::npos)
      << g_expired[0];
  EXPECT_NE(g_expired[0].find("not complete after 0.2 s (--timeout 0.2)"), std::string::npos) << g_expired[0];
  {  // AtLeast lengthens the deadline for checkpoint I/O and restores it
    const AtLeast io(10);
    EXPECT_EQ(timeout(), 10);
  }
  EXPECT_EQ(timeout(), 0.2);
  set_expired_hook(nullptr);
  set_timeout(kSetupTimeoutS);
}

}  // namespace
}  // namespace strata::parallel::watchdog
