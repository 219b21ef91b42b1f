// bench_gpt_step: tokens/s of full GPT (or Llama: --model llama) training steps (zero grads, forward, cross-entropy
// over every position, backward, AdamW step) on one fixed batch of random tokens, one process; the counterpart of
// bench/torch_gpt_step.py (same model, batch, optimizer, warm-up and timing: median of several timed windows). Two more
// modes, for bench/run_gpt_vs_torch.sh:
//   --attention-only  one causal attention forward+backward (Strata's flash or plain op) on
//                     random (B, H, T, Dh) tensors: median time, and with --memory the peak
//                     memory of one call (the allocator's high-water mark and the resident set's).
//   --gemm-peak N     the best GFLOP/s of an N x N x N product through ops::gemm in --precision
//                     (fp32: OpenBLAS; bf16: the CPU's bf16 units through oneDNN where it has
//                     them): the denominator of MFU.
//
//   bench_gpt_step --layers 4 --heads 4 --embed 256 --seq-len 256 --batch 8 --threads 1
//   bench_gpt_step --attention-only --attention plain --seq-len 2048 --memory
//   bench_gpt_step --gemm-peak 2048 --threads 1 [--precision bf16]
#include <cstdio>
#include <fstream>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "bench_common.hpp"
#include "bench_step.hpp"
#include "core/allocator.hpp"
#include "core/ops.hpp"
#include "core/tensor.hpp"
#include "layers/model.hpp"
#include "layers/zoo.hpp"
#include "parallel/runtime/mpi.hpp"

