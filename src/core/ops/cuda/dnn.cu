// CUDA convolution, pooling and batch norm, on the compute stream. Convolution (forward,
// backward data, backward filter) and batch norm go through cuDNN's legacy API, deprecated in
// cuDNN 9 but still shipped (libcudnn_cnn, libcudnn_ops). Pooling is ours: max pooling must
// return the CPU's argmax (cuDNN keeps no argmax), and the gather formulations below sum in the
// CPU's order, so f32 results match it bit for bit. Images are NCHW; cuDNN computes in f32 for
// every storage dtype.
#include <algorithm>
#include <climits>
#include <cmath>

#include "core/cuda/check.hpp"
#include "core/cuda/runtime.hpp"
#include "core/ops/cuda/cuda_ops.hpp"
#include "core/ops/cuda/launch.cuh"
#include "core/ops/pool_math.hpp"

namespace strata::ops::cuda {

namespace {

const float kOne = 1.0f, kZero = 0.0f;  // cuDNN's alpha / beta (host floats for every dtype)

// ---- cuDNN descriptors -------------------------------------------------------------------------

cudnnDataType_t dnn_type(DType t) {
  switch (t) {
    case DType::F32:
      return CUDNN_DATA_FLOAT;
    case DType::BF16:
      return CUDNN_DATA_BFLOAT16;
    case DType::F16:
      return CUDNN_DATA_HALF;
    default:
      STRATA_THROW("cuDNN ops take f32, bf16 or f16 tensors, got ", dtype_name(t));
  }
}

int to_int(int64_t v, const char* what) {
  STRATA_CHECK(v >= 0 && v <= INT_MAX, what, " ", v, " exceeds cuDNN's int range");
  return static_cast<int>(v);
}

// (n, c, h, w), contiguous. cuDNN's legacy API takes tensors of fewer than 2^31 elements.
Owned<cudnnTensorDescriptor_t> tensor_desc(DType t, int64_t n, int64_t c, int64_t h, int64_t w) {
  to_int(n * c * h * w, "cuDNN tensor size");
  cudnnTensorDescriptor_t raw = nullptr;
  CUDNN_CHECK(cudnnCreateTensorDescriptor(&raw));
  Owned<cudnnTensorDescriptor_t> d(raw);
  CUDNN_CHECK(cudnnSetTensor4dDescriptor(d, CUDNN_TENSOR_NCHW, dnn_type(t), to_int(n, "N"), to_int(c, "C"),
                                         to_int(h, "H"), to_int(w, "W")));
  return d;
}

// Descriptors of one convolution: x (N, C, H, W), w (O, C, KH, KW), y (N, O, OH, OW).
struct ConvDescs {
  ConvDescs(DType t, int64_t n, const Conv2dGeometry& g)
      : x(tensor_desc(t, n, g.in_channels, g.in_h, g.in_w)),
        y(tensor_desc(t, n, g.out_channels, g.out_h(), g.out_w())) {
    cudnnFilterDescriptor_t fw = nullptr;
    CUDNN_CHECK(cudnnCreateFilterDescriptor(&fw));
    w = Owned<cudnnFilterDescriptor_t>(fw);
    CUDNN_CHECK(cudnnSetFilter4dDescriptor(w, dnn_type(t), CUDNN_TENSOR_NCHW, to_int(g.out_channels, "O"),
                                           to_int(g.in_channels, "C"), to_int(g.kernel_h, "KH"),
                                           to_int(g.kernel_w, "KW")));
    cudnnConvolutionDescriptor_t fc = nullptr;
    CUDNN_CHECK(cudnnCreateConvolutionDescriptor(&fc));
    conv = Owned<cudnnConvolutionDescriptor_t>(fc);
    const int pad = to_int(g.padding, "padding"), stride = to_int(g.stride, "stride");
    CUDNN_CHECK(cudnnSetConvolution2dDescriptor(conv, pad, pad, stride, stride, 1, 1, CUDNN_CROSS_CORRELATION,
                                                CUDNN_DATA_FLOAT));
  }
  Owned<cudnnTensorDescriptor_t> x, y;
  Owned<cudnnFilterDescriptor_t> w;
  Owned<cudnnConvolutionDescriptor_t> conv;
};

// ---- convolution algorithms, chosen once per shape ----------------------------------------------

enum class ConvDir { Forward, BackwardData, BackwardFilter };

// The best algorithm cuDNN's heuristics rank (cudnnGet*_v7: no trial runs, so no output is
// scribbled on and the choice is the same on every rank), preferring deterministic ones so a
// run repeats bit for bit. `strict_f32` skips tensor-op (TF32) algorithms; algorithms whose
// workspace exceeds `max_workspace` are skipped too (FFT ones can ask for many times the
// tensors, and the choice is cached, so an allocation failure would repeat every step).
template <class Perf>
const Perf* pick(const Perf* perf, int count, bool strict_f32, size_t max_workspace) {
  const Perf* fallback = nullptr;
  for (int i = 0; i < count; ++i) {
    if (perf[i].status != CUDNN_STATUS_SUCCESS || perf[i].memory > max_workspace) continue;
    if (strict_f32 && perf[i].mathType != CUDNN_FMA_MATH && perf[i].mathType != CUDNN_DEFAULT_MATH) continue;
    if (perf[i].determinism == CUDNN_DETERMINISTIC) return &perf[i];
    if (fallback == nullptr) fallback = &perf[i];
  }
  return fallback;
}

// The algorithm (with its math mode and workspace size) for this direction and shape, from the
// device's cache or chosen now. Leaves the math mode set on d.conv.
ConvAlgo conv_algo(DeviceContext& ctx, ConvDir dir, DType t, int64_t n, const Conv2dGeometry& g, const ConvDescs& d) {
  // f32 without TF32 must not touch tensor cores: CUDNN_DEFAULT_MATH would allow TF32 there.
  const bool strict_f32 = t == DType::F32 && !ops::allow_tf32();
  const ConvKey key{static_cast<int>(dir),    to_int(n, "N"),           to_int(g.in_channels, "C"),
                    to_int(g.in_h, "H"),      to_int(g.in_w, "W"),      to_int(g.out_channels, "O"),
                    to_int(g.kernel_h, "KH"), to_int(g.kernel_w, "KW"), to_int(g.stride, "stride"),
                    to_int(g.padding, "pad"), static_cast<int>(t),      strict_f32 ? 1 : 0};
  std::lock_guard lock(ctx.conv_mutex);
  if (auto it = ctx.conv_algos.find(key); it != ctx.conv_algos.end()) {
    CUDNN_CHECK(cudnnSetConvolutionMathType(d.conv, it->second.math));
    return it->second;
  }
  const cudnnMathType_t requested = strict_f32 ? CUDNN_FMA_MATH : CUDNN_DEFAULT_MATH;
  CUDNN_CHECK(cudnnSetConvolutionMathType(d.conv, requested));
  constexpr int kMaxAlgos = 16;  // more than any direction has
  size_t free_bytes = 0, total_bytes = 0;
  CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
  const size_t max_workspace = free_bytes / 2;
  int count = 0;
  ConvAlgo a;
  // Adopts the chosen algorithm's math mode (cuDNN needs algorithm and math mode to agree).
  auto adopt = [&](const auto* perf) {
    STRATA_CHECK(perf != nullptr, "cuDNN offers no convolution algorithm for ", dtype_name(t), " input (", n, ", ",
                 g.in_channels, ", ", g.in_h, ", ", g.in_w, "), kernel ", g.kernel_h, "x", g.kernel_w, " within ",
                 max_workspace >> 20, " MiB of workspace (half the free device memory)");
    a.algo = static_cast<int>(perf->algo);
    a.math = strict_f32 ? CUDNN_FMA_MATH : perf->mathType;
    CUDNN_CHECK(cudnnSetConvolutionMathType(d.conv, a.math));
  };
  switch (dir) {
    case ConvDir::Forward: {
      cudnnConvolutionFwdAlgoPerf_t perf[kMaxAlgos];
      CUDNN_CHECK(cudnnGetConvolutionForwardAlgorithm_v7(ctx.cudnn, d.x, d.w, d.conv, d.y, kMaxAlgos, &count, perf));
      adopt(pick(perf, count, strict_f32, max_workspace));
      CUDNN_CHECK(cudnnGetConvolutionForwardWorkspaceSize(
          ctx.cudnn, d.x, d.w, d.conv, d.y, static_cast<cudnnConvolutionFwdAlgo_t>(a.algo), &a.workspace_bytes));
      break;
    }
    case ConvDir::BackwardData: {
      cudnnConvolutionBwdDataAlgoPerf_t perf[kMaxAlgos];
      CUDNN_CHECK(
          cudnnGetConvolutionBackwardDataAlgorithm_v7(ctx.cudnn, d.w, d.y, d.conv, d.x, kMaxAlgos, &count, perf));
      adopt(pick(perf, count, strict_f32, max_workspace));
      CUDNN_CHECK(cudnnGetConvolutionBackwardDataWorkspaceSize(
          ctx.cudnn, d.w, d.y, d.conv, d.x, static_cast<cudnnConvolutionBwdDataAlgo_t>(a.algo), &a.workspace_bytes));
      break;
    }
    case ConvDir::BackwardFilter: {
      cudnnConvolutionBwdFilterAlgoPerf_t perf[kMaxAlgos];
      CUDNN_CHECK(
          cudnnGetConvolutionBackwardFilterAlgorithm_v7(ctx.cudnn, d.x, d.y, d.conv, d.w, kMaxAlgos, &count, perf));
      adopt(pick(perf, count, strict_f32, max_workspace));
      CUDNN_CHECK(cudnnGetConvolutionBackwardFilterWorkspaceSize(
          ctx.cudnn, d.x, d.y, d.conv, d.w, static_cast<cudnnConvolutionBwdFilterAlgo_t>(a.algo), &a.workspace_bytes));
      break;
    }
  }
  ctx.conv_algos.emplace(key, a);
  return a;
}

// ---- small kernels -----------------------------------------------------------------------------

// y (planes = N * C, hw) += bias[plane % C].
template <class T, class B>
struct AddChannelBias {
  T* y;
  const B* bias;
  int64_t channels, hw;
  __device__ void operator()(int64_t plane, int64_t j) const {
    T& v = y[plane * hw + j];
    v = fn::from_f32<T>(fn::to_f32(v) + fn::to_f32(bias[plane % channels]));
  }
};

// y[plane] = the sum of each plane of x (planes, hw), in f32, divided by `divisor` (hw for the
// mean, 1 for the sum); one block per plane.
template <class T, class Y>
__global__ void plane_sum_kernel(const T* x, int64_t hw, float divisor, Y* y) {
  __shared__ float shared[32];
  const T* in = x + static_cast<int64_t>(blockIdx.x) * hw;
  float acc = 0.0f;
  for (int64_t i = threadIdx.x; i < hw; i += blockDim.x) acc += fn::to_f32(in[i]);
  acc = block_sum(acc, shared);
  if (threadIdx.x == 0) y[blockIdx.x] = fn::from_f32<Y>(acc / divisor);
}

// out[c] += sum over samples and positions of x (n, channels, hw)[:, c, :]: the planes' sums
// (n * channels blocks: one block per channel would leave most of the GPU idle), then the
// column sums of the (n, channels) partials. Fixed shapes and order: deterministic.
template <class T, class G>
void channel_sum(const OnDevice& on, const T* x, int64_t n, int64_t channels, int64_t hw, G* out) {
  if (channels == 0 || n == 0) return;
  const Tensor s = scratch(on, static_cast<size_t>(n * channels) * sizeof(float));
  float* sums = scratch_at<float>(s, 0);
  plane_sum_kernel<<<static_cast<unsigned>(n * channels), row_threads(hw), 0, on.stream>>>(x, hw, 1.0f, sums);
  CUDA_CHECK(cudaGetLastError());
  column_sum(on, n, channels, ReadAt<float>{sums, channels}, out);
}

// ---- pooling (windows, order and tie rules: ops/pool_math.hpp, shared with cpu/pool.cpp) -------

using pool::PoolDims;

template <class T>
struct MaxPoolForward {  // one output element
  const T* x;
  T* y;
  int32_t* argmax;
  PoolDims d;
  __device__ void operator()(int64_t i) const {
    const int64_t ow = i % d.ow, oh = (i / d.ow) % d.oh, plane = i / (d.ow * d.oh);
    float best;
    int64_t best_i;
    pool::window_max(x + plane * d.h * d.w, d.w, d.window(oh, ow), best, best_i);
    y[i] = fn::from_f32<T>(best);  // an input value: exact in T
    argmax[i] = static_cast<int32_t>(best_i);
  }
};

// One input element gathers dy from the outputs whose argmax points at it: no atomics, and the
// outputs are visited in the CPU's scatter order.
template <class T>
struct MaxPoolBackward {
  const T* dy;
  const int32_t* argmax;
  T* dx;
  PoolDims d;
  __device__ void operator()(int64_t i) const {
    const int64_t iw = i % d.w, ih = (i / d.w) % d.h, plane = i / (d.w * d.h);
    const int64_t base = plane * d.oh * d.ow, self = ih * d.w + iw;
    int64_t oh0, oh1, ow0, ow1;
    d.covering(ih, d.oh, oh0, oh1);
    d.covering(iw, d.ow, ow0, ow1);
    float sum = 0.0f;
    for (int64_t oh = oh0; oh <= oh1; ++oh)
      for (int64_t ow = ow0; ow <= ow1; ++ow)
        if (argmax[base + oh * d.ow + ow] == self) sum += fn::to_f32(dy[base + oh * d.ow + ow]);
    dx[i] = fn::from_f32<T>(sum);
  }
};

template <class T>
struct AvgPoolForward {  // padding counts as zeros: always divide by kernel^2
  const T* x;
  T* y;
  PoolDims d;
  __device__ void operator()(int64_t i) const {
    const int64_t ow = i % d.ow, oh = (i / d.ow) % d.oh, plane = i / (d.ow * d.oh);
    y[i] = fn::from_f32<T>(pool::window_sum(x + plane * d.h * d.w, d.w, d.window(oh, ow)) * d.inv_area());
  }
};

template <class T>
struct AvgPoolBackward {  // gather over the covering windows, in the CPU's order
  const T* dy;
  T* dx;
  PoolDims d;
  __device__ void operator()(int64_t i) const {
    const int64_t iw = i % d.w, ih = (i / d.w) % d.h, plane = i / (d.w * d.h);
    const T* g = dy + plane * d.oh * d.ow;
    const float inv = d.inv_area();
    int64_t oh0, oh1, ow0, ow1;
    d.covering(ih, d.oh, oh0, oh1);
    d.covering(iw, d.ow, ow0, ow1);
    float sum = 0.0f;
    for (int64_t oh = oh0; oh <= oh1; ++oh)
      for (int64_t ow = ow0; ow <= ow1; ++ow)
        sum += __fmul_rn(fn::to_f32(g[oh * d.ow + ow]), inv);  // no FMA: CPU rounding
    dx[i] = fn::from_f32<T>(sum);
  }
};

template <class T>
struct GlobalAvgPoolBackward {
  const T* dy;
  T* dx;
  int64_t hw;
  __device__ void operator()(int64_t i) const {
    dx[i] = fn::from_f32<T>(fn::to_f32(dy[i / hw]) / static_cast<float>(hw));
  }
};

// ---- batch norm helpers ------------------------------------------------------------------------

// x (N, C, inner...) as the 4-D (N, C, inner, 1) tensor cuDNN wants, and the per-channel
// (1, C, 1, 1) descriptor cuDNN derives for it (f32 for every data dtype).
struct BnDescs {
  explicit BnDescs(const Tensor& t)
      : x(tensor_desc(t.dtype(), t.dim(0), t.dim(1), t.numel() / (t.dim(0) * t.dim(1)), 1)) {
    cudnnTensorDescriptor_t raw = nullptr;
    CUDNN_CHECK(cudnnCreateTensorDescriptor(&raw));
    param = Owned<cudnnTensorDescriptor_t>(raw);
    CUDNN_CHECK(cudnnDeriveBNTensorDescriptor(param, x, CUDNN_BATCHNORM_SPATIAL));
  }
  Owned<cudnnTensorDescriptor_t> x, param;
};

// A per-channel parameter (C) as f32 for cuDNN: the tensor itself when f32, else an f32 copy
// in `holder`, or `fallback` everywhere when undefined (no affine).
const float* f32_param(const OnDevice& on, const Tensor& t, int64_t c, float fallback, Tensor& holder) {
  if (t.defined() && t.dtype() == DType::F32) return t.data<float>();
  holder = Tensor::empty({c}, DType::F32, Device::cuda(on.device));
  float* p = holder.data<float>();
  if (!t.defined()) {
    parallel_for(on, c, fn::Fill<float>{p, fallback});
  } else {
    with_float_type(t.dtype(), [&](auto tag) {
      using T = decltype(tag);
      parallel_for(on, c, fn::Cast<T, float>{t.data<T>(), p});
    });
  }
  return p;
}

// An f32 output (C) for cuDNN: the tensor itself when defined, else scratch in `holder`.
float* f32_out(const OnDevice& on, const Tensor& t, int64_t c, Tensor& holder) {
  if (t.defined()) return t.data<float>();
  holder = Tensor::empty({c}, DType::F32, Device::cuda(on.device));
  return holder.data<float>();
}

// Batch norm over one value per channel (N * H * W == 1), as the CPU does it: mean = x, biased
// variance 0 standing in for the undefined unbiased one. Not given to cuDNN, whose running
// variance update would divide by count - 1 = 0.
template <class T>
struct BatchNormOfOne {
  const T* x;
  T* y;
  const float *gamma, *beta;
  float* mean;
  float* invstd;
  float* running_mean;  // may be null
  float* running_var;   // may be null
  float momentum, invstd_of_zero;
  __device__ void operator()(int64_t c) const {
    const float v = fn::to_f32(x[c]);
    y[c] = fn::from_f32<T>((v - v) * invstd_of_zero * gamma[c] + beta[c]);
    mean[c] = v;
    invstd[c] = invstd_of_zero;
    if (running_mean) running_mean[c] = (1.0f - momentum) * running_mean[c] + momentum * v;
    if (running_var) running_var[c] = (1.0f - momentum) * running_var[c] + momentum * 0.0f;
  }
};

}  // namespace

// ---- convolution -------------------------------------------------------------------------------

void conv2d_forward(const Tensor& x, const Tensor& w, const Tensor& bias, const Tensor& y, const Conv2dGeometry& g) {
  if (y.numel() == 0) return;
  const OnDevice on(y);
  DeviceContext& ctx = context(on.device);
  const int64_t n = x.dim(0);
  const ConvDescs d(x.dtype(), n, g);
  const ConvAlgo a = conv_algo(ctx, ConvDir::Forward, x.dtype(), n, g, d);
  CUDNN_CHECK(cudnnConvolutionForward(ctx.cudnn, &kOne, d.x, x.raw(), d.w, w.raw(), d.conv,
                                      static_cast<cudnnConvolutionFwdAlgo_t>(a.algo), ctx.workspace(a.workspace_bytes),
                                      a.workspace_bytes, &kZero, d.y, y.raw()));
  if (!bias.defined()) return;
  with_float_type(y.dtype(), [&](auto ty) {
    using T = decltype(ty);
    with_float_type(bias.dtype(), [&](auto tb) {
      using B = decltype(tb);
      const int64_t hw = g.out_h() * g.out_w();
      parallel_for_rows(on, n * g.out_channels, hw,
                        AddChannelBias<T, B>{y.data<T>(), bias.data<B>(), g.out_channels, hw});
    });
  });
}

void conv2d_backward(const Tensor& x, const Tensor& w, const Tensor& dy, const Tensor& dx, const Tensor& dw,
                     const Tensor& db, const Conv2dGeometry& g) {
  const OnDevice on(dy);
  DeviceContext& ctx = context(on.device);
  const DType t = x.dtype();
  const int64_t n = x.dim(0), ohw = g.out_h() * g.out_w();
  if (db.defined()) {  // db (O) += sum of dy over N, OH, OW
    with_float_type(t, [&](auto tt) {
      using T = decltype(tt);
      with_float_type(db.dtype(), [&](auto tg) {
        using G = decltype(tg);
        channel_sum(on, dy.data<T>(), n, g.out_channels, ohw, db.data<G>());
      });
    });
  }
  if (n == 0 || (!dw.defined() && !dx.defined())) return;
  const ConvDescs d(t, n, g);
  if (dw.defined()) {
    const ConvAlgo a = conv_algo(ctx, ConvDir::BackwardFilter, t, n, g, d);
    // cuDNN accumulates (beta = 1) into a dw of the data's dtype. It cannot write an f32 dw
    // for bf16/f16 data, so that goes through a scratch in the data's dtype and is added.
    const bool direct = dw.dtype() == t;
    Tensor partial = direct ? Tensor() : Tensor::empty(w.shape(), t, Device::cuda(on.device));
    CUDNN_CHECK(cudnnConvolutionBackwardFilter(ctx.cudnn, &kOne, d.x, x.raw(), d.y, dy.raw(), d.conv,
                                               static_cast<cudnnConvolutionBwdFilterAlgo_t>(a.algo),
                                               ctx.workspace(a.workspace_bytes), a.workspace_bytes,
                                               direct ? &kOne : &kZero, d.w, direct ? dw.raw() : partial.raw()));
    if (!direct) {
      with_float_type(t, [&](auto tt) {
        using T = decltype(tt);
        parallel_for(on, dw.numel(), fn::Axpy<T, float>{1.0f, partial.data<T>(), dw.data<float>()});
      });
    }
  }
  if (dx.defined()) {
    const ConvAlgo a = conv_algo(ctx, ConvDir::BackwardData, t, n, g, d);
    CUDNN_CHECK(cudnnConvolutionBackwardData(
        ctx.cudnn, &kOne, d.w, w.raw(), d.y, dy.raw(), d.conv, static_cast<cudnnConvolutionBwdDataAlgo_t>(a.algo),
        ctx.workspace(a.workspace_bytes), a.workspace_bytes, &kZero, d.x, dx.raw()));
  }
}

// ---- pooling -----------------------------------------------------------------------------------

void max_pool2d_forward(const Tensor& x, const Tensor& y, const Tensor& argmax, const Pool2dGeometry& g) {
  const OnDevice on(y);
  with_float_type(x.dtype(), [&](auto tag) {
    using T = decltype(tag);
    parallel_for(on, y.numel(), MaxPoolForward<T>{x.data<T>(), y.data<T>(), argmax.data<int32_t>(), PoolDims(g)});
  });
}

void max_pool2d_backward(const Tensor& dy, const Tensor& argmax, const Tensor& dx, const Pool2dGeometry& g) {
  const OnDevice on(dx);
  with_float_type(dx.dtype(), [&](auto tag) {
    using T = decltype(tag);
    parallel_for(on, dx.numel(), MaxPoolBackward<T>{dy.data<T>(), argmax.data<int32_t>(), dx.data<T>(), PoolDims(g)});
  });
}

void avg_pool2d_forward(const Tensor& x, const Tensor& y, const Pool2dGeometry& g) {
  const OnDevice on(y);
  with_float_type(x.dtype(), [&](auto tag) {
    using T = decltype(tag);
    parallel_for(on, y.numel(), AvgPoolForward<T>{x.data<T>(), y.data<T>(), PoolDims(g)});
  });
}

void avg_pool2d_backward(const Tensor& dy, const Tensor& dx, const Pool2dGeometry& g) {
  const OnDevice on(dx);
  with_float_type(dx.dtype(), [&](auto tag) {
    using T = decltype(tag);
    parallel_for(on, dx.numel(), AvgPoolBackward<T>{dy.data<T>(), dx.data<T>(), PoolDims(g)});
  });
}

void global_avg_pool_forward(const Tensor& x, const Tensor& y) {
  // (N, C, H, W) -> (N, C): one block per plane.
  const int64_t planes = y.numel(), hw = planes > 0 ? x.numel() / planes : 0;
  if (planes == 0) return;
  const OnDevice on(y);
  with_float_type(x.dtype(), [&](auto tag) {
    using T = decltype(tag);
    plane_sum_kernel<<<static_cast<unsigned>(planes), row_threads(hw), 0, on.stream>>>(
        x.data<T>(), hw, static_cast<float>(hw), y.data<T>());
    CUDA_CHECK(cudaGetLastError());
  });
}

void global_avg_pool_backward(const Tensor& dy, const Tensor& dx) {
  const int64_t planes = dy.numel(), hw = planes > 0 ? dx.numel() / planes : 0;
  if (planes == 0 || hw == 0) return;
  const OnDevice on(dx);
  with_float_type(dx.dtype(), [&](auto tag) {
    using T = decltype(tag);
    parallel_for(on, dx.numel(), GlobalAvgPoolBackward<T>{dy.data<T>(), dx.data<T>(), hw});
  });
}

// ---- batch norm --------------------------------------------------------------------------------

void batch_norm_forward_train(const Tensor& x, const Tensor& gamma, const Tensor& beta, const Tensor& y,
                              const Tensor& save_mean, const Tensor& save_invstd, const Tensor& running_mean,
                              const Tensor& running_var, float momentum, float eps) {
  if (x.numel() == 0) return;
  const OnDevice on(y);
  DeviceContext& ctx = context(on.device);
  const int64_t c = x.dim(1), count = x.numel() / c;
  const BnDescs d(x);
  Tensor holders[6];
  const float* scale = f32_param(on, gamma, c, 1.0f, holders[0]);
  const float* shift = f32_param(on, beta, c, 0.0f, holders[1]);
  float* mean = f32_out(on, save_mean, c, holders[2]);
  float* invstd = f32_out(on, save_invstd, c, holders[3]);  // cuDNN's "inverse variance" is 1/sqrt(var + eps)
  float* rm = running_mean.defined() ? running_mean.data<float>() : nullptr;
  float* rv = running_var.defined() ? running_var.data<float>() : nullptr;
  if (count == 1) {
    with_float_type(x.dtype(), [&](auto tag) {
      using T = decltype(tag);
      const float invstd_of_zero = static_cast<float>(1.0 / std::sqrt(static_cast<double>(eps)));  // CPU's rounding
      parallel_for(
          on, c,
          BatchNormOfOne<T>{x.data<T>(), y.data<T>(), scale, shift, mean, invstd, rm, rv, momentum, invstd_of_zero});
    });
    return;
  }
  // cuDNN updates running = (1 - factor) * running + factor * batch with the UNBIASED batch
  // variance, as PyTorch's (which passes its momentum as the factor, and whose reference
  // decomposition of cudnn_batch_norm is native_batch_norm with the same factor). It takes both
  // running tensors or neither: a missing one gets scratch.
  if (rm != nullptr || rv != nullptr) {
    if (rm == nullptr) rm = f32_out(on, running_mean, c, holders[4]);
    if (rv == nullptr) rv = f32_out(on, running_var, c, holders[5]);
  }
  CUDNN_CHECK(cudnnBatchNormalizationForwardTraining(ctx.cudnn, CUDNN_BATCHNORM_SPATIAL, &kOne, &kZero, d.x, x.raw(),
                                                     d.x, y.raw(), d.param, scale, shift, momentum, rm, rv, eps, mean,
                                                     invstd));
}

void batch_norm_forward_eval(const Tensor& x, const Tensor& gamma, const Tensor& beta, const Tensor& running_mean,
                             const Tensor& running_var, const Tensor& y, float eps) {
  if (x.numel() == 0) return;
  const OnDevice on(y);
  DeviceContext& ctx = context(on.device);
  const int64_t c = x.dim(1);
  const BnDescs d(x);
  Tensor holders[2];
  const float* scale = f32_param(on, gamma, c, 1.0f, holders[0]);
  const float* shift = f32_param(on, beta, c, 0.0f, holders[1]);
  CUDNN_CHECK(cudnnBatchNormalizationForwardInference(ctx.cudnn, CUDNN_BATCHNORM_SPATIAL, &kOne, &kZero, d.x, x.raw(),
                                                      d.x, y.raw(), d.param, scale, shift, running_mean.data<float>(),
                                                      running_var.data<float>(), eps));
}

void batch_norm_backward(const Tensor& x, const Tensor& dy, const Tensor& gamma, const Tensor& save_mean,
                         const Tensor& save_invstd, const Tensor& dx, const Tensor& dgamma, const Tensor& dbeta) {
  if (x.numel() == 0) return;
  const OnDevice on(dy);
  DeviceContext& ctx = context(on.device);
  const int64_t c = x.dim(1);
  const BnDescs d(x);
  Tensor gamma_f32;
  const float* scale = f32_param(on, gamma, c, 1.0f, gamma_f32);
  // cuDNN writes f32 parameter gradients blended with beta = 1, i.e. accumulated: into dgamma /
  // dbeta themselves when f32, else into zeroed f32 scratch that is then added to the
  // bf16/f16 tensor (or dropped when the gradient is not wanted).
  const bool dgamma_direct = dgamma.defined() && dgamma.dtype() == DType::F32;
  const bool dbeta_direct = dbeta.defined() && dbeta.dtype() == DType::F32;
  Tensor params;
  if (!dgamma_direct || !dbeta_direct) {
    params = Tensor::empty({2 * c}, DType::F32, Device::cuda(on.device));
    CUDA_CHECK(cudaMemsetAsync(params.raw(), 0, params.nbytes(), on.stream));
  }
  float* dg = dgamma_direct ? dgamma.data<float>() : params.data<float>();
  float* db = dbeta_direct ? dbeta.data<float>() : params.data<float>() + c;
  // cuDNN always writes dx; without one it goes to scratch.
  const Tensor dx_out = dx.defined() ? dx : Tensor::empty(x.shape(), x.dtype(), Device::cuda(on.device));
  // With the saved mean and 1/sqrt(var + eps) given, cuDNN does not recompute the statistics, so
  // epsilon (which this API does not carry to backward) is not used; it must be valid though.
  constexpr double kUnusedEps = 1e-5;
  CUDNN_CHECK(cudnnBatchNormalizationBackward(ctx.cudnn, CUDNN_BATCHNORM_SPATIAL, &kOne, &kZero, &kOne, &kOne, d.x,
                                              x.raw(), d.x, dy.raw(), d.x, dx_out.raw(), d.param, scale, dg, db,
                                              kUnusedEps, save_mean.data<float>(), save_invstd.data<float>()));
  auto add_partial = [&](const Tensor& grad, const float* partial) {
    with_float_type(grad.dtype(), [&](auto tag) {
      using G = decltype(tag);
      parallel_for(on, c, fn::Axpy<float, G>{1.0f, partial, grad.data<G>()});
    });
  };
  if (dgamma.defined() && !dgamma_direct) add_partial(dgamma, dg);
  if (dbeta.defined() && !dbeta_direct) add_partial(dbeta, db);
}

}  // namespace strata::ops::cuda
