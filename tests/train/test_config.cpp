// Tests of the train program's options: parse_config on argv arrays (defaults, enumerated
// options parsed into the lower layers' types, a --config INI file under the command line) and
// validate()'s rules, each a one-line Input error.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <regex>
#include <string>
#include <vector>

#include "core/error.hpp"
#include "train/config.hpp"

namespace strata::train {
namespace {

using parallel::ScheduleKind;
using parallel::Transport;

using Args = std::vector<std::string>;

// parse_config on "train" + args (help never printed).
std::optional<Config> parse(const Args& args) {
  std::vector<const char*> argv{"train"};
  for (const std::string& a : args) argv.push_back(a.c_str());
  return parse_config(static_cast<int>(argv.size()), argv.data(), false);
}

// The smallest valid command line plus `extra`.
Config parse_valid(const Args& extra = {}) {
  Args args{"--data", "train.h5", "--steps", "1"};
  args.insert(args.end(), extra.begin(), extra.end());
  const std::optional<Config> c = parse(args);
  EXPECT_TRUE(c.has_value());
  return c.value_or(Config{});
}

// Asserts that parsing `args` throws an Input error of one line containing `part`.
void expect_rejected(const Args& args, const std::string& part) {
  std::string line;
  for (const std::string& a : args) line += " " + a;
  try {
    parse(args);
    ADD_FAILURE() << "accepted:" << line;
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::Input) << line << ": " << e.message();
    EXPECT_NE(e.message().find(part), std::string::npos)
        << line << "\nmessage: " << e.message() << "\nmissing: " << part;
    EXPECT_EQ(e.message().find('\n'), std::string::npos) << line << ": not one line: " << e.message();
  }
}

// `args` after the smallest valid command line.
void expect_rejected_with_data(const Args& args, const std::string& part) {
  Args all{"--data", "train.h5", "--steps", "1"};
  all.insert(all.end(), args.begin(), args.end());
  expect_rejected(all, part);
}

std::string effective(const Config& c, const std::string& key) {
  for (const auto& [k, v] : c.effective)
    if (k == key) return v;
  return "<unset>";
}

// A file in a fresh temporary directory, removed with it.
class TempFile {
 public:
  explicit TempFile(const std::string& text) {
    static int made = 0;
    dir_ = std::filesystem::temp_directory_path() /
           ("strata_test_config_" + std::to_string(::getpid()) + "_" + std::to_string(made++));
    std::filesystem::create_directories(dir_);
    path_ = (dir_ / "run.ini").string();
    std::ofstream(path_) << text;
  }
  ~TempFile() { std::filesystem::remove_all(dir_); }
  const std::string& path() const { return path_; }

