"""``python -m smp.planner``: plans for a model on a cluster, from the command line.

    python -m smp.planner --model config.json --cluster h100 --gpus 64 --global-batch 512 \\
        --seq 2048 [--gpus-per-node 8] [--dtype bf16] [--top 5] [--json plans.json] \\
        [--explain] [--trace predicted.json]

``--model`` is a Hugging Face config (a ``config.json`` path: the causal LM of its
``model_type`` is built on the meta device, so no weights are needed or downloaded) or
``package.module:function`` returning a model (built on the meta device when it allocates its
parameters with the default device). The example batch is one sequence of ``--seq`` tokens with
its labels, so the model computes its loss.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from pathlib import Path

import torch

from smp.planner.cluster import BUILTIN_CLUSTERS, THIS_MACHINE
from smp.planner.plan import plan

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _build_model(spec: str, dtype: torch.dtype) -> torch.nn.Module:
    if ":" in spec and not Path(spec).exists():
        module_name, _, function = spec.partition(":")
        factory = getattr(importlib.import_module(module_name), function)
        with torch.device("meta"):
            model = factory()
    else:
        path = Path(spec)
        if not path.exists():
            raise SystemExit(
                f"smp.planner: --model {spec!r}: no such file (give a config.json path, or "
                "module:function)"
            )
        import transformers  # noqa: PLC0415 - only for Hugging Face configs

        data = json.loads(path.read_text())
        if "model_type" not in data:
            raise SystemExit(f"smp.planner: {spec} has no 'model_type': not a Hugging Face config")
        config = transformers.AutoConfig.for_model(**data)
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(config)
    return model.to(dtype)


def main(argv: list[str] | None = None) -> int:
    names = ", ".join([*BUILTIN_CLUSTERS, THIS_MACHINE])
    parser = argparse.ArgumentParser(
        prog="python -m smp.planner", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "--model", required=True, help="a Hugging Face config.json, or module:function"
    )
    parser.add_argument("--cluster", required=True, help=f"{names}, or a profile's JSON path")
    parser.add_argument("--gpus", type=int, help="devices in all (default: the profile's)")
    parser.add_argument(
        "--gpus-per-node", type=int, help="devices per node (default: the profile's)"
    )
    parser.add_argument("--global-batch", type=int, required=True, help="samples per step")
    parser.add_argument("--seq", type=int, required=True, help="tokens per sample")
    parser.add_argument("--dtype", choices=sorted(_DTYPES), default="bf16")
    parser.add_argument("--top", type=int, default=5, help="plans to print")
    parser.add_argument("--json", help="write {'plans': [...], 'rejected': [...]} here")
    parser.add_argument("--explain", action="store_true", help="the top plans side by side")
    parser.add_argument("--trace", help="write the best plan's predicted timeline (Chrome trace)")
    args = parser.parse_args(argv)
    model = _build_model(args.model, _DTYPES[args.dtype])
    ids = torch.zeros(1, args.seq, dtype=torch.long)
    plans = plan(
        model,
        {"input_ids": ids, "labels": ids, "use_cache": False}
        if hasattr(model, "config")
        else (ids,),
        args.cluster,
        args.global_batch,
        num_devices=args.gpus,
        devices_per_node=args.gpus_per_node,
        max_plans=max(args.top, 50),
        progress=True,
    )
    if args.explain:
        print(plans.explain(args.top))
    else:
        for i, p in enumerate(plans.plans[: args.top]):
            print(f"{i + 1}. {p.summary()}")
        if not plans.plans:
            print(plans.explain())
        print(f"{len(plans.rejected)} candidates rejected (--json lists them with their reasons)")
    if args.json:
        Path(args.json).write_text(json.dumps(plans.to_json(), indent=1) + "\n")
    if args.trace and plans.plans:
        plans.plans[0].timeline.save_chrome_trace(args.trace)
    return 0 if plans.plans else 1


if __name__ == "__main__":
    sys.exit(main())
