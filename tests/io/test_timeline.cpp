// The timeline renderers (io/timeline.hpp) on simulated and hand-made pipeline timelines: the
// ASCII chart's rows, widths and idle fractions, and the SVG's structure and time resolution.
#include <gtest/gtest.h>

#include <iostream>
#include <sstream>

#include "io/timeline.hpp"

namespace strata::io {
namespace {

using parallel::make_schedule;
using parallel::ScheduleKind;
using parallel::simulate_timeline;
constexpr parallel::Op F = parallel::Op::Forward;

TEST(Timeline, RenderAsciiSmallGPipe) {
  // P=2, m=2, tf=1, tb=2: 9 time units, one column each.
  const auto events = simulate_timeline(make_schedule(ScheduleKind::GPipe, 2, 2), 1.0, 2.0);
  const std::string chart = render_ascii(events, 2, 9);
  std::cout << chart;
  std::istringstream in(chart);
  std::vector<std::string> lines;
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  ASSERT_EQ(lines.size(), 4u);  // two stages, the time axis, the legend
  EXPECT_EQ(lines[0], "stage 0 |01...aabb| idle 33.3%");
  EXPECT_EQ(lines[1], "stage 1 |.01aabb..| idle 33.3%");
  EXPECT_NE(lines[2].find("9 s"), std::string::npos) << lines[2];
  EXPECT_EQ(lines[3].rfind("legend:", 0), 0u);
  EXPECT_NE(lines[3].find("1 column = 1 s"), std::string::npos) << lines[3];
}

TEST(Timeline, RenderAsciiRowsHaveTheRequestedWidth) {
  const auto events = simulate_timeline(make_schedule(ScheduleKind::OneFOneB, 4, 6));
  const std::string chart = render_ascii(events, 4);
  std::cout << chart;
  std::istringstream in(chart);
  std::string line;
  for (int s = 0; s < 4; ++s) {
    ASSERT_TRUE(std::getline(in, line));
    EXPECT_EQ(line.rfind("stage " + std::to_string(s) + " |", 0), 0u) << line;
    const size_t open = line.find('|'), close = line.rfind('|');
    EXPECT_EQ(close - open - 1, 100u) << line;
    for (char c : std::string("012345abcdef")) EXPECT_NE(line.find(c, open), std::string::npos) << c << " in " << line;
  }
  // No events: an idle chart, not a crash.
  EXPECT_NE(render_ascii({}, 2, 10).find("stage 1 |..........|"), std::string::npos);
}

TEST(Timeline, RenderSvgStructure) {
  const auto events = simulate_timeline(make_schedule(ScheduleKind::OneFOneB, 3, 2));
  const std::string svg = render_svg(events, 3);
  auto count = [&](const std::string& needle) {
    size_t n = 0;
    for (size_t at = svg.find(needle); at != std::string::npos; at = svg.find(needle, at + 1)) ++n;
    return n;
  };
  EXPECT_EQ(svg.rfind("<?xml", 0), 0u);
  EXPECT_NE(svg.find("<svg xmlns=\"http://www.w3.org/2000/svg\""), std::string::npos);
  EXPECT_NE(svg.find("</svg>"), std::string::npos);
  for (int s = 0; s < 3; ++s) EXPECT_NE(svg.find("stage " + std::to_string(s) + "</text>"), std::string::npos);
  for (const char* label : {">F0<", ">F1<", ">B0<", ">B1<"}) EXPECT_EQ(count(label), 3u) << label;
  // One rectangle per event, plus the background, one lane per stage and two legend swatches.
  EXPECT_EQ(count("<rect"), events.size() + 1 + 3 + 2);
  EXPECT_NE(svg.find("time (s)"), std::string::npos);
  EXPECT_NE(svg.find("forward"), std::string::npos);
  EXPECT_NE(svg.find("backward"), std::string::npos);
  // Event times to the microsecond, for tools that read the hand-off gaps back.
  const std::string fine = render_svg({{0, F, 0, 0.0, 0.0123456}, {1, F, 0, 0.0123471, 0.5}}, 2);
  EXPECT_NE(fine.find("<title>stage 0 F0: 0.000000 - 0.012346 s</title>"), std::string::npos) << fine;
  EXPECT_NE(fine.find("<title>stage 1 F0: 0.012347 - 0.500000 s</title>"), std::string::npos) << fine;
}

}  // namespace
}  // namespace strata::io