 private:
  std::filesystem::path dir_;
  std::string path_;
};

TEST(Config, DeviceMemorySizes) {
  EXPECT_EQ(parse_bytes("4096", "--device-memory"), 4096);
  EXPECT_EQ(parse_bytes("512MiB", "--device-memory"), int64_t{512} << 20);
  EXPECT_EQ(parse_bytes("80GiB", "--device-memory"), int64_t{80} << 30);
  EXPECT_EQ(parse_bytes("1.5GB", "--device-memory"), 1500000000);
  EXPECT_EQ(parse_bytes("0", "--device-memory"), 0);
  EXPECT_EQ(parse({"--data", "x.h5", "--steps", "1", "--device-memory", "2KiB"})->plan.device_memory, 2048);
  for (const char* bad : {"", "GiB", "12 GiB", "12XB", "-1GiB", "nan", "1e30TiB"})
    EXPECT_THROW(
        {
          try {
            parse_bytes(bad, "--device-memory");
          } catch (const Error& e) {
            EXPECT_EQ(e.kind(), ErrorKind::Input);
            EXPECT_NE(std::string(e.what()).find("--device-memory expects a size"), std::string::npos) << e.what();
            throw;
          }
        },
        Error)
        << bad;
}

TEST(Config, HelpReturnsNothing) { EXPECT_FALSE(parse({"--help"}).has_value()); }

TEST(Config, Defaults) {
  const Config c = parse_valid();
  EXPECT_EQ(c.data.train, "train.h5");
  EXPECT_EQ(c.training.steps, 1);
  EXPECT_EQ(c.training.epochs, 0);
  EXPECT_EQ(c.model.name, "cnn");
  EXPECT_EQ(c.model.hidden, (std::vector<int64_t>{1024, 1024}));
  EXPECT_EQ(c.model.depth, 20);
  EXPECT_EQ(c.model.width, 16);
  EXPECT_EQ(c.layout.global_batch, 64);
  EXPECT_EQ(c.layout.micro_batch, 0);
  EXPECT_EQ(c.training.optimizer.name, "sgd");
  EXPECT_FLOAT_EQ(c.training.optimizer.momentum, 0.9f);
  EXPECT_EQ(c.training.lr_schedule.kind, "constant");
  EXPECT_FLOAT_EQ(c.training.lr_schedule.lr, 0.05f);
  EXPECT_EQ(c.checkpoint.resume, "none");
  EXPECT_EQ(c.monitor.log_every, 100);
  EXPECT_EQ(c.data.prefetch, 2);
  EXPECT_EQ(c.layout.pp, 1);
  EXPECT_EQ(c.layout.partition, "balanced");
  EXPECT_EQ(c.layout.zero, 0);
  EXPECT_FLOAT_EQ(c.layout.bucket_mb, 25.0f);
  EXPECT_TRUE(c.data.shuffle);
  EXPECT_TRUE(c.runtime.shared_memory);
  EXPECT_FALSE(c.plan.dry_run);
  EXPECT_FALSE(c.eval_only);
  EXPECT_EQ(c.training.loss_scale, "auto");
  EXPECT_DOUBLE_EQ(c.training.loss_scale_init, 65536.0);
  EXPECT_EQ(c.training.loss_scale_window, 2000);
  // The enumerated options, typed.
  EXPECT_EQ(c.layout.schedule, ScheduleKind::OneFOneB);
  EXPECT_EQ(c.runtime.device, DeviceKind::CPU);
  EXPECT_EQ(c.runtime.comm, Transport::Mpi);  // auto on the CPU
  EXPECT_EQ(c.layout.precision, DType::F32);
  // The start-of-run printout keeps the spellings given.
  EXPECT_EQ(effective(c, "schedule"), "1f1b");
  EXPECT_EQ(effective(c, "device"), "cpu");
  EXPECT_EQ(effective(c, "comm"), "auto");
  EXPECT_EQ(effective(c, "precision"), "fp32");
  EXPECT_EQ(effective(c, "global-batch"), "64");
  EXPECT_EQ(effective(c, "help"), "<unset>");
}

TEST(Config, EnumeratedOptionsParsed) {
  const Config a = parse_valid({"--schedule", "gpipe", "--precision", "bf16", "--optimizer", "adamw", "--lr-schedule",
                                "cosine", "--device", "cuda"});
  EXPECT_EQ(a.layout.schedule, ScheduleKind::GPipe);
  EXPECT_EQ(a.layout.precision, DType::BF16);
  EXPECT_EQ(a.training.optimizer.name, "adamw");
  EXPECT_EQ(a.training.lr_schedule.kind, "cosine");
  EXPECT_EQ(a.runtime.device, DeviceKind::CUDA);
  EXPECT_EQ(a.runtime.comm, Transport::Nccl);  // auto with cuda
  EXPECT_EQ(effective(a, "comm"), "auto");

  const Config b = parse_valid({"--device", "cuda", "--comm", "mpi", "--precision", "fp16"});
  EXPECT_EQ(b.runtime.comm, Transport::Mpi);
  EXPECT_EQ(b.layout.precision, DType::F16);
  EXPECT_EQ(parse_valid({"--comm", "mpi"}).runtime.comm, Transport::Mpi);
  EXPECT_EQ(parse_valid({"--lr-schedule", "step", "--lr-step-size", "10"}).training.lr_schedule.kind, "step");
  const Config wsd = parse_valid({"--lr-schedule", "wsd", "--lr-decay-steps", "30", "--lr-decay-shape", "sqrt"});
  EXPECT_EQ(wsd.training.lr_schedule.kind, "wsd");
  EXPECT_EQ(wsd.training.lr_schedule.decay_steps, 30);
  EXPECT_EQ(wsd.training.lr_schedule.decay_shape, "sqrt");
}

TEST(Config, EnumNamesRoundTrip) {
  for (const char* p : {"fp32", "bf16", "fp16"}) EXPECT_STREQ(precision_name(parse_precision(p)), p);
  for (const char* d : {"cpu", "cuda"}) EXPECT_STREQ(parallel::device_kind_name(parallel::parse_device_kind(d)), d);
  for (const char* s : {"gpipe", "1f1b"}) EXPECT_EQ(parallel::to_string(parallel::parse_schedule_kind(s)), s);
  for (const char* t : {"mpi", "nccl"})
    EXPECT_STREQ(parallel::transport_name(parallel::parse_transport(t, DeviceKind::CUDA)), t);
}

TEST(Config, BadEnumsAreOneLineInputErrors) {
  expect_rejected_with_data({"--device", "gpu"}, "--device must be cpu or cuda, found 'gpu'");
  expect_rejected_with_data({"--comm", "tcp"}, "--comm must be auto, nccl or mpi, found 'tcp'");
  expect_rejected_with_data({"--schedule", "zero-bubble"},
                            "pipeline schedule: expected \"gpipe\", \"1f1b\" or \"interleaved\", got \"zero-bubble\"");
  expect_rejected_with_data({"--precision", "fp64"}, "--precision must be fp32, bf16 or fp16, found 'fp64'");
  expect_rejected_with_data({"--optimizer", "adam"}, "--optimizer must be sgd or adamw, found 'adam'");
  expect_rejected_with_data({"--lr-schedule", "exponential"},
                            "--lr-schedule must be constant, step, cosine, linear or wsd, found 'exponential'");
  expect_rejected_with_data({"--lr-schedule", "wsd", "--lr-decay-shape", "exp"},
                            "--lr-decay-shape must be linear, sqrt or cosine, found 'exp'");
}

// The learning rate's default is the optimizer's (SGD's 0.05 diverges AdamW), a given --lr wins,
// and the run's printout holds the value in effect.
TEST(Config, LearningRateDefaultsPerOptimizer) {
  EXPECT_FLOAT_EQ(parse_valid({}).training.lr_schedule.lr, 0.05f);
  const Config adamw = parse_valid({"--optimizer", "adamw"});
  EXPECT_FLOAT_EQ(adamw.training.lr_schedule.lr, 1e-3f);
  EXPECT_EQ(effective(adamw, "lr"), "0.001");
  EXPECT_FLOAT_EQ(parse_valid({"--optimizer", "adamw", "--lr", "0.01"}).training.lr_schedule.lr, 0.01f);
  expect_rejected_with_data({"--optimizer", "adamw", "--min-lr", "0.002"}, "--min-lr must be in [0, --lr 0.001]");
}

TEST(Config, ValidateRules) {
  const std::vector<std::pair<Args, std::string>> cases = {
      {{"--bucket-mb", "0"}, "--bucket-mb must be in (0, 65536], found 0"},
      {{"--bucket-mb=-1"}, "--bucket-mb must be in (0, 65536], found -1"},
      {{"--zero", "4"}, "--zero must be 0, 1, 2 or 3, found 4"},
      {{"--zero=-1"}, "--zero must be 0, 1, 2 or 3, found -1"},
      {{"--comm", "nccl"}, "--comm nccl needs --device cuda (NCCL moves GPU memory)"},
      {{"--loss-scale", "big"}, "--loss-scale must be auto, dynamic, none or a positive number, found 'big'"},
      {{"--loss-scale", "0"}, "--loss-scale must be auto, dynamic, none or a positive number, found '0'"},
      {{"--precision", "fp16", "--loss-scale-window", "0"}, "--loss-scale-window must be in [1, 68719476736], found 0"},
      {{"--loss-scale", "dynamic", "--loss-scale-init", "0"}, "--loss-scale-init must be finite and > 0, found 0"},
      {{"--global-batch", "0"}, "--global-batch must be in [1, 16777216], found 0"},
      {{"--micro-batch=-1"}, "--micro-batch must be in [0, 64], found -1"},
      {{"--lr", "0"}, "--lr must be positive and finite, found 0"},
      {{"--momentum", "1"}, "--momentum must be in [0, 1), found 1"},
      {{"--weight-decay=-0.5"}, "--weight-decay must be finite and >= 0, found -0.5"},
      {{"--warmup-steps=-1"}, "--warmup-steps must be in [0, 68719476736], found -1"},
      {{"--lr-gamma", "2"}, "--lr-gamma must be in (0, 1], found 2"},
      {{"--min-lr", "1"}, "--min-lr must be in [0, --lr 0.05], found 1"},
      {{"--bench-stage-ms=-1"}, "--bench-stage-ms must be in [0, 60000], found -1"},
      {{"--clip-grad=-1"}, "--clip-grad must be finite and >= 0 (0: off), found -1"},
      {{"--threads=-1"}, "--threads must be in [0, "},
      {{"--log-every", "0"}, "--log-every must be in [1, 68719476736], found 0"},
      {{"--prefetch", "0"}, "--prefetch must be in [1, 64], found 0"},
      {{"--save-every=-1"}, "--save-every must be in [0, 68719476736], found -1"},
      {{"--lr-schedule", "step"}, "--lr-schedule step needs --lr-step-size > 0, found 0"},
      {{"--lr-decay-steps=-1"}, "--lr-decay-steps must be in [0, 68719476736], found -1"},
      {{"--beta1", "1"}, "--beta1 and --beta2 must be in [0, 1), found 1 and 0.999"},
      {{"--eps", "0"}, "--eps must be in (0, 1], found 0"},
      {{"--dropout", "1"}, "--dropout must be in [0, 1), found 1"},
      {{"--keep=-1"}, "--keep must be in [0, 68719476736], found -1"},
      {{"--resume", "auto"}, "--resume auto needs --checkpoint-dir"},
      {{"--resume", "ck.h5", "--init-from", "a.h5"}, "give --resume or --init-from, not both"},
      {{"--hidden", "64,x"},
       "--hidden expects a comma-separated list of positive integers (e.g. 1024,1024), found "
       "'64,x'"},
      {{"--eval-only"}, "--eval-only needs --init-from CHECKPOINT"},
  };
  for (const auto& [args, part] : cases) expect_rejected_with_data(args, part);
}

// Every numeric option has a range (docs/training.md): each violation is one line naming the
// flag, the range and the value, by class: not finite, negative, zero, past the upper bound.
TEST(Config, NumericRanges) {
  const std::vector<std::pair<Args, std::string>> cases = {
      // Not finite (inf, nan): a float flag's bound must refuse them.
      {{"--eps", "inf"}, "--eps must be in (0, 1], found inf"},
      {{"--eps", "nan"}, "--eps must be in (0, 1], found nan"},
      {{"--lr", "inf"}, "--lr must be positive and finite, found inf"},
      {{"--clip-grad", "inf"}, "--clip-grad must be finite and >= 0 (0: off), found inf"},
      {{"--weight-decay", "inf"}, "--weight-decay must be finite and >= 0, found inf"},
      {{"--bucket-mb", "inf"}, "--bucket-mb must be in (0, 65536], found inf"},
      {{"--loss-scale-init", "inf"}, "--loss-scale-init must be finite and > 0, found inf"},
      {{"--bench-stage-ms", "nan"}, "--bench-stage-ms must be in [0, 60000], found nan"},
      {{"--dropout", "nan"}, "--dropout must be in [0, 1), found nan"},
      // Negative where only >= 0 makes sense (a signed read: no wrap to 2^64 - 1).
      {{"--seed=-1"}, "--seed must be in [0, 2^63 - 1], found -1"},
      {{"--epochs=-1"}, "--epochs must be in [0, 1048576], found -1"},
      {{"--eval-every=-1"}, "--eval-every must be in [0, 68719476736], found -1"},
      {{"--lr-step-size=-1"}, "--lr-step-size must be in [0, 68719476736], found -1"},
      {{"--world=-1"}, "--world must be in [0, 1048576], found -1"},
      {{"--vocab=-1"}, "--vocab must be in [0, 2147483647], found -1"},
      {{"--seq-len=-1"}, "--seq-len must be in [0, 16777216], found -1"},
      {{"--debug-fail-step=-2"}, "--debug-fail-step must be in [-1, 68719476736], found -2"},
      // Zero where at least one is needed.
      {{"--pp", "0"}, "--pp must be in [1, 1048576], found 0"},
      {{"--tp", "0"}, "--tp must be in [1, 1048576], found 0"},
      {{"--layers", "0"}, "--layers must be in [1, 16777216], found 0"},
      {{"--heads", "0"}, "--heads must be in [1, 16777216], found 0"},
      {{"--embed", "0"}, "--embed must be in [1, 16777216], found 0"},
      {{"--width", "0"}, "--width must be in [1, 16777216], found 0"},
      {{"--depth", "0"}, "--depth must be in [1, 16777216], found 0"},
      // Past the upper bound (the adversarial run's --threads 100000 and --prefetch 100000000).
      {{"--threads", "100000"}, "--threads must be in [0, "},
      {{"--prefetch", "100000000"}, "--prefetch must be in [1, 64], found 100000000"},
      {{"--global-batch", "16777217"}, "--global-batch must be in [1, 16777216], found 16777217"},
      {{"--micro-batch", "65"}, "--micro-batch must be in [0, 64], found 65"},
      {{"--epochs", "1048577"}, "--epochs must be in [0, 1048576], found 1048577"},
      {{"--eps", "2"}, "--eps must be in (0, 1], found 2"},
      {{"--bucket-mb", "1e9"}, "--bucket-mb must be in (0, 65536], found 1e+09"},
      {{"--hidden", "16,100000000"}, "--hidden must be in [1, 16777216], found 100000000"},
      {{"--schedule", "interleaved", "--pp", "2", "--virtual-stages", "2000000"},
       "--virtual-stages must be in [1, 1048576], found 2000000"},
  };
  for (const auto& [args, part] : cases) expect_rejected_with_data(args, part);
  expect_rejected({"--data", "t.h5", "--steps", "68719476737"},
                  "--steps must be in [0, 68719476736], found 68719476737");
  // The bounds themselves are accepted.
  const Config c = parse_valid({"--prefetch", "64", "--seed", "9223372036854775807", "--eps", "1", "--global-batch",
                                "16777216", "--threads", "0"});
  EXPECT_EQ(c.training.seed, uint64_t{9223372036854775807u});
  EXPECT_EQ(c.data.prefetch, 64);
}

TEST(Config, RequiredOptions) {
  expect_rejected({"--steps", "1"}, "--data is required: an HDF5 file, a directory of .h5 shards, or a glob");
  expect_rejected({"--data", "train.h5"}, "give --epochs or --steps (how long to train)");
  expect_rejected({"--data", "train.h5", "--steps=-1"}, "--steps must be in [0, 68719476736], found -1");
  EXPECT_TRUE(parse({"--data", "train.h5", "--dry-run"}).has_value());
  EXPECT_TRUE(parse({"--eval-only", "--init-from", "ck.h5", "--val-data", "val.h5"}).has_value());
  expect_rejected({"--steps", "1", "--bogus", "1"}, "(see --help)");
  expect_rejected({"--data", "a.h5", "b.h5", "--steps", "1"}, "unexpected argument 'b.h5'");
}

TEST(Config, ValidateAConfigBuiltInCode) {
  Config c;
  c.data.train = "train.h5";
  c.training.steps = 1;
  EXPECT_NO_THROW(validate(c));
  c.layout.bucket_mb = 0;
  EXPECT_THROW(validate(c), Error);
  c.layout.bucket_mb = 1;
  c.layout.zero = 3;
  EXPECT_NO_THROW(validate(c));
  c.runtime.comm = Transport::Nccl;
  EXPECT_THROW(validate(c), Error);
  c.runtime.device = DeviceKind::CUDA;
  EXPECT_NO_THROW(validate(c));
}

TEST(Config, CommandLineOverridesTheConfigFile) {
  const TempFile ini(
      "data = file.h5\nsteps = 7\nglobal-batch = 32\nprecision = bf16\nschedule = gpipe\noptimizer = adamw\n");
  const std::optional<Config> from_file = parse({"--config", ini.path()});
  ASSERT_TRUE(from_file.has_value());
  EXPECT_EQ(from_file->data.train, "file.h5");
  EXPECT_EQ(from_file->training.steps, 7);
  EXPECT_EQ(from_file->layout.global_batch, 32);
  EXPECT_EQ(from_file->layout.precision, DType::BF16);
  EXPECT_EQ(from_file->layout.schedule, ScheduleKind::GPipe);
  EXPECT_EQ(from_file->training.optimizer.name, "adamw");
  EXPECT_EQ(effective(*from_file, "precision"), "bf16");

  const std::optional<Config> c =
      parse({"--config", ini.path(), "--global-batch", "16", "--precision", "fp16", "--schedule", "1f1b"});
  ASSERT_TRUE(c.has_value());
  EXPECT_EQ(c->layout.global_batch, 16);
  EXPECT_EQ(c->layout.precision, DType::F16);
  EXPECT_EQ(c->layout.schedule, ScheduleKind::OneFOneB);
  EXPECT_EQ(c->data.train, "file.h5");  // not given on the command line: the file's
  EXPECT_EQ(c->training.steps, 7);
  EXPECT_EQ(effective(*c, "precision"), "fp16");

  // A bad value in the file is the same error as on the command line; the command line wins.
  const TempFile bad("data = file.h5\nsteps = 1\nprecision = fp8\n");
  expect_rejected({"--config", bad.path()}, "--precision must be fp32, bf16 or fp16, found 'fp8'");
  EXPECT_EQ(parse({"--config", bad.path(), "--precision", "bf16"})->layout.precision, DType::BF16);
}

// --run-dir: {time} becomes the start time, the paths not given go into the directory, and the
// config.ini written there repeats the run: parsed back, it gives the same options, with
// --run-dir as written (a new directory) and without the paths --run-dir chose.
TEST(Config, RunDirectoryHoldsTheRunAndItsConfiguration) {
  Config c = parse_valid({"--run-dir", "runs/x-{time}", "--lr", "0.2", "--metrics", "m.jsonl"});
  std::tm t{};
  t.tm_year = 2026 - 1900;
  t.tm_mon = 11;
  t.tm_mday = 4;
  t.tm_hour = 21;
  t.tm_min = 15;
  t.tm_sec = 7;
  t.tm_isdst = -1;
  apply_run_dir(c, std::mktime(&t));
  EXPECT_EQ(c.run_dir, "runs/x-20261204-211507");
  EXPECT_EQ(c.checkpoint.dir, "runs/x-20261204-211507");
  EXPECT_EQ(c.monitor.log_file, "runs/x-20261204-211507/train.log");
  EXPECT_EQ(c.monitor.metrics, "m.jsonl");                              // given: kept
  EXPECT_EQ(effective(c, "checkpoint-dir"), "runs/x-20261204-211507");  // what checkpoints record
  EXPECT_EQ(given_options(c), "--data train.h5 --lr 0.2 --metrics m.jsonl --run-dir runs/x-{time} --steps 1");

  const std::string text = run_config_text(c, "runs/x-{time}");
  EXPECT_NE(text.find("# The configuration of the run in runs/x-20261204-211507"), std::string::npos) << text;
  EXPECT_EQ(text.find("checkpoint-dir"), std::string::npos) << text;
  EXPECT_EQ(text.find("log-file = runs"), std::string::npos) << text;
  const TempFile ini(text);
  const std::optional<Config> again = parse({"--config", ini.path()});
  ASSERT_TRUE(again.has_value());
  EXPECT_EQ(again->run_dir, "runs/x-{time}");
  EXPECT_EQ(again->monitor.metrics, "m.jsonl");
  EXPECT_EQ(again->training.lr_schedule.lr, 0.2f);
  EXPECT_EQ(again->training.steps, 1);
  EXPECT_EQ(again->data.train, "train.h5");
  EXPECT_TRUE(again->checkpoint.dir.empty());  // --run-dir places it again
  for (const auto& [key, value] : c.effective) {
    if (key != "config" && key != "run-dir" && key != "checkpoint-dir" && key != "log-file") {
      EXPECT_EQ(effective(*again, key), value) << key;
    }
  }

  Config plain = parse_valid();
  apply_run_dir(plain, 0);
  EXPECT_TRUE(plain.checkpoint.dir.empty());
  EXPECT_TRUE(plain.monitor.log_file.empty());
}

TEST(Config, ConfigFileErrors) {
  expect_rejected({"--config", "/nonexistent/run.ini"}, "--config: cannot read '/nonexistent/run.ini'");
  const TempFile nested("config = other.ini\n");
  expect_rejected({"--config", nested.path()}, "a config file cannot include another");
}

// What a new user met (#22): no prefix guessing (--epoch is not quietly --epochs: one line
// naming the nearest option), --help shows defaults as written (not 0.0500000007), --version,
// and an error in a config file names the file and the line.
TEST(Config, UnknownOptionsNameTheNearest) {
  expect_rejected_with_data({"--epoch", "3"}, "unknown option '--epoch'; did you mean --epochs?");
  expect_rejected_with_data({"--lr-shedule", "cosine"}, "unknown option '--lr-shedule'; did you mean --lr-schedule?");
  expect_rejected_with_data({"--zzzzzz", "1"}, "unknown option '--zzzzzz' (see --help)");
}

std::string printed(const Args& args) {
  std::vector<const char*> argv{"train"};
  for (const std::string& a : args) argv.push_back(a.c_str());
  testing::internal::CaptureStdout();
  EXPECT_FALSE(parse_config(static_cast<int>(argv.size()), argv.data(), true).has_value());
  return testing::internal::GetCapturedStdout();
}

TEST(Config, HelpShowsDefaultsAsWritten) {
  const std::string help = printed({"--help"});
  for (const char* shown : {"--lr arg (=0.05 for sgd, 0.001 for adamw)", "--momentum arg (=0.9)",
                            "--lr-gamma arg (=0.1)", "--eps arg (=1e-08)"})
    EXPECT_NE(help.find(shown), std::string::npos) << shown;
  // A float's binary value (0.050000000745...) would show a run of zeros or nines after the point.
  EXPECT_FALSE(std::regex_search(help, std::regex(R"(\.\d*(00000|99999)\d)"))) << "a float's binary value shown";
}

TEST(Config, VersionNamesTheBuild) {
  const std::string version = printed({"--version"});
  EXPECT_TRUE(version.starts_with("strata 0.")) << version;
  EXPECT_NE(version.find("HDF5 1."), std::string::npos) << version;
  EXPECT_TRUE(version.find(" parallel") != std::string::npos || version.find(" serial") != std::string::npos)
      << version;
  EXPECT_NE(version.find("C++ compiled for "), std::string::npos) << version;  // the -march, or portable
  EXPECT_NE(version.find(", bf16 GEMMs "), std::string::npos) << version;      // on which units, or widened
  EXPECT_EQ(std::count(version.begin(), version.end(), '\n'), 1) << version;
}

TEST(Config, ConfigFileErrorsNameTheLine) {
  const TempFile unknown("steps = 3\n# a comment\nepoch = 2\n");
  expect_rejected({"--data", "x.h5", "--config", unknown.path()},
                  "--config " + unknown.path() + " line 3: unknown option '--epoch'; did you mean --epochs?");
  const TempFile bad_value("data = x.h5\nsteps = many\n");
  expect_rejected({"--config", bad_value.path()}, "--config " + bad_value.path() + " line 2: ");
  const TempFile twice("steps = 2\nlr = 0.1\nmodel = mlp\nlr = 0.2\n");  // the second is the error
  expect_rejected({"--data", "x.h5", "--config", twice.path()},
                  "--config " + twice.path() + " line 4: 'lr' is set again (first on line 2); give each option once");
}

// --deepspeed-config: a ds_config's keys give exactly the options of the flags they map to
// (docs/migration.md's table), flags win over it, unmapped keys are listed (an error with
// --strict-config), and what Strata cannot reproduce is one line.
std::vector<std::pair<std::string, std::string>> options_of(const Config& c) {
  std::vector<std::pair<std::string, std::string>> out;
  for (const auto& kv : c.effective)
    if (kv.first != "deepspeed-config") out.push_back(kv);
  return out;
}

TEST(Config, DeepSpeedKeysEqualTheirFlags) {
  const TempFile ds(R"({
    "train_batch_size": 64, "train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 4,
    "gradient_clipping": 1.0, "steps_per_print": 10, "seed": 7,
    "zero_optimization": {"stage": 2, "reduce_bucket_size": 5e5, "overlap_comm": true, "contiguous_gradients": true},
    "fp16": {"enabled": true, "loss_scale": 0, "initial_scale_power": 12, "loss_scale_window": 500},
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.8, 0.95], "eps": 1e-6, "weight_decay": 0.1}},
    "scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 1000, "warmup_num_steps": 100,
                                                       "cos_min_ratio": 0.1, "warmup_type": "linear"}},
    "pipeline": {"stages": 2}
  })");
  const Config from_json = parse_valid({"--deepspeed-config", ds.path()});
  const Config from_flags = parse_valid({"--global-batch",
                                         "64",
                                         "--micro-batch",
                                         "8",
                                         "--clip-grad",
                                         "1",
                                         "--log-every",
                                         "10",
                                         "--seed",
                                         "7",
                                         "--zero",
                                         "2",
                                         "--bucket-mb",
                                         "1.9073486328125",
                                         "--precision",
                                         "fp16",
                                         "--loss-scale",
                                         "dynamic",
                                         "--loss-scale-init",
                                         "4096",
                                         "--loss-scale-window",
                                         "500",
                                         "--optimizer",
                                         "adamw",
                                         "--lr",
                                         "0.0003",
                                         "--beta1",
                                         "0.8",
                                         "--beta2",
                                         "0.95",
                                         "--eps",
                                         "1e-06",
                                         "--weight-decay",
                                         "0.1",
                                         "--lr-schedule",
                                         "cosine",
                                         "--warmup-steps",
                                         "100",
                                         "--min-lr",
                                         "3e-05",
                                         "--pp",
                                         "2"});
  EXPECT_EQ(options_of(from_json), options_of(from_flags));
  EXPECT_TRUE(from_json.deepspeed_unsupported.empty());
  EXPECT_EQ(from_json.layout.gradient_accumulation, 4);
  EXPECT_EQ(from_json.training.steps, 1);  // --steps on the command line wins over total_num_steps
  // Flags and --config win over the JSON.
  EXPECT_FLOAT_EQ(parse_valid({"--deepspeed-config", ds.path(), "--lr", "0.01"}).training.lr_schedule.lr, 0.01f);
  const TempFile ini("zero = 1\n");
  EXPECT_EQ(parse_valid({"--deepspeed-config", ds.path(), "--config", ini.path()}).layout.zero, 1);
}