namespace {

using namespace strata;
using bench::clock_type;
using bench::median;
using bench::seconds_since;

struct Options {
  std::string model = "gpt";  // gpt | llama
  int layers = 4, heads = 4, kv_heads = 0;
  int64_t ffn_hidden = 0;
  int64_t embed = 256, seq_len = 256, batch = 8, vocab = 8192;
  std::string attention = "flash";
  std::string precision = "fp32";
  int threads = 1;
  int warmup = 3;   // untimed steps (or attention calls) first
  int steps = 5;    // steps per timed window
  int windows = 5;  // timed windows; the median is reported
  float lr = 6e-4f, weight_decay = 0.1f;
  uint64_t seed = 1;
  bool profile = false;
  int profile_steps = 5;
  bool attention_only = false, memory = false;
  int64_t head_dim = 64;
  int reps = 5;  // timed attention calls
  int64_t gemm_peak = 0;
};

Options parse(int argc, char** argv) {
  Options o;
  bench::po::options_description desc("usage: bench_gpt_step [options]\noptions");
  // clang-format off
  desc.add_options()
    ("help,h", "print this help")
    ("model", bench::po::value(&o.model)->default_value(o.model), "gpt | llama (RMSNorm, rotary positions, SwiGLU, grouped-query attention)")
    ("layers", bench::po::value(&o.layers)->default_value(o.layers), "transformer blocks")
    ("kv-heads", bench::po::value(&o.kv_heads)->default_value(o.kv_heads), "llama: key/value heads (0: --heads)")
    ("ffn-hidden", bench::po::value(&o.ffn_hidden)->default_value(o.ffn_hidden), "llama: the SwiGLU hidden size (0: Llama's rule)")
    ("heads", bench::po::value(&o.heads)->default_value(o.heads), "attention heads")
    ("embed", bench::po::value(&o.embed)->default_value(o.embed), "model width D")
    ("seq-len", bench::po::value(&o.seq_len)->default_value(o.seq_len), "tokens per window T")
    ("batch", bench::po::value(&o.batch)->default_value(o.batch), "windows per step B")
    ("vocab", bench::po::value(&o.vocab)->default_value(o.vocab), "vocabulary V (tied embedding and head)")
    ("attention", bench::po::value(&o.attention)->default_value(o.attention), "flash | plain")
    ("precision", bench::po::value(&o.precision)->default_value(o.precision), "fp32 | bf16 (train's --precision)")
    ("threads", bench::po::value(&o.threads)->default_value(o.threads), "ops threads")
    ("warmup", bench::po::value(&o.warmup)->default_value(o.warmup), "untimed steps (attention calls) first")
    ("steps", bench::po::value(&o.steps)->default_value(o.steps), "steps per timed window")
    ("windows", bench::po::value(&o.windows)->default_value(o.windows), "timed windows; the median is reported")
    ("lr", bench::po::value(&o.lr)->default_value(o.lr, "6e-4"), "AdamW learning rate")
    ("weight-decay", bench::po::value(&o.weight_decay)->default_value(o.weight_decay, "0.1"),
     "AdamW weight decay of the Linear weights")
    ("seed", bench::po::value(&o.seed)->default_value(o.seed), "parameter and data seed")
    ("profile", bench::po::bool_switch(&o.profile), "add a per-layer forward/backward breakdown")
    ("profile-steps", bench::po::value(&o.profile_steps)->default_value(o.profile_steps), "steps of --profile")
    ("attention-only", bench::po::bool_switch(&o.attention_only),
     "time one causal attention forward+backward on (batch, heads, seq-len, head-dim) instead")
    ("head-dim", bench::po::value(&o.head_dim)->default_value(o.head_dim), "--attention-only: Dh")
    ("reps", bench::po::value(&o.reps)->default_value(o.reps), "--attention-only: timed calls")
    ("memory", bench::po::bool_switch(&o.memory),
     "--attention-only: measure the peak memory of one call instead of timing")
    ("gemm-peak", bench::po::value(&o.gemm_peak)->default_value(o.gemm_peak),
     "print the best GFLOP/s of an N x N x N product in --precision (N > 0) instead");
  // clang-format on
  bench::parse_or_exit(argc, argv, desc);
  bench::require(o.layers > 0 && o.heads > 0 && o.embed > 0 && o.seq_len > 0 && o.batch > 0 && o.vocab > 1,
                 "layers, heads, embed, seq-len, batch must be > 0 and vocab > 1", desc);
  bench::require(o.steps > 0 && o.windows > 0 && o.threads > 0 && o.reps > 0 && o.warmup >= 0,
                 "steps, windows, threads, reps must be > 0", desc);
  bench::require(o.attention == "flash" || o.attention == "plain", "--attention must be flash or plain", desc);
  bench::require(o.precision == "fp32" || o.precision == "bf16", "--precision must be fp32 or bf16", desc);
  bench::require(o.model == "gpt" || o.model == "llama", "--model must be gpt or llama", desc);
  return o;
}

// ---- resident memory -------------------------------------------------------------------------

// A field of /proc/self/status in KiB (VmRSS: resident now; VmHWM: peak since start or reset).
int64_t status_kib(const std::string& field) {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line))
    if (line.rfind(field + ":", 0) == 0) {
      std::istringstream s(line.substr(field.size() + 1));
      int64_t kib = 0;
      s >> kib;
      return kib;
    }
  return -1;
}

// Linux >= 4.0: writing 5 to clear_refs sets VmHWM to the current VmRSS.
bool reset_peak_rss() {
  std::ofstream out("/proc/self/clear_refs");
  out << "5";
  out.flush();
  return static_cast<bool>(out);
}

double mib(double bytes) { return bytes / (1 << 20); }

// ---- full training steps ---------------------------------------------------------------------

// llm.c's model FLOPs per token (train_gpt2.cu, gpt2_estimate_mfu): 6 N for the weight
// matmuls forward and backward, N = every parameter (the tied wte counts once: it is the head's
// matmul), plus 6 L D T for q k^T and p v over the causal half of the T x T scores.
double flops_per_token(int64_t params, const Options& o) {
  return 6.0 * static_cast<double>(params) + 6.0 * o.layers * static_cast<double>(o.embed * o.seq_len);
}

