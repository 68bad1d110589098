// CPU paths of smp's fused ops: the ATen compositions the CUDA kernels replace (see kernels.h).
#include "smp/pytorch/kernels.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

namespace smp::kernels {
namespace internal {

void check_ce_stats(const at::Tensor& logits, const at::Tensor& target) {
  TORCH_CHECK(logits.dim() == 2, "vocab_ce_stats: logits must be [tokens, vocab slice], got ",
              logits.sizes());
  TORCH_CHECK(at::isFloatingType(logits.scalar_type()),
              "vocab_ce_stats: logits must be floating point, got ", logits.scalar_type());
  TORCH_CHECK(target.dim() == 1 && target.size(0) == logits.size(0),
              "vocab_ce_stats: target must be [", logits.size(0), "] (one id per token), got ",
              target.sizes());
  TORCH_CHECK(target.scalar_type() == at::kLong, "vocab_ce_stats: target must be int64, got ",
              target.scalar_type());
  TORCH_CHECK(target.device() == logits.device(), "vocab_ce_stats: target is on ", target.device(),
              " but logits are on ", logits.device());
}

at::ScalarType stats_type(const at::Tensor& logits) {
  return logits.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

void check_ce_grad(const at::Tensor& logits, const at::Tensor& lse, const at::Tensor& target,
                   const at::Tensor& grad) {
  check_ce_stats(logits, target);
  const at::ScalarType type = stats_type(logits);
  for (const auto* t : {&lse, &grad}) {
    TORCH_CHECK(t->dim() == 1 && t->size(0) == logits.size(0) && t->scalar_type() == type &&
                    t->device() == logits.device(),
                "vocab_ce_grad: lse and grad must be ", type, " [", logits.size(0), "] on ",
                logits.device(), ", got ", t->scalar_type(), " ", t->sizes(), " on ", t->device());
  }
}

void check_bias_gelu(const at::Tensor& x, const at::Tensor& bias, const std::string& approximate) {
  TORCH_CHECK(approximate == "none" || approximate == "tanh",
              "bias_gelu: approximate must be 'none' or 'tanh', got '", approximate, "'");
  TORCH_CHECK(x.dim() >= 1 && bias.dim() == 1 && bias.size(0) == x.size(-1),
              "bias_gelu: bias must be [", x.dim() >= 1 ? x.size(-1) : 0,
              "] (x's last dimension), got ", bias.sizes(), " for x ", x.sizes());
  TORCH_CHECK(bias.device() == x.device(), "bias_gelu: bias is on ", bias.device(), " but x is on ",
              x.device());
  TORCH_CHECK(at::isFloatingType(x.scalar_type()) && at::isFloatingType(bias.scalar_type()),
              "bias_gelu: x and bias must be floating point, got ", x.scalar_type(), " and ",
              bias.scalar_type());
}

}  // namespace internal

namespace {

// Which rows' targets fall in this slice, and their column in it (0 where they do not).
std::pair<at::Tensor, at::Tensor> local_targets(const at::Tensor& target, int64_t vocab_start,
                                                int64_t slice) {
  at::Tensor local = target - vocab_start;
  at::Tensor inside = local.ge(0).logical_and(local.lt(slice));
  return {inside, at::where(inside, local, at::zeros_like(local))};
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> vocab_ce_stats_cpu(const at::Tensor& logits,
                                                                  const at::Tensor& target,
                                                                  int64_t vocab_start) {
  internal::check_ce_stats(logits, target);
  at::Tensor x = logits.to(internal::stats_type(logits));
  at::Tensor max = std::get<0>(x.max(-1));
  at::Tensor sum_exp = (x - max.unsqueeze(-1)).exp_().sum(-1);
  auto [inside, column] = local_targets(target, vocab_start, logits.size(1));
  at::Tensor picked = x.gather(-1, column.unsqueeze(-1)).squeeze(-1);
  return {max, sum_exp, at::where(inside, picked, at::zeros_like(picked))};
}

at::Tensor vocab_ce_grad_cpu(const at::Tensor& logits, const at::Tensor& lse,
                             const at::Tensor& target, int64_t vocab_start,
                             const at::Tensor& grad) {
  internal::check_ce_grad(logits, lse, target, grad);
  at::Tensor p = (logits.to(lse.scalar_type()) - lse.unsqueeze(-1)).exp_();
  auto [inside, column] = local_targets(target, vocab_start, logits.size(1));
  p.scatter_add_(-1, column.unsqueeze(-1), inside.to(p.scalar_type()).neg().unsqueeze(-1));
  return p.mul_(grad.unsqueeze(-1)).to(logits.scalar_type());
}

at::Tensor bias_gelu_cpu(const at::Tensor& x, const at::Tensor& bias,
                         const std::string& approximate) {
  internal::check_bias_gelu(x, bias, approximate);
  return at::gelu(x + bias.to(x.scalar_type()), approximate);
}

at::Tensor bias_gelu_backward_cpu(const at::Tensor& grad, const at::Tensor& x,
                                  const at::Tensor& bias, const std::string& approximate) {
  internal::check_bias_gelu(x, bias, approximate);
  TORCH_CHECK(grad.sizes() == x.sizes(), "bias_gelu_backward: grad ", grad.sizes(),
              " must have x's shape ", x.sizes());
  return at::gelu_backward(grad, x + bias.to(x.scalar_type()), approximate);
}

}  // namespace smp::kernels
