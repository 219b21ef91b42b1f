// The training checkpoint schema (io/checkpoint/run_state.hpp) through real checkpoint files: the
// run state's root attributes round trip, tensor names, and read_model_value's choice between
// the model tensor and the f32 master weights. And the --metrics writer: the exact JSON line,
// drop_after on resume, and a failed write that warns once and goes on.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <limits>
#include <sstream>
#include <string>

#include "io/checkpoint/file.hpp"
#include "io/checkpoint/run_state.hpp"
#include "io/metrics.hpp"
#include "io_test_util.hpp"

namespace strata::io {
namespace {

Tensor arange(Shape shape, float start) {
  Tensor t = Tensor::empty(std::move(shape));
  for (int64_t i = 0; i < t.numel(); ++i) t.data<float>()[i] = start + 0.25f * static_cast<float>(i);
  return t;
}

bool equal(const Tensor& a, const Tensor& b) {
  if (a.shape() != b.shape()) return false;
  for (int64_t i = 0; i < a.numel(); ++i)
    if (a.data<float>()[i] != b.data<float>()[i]) return false;
  return true;
}

// ---- names ---------------------------------------------------------------------------------

TEST(TrainingState, TensorNames) {
  EXPECT_EQ(model_tensor("fc1/weight"), "model/fc1/weight");
  EXPECT_EQ(optimizer_tensor("momentum", "fc1/weight"), "optimizer/momentum/fc1/weight");
  EXPECT_EQ(optimizer_tensor("master", "block2_1/conv1/weight"), "optimizer/master/block2_1/conv1/weight");
  EXPECT_EQ(state_tensor("", "fc1/weight"), "model/fc1/weight");
  EXPECT_EQ(state_tensor("exp_avg_sq", "fc1/bias"), "optimizer/exp_avg_sq/fc1/bias");
}

// ---- run state -----------------------------------------------------------------------------

RunState known_state() {
  RunState s;
  s.step = 1200;
  s.optimizer_step = 1187;
  s.epoch = 3;
  s.step_in_epoch = 41;
  s.seed = 0xFEDCBA9876543210ull;  // above INT64_MAX: stored as int64, must come back unchanged
  s.global_batch = 256;
  s.model = "resnet";
  s.optimizer = "adamw";
  s.precision = "fp16";
  s.num_classes = 10;
  s.loss_scale = 32768.0;
  s.loss_scale_good_steps = 517;
  s.has_loss_scale = true;
  s.log_window_loss = 0.4375;
  s.log_window_steps = 7;
  s.config = "lr = 0.1\nzero = 2\n";
  return s;
}

void expect_same(const RunState& got, const RunState& want) {
  EXPECT_EQ(got.step, want.step);
  EXPECT_EQ(got.optimizer_step, want.optimizer_step);
  EXPECT_EQ(got.epoch, want.epoch);
  EXPECT_EQ(got.step_in_epoch, want.step_in_epoch);
  EXPECT_EQ(got.seed, want.seed);
  EXPECT_EQ(got.global_batch, want.global_batch);
  EXPECT_EQ(got.model, want.model);
  EXPECT_EQ(got.optimizer, want.optimizer);
  EXPECT_EQ(got.precision, want.precision);
  EXPECT_EQ(got.num_classes, want.num_classes);
  EXPECT_EQ(got.loss_scale, want.loss_scale);
  EXPECT_EQ(got.loss_scale_good_steps, want.loss_scale_good_steps);
  EXPECT_EQ(got.has_loss_scale, want.has_loss_scale);
  EXPECT_EQ(got.log_window_loss, want.log_window_loss);
  EXPECT_EQ(got.log_window_steps, want.log_window_steps);
  EXPECT_EQ(got.config, want.config);
}

TEST(TrainingState, RunStateRoundTripsThroughACheckpoint) {
  test::TempDir dir;
  const std::string path = dir / "step-00001200.h5";
  {
    CheckpointWriter w(path);
    write_run_state(w, known_state());
    w.commit();
  }
  const CheckpointReader r(path);
  EXPECT_EQ(r.attr_int("format_version"), kCheckpointFormatVersion);
  expect_same(read_run_state(r), known_state());
}

TEST(TrainingState, RunStateWithoutALossScaleStillWritesOne) {
  // Every run writes its loss scale (1 without scaling), so has_loss_scale reads back true.
  test::TempDir dir;
  RunState s = known_state();
  s.loss_scale = 1.0;
  s.loss_scale_good_steps = 0;
  s.has_loss_scale = false;
  {
    CheckpointWriter w(dir / "c.h5");
    write_run_state(w, s);
    w.commit();
  }
  const RunState got = read_run_state(CheckpointReader(dir / "c.h5"));
  EXPECT_TRUE(got.has_loss_scale);
  EXPECT_EQ(got.loss_scale, 1.0);
  EXPECT_EQ(got.loss_scale_good_steps, 0);
}

TEST(TrainingState, OlderFilesReadWithDefaults) {
  // The attributes of the first version-2 files only.
  test::TempDir dir;
  {
    CheckpointWriter w(dir / "old.h5");
    w.set_attr("step", 50);
    w.set_attr("optimizer_step", 50);
    w.set_attr("epoch", 1);
    w.set_attr("step_in_epoch", 2);
    w.set_attr("global_batch", 64);
    w.set_attr("optimizer", "sgd");
    w.commit();
  }
  const RunState got = read_run_state(CheckpointReader(dir / "old.h5"));
  RunState want;
  want.step = 50;
  want.optimizer_step = 50;
  want.epoch = 1;
  want.step_in_epoch = 2;
  want.global_batch = 64;
  want.optimizer = "sgd";
  expect_same(got, want);
}

TEST(TrainingState, MissingRequiredAttributeIsAnInputErrorNamingIt) {
  test::TempDir dir;
  {
    CheckpointWriter w(dir / "c.h5");
    w.set_attr("step", 50);
    w.set_attr("optimizer_step", 50);
    w.set_attr("epoch", 1);
    w.set_attr("global_batch", 64);  // no step_in_epoch
    w.set_attr("optimizer", "sgd");
    w.commit();
  }
  const CheckpointReader r(dir / "c.h5");
  test::expect_input_error([&] { read_run_state(r); }, {"step_in_epoch"});
}

// A file's numbers are held to the ranges the options have (a file from before manifests has only
// these checks): one line naming the attribute, its range and the value found.
TEST(TrainingState, AttributesOutOfRangeAreRefusedNamingThem) {
  test::TempDir dir;
  const auto expect_refused = [&](const std::string& attr, auto value, const std::string& message) {
    const std::string path = dir / (attr + ".h5");
    {
      CheckpointWriter w(path);
      RunState s = known_state();
      s.optimizer_step = s.step;
      write_run_state(w, s);
      w.set_attr(attr, value);
      w.commit();
    }
    test::expect_input_error([&] { read_run_state(CheckpointReader(path)); }, {message});
  };
  expect_refused("global_batch", int64_t{1} << 62,
                 "attribute global_batch must be in [1, 16777216], found 4611686018427387904");
  expect_refused("global_batch", int64_t{0}, "attribute global_batch must be in [1, 16777216], found 0");
  expect_refused("optimizer_step", known_state().step + 1, "attribute optimizer_step must be in [0, ");
  expect_refused("num_classes", int64_t{-3}, "attribute num_classes must be in [0, 16777216], found -3");
  expect_refused("loss_scale", 0.0, "attribute loss_scale must be positive and finite, found 0");
  expect_refused("loss_scale_good_steps", int64_t{-1}, "attribute loss_scale_good_steps must be in [0, ");
  expect_refused("log_window_steps", int64_t{-2}, "attribute log_window_steps must be in [0, ");
}

// ---- read_model_value ----------------------------------------------------------------------

// A checkpoint with fc1/weight (model and master), fc1/bias (model only), fc2/weight (model,
// and a master of the wrong shape).
std::string write_model_checkpoint(const test::TempDir& dir) {
  const std::string path = dir / "model.h5";
  CheckpointWriter w(path);
  w.write_tensor(model_tensor("fc1/weight"), arange({3, 2}, 1.0f));
  w.write_tensor(optimizer_tensor("master", "fc1/weight"), arange({3, 2}, 1.0625f));
  w.write_tensor(optimizer_tensor("momentum", "fc1/weight"), arange({3, 2}, -7.0f));
  w.write_tensor(model_tensor("fc1/bias"), arange({3}, -1.0f));
  w.write_tensor(model_tensor("fc2/weight"), arange({2, 3}, 5.0f));
  w.write_tensor(optimizer_tensor("master", "fc2/weight"), arange({3, 2}, 5.0f));
  w.commit();
  return path;
}

TEST(TrainingState, ReadModelValuePrefersTheMasterWeightsOfTrainableEntries) {
  test::TempDir dir;
  const CheckpointReader r(write_model_checkpoint(dir));
  Tensor out = Tensor::empty({3, 2});
  read_model_value(r, "fc1/weight", /*trainable=*/true, out);
  EXPECT_TRUE(equal(out, arange({3, 2}, 1.0625f))) << "the f32 master weights";
  read_model_value(r, "fc1/weight", /*trainable=*/false, out);
  EXPECT_TRUE(equal(out, arange({3, 2}, 1.0f))) << "the model tensor (not trainable: no master)";
  Tensor bias = Tensor::empty({3});
  read_model_value(r, "fc1/bias", /*trainable=*/true, bias);
  EXPECT_TRUE(equal(bias, arange({3}, -1.0f))) << "no master saved: the model tensor";
}

TEST(TrainingState, ReadModelValueErrorsNameTheTensor) {
  test::TempDir dir;
  const CheckpointReader r(write_model_checkpoint(dir));
  Tensor out = Tensor::empty({3, 2});
  test::expect_input_error([&] { read_model_value(r, "fc3/weight", true, out); },
                           {"model/fc3/weight", "different --model"});
  // Misshapen: the model tensor is named (checked before any master is looked at).
  Tensor wrong = Tensor::empty({2, 2});
  test::expect_input_error([&] { read_model_value(r, "fc1/weight", true, wrong); }, {"model/fc1/weight"});
  test::expect_input_error([&] { read_model_value(r, "fc1/weight", false, wrong); }, {"model/fc1/weight"});
  // A master of another shape than its model tensor is a broken file: an Input error too.
  Tensor fc2 = Tensor::empty({2, 3});
  test::expect_input_error([&] { read_model_value(r, "fc2/weight", true, fc2); }, {"optimizer/master/fc2/weight"});
  // Nothing was written into `out` by the failed reads.
  Tensor untouched = arange({3, 2}, 100.0f);
  test::expect_input_error([&] { read_model_value(r, "fc3/weight", true, untouched); }, {"model/fc3/weight"});
  EXPECT_TRUE(equal(untouched, arange({3, 2}, 100.0f)));
}

// ---- metrics -------------------------------------------------------------------------------

std::string read_all(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// A progress record with its first fields set (the others zero or unknown).
ProgressRecord progress(int64_t step, int64_t epoch, double loss, double lr, double samples_per_s) {
  ProgressRecord r;
  r.step = step;
  r.epoch = epoch;
  r.loss = loss;
  r.lr = lr;
  r.samples_per_s = samples_per_s;
  return r;
}

TEST(Metrics, AppendWritesOneJsonLinePerRecord) {
  test::TempDir dir;
  const std::string path = dir / "metrics.jsonl";
  MetricsWriter w(path);
  ProgressRecord a = progress(3, 1, 0.1234567, 0.001, 1234.56);
  a.step_time_s = 0.0125;
  a.tflops_per_rank = 0.5;
  a.dp_bytes_per_step = 4096;
  a.tp_bytes_per_step = 512;
  a.peak_bytes = 1 << 20;
  a.eta_s = 61.04;
  ProgressRecord b = progress(4, 2, 2.5, 0.05, 10.0);
  b.tokens_per_s = 10240.0;
  b.step_time_s = 0.1;
  b.split = StepSplit{0.5, 0.25, 0.125, 0.125};
  b.mfu = 0.123456;
  b.straggler = Straggler{3, "node2", 0.5, "compute"};
  w.append(a);
  w.append(b);
  EXPECT_EQ(read_all(path),
            "{\"step\": 3, \"epoch\": 1, \"loss\": 0.123457, \"lr\": 0.001, \"samples_per_s\": 1234.6, "
            "\"step_time_s\": 0.012500, \"split\": null, \"tflops_per_rank\": 0.5, \"mfu\": null, "
            "\"dp_bytes_per_step\": 4096, \"tp_bytes_per_step\": 512, \"peak_bytes\": 1048576, \"eta_s\": 61.0, "
            "\"straggler\": null}\n"
            "{\"step\": 4, \"epoch\": 2, \"loss\": 2.500000, \"lr\": 0.05, \"samples_per_s\": 10.0, "
            "\"tokens_per_s\": 10240.0, \"step_time_s\": 0.100000, \"split\": {\"compute\": 0.5000, \"comm\": 0.2500, "
            "\"pipeline\": 0.1250, \"data\": 0.1250}, \"tflops_per_rank\": 0, \"mfu\": 0.1235, "
            "\"dp_bytes_per_step\": 0, \"tp_bytes_per_step\": 0, \"peak_bytes\": 0, \"eta_s\": 0.0, "
            "\"straggler\": {\"rank\": 3, \"host\": \"node2\", \"slower\": 0.5, \"cause\": \"compute\"}}\n");
}

// The split is each rank's share averaged over the ranks (compute the rest), and the console
// line carries every field: tokens/s for a language model, the waits (compute is the rest), n/a
// without a split, MFU when known.
TEST(Metrics, ProgressLineAndTheSplitOverRanks) {
  const StepSplit split = average_split({{1.0, 0.5, 0.0, 0.1}, {2.0, 0.0, 1.0, 0.2}});
  EXPECT_DOUBLE_EQ(split.comm, 0.25);
  EXPECT_DOUBLE_EQ(split.pipeline, 0.25);
  EXPECT_DOUBLE_EQ(split.data, 0.1);
  EXPECT_DOUBLE_EQ(split.compute, 0.4);
  EXPECT_DOUBLE_EQ(average_split({{1.0, 0.9, 0.3, 0.0}}).compute, 0.0);  // waits overlapping: never below 0

  ProgressRecord r = progress(8, 0, 1.05663, 0.05, 196385.4);
  r.step_time_s = 0.000163;
  r.split = StepSplit{0.03, 0.51, 0.36, 0.10};
  r.mfu = 0.0344;
  r.peak_bytes = 3205184;
  r.eta_s = 3725;
  EXPECT_EQ(progress_line(r, 12),
            "step 8/12  epoch 0  loss 1.0566  lr 0.05  196385 samples/s  0.2 ms (comm 51%, pipeline 36%, data 10%)"
            "  MFU 3.4%  mem 3.06 MiB  eta 1h02m");
  r.split = StepSplit{0.996, 0.004, 0.0, 0.0};  // nothing but compute: no parenthesis
  EXPECT_NE(progress_line(r, 12).find("  0.2 ms  MFU 3.4%"), std::string::npos);
  r.tokens_per_s = 12.5e6;
  r.split.reset();
  r.mfu.reset();
  r.peak_bytes = int64_t{3} << 30;
  EXPECT_NE(progress_line(r, 12).find("mem 3.00 GiB"), std::string::npos);
  r.peak_bytes = 20864;  // a tiny model's: not "0.0 MiB"
  EXPECT_NE(progress_line(r, 12).find("mem 20.38 KiB"), std::string::npos);
  r.peak_bytes = int64_t{3} << 30;
  r.eta_s = 61;
  EXPECT_EQ(progress_line(r, 12),
            "step 8/12  epoch 0  loss 1.0566  lr 0.05  12500000 tokens/s  0.2 ms (split n/a under NCCL)  mem "
            "3.00 GiB  eta 1m01s");
}

// The straggler: the rank whose busy time (the window less its waits on others) exceeds the
// median of its stage's other ranks by more than 15% and 2 ms per step; its cause what its excess
// is made of; ranks of other stages (other work) are not compared with it.
TEST(Metrics, StragglerIsTheBusiestRankOfItsStage) {
  // 10 steps of 1 s windows: rank 2 computes 0.6 s where the others compute 0.4 s and wait.
  std::vector<RankWindow> w{{1.0, 0.6, 0, 0}, {1.0, 0.6, 0, 0}, {1.0, 0.4, 0, 0}, {1.0, 0.6, 0, 0}};
  std::optional<Straggler> s = find_straggler(w, 10);
  ASSERT_TRUE(s);
  EXPECT_EQ(s->rank, 2);
  EXPECT_NEAR(s->slower, 0.5, 1e-12);  // 0.6 against 0.4
  EXPECT_EQ(s->cause, "compute");
  w[2] = {1.0, 0.4, 0, 0.19};  // its excess is its loader's
  EXPECT_EQ(find_straggler(w, 10)->cause, "data");
  w[2] = {1.0, 0.55, 0, 0};  // 0.45 against 0.4: 12.5%, within the noise
  EXPECT_FALSE(find_straggler(w, 10));
  w[2] = {1.0, 0.4, 0, 0};
  EXPECT_FALSE(find_straggler(w, 200));  // 0.2 s over 200 steps: 1 ms a step, timer noise
  // Two stages of different work (pp 2 x dp 2): stage 1's ranks are busier than stage 0's by
  // their layers, not by a fault; a slow rank of stage 1 is compared with stage 1's other rank.
  const std::vector<RankWindow> pp{{1.0, 0.7, 0, 0, 0}, {1.0, 0.7, 0, 0, 0}, {1.0, 0.4, 0, 0, 1}, {1.0, 0.4, 0, 0, 1}};
  EXPECT_FALSE(find_straggler(pp, 10));
  std::vector<RankWindow> slow = pp;
  slow[3].comm_s = 0.1;  // 0.9 s busy against its stage peer's 0.6
  EXPECT_EQ(find_straggler(slow, 10)->rank, 3);
  EXPECT_FALSE(find_straggler({{1.0, 0.0, 0, 0}}, 10));  // alone: nothing to compare with

  ProgressRecord r = progress(8, 0, 1.05663, 0.05, 196385.4);
  r.step_time_s = 0.000163;
  r.straggler = Straggler{3, "node2", 0.4512, "compute"};
  EXPECT_TRUE(progress_line(r, 12).ends_with("  slow: rank 3 (node2) +45% compute")) << progress_line(r, 12);
}

TEST(Metrics, EmptyPathWritesNothing) {
  MetricsWriter w("");
  EXPECT_NO_THROW(w.append(progress(1, 0, 1.0, 0.1, 1.0)));
  EXPECT_NO_THROW(w.drop_after(0));
}

TEST(Metrics, DropAfterRemovesOnlyLaterSteps) {
  test::TempDir dir;
  const std::string path = dir / "metrics.jsonl";
  MetricsWriter w(path);
  for (int64_t step : {10, 20, 30, 40}) w.append(progress(step, 0, 1.0, 0.1, 100.0));
  const std::string all = read_all(path);
  const auto line_of = [&](int64_t step) {
    std::ostringstream os;
    os << "{\"step\": " << step << ", \"epoch\": 0, \"loss\": 1.000000, \"lr\": 0.1, \"samples_per_s\": 100.0, "
       << "\"step_time_s\": 0.000000, \"split\": null, \"tflops_per_rank\": 0, \"mfu\": null, "
       << "\"dp_bytes_per_step\": 0, \"tp_bytes_per_step\": 0, \"peak_bytes\": 0, \"eta_s\": 0.0, \"straggler\": "
          "null}\n";
    return os.str();
  };
  ASSERT_EQ(all, line_of(10) + line_of(20) + line_of(30) + line_of(40));

  w.drop_after(40);  // nothing later: the file is left as it is
  EXPECT_EQ(read_all(path), all);
  w.drop_after(20);  // a resume from step 20 logs 30 and 40 again
  EXPECT_EQ(read_all(path), line_of(10) + line_of(20));
  EXPECT_FALSE(std::filesystem::exists(path + ".tmp"));
  w.append(progress(30, 0, 1.0, 0.1, 100.0));  // appending continues after the kept lines
  EXPECT_EQ(read_all(path), line_of(10) + line_of(20) + line_of(30));
  w.drop_after(0);
  EXPECT_EQ(read_all(path), "");
}

TEST(Metrics, DropAfterKeepsLinesItDoesNotRecognise) {
  test::TempDir dir;
  const std::string path = dir / "metrics.jsonl";
  {
    std::ofstream out(path);
    out << "{\"step\": 5}\nnot json\n{\"step\": 9}\n\n{\"step\": 2}\n";
  }
  MetricsWriter(path).drop_after(5);
  EXPECT_EQ(read_all(path), "{\"step\": 5}\nnot json\n\n{\"step\": 2}\n");
}

TEST(Metrics, DropAfterOnAMissingFileDoesNothing) {
  test::TempDir dir;
  const std::string path = dir / "none.jsonl";
  EXPECT_NO_THROW(MetricsWriter(path).drop_after(3));
  EXPECT_FALSE(std::filesystem::exists(path));
}

// Every record is one complete line, whatever its values: a huge (finite) loss or rate must not
// truncate the line and glue the next record onto it.
TEST(Metrics, HugeValuesStillMakeCompleteLines) {
  test::TempDir dir;
  const std::string path = dir / "metrics.jsonl";
  MetricsWriter w(path);
  const int64_t most = std::numeric_limits<int64_t>::max();
  ProgressRecord huge = progress(1, 0, 1e300, 0.1, 1e300);
  huge.tokens_per_s = huge.step_time_s = 1e300;
  huge.split = StepSplit{1e300, 1e300, 1e300, 1e300};
  huge.tflops_per_rank = huge.eta_s = 1e300;
  huge.mfu = 1e300;
  huge.dp_bytes_per_step = huge.tp_bytes_per_step = huge.peak_bytes = most;
  w.append(huge);
  w.append(progress(2, 0, 1.0, 0.1, 1.0));
  const std::string all = read_all(path);
  ASSERT_FALSE(all.empty());
  size_t lines = 0;
  for (char c : all) lines += c == '\n';
  EXPECT_EQ(lines, 2u) << all.size() << " bytes";
  EXPECT_EQ(all.substr(all.find('\n') - 1, 2), "}\n") << "the first line is cut short";
  EXPECT_NE(all.find("\"peak_bytes\": 9223372036854775807, \"eta_s\": "), std::string::npos);
}

TEST(Metrics, UnwritablePathWarnsOnceAndGoesOn) {
  if (!std::filesystem::exists("/dev/full")) GTEST_SKIP() << "no /dev/full";
  MetricsWriter w("/dev/full");
  testing::internal::CaptureStderr();
  EXPECT_NO_THROW(w.append(progress(1, 0, 1.0, 0.1, 1.0)));
  EXPECT_NO_THROW(w.append(progress(2, 0, 1.0, 0.1, 1.0)));
  EXPECT_NO_THROW(w.append(progress(3, 0, 1.0, 0.1, 1.0)));
  const std::string err = testing::internal::GetCapturedStderr();
  size_t warnings = 0;
  for (size_t at = err.find("--metrics"); at != std::string::npos; at = err.find("--metrics", at + 1)) ++warnings;
  EXPECT_EQ(warnings, 1u) << err;
  EXPECT_NE(err.find("/dev/full"), std::string::npos) << err;
}

}  // namespace
}  // namespace strata::io
