"""The language-model examples written the SMP v1 way train under torchrun: the Hugging Face
GPT-2 (examples/hf_gpt) at pp 2 x tp 2, BERT masked-LM pretraining (examples/bert_mlm) at
pp 2 x dp 2 with its configuration in a file given by --config, RoBERTa at tp 2 (each rank's
batch padded to its own length). Each job exits non-zero when its loss did not fall. And the
GPT example's --plan-only partitions GPT-3 175B, built on the meta device, in this process."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
from conftest import REPO

pytest.importorskip("transformers")

EXAMPLES = REPO / "examples"
BERT_CONFIG = "examples/bert_mlm/smp_config.json"  # pipeline_parallel_degree 2, microbatches 2


def _torchrun(nproc: int, script: str, *args: str) -> str:
    env = {**os.environ, "PYTHONFAULTHANDLER": "1"}
    for name in ("SMP_CONFIG", "SM_HP_MP_PARAMETERS"):
        env.pop(name, None)
    proc = subprocess.run(
        [
            sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc_per_node", str(nproc), str(EXAMPLES / script), *args,
        ],
        capture_output=True, text=True, timeout=240, env=env, cwd=REPO,
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]  # non-zero when the loss did not fall
    return out


def test_hf_gpt2_trains_at_pp2_tp2():
    out = _torchrun(
        4, "hf_gpt/train.py", "--pp", "2", "--tp", "2", "--microbatches", "2", "--steps", "8"
    )
    header = next(line for line in out.splitlines() if line.startswith("hf_gpt: "))
    assert "pp 2 x tp 2 x rdp 1" in header, header
    for split in ("transformer.wte", "lm_head", "transformer.h.1"):  # tied head: vocab-split
        assert split in header.partition("tensor parallel:")[2], header
    assert "smp partition: 2 stages" in out, out[-4000:]
    assert "hf_gpt done: loss" in out, out[-4000:]


@pytest.mark.parametrize(
    "nproc,args,layout",
    [
        (4, ["--model", "bert", "--config", BERT_CONFIG], "pp 2 x tp 1 x rdp 2"),
        (2, ["--model", "roberta", "--tp", "2"], "pp 1 x tp 2 x rdp 1"),
    ],
    ids=["bert-pp2-dp2-config-file", "roberta-tp2"],
)
def test_masked_lm_pretraining(nproc, args, layout):
    out = _torchrun(nproc, "bert_mlm/train.py", *args, "--steps", "12")
    assert layout in out, out[-4000:]
    assert f"{args[1]}_mlm done: loss" in out, out[-4000:]


def test_plan_only_partitions_gpt3_175b_on_the_meta_device(capsys):
    spec = importlib.util.spec_from_file_location("hf_gpt_train", EXAMPLES / "hf_gpt/train.py")
    train = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train)
    assert train.main(["--model-config", "gpt3-175b", "--plan-only", "--pp", "8"]) == 0
    out = capsys.readouterr().out
    assert "174.60B parameters" in out, out
    assert "smp partition: 8 stages" in out, out
    assert "transformer.h.95" in out, out  # every one of the 96 blocks is placed
