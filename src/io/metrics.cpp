#include "io/metrics.hpp"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <utility>

#include "core/error.hpp"
#include "core/log.hpp"

namespace strata::io {

void require_writable_file(const std::string& path, const std::string& flag) {
  namespace fs = std::filesystem;
  std::error_code ec;  // the error_code forms: a name too long is this line's error, not an exception's
  STRATA_REQUIRE(!fs::is_directory(path, ec), flag, " must name a file, found the directory '", path, "'");
  const bool existed = fs::exists(path, ec);
  STRATA_REQUIRE(std::ofstream(path, std::ios::app).good(), flag, ": cannot write '", path,
                 "': ", std::strerror(errno));
  if (!existed) fs::remove(path, ec);  // --timeline writes it later; --metrics appends to it
}

MetricsWriter::MetricsWriter(std::string path, const std::string& tensorboard_dir,
                             std::optional<int64_t> continues_from)
    : path_(std::move(path)) {
  if (!tensorboard_dir.empty()) tensorboard_.emplace(tensorboard_dir, continues_from);
}

void MetricsWriter::append(const ProgressRecord& r) {
  if (path_.empty() && !tensorboard_) return;
  char split[160] = "null", mfu[32] = "null", tokens[48] = "";
  if (r.split)
    std::snprintf(split, sizeof split, "{\"compute\": %.4f, \"comm\": %.4f, \"pipeline\": %.4f, \"data\": %.4f}",
                  r.split->compute, r.split->comm, r.split->pipeline, r.split->data);
  if (r.mfu) std::snprintf(mfu, sizeof mfu, "%.4f", *r.mfu);
  if (r.tokens_per_s > 0) std::snprintf(tokens, sizeof tokens, ", \"tokens_per_s\": %.1f", r.tokens_per_s);
  std::string straggler = "null";
  if (r.straggler)  // the host as MPI names it: no quotes or backslashes to escape
    straggler = detail::cat("{\"rank\": ", r.straggler->rank, ", \"host\": \"", r.straggler->host,
                            "\", \"slower\": ", r.straggler->slower, ", \"cause\": \"", r.straggler->cause, "\"}");
  char json[4096];  // room for any finite double in %f (up to 317 characters each)
  std::snprintf(json, sizeof json,
                "{\"step\": %lld, \"epoch\": %lld, \"loss\": %.6f, \"lr\": %.6g, \"samples_per_s\": %.1f%s, "
                "\"step_time_s\": %.6f, \"split\": %s, \"tflops_per_rank\": %.6g, \"mfu\": %s, "
                "\"dp_bytes_per_step\": %lld, \"tp_bytes_per_step\": %lld, \"peak_bytes\": %lld, \"eta_s\": %.1f, "
                "\"straggler\": %s}\n",
                static_cast<long long>(r.step), static_cast<long long>(r.epoch), r.loss, r.lr, r.samples_per_s, tokens,
                r.step_time_s, split, r.tflops_per_rank, mfu, static_cast<long long>(r.dp_bytes_per_step),
                static_cast<long long>(r.tp_bytes_per_step), static_cast<long long>(r.peak_bytes), r.eta_s,
                straggler.c_str());
  write(json);
}

void MetricsWriter::append(const EvalRecord& r) {
  if (path_.empty() && !tensorboard_) return;
  char perplexity[64] = "";
  if (r.tokens) std::snprintf(perplexity, sizeof perplexity, ", \"eval_perplexity\": %.4f", std::exp(r.loss));
  char json[1024];
  std::snprintf(json, sizeof json,
                "{\"step\": %lld, \"eval\": \"%s\", \"eval_loss\": %.6f, \"eval_accuracy\": %.6f%s, "
                "\"eval_samples\": %lld}\n",
                static_cast<long long>(r.step), r.what.c_str(), r.loss, r.accuracy, perplexity,
                static_cast<long long>(r.samples));
  write(json);
}

void MetricsWriter::write(const char* json) {
  if (tensorboard_) tensorboard_->write(tensorboard_event(json));
  if (path_.empty()) return;
  std::ofstream out(path_, std::ios::app);
  out << json;
  out.flush();
  if (!out.good() && !lost_) {  // metrics are lost, not the training: warn once, go on
    lost_ = true;
    log::warn("--metrics: cannot write '", path_, "' (", std::strerror(errno), "): its lines are being lost");
  }
}

void MetricsWriter::drop_after(int64_t step) const {
  if (path_.empty()) return;
  std::ifstream in(path_);
  std::string kept, line;
  bool dropped = false;
  while (std::getline(in, line)) {
    long long logged = 0;
    if (std::sscanf(line.c_str(), "{\"step\": %lld", &logged) == 1 && logged > step) {
      dropped = true;
      continue;
    }
    kept += line + "\n";
  }
  if (!dropped) return;
  const std::string tmp = path_ + ".tmp";
  std::ofstream out(tmp, std::ios::trunc);
  out << kept;
  out.close();
  STRATA_REQUIRE(out.good(), "--metrics: cannot write '", tmp, "': ", std::strerror(errno));
  std::error_code ec;
  std::filesystem::rename(tmp, path_, ec);
  STRATA_REQUIRE(!ec, "--metrics: cannot replace '", path_, "': ", ec.message());
}

namespace {

// Reads the JSON MetricsWriter writes (objects of numbers, null, text without escapes, objects;
// not JSON in general) into scalars.
class LineReader {
 public:
  explicit LineReader(const std::string& line) : line_(line), p_(line.c_str()) {}

