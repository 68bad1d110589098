// CUDA kernels of bias + GeLU (see smp/pytorch/kernels.h): one elementwise pass forward
// (x + bias, then GeLU) and one backward (the GeLU derivative at x + bias), where the ATen
// composition makes two passes and keeps x + bias for backward.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>
#include <cmath>

#include "smp/pytorch/kernels.h"

namespace smp::kernels {
namespace {

constexpr int kThreads = 256;

// The GeLU formulas as ATen's CUDA kernels write them, in float.
template <bool kTanh>
__device__ __forceinline__ float gelu(float v) {
  if constexpr (kTanh) {
    constexpr float kBeta = M_SQRT2 * M_2_SQRTPI * 0.5f;
    constexpr float kKappa = 0.044715f;
    const float inner = kBeta * (v + kKappa * v * v * v);
    return 0.5f * v * (1.f + tanhf(inner));
  } else {
    return 0.5f * v * (1.f + erff(v * static_cast<float>(M_SQRT1_2)));
  }
}

template <bool kTanh>
__device__ __forceinline__ float gelu_grad(float dy, float v) {
  if constexpr (kTanh) {
    constexpr float kBeta = M_SQRT2 * M_2_SQRTPI * 0.5f;
    constexpr float kKappa = 0.044715f;
    const float v_sq = v * v;
    const float tanh_inner = tanhf(kBeta * (v + kKappa * v_sq * v));
    const float left = 0.5f * v;
    const float right = 1.f + tanh_inner;
    const float right_derivative =
        left * (1.f - tanh_inner * tanh_inner) * kBeta * (1.f + 3.f * kKappa * v_sq);
    return dy * (0.5f * right + right_derivative);
  } else {
    constexpr float kBeta = M_2_SQRTPI * M_SQRT1_2 * 0.5f;
    const float cdf = 0.5f * (1.f + erff(v * static_cast<float>(M_SQRT1_2)));
    const float pdf = expf(-0.5f * v * v) * kBeta;
    return dy * (cdf + v * pdf);
  }
}

// x + bias rounded to x's dtype, as the composition's add is.
template <typename scalar_t>
__device__ __forceinline__ float biased(const scalar_t* x, const scalar_t* bias, int64_t i,
                                        int64_t width) {
  return static_cast<float>(
      static_cast<scalar_t>(static_cast<float>(x[i]) + static_cast<float>(bias[i % width])));
}

template <typename scalar_t, bool kTanh>
__global__ void __launch_bounds__(kThreads)
    bias_gelu_kernel(const scalar_t* __restrict__ x, const scalar_t* __restrict__ bias, int64_t n,
                     int64_t width, scalar_t* __restrict__ out) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride) {
    out[i] = static_cast<scalar_t>(gelu<kTanh>(biased(x, bias, i, width)));
  }
}

template <typename scalar_t, bool kTanh>
__global__ void __launch_bounds__(kThreads)
    bias_gelu_backward_kernel(const scalar_t* __restrict__ dy, const scalar_t* __restrict__ x,
                              const scalar_t* __restrict__ bias, int64_t n, int64_t width,
                              scalar_t* __restrict__ dx) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride) {
    dx[i] = static_cast<scalar_t>(
        gelu_grad<kTanh>(static_cast<float>(dy[i]), biased(x, bias, i, width)));
  }
}

int64_t blocks_for(int64_t n) {
  int device = 0;
  int processors = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&processors, cudaDevAttrMultiProcessorCount, device));
  const int64_t most = static_cast<int64_t>(processors) * 16;
  return std::max<int64_t>(1, std::min<int64_t>((n + kThreads - 1) / kThreads, most));
}

}  // namespace

at::Tensor bias_gelu_cuda(const at::Tensor& x_in, const at::Tensor& bias_in,
                          const std::string& approximate) {
  internal::check_bias_gelu(x_in, bias_in, approximate);
  const c10::cuda::CUDAGuard guard(x_in.device());
  const at::Tensor x = x_in.contiguous();
  const at::Tensor bias = bias_in.to(x.scalar_type()).contiguous();
  at::Tensor out = at::empty_like(x);
  const int64_t n = x.numel();
  if (n == 0) return out;
  auto stream = c10::cuda::getCurrentCUDAStream();
  const bool tanh = approximate == "tanh";
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "bias_gelu", [&] {
    auto kernel = tanh ? bias_gelu_kernel<scalar_t, true> : bias_gelu_kernel<scalar_t, false>;
    kernel<<<blocks_for(n), kThreads, 0, stream>>>(
        x.data_ptr<scalar_t>(), bias.data_ptr<scalar_t>(), n, x.size(-1), out.data_ptr<scalar_t>());
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

at::Tensor bias_gelu_backward_cuda(const at::Tensor& grad_in, const at::Tensor& x_in,
                                   const at::Tensor& bias_in, const std::string& approximate) {
  internal::check_bias_gelu(x_in, bias_in, approximate);
  TORCH_CHECK(grad_in.sizes() == x_in.sizes(), "bias_gelu_backward: grad ", grad_in.sizes(),
              " must have x's shape ", x_in.sizes());
  const c10::cuda::CUDAGuard guard(x_in.device());
  const at::Tensor x = x_in.contiguous();
  const at::Tensor grad = grad_in.to(x.scalar_type()).contiguous();
  const at::Tensor bias = bias_in.to(x.scalar_type()).contiguous();
  at::Tensor dx = at::empty_like(x);
  const int64_t n = x.numel();
  if (n == 0) return dx;
  auto stream = c10::cuda::getCurrentCUDAStream();
  const bool tanh = approximate == "tanh";
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, x.scalar_type(), "bias_gelu_backward", [&] {
        auto kernel = tanh ? bias_gelu_backward_kernel<scalar_t, true>
                           : bias_gelu_backward_kernel<scalar_t, false>;
        kernel<<<blocks_for(n), kThreads, 0, stream>>>(
            grad.data_ptr<scalar_t>(), x.data_ptr<scalar_t>(), bias.data_ptr<scalar_t>(), n,
            x.size(-1), dx.data_ptr<scalar_t>());
      });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return dx;
}

}  // namespace smp::kernels
