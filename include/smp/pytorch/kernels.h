// smp/pytorch/kernels.h — fused kernels, each an op in torch's dispatcher (torch.ops.smp.*).
//
// Every op has a CPU path, written as the ATen composition it replaces, and, in a build with
// CUDA, a CUDA kernel that does the same work in fewer passes over memory. Tests hold each CUDA
// kernel to its CPU path. Autograd is added in Python (smp/kernels.py), where the communication
// between a forward's pieces lives.
//
//   vocab_ce_stats(logits[N, V], target[N], vocab_start) -> (max[N], sum_exp[N], target_logit[N])
//       One pass over a rank's vocabulary slice of the logits: the row maximum, the sum of
//       exp(logit - max), and the logit of the target token if it falls in this slice (0 if not).
//       All float32 (float64 for float64 logits). Ranks combine these into log-sum-exp.
//   vocab_ce_grad(logits[N, V], lse[N], target[N], vocab_start, grad[N]) -> grad_logits[N, V]
//       grad * (exp(logit - lse) - [column == target]) in one pass, in the logits' dtype: the
//       softmax is never stored.
//   bias_gelu(x[..., H], bias[H], approximate) -> gelu(x + bias)
//   bias_gelu_backward(grad[..., H], x[..., H], bias[H], approximate) -> d gelu(x + bias) / dx
//       approximate is "none" (erf) or "tanh", as torch.nn.functional.gelu. The bias is added in
//       x's dtype, as a Linear's bias is under autocast. The bias gradient is the sum of the
//       returned gradient over the leading dimensions (done by the caller).
//
// Bad shapes, dtypes or devices raise c10::Error naming the argument.
#pragma once

#include <ATen/ATen.h>

#include <string>
#include <tuple>

namespace smp::kernels {

std::tuple<at::Tensor, at::Tensor, at::Tensor> vocab_ce_stats_cpu(const at::Tensor& logits,
                                                                  const at::Tensor& target,
                                                                  int64_t vocab_start);
at::Tensor vocab_ce_grad_cpu(const at::Tensor& logits, const at::Tensor& lse,
                             const at::Tensor& target, int64_t vocab_start, const at::Tensor& grad);
at::Tensor bias_gelu_cpu(const at::Tensor& x, const at::Tensor& bias,
                         const std::string& approximate);
at::Tensor bias_gelu_backward_cpu(const at::Tensor& grad, const at::Tensor& x,
                                  const at::Tensor& bias, const std::string& approximate);

#ifdef SMP_WITH_CUDA
std::tuple<at::Tensor, at::Tensor, at::Tensor> vocab_ce_stats_cuda(const at::Tensor& logits,
                                                                   const at::Tensor& target,
                                                                   int64_t vocab_start);
at::Tensor vocab_ce_grad_cuda(const at::Tensor& logits, const at::Tensor& lse,
                              const at::Tensor& target, int64_t vocab_start,
                              const at::Tensor& grad);
at::Tensor bias_gelu_cuda(const at::Tensor& x, const at::Tensor& bias,
                          const std::string& approximate);
at::Tensor bias_gelu_backward_cuda(const at::Tensor& grad, const at::Tensor& x,
                                   const at::Tensor& bias, const std::string& approximate);
#endif

namespace internal {
// Argument checks shared by the CPU and CUDA paths.
void check_ce_stats(const at::Tensor& logits, const at::Tensor& target);
// The dtype of the statistics, lse and grad: float64 for float64 logits, else float32.
at::ScalarType stats_type(const at::Tensor& logits);
void check_ce_grad(const at::Tensor& logits, const at::Tensor& lse, const at::Tensor& target,
                   const at::Tensor& grad);
void check_bias_gelu(const at::Tensor& x, const at::Tensor& bias, const std::string& approximate);
}  // namespace internal

}  // namespace smp::kernels
