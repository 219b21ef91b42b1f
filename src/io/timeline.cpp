// Pipeline timelines rendered for people: an ASCII chart for logs, an SVG for docs.
#include "io/timeline.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>

#include "core/error.hpp"
#include "core/log.hpp"

namespace strata::io {

using parallel::Op;
using parallel::TimelineEvent;

namespace {

// Compact number formatting for axes and legends ("0.5", "12", "1.25e-05").
std::string fmt(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.4g", v);
  return buf;
}

// Event times to the microsecond: tools read the gaps between stages back from the SVG.
std::string fmt_us(double seconds) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.6f", seconds);
  return buf;
}

}  // namespace

std::string render_ascii(const std::vector<TimelineEvent>& events, int stages, int columns) {
  STRATA_CHECK(columns >= 1, "render_ascii: need at least one column, got ", columns);
  const std::vector<double> idle = parallel::bubble_fractions(events, stages);  // checks the stages first
  const auto [t0, t1] = parallel::timeline_window(events);
  const double span = t1 - t0;
  std::vector<std::string> rows(stages, std::string(columns, '.'));
  if (span > 0) {
    const double per_col = span / columns;
    for (const TimelineEvent& e : events) {
      if (!(e.op == Op::Forward || e.op == Op::Backward)) continue;
      // Edges round to the nearest column boundary, so back-to-back events tile without
      // overlapping; an event shorter than a column still gets one.
      int c0 = static_cast<int>(std::lround((e.start_s - t0) / per_col));
      int c1 = static_cast<int>(std::lround((e.end_s - t0) / per_col));
      c0 = std::clamp(c0, 0, columns - 1);
      c1 = std::clamp(std::max(c1, c0 + 1), c0 + 1, columns);
      const char mark = static_cast<char>((e.op == Op::Forward ? '0' : 'a') + e.micro_batch % 10);
      for (int c = c0; c < c1; ++c) rows[e.stage][c] = mark;
    }
  }
  const std::string last_label = "stage " + std::to_string(stages - 1);
  std::ostringstream os;
  for (int s = 0; s < stages; ++s) {
    std::string label = "stage " + std::to_string(s);
    label.resize(last_label.size(), ' ');
    char pct[16];
    std::snprintf(pct, sizeof pct, "%.1f%%", 100.0 * idle[s]);
    os << label << " |" << rows[s] << "| idle " << pct << '\n';
  }
  // Time axis: 0 under the first column, the span right-aligned under the last one.
  const std::string pad(last_label.size() + 2, ' ');
  const std::string end = fmt(span) + " s";
  std::string axis = "0";
  if (static_cast<int>(end.size()) + 1 < columns) axis += std::string(columns - 1 - end.size(), ' ') + end;
  os << pad << axis << '\n';
  os << "legend: 0-9 Forward of micro-batch i (digit i mod 10), a-j Backward of micro-batch i ('a' + i mod 10), "
        ". idle; 1 column = "
     << fmt(span / columns) << " s\n";
  return os.str();
}

