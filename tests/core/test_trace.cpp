// The trace recorder: spans record only while recording, nest on their thread with the step of
// the thread that recorded them, other threads record too, the cap stops recording and says so,
// and the JSON of each kind of event is what the Chrome trace-event format defines (parsed back
// with a minimal reader of the fields we check).
#include <gtest/gtest.h>

#include <thread>

#include "core/trace.hpp"

namespace strata::trace {
namespace {

TEST(Trace, SpansRecordOnlyWhileRecording) {
  take();
  { const Span off(Track::Compute, "off"); }
  set_recording(true);
  set_step(7);
  {
    Span outer(Track::Compute, "outer");
    outer.arg("micro", 2).arg("what", "a \"quoted\" name");
    { const Span inner(Track::Compute, "inner"); }
  }
  set_step(-1);
  std::thread([] { const Span loader(Track::Loader, "read batch"); }).join();
  set_recording(false);
  { const Span off(Track::Compute, "off again"); }
  bool cut = true;
  const std::vector<Event> events = take(&cut);
  EXPECT_FALSE(cut);
  ASSERT_EQ(events.size(), 3u);
  // Recorded when they end: the inner span first.
  EXPECT_EQ(events[0].name, "inner");
  EXPECT_EQ(events[1].name, "outer");
  EXPECT_EQ(events[1].args, "\"micro\":2,\"what\":\"a \\\"quoted\\\" name\"");
  EXPECT_LE(events[1].begin_ns, events[0].begin_ns);
  EXPECT_LE(events[0].end_ns, events[1].end_ns);
  EXPECT_EQ(events[0].step, 7);
  EXPECT_EQ(events[1].step, 7);
  EXPECT_EQ(events[2].track, Track::Loader);
  EXPECT_EQ(events[2].step, -1);  // the step is per thread
  EXPECT_TRUE(take().empty());
}

TEST(Trace, RecordingStopsAtTheCapAndSaysSo) {
  take();
  set_recording(true);
  for (size_t i = 0; i < kMaxEvents + 5; ++i) record(Event{});
  EXPECT_FALSE(recording());
  bool cut = false;
  EXPECT_EQ(take(&cut).size(), kMaxEvents);
  EXPECT_TRUE(cut);
}

TEST(Trace, JsonOfSpansOperationsAndMessages) {
  Event span{1'000'000, 1'250'500, Track::Compute, "fc1", "\"micro\":1", 3};
  Event op{2'000'000, 2'400'000, Track::Communication, "all_reduce sum dp", "\"bytes\":64", 3};
  Event send{3'000'000, 3'100'000, Track::Communication, "send pp to rank 1", "\"flow\":77", 3, 77, true};
  Event recv{3'000'000, 3'500'000, Track::Communication, "recv pp from rank 1", "\"flow\":78", 3, 78, false};
  // Times in us from the origin, after taking away this clock's offset from the reference.
  const std::string json = trace_json({span, op, send, recv}, 2, 500'000, 100'000);
  EXPECT_NE(json.find("{\"ph\":\"X\",\"pid\":2,\"ts\":400.000,\"cat\":\"compute\",\"name\":\"fc1\",\"dur\":250.500,"
                      "\"tid\":2,\"args\":{\"step\":3,\"micro\":1}}"),
            std::string::npos)
      << json;
  EXPECT_NE(json.find("{\"ph\":\"b\",\"pid\":2,\"ts\":1400.000,\"cat\":\"communication\",\"name\":\"all_reduce sum "
                      "dp\",\"id2\":{\"local\":\"1\"},\"args\":{\"step\":3,\"bytes\":64}}"),
            std::string::npos)
      << json;
  EXPECT_NE(json.find("{\"ph\":\"e\",\"pid\":2,\"ts\":1800.000,\"cat\":\"communication\",\"name\":\"all_reduce sum "
                      "dp\",\"id2\":{\"local\":\"1\"}}"),
            std::string::npos)
      << json;
  // A send's flow starts where it starts; a receive's ends where it was seen complete.
  EXPECT_NE(json.find("{\"ph\":\"s\",\"pid\":2,\"ts\":2400.000,\"cat\":\"communication\",\"name\":\"send pp to rank "
                      "1\",\"tid\":8,\"id\":77}"),
            std::string::npos)
      << json;
  EXPECT_NE(json.find("{\"ph\":\"f\",\"pid\":2,\"ts\":2900.000,\"cat\":\"communication\",\"name\":\"recv pp from "
                      "rank 1\",\"tid\":8,\"id\":78,\"bp\":\"e\"}"),
            std::string::npos)
      << json;
  const std::string meta = trace_metadata_json(2, "rank 2: stage 1");
  EXPECT_NE(meta.find("\"name\":\"process_name\",\"args\":{\"name\":\"rank 2: stage 1\"}"), std::string::npos);
  EXPECT_NE(meta.find("\"tid\":10,\"name\":\"thread_name\",\"args\":{\"name\":\"checkpoint writer thread\"}"),
            std::string::npos)
      << meta;
}

TEST(Trace, JsonStringsEscapeQuotesBackslashesAndControlCharacters) {
  EXPECT_EQ(json_string("a\"b\\c\n\x01"), "\"a\\\"b\\\\c\\u000a\\u0001\"");
}

}  // namespace
}  // namespace strata::trace
