// Registers smp's fused ops with torch's dispatcher (torch.ops.smp.*): a CPU implementation
// everywhere, a CUDA one in builds with CUDA. Autograd wraps them in smp/kernels.py.
#include <torch/library.h>

#include "python/bindings.h"
#include "smp/pytorch/kernels.h"

TORCH_LIBRARY(smp, m) {
  m.def(
      "vocab_ce_stats(Tensor logits, Tensor target, int vocab_start) -> (Tensor, Tensor, Tensor)");
  m.def(
      "vocab_ce_grad(Tensor logits, Tensor lse, Tensor target, int vocab_start, Tensor grad) -> "
      "Tensor");
  m.def("bias_gelu(Tensor x, Tensor bias, str approximate) -> Tensor");
  m.def("bias_gelu_backward(Tensor grad, Tensor x, Tensor bias, str approximate) -> Tensor");
}

TORCH_LIBRARY_IMPL(smp, CPU, m) {
  m.impl("vocab_ce_stats", &smp::kernels::vocab_ce_stats_cpu);
  m.impl("vocab_ce_grad", &smp::kernels::vocab_ce_grad_cpu);
  m.impl("bias_gelu", &smp::kernels::bias_gelu_cpu);
  m.impl("bias_gelu_backward", &smp::kernels::bias_gelu_backward_cpu);
}

#ifdef SMP_WITH_CUDA
TORCH_LIBRARY_IMPL(smp, CUDA, m) {
  m.impl("vocab_ce_stats", &smp::kernels::vocab_ce_stats_cuda);
  m.impl("vocab_ce_grad", &smp::kernels::vocab_ce_grad_cuda);
  m.impl("bias_gelu", &smp::kernels::bias_gelu_cuda);
  m.impl("bias_gelu_backward", &smp::kernels::bias_gelu_backward_cuda);
}
#endif

namespace smp::python {

void init_kernel_bindings(pybind11::module_& m) {
#ifdef SMP_WITH_CUDA
  m.attr("built_with_cuda") = true;
#else
  m.attr("built_with_cuda") = false;
#endif
}

}  // namespace smp::python
