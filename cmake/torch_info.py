"""Prints what CMake needs to know about the installed torch, one `KEY=value` per line.

PREFIX      torch.utils.cmake_prefix_path (TorchConfig.cmake lives under it)
ROOT        the torch package directory (include/ and lib/ beside it)
CUDA        torch.version.cuda, empty for a CPU build
ARCHS       the GPU architectures torch was built for, TORCH_CUDA_ARCH_LIST style ("8.0,9.0")
ABI         torch's _GLIBCXX_USE_CXX11_ABI (0 or 1)
NVRTC       a libnvrtc shipped beside torch by the CUDA wheels, empty if none
"""

import glob
import os

import torch
import torch.utils

root = os.path.dirname(torch.__file__)
archs = []
if torch.version.cuda:
    for name in torch.cuda.get_arch_list():
        if name.startswith("sm_"):
            number = int("".join(ch for ch in name[3:] if ch.isdigit()))
            archs.append(f"{number // 10}.{number % 10}")
site = os.path.dirname(root)
nvrtc = sorted(glob.glob(os.path.join(site, "nvidia", "*", "lib", "libnvrtc.so*")))
nvrtc = [path for path in nvrtc if "builtins" not in path and ".alt." not in path]
print(f"PREFIX={torch.utils.cmake_prefix_path}")
print(f"ROOT={root}")
print(f"CUDA={torch.version.cuda or ''}")
print(f"ARCHS={','.join(archs)}")
print(f"ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}")
print(f"NVRTC={nvrtc[0] if nvrtc else ''}")