TEST(Config, DeepSpeedUnmappedKeysAreListed) {
  // Modelled on DeepSpeedExamples' training/cifar/ds_config.json.
  const TempFile ds(R"({
    "train_batch_size": 16, "steps_per_print": 2000,
    "optimizer": {"type": "Adam", "params": {"lr": 0.001, "betas": [0.8, 0.999], "eps": 1e-8, "weight_decay": 3e-7}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 0.001, "warmup_num_steps": 1000}},
    "gradient_clipping": 1.0, "prescale_gradients": false,
    "fp16": {"enabled": true, "fp16_master_weights_and_grads": false, "loss_scale": 0, "loss_scale_window": 500,
             "hysteresis": 2, "min_loss_scale": 1, "initial_scale_power": 15},
    "wall_clock_breakdown": false,
    "zero_optimization": {"stage": 0, "allgather_partitions": true, "reduce_scatter": true,
                          "allgather_bucket_size": 50000000, "reduce_bucket_size": 50000000, "overlap_comm": true,
                          "contiguous_gradients": true, "cpu_offload": false}
  })");
  const Config c = parse_valid({"--deepspeed-config", ds.path()});
  EXPECT_EQ(c.deepspeed_unsupported,
            (std::vector<std::string>{
                "fp16.fp16_master_weights_and_grads", "fp16.hysteresis", "fp16.min_loss_scale", "prescale_gradients",
                "scheduler.params.warmup_type (log, the default; Strata warms up linearly)", "wall_clock_breakdown",
                "zero_optimization.allgather_bucket_size", "zero_optimization.cpu_offload"}));
  EXPECT_EQ(c.training.optimizer.name, "adamw");
  EXPECT_EQ(c.layout.precision, DType::F16);
  EXPECT_EQ(c.layout.global_batch, 16);
  EXPECT_EQ(c.training.lr_schedule.warmup_steps, 1000);
  EXPECT_FLOAT_EQ(c.training.optimizer.beta1, 0.8f);
  expect_rejected_with_data({"--deepspeed-config", ds.path(), "--strict-config"},
                            "not supported: fp16.fp16_master_weights_and_grads, fp16.hysteresis");
}

