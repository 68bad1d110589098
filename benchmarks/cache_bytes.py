"""What a Hugging Face key/value cache costs in pipeline traffic (design.md §4.6).

An unmodified Hugging Face Llama (8 layers, hidden 256, FFN 704, 8 heads / 4 KV heads, vocab
4096, untied head) trains at pp = 2 on two gloo processes, 8 microbatches of 2 x 128 tokens, with
its default ``use_cache=True`` (the cache crosses stages with every call that takes it, and the
layers' changes come back) and with ``use_cache=False``. Counted: the bytes of the tensors each
stage hands to its sender, and the messages, per microbatch, in the third step (steady state).

    .venv/bin/python benchmarks/cache_bytes.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _launch import run_ranks  # noqa: E402

MICROBATCHES, STEPS = 8, 3


def _traffic(rank: int, use_cache: bool) -> list[tuple[float, float]]:
    """(MB, messages) sent per microbatch by each stage in the last step."""
    import transformers

    import smp
    from smp.pipeline import sender

    count = {"bytes": 0, "messages": 0}
    send = sender.Sender.send

    def counting_send(self, peer, header, tensors):
        count["bytes"] += sum(t.numel() * t.element_size() for t in tensors)
        count["messages"] += 1
        return send(self, peer, header, tensors)

    sender.Sender.send = counting_send
    smp.init({"pipeline_parallel_degree": 2, "microbatches": MICROBATCHES})
    config = transformers.LlamaConfig(
        vocab_size=4096, hidden_size=256, intermediate_size=704, num_hidden_layers=8,
        num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=256,
        use_cache=use_cache, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = smp.DistributedModel(transformers.LlamaForCausalLM(config))

    @smp.step
    def train_step(model, ids):
        loss = model(input_ids=ids, labels=ids).loss
        model.backward(loss)
        return loss

    ids = torch.randint(
        0, 4096, (2 * MICROBATCHES, 128), generator=torch.Generator().manual_seed(1)
    )
    for step in range(STEPS):
        if step == STEPS - 1:
            count.update(bytes=0, messages=0)
        train_step(model, ids)
    mine = (count["bytes"] / MICROBATCHES / 1e6, count["messages"] / MICROBATCHES)
    everyone = smp.allgather(mine, smp.PP_GROUP)
    smp.shutdown()
    sender.Sender.send = send
    return everyone


def main() -> None:
    print("HF Llama 8 x 256, pp 2, 8 microbatches of 2 x 128 tokens; sent per microbatch:")
    for use_cache in (True, False):
        stages = run_ranks(_traffic, 2, use_cache)
        for stage, (mb, messages) in enumerate(stages):
            cache = f"use_cache={use_cache!s:5}"
            print(f"  {cache}  stage {stage}: {mb:6.2f} MB, {messages:5.1f} messages")


if __name__ == "__main__":
    main()
