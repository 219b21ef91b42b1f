// TraceSession under real MPI (2 and 4 ranks): the clock offsets measured on one node are small
// and their round trips positive; recording follows the step window; a message between ranks
// appears on both sides with one flow id (computed independently by sender and receiver); rank 0
// writes one file holding every rank's process and events, and the others write nothing.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <regex>
#include <set>
#include <sstream>

#include "core/trace.hpp"
#include "parallel/mpi_world.hpp"
#include "parallel/runtime/host_values.hpp"
#include "parallel/runtime/trace_collect.hpp"

namespace strata::parallel {
namespace {

using namespace testing_world;

TEST(TraceCollect, ClockOffsetsOnOneNodeAreSmall) {
  MpiCommunicator world(MPI_COMM_WORLD, "world");
  const ClockOffset c = measure_clock_offset(world);
  if (world.rank() == 0) {
    EXPECT_EQ(c.offset_ns, 0);
    EXPECT_EQ(c.rtt_ns, 0);
  } else {
    EXPECT_GT(c.rtt_ns, 0);
    EXPECT_LT(std::abs(c.offset_ns), 1'000'000);  // one CLOCK_MONOTONIC: the error, well below 1 ms
  }
}

std::string read_file(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

TEST(TraceCollect, OneFileWithEveryRankAndMatchingMessages) {
  MpiCommunicator world(MPI_COMM_WORLD, "world");
  const std::string dir = "trace-test-" + std::to_string(broadcast_value(world, getpid(), 0));
  if (world.rank() == 0) std::filesystem::create_directories(dir);
  world.barrier();
  const std::string path = dir + "/t.json";
  {
    TraceSession session(world, path, 2, 3, "rank " + std::to_string(world.rank()));
    const Tensor t = Tensor::zeros({16});
    for (int64_t step = 1; step <= 4; ++step) {
      session.begin_step(step);
      trace::set_step(step);
      const trace::Span span(trace::Track::Step, "step " + std::to_string(step));
      // A ring of messages: each rank sends to the next and receives from the previous.
      const int next = (world.rank() + 1) % world.size(), previous = (world.rank() + world.size() - 1) % world.size();
      WorkPtr sent = world.send_async(t, next, 5);
      world.recv(t, previous, 5);
      sent->wait();
    }
    trace::set_step(-1);
    const std::string summary = session.write();
    EXPECT_EQ(summary.empty(), world.rank() != 0) << summary;
  }
  world.barrier();
  if (world.rank() == 0) {
    const std::string json = read_file(path);
    EXPECT_FALSE(std::filesystem::exists(path + ".tmp"));
    for (int r = 0; r < world.size(); ++r)
      EXPECT_NE(json.find("\"args\":{\"name\":\"rank " + std::to_string(r) + "\"}"), std::string::npos) << r;
    // Steps 2 and 3 only, on every rank.
    const std::regex step_span("\"cat\":\"step\",\"name\":\"step (\\d)\"");
    std::multiset<std::string> steps;
    for (auto it = std::sregex_iterator(json.begin(), json.end(), step_span); it != std::sregex_iterator(); ++it)
      steps.insert((*it)[1]);
    EXPECT_EQ(steps.count("2"), static_cast<size_t>(world.size()));
    EXPECT_EQ(steps.count("3"), static_cast<size_t>(world.size()));
    EXPECT_EQ(steps.size(), static_cast<size_t>(2 * world.size()));
    // Each flow id starts once (a send) and ends once (its receive): 2 steps x ranks messages.
    const std::regex flow("\"ph\":\"([sf])\".*?\"id\":(\\d+)");
    std::set<std::string> starts, ends;
    for (auto it = std::sregex_iterator(json.begin(), json.end(), flow); it != std::sregex_iterator(); ++it)
      EXPECT_TRUE(((*it)[1] == "s" ? starts : ends).insert((*it)[2]).second) << (*it)[0];
    EXPECT_EQ(starts.size(), static_cast<size_t>(2 * world.size()));
    EXPECT_EQ(starts, ends);
    EXPECT_NE(json.find("\"otherData\":{\"producer\":\"strata train --trace\",\"steps\":\"2:3\",\"ranks\":" +
                        std::to_string(world.size())),
              std::string::npos);
    std::filesystem::remove_all(dir);
  }
  EXPECT_FALSE(trace::recording());
}

}  // namespace
}  // namespace strata::parallel
