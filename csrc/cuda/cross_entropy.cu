// CUDA kernels of the vocab-parallel cross-entropy (see smp/pytorch/kernels.h).
//
// vocab_ce_stats: one block per token row; each thread keeps a running (max, sum of exp) over its
// columns (the online softmax normaliser), the block combines the pairs, and thread 0 reads the
// target logit. One read of the logits, three floats written per row.
// vocab_ce_grad: one block per row writes grad * (exp(x - lse) - onehot) in the logits' dtype.
// One read, one write; the softmax is never stored.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cmath>

#include "smp/pytorch/kernels.h"

namespace smp::kernels {
namespace {

constexpr int kThreads = 256;
constexpr int kWarp = 32;

// Statistics are accumulated in float (double for double logits), as at::opmath_type says.
__device__ __forceinline__ float exp_of(float x) { return expf(x); }
__device__ __forceinline__ double exp_of(double x) { return exp(x); }

template <typename acc_t>
struct MaxSum {
  acc_t max;
  acc_t sum;
};

template <typename acc_t>
__device__ __forceinline__ MaxSum<acc_t> combine(MaxSum<acc_t> a, MaxSum<acc_t> b) {
  if (a.max == -INFINITY) return b;
  if (b.max == -INFINITY) return a;
  const acc_t max = a.max > b.max ? a.max : b.max;
  return {max, a.sum * exp_of(a.max - max) + b.sum * exp_of(b.max - max)};
}

template <typename acc_t>
__device__ MaxSum<acc_t> warp_combine(MaxSum<acc_t> value) {
  for (int offset = kWarp / 2; offset > 0; offset /= 2) {
    MaxSum<acc_t> other{__shfl_xor_sync(0xffffffff, value.max, offset),
                        __shfl_xor_sync(0xffffffff, value.sum, offset)};
    value = combine(value, other);
  }
  return value;
}

template <typename acc_t>
__device__ MaxSum<acc_t> block_combine(MaxSum<acc_t> value) {
  __shared__ MaxSum<acc_t> warps[kThreads / kWarp];
  value = warp_combine(value);
  const int lane = threadIdx.x % kWarp;
  const int warp = threadIdx.x / kWarp;
  if (lane == 0) warps[warp] = value;
  __syncthreads();
  if (warp == 0) {
    value = lane < blockDim.x / kWarp ? warps[lane] : MaxSum<acc_t>{-INFINITY, 0};
    value = warp_combine(value);
  }
  return value;  // valid in thread 0
}

template <typename scalar_t, typename acc_t>
__global__ void __launch_bounds__(kThreads)
    ce_stats_kernel(const scalar_t* __restrict__ logits, const int64_t* __restrict__ target,
                    int64_t vocab, int64_t vocab_start, acc_t* __restrict__ max_out,
                    acc_t* __restrict__ sum_out, acc_t* __restrict__ target_out) {
  const int64_t row = blockIdx.x;
  const scalar_t* x = logits + row * vocab;
  MaxSum<acc_t> acc{-INFINITY, 0};
  for (int64_t j = threadIdx.x; j < vocab; j += blockDim.x) {
    const acc_t v = static_cast<acc_t>(x[j]);
    if (v > acc.max) {
      acc.sum = acc.sum * exp_of(acc.max - v) + 1;
      acc.max = v;
    } else if (v != -INFINITY) {
      acc.sum += exp_of(v - acc.max);
    }
  }
  acc = block_combine(acc);
  if (threadIdx.x == 0) {
    max_out[row] = acc.max;
    sum_out[row] = acc.sum;
    const int64_t t = target[row] - vocab_start;
    target_out[row] = (t >= 0 && t < vocab) ? static_cast<acc_t>(x[t]) : acc_t(0);
  }
}

template <typename scalar_t, typename acc_t>
__global__ void __launch_bounds__(kThreads)
    ce_grad_kernel(const scalar_t* __restrict__ logits, const acc_t* __restrict__ lse,
                   const int64_t* __restrict__ target, const acc_t* __restrict__ grad,
                   int64_t vocab, int64_t vocab_start, scalar_t* __restrict__ out) {
  const int64_t row = blockIdx.x;
  const acc_t row_lse = lse[row];
  const acc_t g = grad[row];
  const int64_t t = target[row] - vocab_start;
  const scalar_t* x = logits + row * vocab;
  scalar_t* y = out + row * vocab;
  for (int64_t j = threadIdx.x; j < vocab; j += blockDim.x) {
    acc_t p = exp_of(static_cast<acc_t>(x[j]) - row_lse);
    if (j == t) p -= 1;
    y[j] = static_cast<scalar_t>(p * g);
  }
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> vocab_ce_stats_cuda(const at::Tensor& logits_in,
                                                                   const at::Tensor& target_in,
                                                                   int64_t vocab_start) {
  internal::check_ce_stats(logits_in, target_in);
  const c10::cuda::CUDAGuard guard(logits_in.device());
  const at::Tensor logits = logits_in.contiguous();
  const at::Tensor target = target_in.contiguous();
  const int64_t rows = logits.size(0);
  const auto options = logits.options().dtype(internal::stats_type(logits));
  at::Tensor max = at::empty({rows}, options);
  at::Tensor sum = at::empty({rows}, options);
  at::Tensor picked = at::empty({rows}, options);
  if (rows == 0) return {max, sum, picked};
  TORCH_CHECK(logits.size(1) > 0, "vocab_ce_stats: the vocabulary slice is empty");
  auto stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, logits.scalar_type(), "vocab_ce_stats", [&] {
        using acc_t = at::opmath_type<scalar_t>;
        ce_stats_kernel<scalar_t, acc_t><<<rows, kThreads, 0, stream>>>(
            logits.data_ptr<scalar_t>(), target.data_ptr<int64_t>(), logits.size(1), vocab_start,
            max.data_ptr<acc_t>(), sum.data_ptr<acc_t>(), picked.data_ptr<acc_t>());
      });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {max, sum, picked};
}

at::Tensor vocab_ce_grad_cuda(const at::Tensor& logits_in, const at::Tensor& lse_in,
                              const at::Tensor& target_in, int64_t vocab_start,
                              const at::Tensor& grad_in) {
  internal::check_ce_grad(logits_in, lse_in, target_in, grad_in);
  const c10::cuda::CUDAGuard guard(logits_in.device());
  const at::Tensor logits = logits_in.contiguous();
  const at::Tensor lse = lse_in.contiguous();
  const at::Tensor target = target_in.contiguous();
  const at::Tensor grad = grad_in.contiguous();
  at::Tensor out = at::empty_like(logits);
  const int64_t rows = logits.size(0);
  if (rows == 0 || logits.size(1) == 0) return out;
  auto stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, logits.scalar_type(), "vocab_ce_grad", [&] {
        using acc_t = at::opmath_type<scalar_t>;
        ce_grad_kernel<scalar_t, acc_t><<<rows, kThreads, 0, stream>>>(
            logits.data_ptr<scalar_t>(), lse.data_ptr<acc_t>(), target.data_ptr<int64_t>(),
            grad.data_ptr<acc_t>(), logits.size(1), vocab_start, out.data_ptr<scalar_t>());
      });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

}  // namespace smp::kernels