  void object(const std::string& prefix) {
    expect('{');
    for (space(); *p_ == '"'; space()) {
      const std::string key = prefix + text();
      space();
      expect(':');
      space();
      if (*p_ == '{') {
        object(key + "/");
      } else if (*p_ == '"') {
        const std::string value = text();
        if (prefix.empty()) label = value;  // a nested object's text (a straggler's host) is no scalar
      } else if (std::strncmp(p_, "null", 4) == 0) {
        p_ += 4;
      } else {
        char* end = nullptr;
        const double v = std::strtod(p_, &end);  // also "nan" and "inf", which %f writes
        STRATA_CHECK(end != p_, "a metrics line with a value that is not a number: ", line_);
        p_ = end;
        numbers.emplace_back(key, v);
      }
      space();
      if (*p_ == ',') ++p_;
    }
    expect('}');
  }

  std::vector<std::pair<std::string, double>> numbers;
  std::string label;  // the line's text field

 private:
  void space() {
    while (*p_ == ' ' || *p_ == '\n') ++p_;
  }
  void expect(char c) {
    STRATA_CHECK(*p_ == c, "a metrics line without '", c, "' where expected: ", line_);
    ++p_;
  }
  std::string text() {
    expect('"');
    const char* end = std::strchr(p_, '"');
    STRATA_CHECK(end, "a metrics line with an unterminated string: ", line_);
    std::string s(p_, end);
    p_ = end + 1;
    return s;
  }