// The step under test: train's own (bench_step.hpp) on one rank, for GPT with AdamW (nanoGPT's
// betas and weight decay on the Linear weights, as train applies it) and one fixed batch of
// random tokens: x a window, y the same stream shifted by one.
std::unique_ptr<bench::StepBench> make_bench(const Options& o) {
  layers::ModelSpec spec;
  spec.name = o.model;
  spec.kv_heads = o.kv_heads;
  spec.ffn_hidden = o.ffn_hidden;
  if (o.model == "llama") spec.rope_theta = 10000;  // as torch_models.Llama
  spec.tie_embeddings = true;
  spec.layers = o.layers;
  spec.heads = o.heads;
  spec.embed = o.embed;
  spec.seq_len = o.seq_len;
  spec.attention = o.attention;  // tied embeddings, no dropout: as torch_gpt_step.py
  bench::StepSetup setup;
  setup.optimizer.name = "adamw";
  setup.optimizer.weight_decay = o.weight_decay;
  setup.optimizer.beta1 = 0.9;
  setup.optimizer.beta2 = 0.95;  // nanoGPT's
  setup.optimizer.eps = 1e-8f;
  setup.batch = o.batch;
  setup.dtype = parse_precision(o.precision);
  setup.seed = o.seed;
  setup.lr = o.lr;
  auto bench = std::make_unique<bench::StepBench>(
      MPI_COMM_SELF, setup, [&] { return layers::build_model(spec, {o.seq_len}, static_cast<int>(o.vocab)); });
  std::mt19937 gen(static_cast<uint32_t>(o.seed));
  std::uniform_int_distribution<int32_t> token(0, static_cast<int32_t>(o.vocab - 1));
  std::vector<int32_t> stream(static_cast<size_t>(o.batch * (o.seq_len + 1)));
  for (int32_t& v : stream) v = token(gen);
  Tensor x = Tensor::empty({o.batch, o.seq_len}, DType::I32), y = Tensor::empty({o.batch, o.seq_len}, DType::I32);
  for (int64_t b = 0; b < o.batch; ++b)
    for (int64_t t = 0; t < o.seq_len; ++t) {
      x.data<int32_t>()[b * o.seq_len + t] = stream[static_cast<size_t>(b * (o.seq_len + 1) + t)];
      y.data<int32_t>()[b * o.seq_len + t] = stream[static_cast<size_t>(b * (o.seq_len + 1) + t + 1)];
    }
  bench->set_batch(x, y);
  return bench;
}

int run_steps(const Options& o) {
  const std::unique_ptr<bench::StepBench> bench = make_bench(o);
  bench::StepBench& b = *bench;
  const int64_t params = b.engine().trainable_parameters();
  const int64_t tokens = o.batch * o.seq_len;
  const double fpt = flops_per_token(params, o);
  std::printf(
      "strata bench_gpt_step: %s L%d H%d D%lld T%lld V%lld, %s attention, %s (bf16 GEMMs: %s; kernels %s), "
      "batch %lld (%lld tokens/step), AdamW, threads %d, %lld parameters; train's step (StageEngine)\n",
      o.model.c_str(), o.layers, o.heads, static_cast<long long>(o.embed), static_cast<long long>(o.seq_len),
      static_cast<long long>(o.vocab), o.attention.c_str(), o.precision.c_str(),
      ops::bf16_matrix_units().empty() ? "widened to f32" : ops::bf16_matrix_units().c_str(),
      ops::cpu_kernel_isa().c_str(), static_cast<long long>(o.batch), static_cast<long long>(tokens),
      ops::num_threads(), static_cast<long long>(params));
  double first_loss = 0;
  for (int s = 0; s < o.warmup; ++s) {
    const double l = b.step();
    if (s == 0) first_loss = l;
  }
  const AllocatorStats before = host_allocator().stats();
  std::vector<double> rates;
  double last_loss = 0;
  for (int w = 0; w < o.windows; ++w) {
    const auto t0 = clock_type::now();
    for (int s = 0; s < o.steps; ++s) last_loss = b.step();
    rates.push_back(static_cast<double>(o.steps * tokens) / seconds_since(t0));
  }
  const double med = median(rates);
  const AllocatorStats after = host_allocator().stats();
  std::printf("windows (tokens/s):");
  for (double r : rates) std::printf(" %.0f", r);
  std::printf("\nallocator: %llu system allocations during timed steps, peak %.1f MiB in use\n",
              static_cast<unsigned long long>(after.system_allocs - before.system_allocs), mib(after.peak_in_use));
  std::printf("loss: first %.4f, last %.4f\n", first_loss, last_loss);
  std::printf("median %.0f tokens/s, %.1f ms/step, %.2f GFLOP/s (%.4g FLOP/token, llm.c's 6N + 6LDT)\n", med,
              1e3 * static_cast<double>(tokens) / med, med * fpt * 1e-9, fpt);
  // One line for scripts.
  std::printf(
      "RESULT impl=strata mode=step attention=%s precision=%s threads=%d tokens_per_s=%.2f flops_per_token=%.0f "
      "params=%lld\n",
      o.attention.c_str(), o.precision.c_str(), o.threads, med, fpt, static_cast<long long>(params));
  if (o.profile) bench::print_profile(b, o.profile_steps);
  return 0;
}

