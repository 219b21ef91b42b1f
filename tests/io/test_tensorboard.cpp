// --tensorboard's event files: CRC-32C against published check values, the reader and the writer
// against files tensorboard's and torch's own writers made (tests/fixtures/tensorboard, written by
// tools/interop/make_tensorboard_fixtures.py, listed as tensorboard's reader reads them), damaged
// files refused, and MetricsWriter's two sinks holding the same numbers.
#include <gtest/gtest.h>
#include <sys/resource.h>

#include <bit>
#include <cinttypes>
#include <cmath>
#include <csignal>
#include <cstring>
#include <fstream>
#include <iterator>
#include <sstream>

#include "io/io_test_util.hpp"
#include "io/metrics.hpp"
#include "io/tensorboard.hpp"

namespace strata::io {
namespace {

using test::TempDir;

std::string read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

void write_bytes(const std::string& path, const std::string& bytes) { std::ofstream(path, std::ios::binary) << bytes; }

TensorBoardEvent scalars_at(int64_t step, std::vector<TensorBoardScalar> scalars, double wall_time = 0) {
  TensorBoardEvent e;
  e.wall_time = wall_time;
  e.step = step;
  e.scalars = std::move(scalars);
  return e;
}

std::vector<std::string> split(const std::string& line, char sep) {
  std::vector<std::string> parts;
  std::string part;
  std::istringstream in(line);
  while (std::getline(in, part, sep)) parts.push_back(part);
  if (!line.empty() && line.back() == sep) parts.emplace_back();
  return parts;
}

// The fixture's listing format (make_tensorboard_fixtures.py): wall_time's bits, step,
// file_version, SessionLog status, writer, then TAG=BITS (float32 bits) per scalar.
std::string listing(const std::vector<TensorBoardEvent>& events) {
  std::string out;
  for (const TensorBoardEvent& e : events) {
    char head[64];
    std::snprintf(head, sizeof head, "%016" PRIx64 "\t%" PRId64, std::bit_cast<uint64_t>(e.wall_time), e.step);
    out += head + ("\t" + e.file_version) + "\t" + std::to_string(e.session_status) + "\t" + e.writer;
    for (const TensorBoardScalar& s : e.scalars) {
      char bits[16];
      std::snprintf(bits, sizeof bits, "%08" PRIx32, std::bit_cast<uint32_t>(s.value));
      out += "\t" + s.tag + "=" + bits;
    }
    out += "\n";
  }
  return out;
}

std::vector<TensorBoardEvent> parse_listing(const std::string& text) {
  std::vector<TensorBoardEvent> events;
  for (const std::string& line : split(text, '\n')) {
    if (line.empty()) continue;
    const std::vector<std::string> f = split(line, '\t');
    EXPECT_GE(f.size(), 5u) << line;
    if (f.size() < 5) continue;
    TensorBoardEvent e;
    e.wall_time = std::bit_cast<double>(std::stoull(f[0], nullptr, 16));
    e.step = std::stoll(f[1]);
    e.file_version = f[2];
    e.session_status = std::stoi(f[3]);
    e.writer = f[4];
    for (size_t i = 5; i < f.size(); ++i) {
      const size_t eq = f[i].rfind('=');
      const auto bits = static_cast<uint32_t>(std::stoul(f[i].substr(eq + 1), nullptr, 16));
      e.scalars.push_back({f[i].substr(0, eq), std::bit_cast<float>(bits)});
    }
    events.push_back(e);
  }
  return events;
}

TEST(Crc32c, CheckValues) {
  EXPECT_EQ(crc32c("123456789", 9), 0xE3069283u);  // the catalogue's check value of CRC-32/ISCSI
  // RFC 3720 (iSCSI), B.4: 32 bytes of zeros, of ones, incrementing, decrementing.
  std::string zeros(32, '\0'), ones(32, '\xff'), up(32, 0), down(32, 0);
  for (int i = 0; i < 32; ++i) {
    up[i] = static_cast<char>(i);
    down[i] = static_cast<char>(31 - i);
  }
  EXPECT_EQ(crc32c(zeros.data(), 32), 0x8A9136AAu);
  EXPECT_EQ(crc32c(ones.data(), 32), 0x62A8AB43u);
  EXPECT_EQ(crc32c(up.data(), 32), 0x46DD794Eu);
  EXPECT_EQ(crc32c(down.data(), 32), 0x113FDB5Cu);
  EXPECT_EQ(crc32c(up.data() + 10, 22, crc32c(up.data(), 10)), 0x46DD794Eu);  // continued
  const uint32_t crc = 0xE3069283u;
  EXPECT_EQ(masked_crc32c("123456789", 9), ((crc >> 15) | (crc << 17)) + 0xa282ead8u);
}

class Fixture : public ::testing::TestWithParam<std::string> {};

// Our reader reads what tensorboard's reader read; our encoding of those events is the reference
// writer's file, byte for byte.
TEST_P(Fixture, ReadAndWrittenAsTheReference) {
  const std::string path = std::string(STRATA_TENSORBOARD_FIXTURES) + "/" + GetParam();
  const std::string reference = read_bytes(path + ".txt");
  ASSERT_FALSE(reference.empty()) << path << ".txt";
  EXPECT_EQ(listing(read_tensorboard_events(path)), reference);
  std::string ours;
  for (const TensorBoardEvent& e : parse_listing(reference)) ours += tf_record(encode_event(e));
  const std::string bytes = read_bytes(path);
  EXPECT_EQ(ours.size(), bytes.size());
  EXPECT_TRUE(ours == bytes) << "our bytes differ from " << path;
}

INSTANTIATE_TEST_SUITE_P(TensorBoard, Fixture, ::testing::Values("tensorboard.events", "torch.events"));

TEST(TensorBoardWriter, WritesWhatIsReadBack) {
  TempDir dir;
  std::string path;
  {
    TensorBoardWriter w(dir / "tb/run", 7);  // made with its parents; a run resumed at step 7
    path = w.path();
    w.write(scalars_at(3, {{"loss", 1.5f}, {"split/comm", 0.25f}}));
    // Flushed at once: a live reader sees it before the writer closes.
    const std::vector<TensorBoardEvent> live = read_tensorboard_events(path);
    ASSERT_EQ(live.size(), 3u);
    EXPECT_EQ(live[2].scalars, (std::vector<TensorBoardScalar>{{"loss", 1.5f}, {"split/comm", 0.25f}}));
    w.write(scalars_at(int64_t{1} << 40, {{"zero", 0.0f}}, 1.25));
  }
  const std::string name = std::filesystem::path(path).filename().string();
  EXPECT_EQ(name.rfind("events.out.tfevents.", 0), 0u) << name;
  EXPECT_EQ(name.substr(name.rfind('.') + 1), std::to_string(getpid())) << name;  // <time>.<host>.<pid>
  const std::vector<TensorBoardEvent> events = read_tensorboard_events(path);
  ASSERT_EQ(events.size(), 4u);
  EXPECT_EQ(events[0].file_version, "brain.Event:2");
  EXPECT_EQ(events[0].writer, "strata");
  EXPECT_GT(events[0].wall_time, 1.6e9);  // now, in seconds since the epoch
  EXPECT_EQ(events[1].step, 8);           // readers drop what earlier files logged from step 8 on
  EXPECT_EQ(events[1].session_status, kSessionStart);
  EXPECT_TRUE(events[1].scalars.empty());
  EXPECT_EQ(events[2].step, 3);
  EXPECT_EQ(events[3].wall_time, 1.25);
  EXPECT_EQ(events[3].step, int64_t{1} << 40);
  EXPECT_EQ(events[3].scalars, (std::vector<TensorBoardScalar>{{"zero", 0.0f}}));
  // A second writer in the same second never takes the first one's file; one that is no
  // training run (--eval-only) marks no start.
  TensorBoardWriter again(dir / "tb/run", std::nullopt);
  EXPECT_NE(again.path(), path);
  EXPECT_EQ(read_tensorboard_events(path).size(), 4u);
  const std::vector<TensorBoardEvent> other = read_tensorboard_events(again.path());
  ASSERT_EQ(other.size(), 1u);
  EXPECT_EQ(other[0].file_version, "brain.Event:2");
}

TEST(TensorBoardWriter, UnwritableDirectoryIsAnInputError) {
  TempDir dir;
  write_bytes(dir / "file", "x");
  strata::test::expect_input_error([&] { TensorBoardWriter w(dir / "file", 0); }, {"--tensorboard", "file"});
}

// A full disk (here a file-size limit): one warning, no error, and the file ends where the writes
// failed, its records before that intact.
TEST(TensorBoardWriter, AFailedWriteEndsTheFileNotTheRun) {
  TempDir dir;
  TensorBoardWriter w(dir / "tb", 0);
  w.write(scalars_at(1, {{"loss", 1.0f}}));
  const auto size = std::filesystem::file_size(w.path());
  rlimit old{};
  ASSERT_EQ(getrlimit(RLIMIT_FSIZE, &old), 0);
  rlimit small = old;
  small.rlim_cur = size + 10;                           // the next record does not fit
  const auto previous = std::signal(SIGXFSZ, SIG_IGN);  // write() fails with EFBIG instead
  ASSERT_EQ(setrlimit(RLIMIT_FSIZE, &small), 0);
  EXPECT_NO_THROW(w.write(scalars_at(2, {{"loss", 2.0f}})));
  EXPECT_NO_THROW(w.write(scalars_at(3, {{"loss", 3.0f}})));
  ASSERT_EQ(setrlimit(RLIMIT_FSIZE, &old), 0);
  std::signal(SIGXFSZ, previous);
  w.write(scalars_at(4, {{"loss", 4.0f}}));  // never after part of a record
  EXPECT_EQ(std::filesystem::file_size(w.path()), size + 10);
  std::string whole = read_bytes(w.path());
  whole.resize(size);
  write_bytes(dir / "before", whole);
  const std::vector<TensorBoardEvent> events = read_tensorboard_events(dir / "before");
  ASSERT_EQ(events.size(), 3u);  // version, start, step 1
  EXPECT_EQ(events[2].step, 1);
}

TEST(TensorBoardReader, DamageIsFound) {
  TempDir dir;
  std::string file;
  for (float v : {1.0f, 2.0f}) file += tf_record(encode_event(scalars_at(1, {{"x", v}}, 5)));
  const size_t record = file.size() / 2;
  write_bytes(dir / "whole", file);
  ASSERT_EQ(read_tensorboard_events(dir / "whole").size(), 2u);
  // Cut inside the last record's data, inside its header, and one byte short of its CRC.
  for (size_t keep : {file.size() - 6, record + 5, file.size() - 1}) {
    write_bytes(dir / "cut", file.substr(0, keep));
    strata::test::expect_input_error([&] { read_tensorboard_events(dir / "cut"); },
                                     {"cut", "at byte " + std::to_string(record), "truncated"});
  }
  std::string flipped = file;
  flipped[record + 20] ^= 0x10;  // a byte of the second event's data
  write_bytes(dir / "data", flipped);
  strata::test::expect_input_error([&] { read_tensorboard_events(dir / "data"); }, {"data fails its CRC"});
  flipped = file;
  flipped[record] ^= 0x01;  // the second record's length
  write_bytes(dir / "length", flipped);
  strata::test::expect_input_error([&] { read_tensorboard_events(dir / "length"); }, {"length fails its CRC"});
}

// The two sinks of MetricsWriter: every number of a JSON line is a scalar of its event, the float32
// nearest to the number as the line prints it.
TEST(MetricsWriter, TensorBoardHoldsTheLinesNumbers) {
  TempDir dir;
  {
    MetricsWriter metrics(dir / "m.jsonl", dir / "tb", 4);  // a run resumed at step 4
    ProgressRecord p;
    p.step = 8;
    p.loss = 1.23456789;
    p.lr = 3e-4;
    p.samples_per_s = 1000;
    p.tokens_per_s = 64000;
    p.split = StepSplit{0.5, 0.25, 0.125, 0.125};
    p.mfu = 0.034;
    p.peak_bytes = 123456789;
    metrics.append(p);
    metrics.append(EvalRecord{8, "val", 2.5, 0.75, 512, true});
  }
  std::vector<std::string> lines;
  std::ifstream in(dir / "m.jsonl");
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  ASSERT_EQ(lines.size(), 2u);
  std::vector<std::string> files;
  for (const auto& f : std::filesystem::directory_iterator(dir.path() / "tb")) files.push_back(f.path().string());
  ASSERT_EQ(files.size(), 1u);
  std::vector<TensorBoardEvent> events = read_tensorboard_events(files[0]);
  ASSERT_EQ(events.size(), 4u);  // version, restart, progress, evaluation
  EXPECT_EQ(events[1].step, 5);
  EXPECT_EQ(events[1].session_status, kSessionStart);
  events.erase(events.begin() + 1);
  EXPECT_EQ(events[1].step, 8);
  EXPECT_EQ(events[1].scalars, tensorboard_event(lines[0]).scalars);
  std::vector<std::string> tags;
  for (const TensorBoardScalar& s : events[1].scalars) tags.push_back(s.tag);
  EXPECT_EQ(tags,
            (std::vector<std::string>{"epoch", "loss", "lr", "samples_per_s", "tokens_per_s", "step_time_s",
                                      "split/compute", "split/comm", "split/pipeline", "split/data", "tflops_per_rank",
                                      "mfu", "dp_bytes_per_step", "tp_bytes_per_step", "peak_bytes", "eta_s"}));
  EXPECT_EQ(events[1].scalars[1].value, 1.234568f);  // "loss": 1.234568 (%.6f)
  EXPECT_EQ(events[1].scalars[14].value, 123456789.0f);
  EXPECT_EQ(events[2].step, 8);
  EXPECT_EQ(events[2].scalars,
            (std::vector<TensorBoardScalar>{{"val/eval_loss", 2.5f},
                                            {"val/eval_accuracy", 0.75f},
                                            {"val/eval_perplexity", static_cast<float>(std::stod("12.1825"))},
                                            {"val/eval_samples", 512.0f}}));
}

// Without a split or MFU (null in the line) there are no such scalars.
TEST(MetricsWriter, NullFieldsAreNoScalars) {
  const TensorBoardEvent e = tensorboard_event(
      R"({"step": 2, "loss": 0.5, "split": null, "mfu": null, "eval": "final", "x": {"y": {"z": -1e-3}}})");
  EXPECT_EQ(e.step, 2);
  EXPECT_EQ(e.scalars, (std::vector<TensorBoardScalar>{{"final/loss", 0.5f}, {"final/x/y/z", -1e-3f}}));
}

// A straggler's numbers are scalars; its host and cause (text inside an object) are not, and do
// not become the line's label.
TEST(MetricsWriter, StragglerNumbersAreScalars) {
  const TensorBoardEvent e = tensorboard_event(
      R"({"step": 5, "loss": 0.5, "straggler": {"rank": 3, "host": "node2", "slower": 0.5, "cause": "compute"}})");
  EXPECT_EQ(e.scalars,
            (std::vector<TensorBoardScalar>{{"loss", 0.5f}, {"straggler/rank", 3.0f}, {"straggler/slower", 0.5f}}));
}

}  // namespace
}  // namespace strata::io