std::string render_svg(const std::vector<TimelineEvent>& events, int stages) {
  const std::vector<double> idle = parallel::bubble_fractions(events, stages);  // checks the stages first
  const auto [t0, t1] = parallel::timeline_window(events);
  const double span = t1 > t0 ? t1 - t0 : 1.0;  // an empty chart still gets an axis
  constexpr double kLeft = 70, kTop = 40, kChartW = 900, kRowH = 28, kRowGap = 6, kRight = 90;
  const double chart_h = stages * (kRowH + kRowGap);
  const double width = kLeft + kChartW + kRight, height = kTop + chart_h + 70;
  auto x_of = [&](double t) { return kLeft + (t - t0) / span * kChartW; };
  const char* kForwardFill = "#4e79a7";
  const char* kBackwardFill = "#f28e2b";

  std::ostringstream os;
  os << "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n"
     << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << width << "\" height=\"" << height << "\" viewBox=\"0 0 "
     << width << ' ' << height << "\" font-family=\"sans-serif\" font-size=\"12\">\n"
     << "<title>Pipeline timeline: " << stages << " stages</title>\n"
     << "<rect x=\"0\" y=\"0\" width=\"" << width << "\" height=\"" << height << "\" fill=\"white\"/>\n";
  // Legend above the chart.
  os << "<rect x=\"" << kLeft << "\" y=\"12\" width=\"14\" height=\"14\" fill=\"" << kForwardFill << "\"/>\n"
     << "<text x=\"" << kLeft + 20 << "\" y=\"24\">forward (F + micro-batch)</text>\n"
     << "<rect x=\"" << kLeft + 200 << "\" y=\"12\" width=\"14\" height=\"14\" fill=\"" << kBackwardFill << "\"/>\n"
     << "<text x=\"" << kLeft + 220 << "\" y=\"24\">backward (B + micro-batch)</text>\n";
  for (int s = 0; s < stages; ++s) {
    const double y = kTop + s * (kRowH + kRowGap);
    char pct[16];
    std::snprintf(pct, sizeof pct, "%.1f%%", 100.0 * idle[s]);
    os << "<rect x=\"" << kLeft << "\" y=\"" << y << "\" width=\"" << kChartW << "\" height=\"" << kRowH
       << "\" fill=\"#eeeeee\"/>\n"
       << "<text x=\"" << kLeft - 8 << "\" y=\"" << y + kRowH / 2 + 4 << "\" text-anchor=\"end\">stage " << s
       << "</text>\n"
       << "<text x=\"" << kLeft + kChartW + 8 << "\" y=\"" << y + kRowH / 2 + 4 << "\">idle " << pct << "</text>\n";
  }
  for (const TimelineEvent& e : events) {
    if (!(e.op == Op::Forward || e.op == Op::Backward)) continue;
    const bool fwd = e.op == Op::Forward;
    const double x = x_of(e.start_s), w = std::max(x_of(e.end_s) - x, 0.5);
    const double y = kTop + e.stage * (kRowH + kRowGap);
    std::string label(1, fwd ? 'F' : 'B');
    label += std::to_string(e.micro_batch);
    os << "<g><title>stage " << e.stage << ' ' << label << ": " << fmt_us(e.start_s - t0) << " - "
       << fmt_us(e.end_s - t0) << " s</title><rect x=\"" << x << "\" y=\"" << y << "\" width=\"" << w << "\" height=\""
       << kRowH << "\" fill=\"" << (fwd ? kForwardFill : kBackwardFill) << "\" stroke=\"white\" stroke-width=\"1\"/>";
    // Labels only where they fit (about 7 px per character).
    if (w >= 7.0 * label.size() + 4)
      os << "<text x=\"" << x + w / 2 << "\" y=\"" << y + kRowH / 2 + 4 << "\" text-anchor=\"middle\" fill=\"white\">"
         << label << "</text>";
    os << "</g>\n";
  }
  // Time axis with about ten ticks at 1, 2 or 5 times a power of ten.
  const double axis_y = kTop + chart_h + 4;
  os << "<line x1=\"" << kLeft << "\" y1=\"" << axis_y << "\" x2=\"" << kLeft + kChartW << "\" y2=\"" << axis_y
     << "\" stroke=\"black\"/>\n";
  const double raw = span / 10, mag = std::pow(10.0, std::floor(std::log10(raw)));
  const double step = raw / mag < 1.5 ? mag : raw / mag < 3.5 ? 2 * mag : raw / mag < 7.5 ? 5 * mag : 10 * mag;
  for (int k = 0; k * step <= span * (1 + 1e-9); ++k) {
    const double x = kLeft + k * step / span * kChartW;
    os << "<line x1=\"" << x << "\" y1=\"" << axis_y << "\" x2=\"" << x << "\" y2=\"" << axis_y + 5
       << "\" stroke=\"black\"/><text x=\"" << x << "\" y=\"" << axis_y + 18 << "\" text-anchor=\"middle\">"
       << fmt(k * step) << "</text>\n";
  }
  os << "<text x=\"" << kLeft + kChartW / 2 << "\" y=\"" << axis_y + 38 << "\" text-anchor=\"middle\">time (s)</text>\n"
     << "</svg>\n";
  return os.str();
}

std::string write_timeline(const std::string& path, const std::vector<TimelineEvent>& events, int stages,
                           int64_t micro_batches, const std::string& schedule) {
  std::ofstream svg(path);
  svg << render_svg(events, stages);
  svg.close();
  if (svg.fail()) log::warn("--timeline: writing '", path, "' failed (", std::strerror(errno), ")");
  std::ostringstream os;
  os << "timeline of the last step (" << schedule << ", " << stages << " stages, " << micro_batches
     << " micro-batches) written to " << path << "\n"
     << render_ascii(events, stages) << "\nbubble (idle) fraction per stage:";
  for (double f : parallel::bubble_fractions(events, stages)) os << " " << f;
  os << "  (formula (P-1)/(m+P-1) = "
     << static_cast<double>(stages - 1) / static_cast<double>(micro_batches + stages - 1) << ")";
  return os.str();
}

}  // namespace strata::io