// ---- attention alone -------------------------------------------------------------------------

// One causal attention forward and backward with Strata's op, as CausalSelfAttention calls it:
// outputs, the saved statistics (flash: the rows' log-sum-exp; plain: the probabilities) and
// the input gradients are fresh tensors of each call. Returns the forward's seconds.
double attention_call(const Options& o, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& dy) {
  const auto t0 = clock_type::now();
  Tensor y = Tensor::empty(q.shape(), q.dtype());
  Tensor stats;
  if (o.attention == "flash") {
    stats = Tensor::empty({q.dim(0), q.dim(1), q.dim(2)});
    ops::flash_attention_forward(q, k, v, y, stats);
  } else {
    stats = Tensor::empty({q.dim(0), q.dim(1), q.dim(2), q.dim(2)}, q.dtype());
    ops::attention_forward(q, k, v, y, stats);
  }
  const double fwd = seconds_since(t0);
  Tensor dq = Tensor::empty(q.shape(), q.dtype()), dk = Tensor::empty(q.shape(), q.dtype()),
         dv = Tensor::empty(q.shape(), q.dtype());
  if (o.attention == "flash")
    ops::flash_attention_backward(q, k, v, y, stats, dy, dq, dk, dv);
  else
    ops::attention_backward(q, k, v, stats, dy, dq, dk, dv);
  return fwd;
}

int run_attention(const Options& o) {
  const Shape shape{o.batch, o.heads, o.seq_len, o.head_dim};
  std::mt19937 gen(static_cast<uint32_t>(o.seed));
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const DType dtype = parse_precision(o.precision);
  auto random = [&] {
    Tensor t = Tensor::empty(shape), cast = Tensor::empty(shape, dtype);
    for (int64_t i = 0; i < t.numel(); ++i) t.data<float>()[i] = normal(gen);
    ops::cast(t, cast);
    return cast;
  };
  const Tensor q = random(), k = random(), v = random(), dy = random();
  // Model FLOPs of forward+backward: 4 matmuls of 2 Dh FLOPs per (query, key) pair of the causal
  // half in backward, 2 in forward (flash's recomputation of the scores not counted).
  const double pairs = static_cast<double>(o.batch * o.heads) * o.seq_len * (o.seq_len + 1) / 2.0;
  const double flops = 12.0 * static_cast<double>(o.head_dim) * pairs;
  std::printf("strata attention (%s, %s): B %lld, H %d, T %lld, Dh %lld, threads %d\n", o.attention.c_str(),
              o.precision.c_str(), static_cast<long long>(o.batch), o.heads, static_cast<long long>(o.seq_len),
              static_cast<long long>(o.head_dim), ops::num_threads());
  const size_t inputs_in_use = host_allocator().stats().bytes_in_use;
  for (int i = 0; i < o.warmup; ++i) attention_call(o, q, k, v, dy);
  if (o.memory) {
    // Every call allocates the same, so the allocator's high-water mark above the inputs is one
    // call's; then one more call after handing the cache back, to see its resident pages.
    if (o.warmup == 0) attention_call(o, q, k, v, dy);
    const double alloc_peak = mib(static_cast<double>(host_allocator().stats().peak_in_use - inputs_in_use));
    host_allocator().release_cached();
    const int64_t rss_before = status_kib("VmRSS");
    const bool reset = reset_peak_rss();
    attention_call(o, q, k, v, dy);
    const int64_t hwm = status_kib("VmHWM");
    const double rss_peak = reset && hwm >= 0 ? (hwm - rss_before) / 1024.0 : -1.0;
    std::printf("peak memory of one call above the inputs: allocator %.1f MiB, resident set %.1f MiB\n", alloc_peak,
                rss_peak);
    std::printf("RESULT impl=strata mode=memory attention=%s seq_len=%lld alloc_peak_mib=%.1f rss_peak_mib=%.1f\n",
                o.attention.c_str(), static_cast<long long>(o.seq_len), alloc_peak, rss_peak);
    return 0;
  }
  std::vector<double> totals, fwds;
  for (int i = 0; i < o.reps; ++i) {
    const auto t0 = clock_type::now();
    fwds.push_back(attention_call(o, q, k, v, dy));
    totals.push_back(seconds_since(t0));
  }
  const double ms = 1e3 * median(totals), fwd_ms = 1e3 * median(fwds);
  std::printf("forward+backward: median %.2f ms (forward %.2f ms), %.1f GFLOP/s (%.4g model FLOPs)\n", ms, fwd_ms,
              flops / ms * 1e-6, flops);
  std::printf(
      "RESULT impl=strata mode=attention attention=%s precision=%s seq_len=%lld threads=%d ms=%.3f fwd_ms=%.3f "
      "gflops=%.2f\n",
      o.attention.c_str(), o.precision.c_str(), static_cast<long long>(o.seq_len), o.threads, ms, fwd_ms,
      flops / ms * 1e-6);
  return 0;
}

