// The CUDA language-model ops against the CPU ones (f32): embedding, head layout, plain and
// memory-efficient attention with dropout; GPU runs repeat bit for bit. Skips without a GPU.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>

#include "core/ops.hpp"
#include "core/rng.hpp"
#if STRATA_WITH_CUDA
#include "core/cuda/runtime.hpp"
#include "core/cuda_test_util.hpp"
#endif

using namespace strata;

#if STRATA_WITH_CUDA
using namespace strata::cuda_test;

namespace {

bool no_gpu() { return strata::cuda::device_count() == 0; }

// max |a - b| / max(max |b|, 1e-2)
double rel_diff(const Tensor& a, const Tensor& b) {
  double scale = 1e-2, diff = 0.0;
  for (int64_t i = 0; i < b.numel(); ++i) {
    scale = std::max(scale, std::fabs(static_cast<double>(b.data<float>()[i])));
    diff = std::max(diff, std::fabs(static_cast<double>(a.data<float>()[i]) - b.data<float>()[i]));
  }
  return diff / scale;
}

bool bit_equal(const Tensor& a, const Tensor& b) {
  return a.nbytes() == b.nbytes() && std::memcmp(a.raw(), b.raw(), a.nbytes()) == 0;
}

const ops::DropoutKey kKey{rng::derive_key(5, rng::kDropout), 3, 1};

// y, saved, dq, dk, dv of one implementation on one device.
std::vector<Tensor> run(bool flash, const std::vector<Tensor>& in, float p, Device dev) {
  const Tensor &q = in[0], &k = in[1], &v = in[2], &dy = in[3];
  const Shape s = q.shape();
  Tensor y = Tensor::empty(s, DType::F32, dev), dq = Tensor::empty(s, DType::F32, dev);
  Tensor dk = Tensor::empty(s, DType::F32, dev), dv = Tensor::empty(s, DType::F32, dev);
  Tensor saved = flash ? Tensor::empty({s[0], s[1], s[2]}, DType::F32, dev)
                       : Tensor::empty({s[0], s[1], s[2], s[2]}, DType::F32, dev);
  if (flash) {
    ops::flash_attention_forward(q, k, v, y, saved, p, kKey);
    ops::flash_attention_backward(q, k, v, y, saved, dy, dq, dk, dv, p, kKey);
  } else {
    ops::attention_forward(q, k, v, y, saved, p, kKey);
    ops::attention_backward(q, k, v, saved, dy, dq, dk, dv, p, kKey);
  }
  return {y, saved, dq, dk, dv};
}

}  // namespace

TEST(CudaAttention, MatchesCpuAndRepeats) {
  if (no_gpu()) GTEST_SKIP() << "no GPU";
  for (const int64_t t : {1, 7, 130}) {
    for (const int64_t dh : {8, 64}) {
      for (const float p : {0.0f, 0.1f}) {
        SCOPED_TRACE("T=" + std::to_string(t) + " Dh=" + std::to_string(dh) + " p=" + std::to_string(p));
        const Shape s{2, 3, t, dh};
        std::vector<Tensor> host, dev;
        for (uint32_t i = 0; i < 4; ++i) {
          host.push_back(rand_host(s, static_cast<uint32_t>(t * 10 + dh + i), DType::F32, -2.0f, 2.0f));
          dev.push_back(to_gpu(host.back()));
        }
        for (const bool flash : {false, true}) {
          SCOPED_TRACE(flash ? "flash" : "plain");
          const auto want = run(flash, host, p, Device::cpu());
          const auto got = run(flash, dev, p, kGpu), again = run(flash, dev, p, kGpu);
          for (size_t i = 0; i < want.size(); ++i) {
            EXPECT_LT(rel_diff(to_host(got[i]), want[i]), 1e-5) << "output " << i;
            EXPECT_TRUE(bit_equal(to_host(got[i]), to_host(again[i]))) << "output " << i;
          }
        }
      }
    }
  }
}