  const std::string& line_;
  const char* p_;
};

std::string format_duration(double seconds) {
  const int64_t s = static_cast<int64_t>(std::max(0.0, seconds));
  char buf[32];
  if (s >= 3600)
    std::snprintf(buf, sizeof buf, "%lldh%02lldm", static_cast<long long>(s / 3600),
                  static_cast<long long>(s / 60 % 60));
  else
    std::snprintf(buf, sizeof buf, "%lldm%02llds", static_cast<long long>(s / 60), static_cast<long long>(s % 60));
  return buf;
}

}  // namespace

TensorBoardEvent tensorboard_event(const std::string& json_line) {
  LineReader line(json_line);
  line.object("");
  TensorBoardEvent event;
  for (const auto& [key, value] : line.numbers) {
    if (key == "step")
      event.step = static_cast<int64_t>(value);
    else  // TensorBoard's scalars are float32: the nearest to the number the JSON line holds
      event.scalars.push_back({line.label.empty() ? key : line.label + "/" + key, static_cast<float>(value)});
  }
  return event;
}

StepSplit average_split(const std::vector<RankWindow>& ranks) {
  StepSplit split;
  const auto n = static_cast<double>(std::max<size_t>(ranks.size(), 1));
  for (const RankWindow& w : ranks) {
    const double window = std::max(w.seconds, 1e-9);
    split.comm += w.comm_s / window / n;
    split.pipeline += w.pipeline_s / window / n;
    split.data += w.data_s / window / n;
  }
  split.compute = std::max(0.0, 1.0 - split.comm - split.pipeline - split.data);
  return split;
}

std::optional<Straggler> find_straggler(const std::vector<RankWindow>& ranks, int64_t steps) {
  const auto busy = [](const RankWindow& w) { return std::max(0.0, w.seconds - w.comm_s - w.pipeline_s); };
  const auto data = [](const RankWindow& w) { return w.data_s; };
  // The median over the other ranks of rank r's stage (-1 when it has none).
  const auto median_of_others = [&](size_t r, auto value) {
    std::vector<double> v;
    for (size_t o = 0; o < ranks.size(); ++o)
      if (o != r && ranks[o].stage == ranks[r].stage) v.push_back(value(ranks[o]));
    if (v.empty()) return -1.0;
    std::sort(v.begin(), v.end());
    const size_t n = v.size();
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
  };
  // Below kStragglerSeconds a step, busy times are noise: the least a median is taken as.
  const double floor = kStragglerSeconds * static_cast<double>(std::max<int64_t>(steps, 1));
  std::optional<Straggler> worst;
  for (size_t r = 0; r < ranks.size(); ++r) {
    const double median = median_of_others(r, busy);
    if (median < 0) continue;  // alone in its stage
    const double excess = busy(ranks[r]) - median, slower = excess / std::max(median, floor);
    if (excess <= kStragglerShare * median || excess <= floor || (worst && slower <= worst->slower)) continue;
    const double data_excess = ranks[r].data_s - median_of_others(r, data);
    worst = Straggler{static_cast<int>(r), "", slower, data_excess > 0.5 * excess ? "data" : "compute"};
  }
  return worst;
}

std::string progress_line(const ProgressRecord& r, int64_t total_steps) {
  char rate[64], line[512];
  if (r.tokens_per_s > 0)
    std::snprintf(rate, sizeof rate, "%.0f tokens/s", r.tokens_per_s);
  else
    std::snprintf(rate, sizeof rate, "%.0f samples/s", r.samples_per_s);
  // Compute is the remainder, so the line names only the waits a step had (each >= 0.5%).
  std::string waits;
  if (r.split) {
    for (const auto& [name, share] : {std::pair{"comm", r.split->comm}, std::pair{"pipeline", r.split->pipeline},
                                      std::pair{"data", r.split->data}}) {
      if (share < 0.005) continue;
      char part[32];
      std::snprintf(part, sizeof part, "%s%s %.0f%%", waits.empty() ? " (" : ", ", name, 100 * share);
      waits += part;
    }
    if (!waits.empty()) waits += ")";
  } else {
    waits = " (split n/a under NCCL)";
  }
  char mfu[32] = "";
  if (r.mfu) std::snprintf(mfu, sizeof mfu, "  MFU %.1f%%", 100 * *r.mfu);
  std::snprintf(line, sizeof line, "step %lld/%lld  epoch %lld  loss %.4f  lr %.3g  %s  %.1f ms%s%s  mem %s  eta %s",
                static_cast<long long>(r.step), static_cast<long long>(total_steps), static_cast<long long>(r.epoch),
                r.loss, r.lr, rate, 1e3 * r.step_time_s, waits.c_str(), mfu, log::format_bytes(r.peak_bytes).c_str(),
                format_duration(r.eta_s).c_str());
  if (!r.straggler) return line;
  return detail::cat(line, "  slow: rank ", r.straggler->rank, " (", r.straggler->host, ") +",
                     static_cast<int>(std::lround(100 * r.straggler->slower)), "% ", r.straggler->cause);
}

}  // namespace strata::io
