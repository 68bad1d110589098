#!/usr/bin/env python3
"""Fails if the torch-free core (include/smp/*.h outside pytorch/, csrc/core/, tests/cpp/core/)
includes torch, ATen, c10, pybind11 or Python headers."""

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FORBIDDEN = re.compile(r'^\s*#\s*include\s*[<"](torch|ATen|c10|caffe2|pybind11|Python\.h)')
CORE = [
    *sorted(p for p in (ROOT / "include" / "smp").glob("*.h")),
    *sorted((ROOT / "csrc" / "core").rglob("*.[ch]*")),
    *sorted((ROOT / "tests" / "cpp" / "core").rglob("*.[ch]*")),
]


def main() -> int:
    bad = []
    for path in CORE:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if FORBIDDEN.match(line):
                bad.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    if bad:
        print("the smp core must stay torch-free, but includes:", *bad, sep="\n  ")
        return 1
    print(f"core include check: {len(CORE)} files, none include torch/ATen/c10/pybind11/Python")
    return 0


if __name__ == "__main__":
    sys.exit(main())
