// Pipeline timelines (parallel::TimelineEvent, recorded by the executor or simulated) rendered
// for people: an ASCII chart for logs and an SVG for docs.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "parallel/pipeline/schedule.hpp"

namespace strata::io {

// ASCII chart: one row per stage, time quantised to `columns` characters; Forward of
// micro-batch i drawn as the digit i mod 10, Backward as the letter 'a' + i mod 10, idle as
// '.'; each row ends with the stage's idle fraction; a time axis and a legend follow.
std::string render_ascii(const std::vector<parallel::TimelineEvent>& events, int stages, int columns = 100);

// A standalone SVG document: one row per stage, one labelled rectangle per Forward/Backward
// event (forward blue, backward orange), a time axis in seconds and a legend.
std::string render_svg(const std::vector<parallel::TimelineEvent>& events, int stages);

// Writes the SVG of a step's `events` to `path` and returns the text for the log: what was
// written, the ASCII chart, and each stage's idle fraction beside the formula (P-1)/(m+P-1).
std::string write_timeline(const std::string& path, const std::vector<parallel::TimelineEvent>& events, int stages,
                           int64_t micro_batches, const std::string& schedule);

}  // namespace strata::io