// WarmupDecayLR: linear warm-up to warmup_max_lr, then linearly down to warmup_min_lr at
// total_num_steps: --lr-schedule linear.
TEST(Config, DeepSpeedWarmupDecayIsTheLinearSchedule) {
  const TempFile ds(R"({"scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 300,
    "warmup_min_lr": 0.0001, "warmup_max_lr": 0.002, "warmup_num_steps": 20, "warmup_type": "linear"}}})");
  const Config c = parse_valid({"--deepspeed-config", ds.path()});
  EXPECT_TRUE(c.deepspeed_unsupported.empty());
  EXPECT_EQ(c.training.lr_schedule.kind, "linear");
  EXPECT_FLOAT_EQ(c.training.lr_schedule.lr, 0.002f);
  EXPECT_FLOAT_EQ(c.training.lr_schedule.min_lr, 0.0001f);
  EXPECT_EQ(c.training.lr_schedule.warmup_steps, 20);
  EXPECT_EQ(c.training.steps, 1);  // the command line's --steps (parse_valid's) wins over total_num_steps
}

TEST(Config, DeepSpeedValuesStrataCannotReproduceAreOneLine) {
  const TempFile both(R"({"fp16": {"enabled": true}, "bf16": {"enabled": true}})");
  expect_rejected_with_data({"--deepspeed-config", both.path()}, "fp16.enabled and bf16.enabled are both true");
  const TempFile cycle(R"({"scheduler": {"type": "OneCycle", "params": {"cycle_max_lr": 0.1}}})");
  expect_rejected_with_data({"--deepspeed-config", cycle.path()}, "OneCycle is not supported");
  const TempFile lamb(R"({"optimizer": {"type": "Lamb", "params": {"lr": 0.1}}})");
  expect_rejected_with_data({"--deepspeed-config", lamb.path()}, "must be Adam, AdamW or SGD, found 'Lamb'");
  const TempFile broken("{\"train_batch_size\": 16,\n  \"fp16\": {\n");
  expect_rejected_with_data({"--deepspeed-config", broken.path()}, "line 3");
  const TempFile word(R"({"train_batch_size": "many"})");
  expect_rejected_with_data({"--deepspeed-config", word.path()}, "'train_batch_size' must be a number, found 'many'");
}