TEST(CudaAttention, EmbeddingAndLayoutMatchCpu) {
  if (no_gpu()) GTEST_SKIP() << "no GPU";
  const int64_t B = 3, T = 37, V = 50, D = 300, H = 4, Dh = 8;
  Tensor tokens = Tensor::empty({B, T}, DType::I32);
  for (int64_t i = 0; i < B * T; ++i) tokens.data<int32_t>()[i] = static_cast<int32_t>((i * 7) % 11);  // repeats
  const Tensor wte = rand_host({V, D}, 1, DType::F32, -1, 1), wpe = rand_host({T + 3, D}, 2, DType::F32, -1, 1);
  const Tensor dy = rand_host({B, T, D}, 3, DType::F32, -1, 1);
  Tensor y = Tensor::empty({B, T, D}), dwte = Tensor::zeros({V, D}), dwpe = Tensor::zeros({T + 3, D});
  ops::embedding_forward(tokens, wte, wpe, y);
  ops::embedding_backward(tokens, dy, dwte, dwpe);
  const Tensor tokens_d = to_gpu(tokens), y_d = Tensor::empty({B, T, D}, DType::F32, kGpu);
  const Tensor dwte_d = to_gpu(Tensor::zeros({V, D})), dwpe_d = to_gpu(Tensor::zeros({T + 3, D}));
  ops::embedding_forward(tokens_d, to_gpu(wte), to_gpu(wpe), y_d);
  ops::embedding_backward(tokens_d, to_gpu(dy), dwte_d, dwpe_d);
  EXPECT_TRUE(bit_equal(to_host(y_d), y));
  EXPECT_TRUE(bit_equal(to_host(dwte_d), dwte));  // same summation order as the CPU
  EXPECT_TRUE(bit_equal(to_host(dwpe_d), dwpe));
  tokens.data<int32_t>()[40] = static_cast<int32_t>(V);
  try {
    ops::embedding_forward(to_gpu(tokens), to_gpu(wte), to_gpu(wpe), y_d);
    FAIL() << "no error for a token >= V";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::Input);
    EXPECT_NE(e.message().find("at (1, 3)"), std::string::npos) << e.message();
  }

  // A vocabulary slice (tensor parallelism: rows [first, first + 10) of wte, no wpe) as on the
  // CPU: other tokens add zero, dwte gets the slice's own rows.
  tokens.data<int32_t>()[40] = 3;
  for (const int64_t first : {int64_t{0}, int64_t{10}, int64_t{40}}) {
    const Tensor part = wte.slice(first, first + 10);
    Tensor yc = Tensor::empty({B, T, D}), dc = Tensor::zeros({10, D});
    ops::embedding_forward(tokens, part, Tensor(), yc, first, V);
    ops::embedding_backward(tokens, dy, dc, Tensor(), first);
    const Tensor yg = Tensor::empty({B, T, D}, DType::F32, kGpu), dg = to_gpu(Tensor::zeros({10, D}));
    ops::embedding_forward(to_gpu(tokens), to_gpu(part), Tensor(), yg, first, V);
    ops::embedding_backward(to_gpu(tokens), to_gpu(dy), dg, Tensor(), first);
    EXPECT_TRUE(bit_equal(to_host(yg), yc)) << "slice from " << first;
    EXPECT_TRUE(bit_equal(to_host(dg), dc)) << "slice from " << first;
  }

  const Tensor qkv = rand_host({B, T, 3 * H * Dh}, 4, DType::F32, -1, 1);
  Tensor q = Tensor::empty({B, H, T, Dh}), k = Tensor::empty({B, H, T, Dh}), v = Tensor::empty({B, H, T, Dh});
  ops::split_qkv(qkv, q, k, v);
  Tensor qd = Tensor::empty({B, H, T, Dh}, DType::F32, kGpu), kd = Tensor::empty({B, H, T, Dh}, DType::F32, kGpu);
  Tensor vd = Tensor::empty({B, H, T, Dh}, DType::F32, kGpu),
         back = Tensor::empty({B, T, 3 * H * Dh}, DType::F32, kGpu);
  ops::split_qkv(to_gpu(qkv), qd, kd, vd);
  EXPECT_TRUE(bit_equal(to_host(qd), q));
  EXPECT_TRUE(bit_equal(to_host(kd), k));
  EXPECT_TRUE(bit_equal(to_host(vd), v));
  ops::merge_qkv(qd, kd, vd, back);
  EXPECT_TRUE(bit_equal(to_host(back), qkv));
  Tensor merged = Tensor::empty({B, T, H * Dh}), merged_d = Tensor::empty({B, T, H * Dh}, DType::F32, kGpu);
  ops::merge_heads(v, merged);
  ops::merge_heads(vd, merged_d);
  EXPECT_TRUE(bit_equal(to_host(merged_d), merged));
  ops::split_heads(merged_d, qd);
  EXPECT_TRUE(bit_equal(to_host(qd), v));
}
#endif
