// strata-events: the events of TensorBoard event files as JSON lines (what train --tensorboard
// wrote, or any TensorBoard writer's scalars), to read them without TensorBoard.
//   strata-events FILE...
// One object per event: {"file": F, "wall_time": T, "step": N} plus "file_version" and "writer"
// (a file's first event), "session": "START" (a run's start), or each scalar as "TAG": VALUE
// (float32, printed to round-trip; NaN and infinities as Python's json writes them). A truncated
// or corrupt record is one line on stderr naming the file and byte, exit code 2.
#include <cmath>
#include <cstdio>
#include <iostream>
#include <string>

#include "core/error.hpp"
#include "core/trace.hpp"
#include "io/tensorboard.hpp"

namespace {

using strata::trace::json_string;  // the trace files' escaping: one JSON string writer

std::string json_number(double v) {
  if (std::isnan(v)) return "NaN";
  if (std::isinf(v)) return v > 0 ? "Infinity" : "-Infinity";
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.17g", v);
  return buf;
}

}  // namespace

int main(int argc, char** argv) {
  using namespace strata;
  if (argc < 2 || std::string(argv[1]) == "--help" || std::string(argv[1]) == "-h") {
    std::cout << "usage: strata-events FILE...\n  prints each TensorBoard event as one JSON object a line\n";
    return argc < 2 ? 2 : 0;
  }
  try {
    for (int i = 1; i < argc; ++i) {
      for (const io::TensorBoardEvent& e : io::read_tensorboard_events(argv[i])) {
        std::string line = "{\"file\": " + json_string(argv[i]) + ", \"wall_time\": " + json_number(e.wall_time) +
                           ", \"step\": " + std::to_string(e.step);
        if (!e.file_version.empty()) line += ", \"file_version\": " + json_string(e.file_version);
        if (!e.writer.empty()) line += ", \"writer\": " + json_string(e.writer);
        if (e.session_status == io::kSessionStart) line += ", \"session\": \"START\"";
        char value[32];
        for (const io::TensorBoardScalar& s : e.scalars) {
          std::snprintf(value, sizeof value, "%.9g", static_cast<double>(s.value));  // 9 digits: a float32 exactly
          line += ", " + json_string(s.tag) + ": " + (std::isfinite(s.value) ? value : json_number(s.value));
        }
        std::cout << line << "}\n";
      }
    }
    return 0;
  } catch (const Error& e) {
    std::cout << std::flush;
    std::cerr << "strata-events: error: " << e.what() << "\n";
    return e.kind() == ErrorKind::Input ? 2 : 1;
  }
}