TEST(Config, DeepSpeedValuesOfTheWrongTypeAreOneLine) {
  const std::vector<std::pair<std::string, std::string>> cases{
      {R"({"optimizer": "AdamW"})", "'optimizer' must be an object (of its keys such as 'type'), found string AdamW"},
      {R"({"zero_optimization": 3})",
       "'zero_optimization' must be an object (of its keys such as 'stage'), found number 3"},
      {R"([{"train_batch_size": 8}])", "expected a JSON object of DeepSpeed keys, found array"},
      {"7", "expected a JSON object of DeepSpeed keys, found number"},
      {R"({"train_batch_size": 8.5})", "'train_batch_size' must be an integer (of at most 2^53), found 8.5"},
      {R"({"train_batch_size": 1e23})", "'train_batch_size' must be an integer (of at most 2^53), found "},
      {R"({"fp16": {"enabled": "yes"}})", "'fp16.enabled' must be true or false, found yes"},
      {R"({"optimizer": {"type": 1}})", "'optimizer.type' must be a string, found 1"},
      {R"({"optimizer": {"type": "SGD", "params": {"betas": 0.9}}})", "'optimizer.params.betas' must hold two numbers"},
  };
  for (const auto& [json, message] : cases) {
    const TempFile file(json);
    expect_rejected_with_data({"--deepspeed-config", file.path()}, message);
  }
  // Hugging Face Trainer's "auto" leaves the flag (or its default) in charge.
  const TempFile automatic(R"({"train_batch_size": "auto", "gradient_clipping": "auto", "optimizer": {"type": "AdamW",
                               "params": {"lr": "auto"}}})");
  const Config c = parse_valid({"--deepspeed-config", automatic.path(), "--lr", "0.001"});
  EXPECT_EQ(c.layout.global_batch, 64);
  EXPECT_EQ(c.training.optimizer.name, "adamw");
  EXPECT_FLOAT_EQ(c.training.lr_schedule.lr, 0.001f);
  EXPECT_TRUE(c.deepspeed_unsupported.empty());
}

TEST(Config, DeepSpeedDeepNestingIsOneLine) {
  // A recursive parser would overflow the stack (a crash, no message); nesting is refused early.
  for (const auto& [open, close] : {std::pair{"[", "]"}, std::pair{"{\"a\": ", "}"}}) {
    std::string json;
    for (int i = 0; i < 100000; ++i) json += open;
    json += "1";
    for (int i = 0; i < 100000; ++i) json += close;
    const TempFile deep(json);
    expect_rejected_with_data({"--deepspeed-config", deep.path()}, "nested deeper than 32 levels");
    const TempFile ini("deepspeed-config = " + deep.path() + "\n");
    expect_rejected_with_data({"--config", ini.path()}, "nested deeper than 32 levels");
  }
  const std::string dir = std::filesystem::temp_directory_path().string();
  expect_rejected_with_data({"--deepspeed-config", dir}, "--deepspeed-config: cannot read '" + dir);
}

}  // namespace
}  // namespace strata::train