// ---- GEMM peak -------------------------------------------------------------------------------

int run_gemm_peak(const Options& o) {
  const int64_t n = o.gemm_peak;
  const DType dtype = parse_precision(o.precision);
  Tensor a = Tensor::empty({n, n}), b = Tensor::empty({n, n});
  std::mt19937 gen(static_cast<uint32_t>(o.seed));
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  for (Tensor* t : {&a, &b})
    for (int64_t i = 0; i < t->numel(); ++i) t->data<float>()[i] = u(gen);
  Tensor ad = Tensor::empty({n, n}, dtype), bd = Tensor::empty({n, n}, dtype), c = Tensor::zeros({n, n}, dtype);
  ops::cast(a, ad);
  ops::cast(b, bd);
  ops::gemm(ad, false, bd, false, c);  // warm-up: buffers, page faults, oneDNN's kernel generation
  double best = 0;
  for (int i = 0; i < o.reps; ++i) {
    const auto t0 = clock_type::now();
    ops::gemm(ad, false, bd, false, c);
    best = std::max(best, 2.0 * static_cast<double>(n) * n * n / seconds_since(t0) * 1e-9);
  }
  const std::string units = dtype != DType::BF16               ? "OpenBLAS"
                            : ops::bf16_matrix_units().empty() ? "widened to f32 for OpenBLAS"
                                                               : "oneDNN on " + ops::bf16_matrix_units();
  std::printf("gemm %lld x %lld x %lld %s (%s), threads %d: best of %d %.1f GFLOP/s\n", static_cast<long long>(n),
              static_cast<long long>(n), static_cast<long long>(n), o.precision.c_str(), units.c_str(),
              ops::num_threads(), o.reps, best);
  std::printf("RESULT impl=strata mode=gemm precision=%s n=%lld threads=%d gflops=%.2f\n", o.precision.c_str(),
              static_cast<long long>(n), o.threads, best);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const Options o = parse(argc, argv);
  parallel::MpiRuntime mpi(argc, argv);  // the step's communicators (one rank)
  try {
    ops::set_num_threads(o.threads);
    const std::string warning = ops::blas_kernel_warning();
    if (!warning.empty()) std::fprintf(stderr, "warning: %s\n", warning.c_str());
    if (o.gemm_peak > 0) return run_gemm_peak(o);
    if (o.attention_only) return run_attention(o);
    return run_steps(o);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_gpt_step: %s\n", e.what());
    return 1;
  }
}
