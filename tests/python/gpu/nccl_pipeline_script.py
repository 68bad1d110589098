"""Run by test_parallel_cuda.py under torchrun on two GPUs: pp 2 on NCCL (headers on the gloo
twin of the pipeline group, activations and gradients device to device on the payload
groups), against one process on this rank's GPU; then a step that fails on stage 1, and steps
after it that must still be exact (the payload groups are renewed). Prints "nccl pipeline ok"
on each rank."""

from __future__ import annotations

import torch
from models import parity_adamw, tiny_hf_model
from test_parallel_cuda import assert_same_state  # this script's directory is on sys.path

import smp

VOCAB, SEQ = 64, 8


def main() -> None:
    smp.init({"pipeline_parallel_degree": 2, "microbatches": 4})
    state = smp.state.get_state()
    assert state.backend == "nccl" and state.device.type == "cuda", (state.backend, state.device)
    assert len(state.pipeline_payload_groups()) == 2
    device = state.device
    torch.manual_seed(5)
    reference = tiny_hf_model("llama", VOCAB, SEQ).to(device)
    torch.manual_seed(5)
    module = tiny_hf_model("llama", VOCAB, SEQ)
    model = smp.DistributedModel(module)
    optimizer = smp.DistributedOptimizer(parity_adamw(model.parameters()))
    reference_optimizer = parity_adamw(reference.parameters())
    fail = {"armed": False}

    def maybe_fail(_module, _args):
        if fail["armed"]:
            raise ValueError("stage 1 fails on purpose")

    last = model.module.model.layers[-1]
    last.register_forward_pre_hook(maybe_fail)

    @smp.step
    def train_step(model, ids):
        loss = model(input_ids=ids, labels=ids).loss
        model.backward(loss)
        return loss

    for step in range(5):
        g = torch.Generator().manual_seed(step)
        ids = torch.randint(0, VOCAB, (8, SEQ), generator=g)
        if step == 2:
            fail["armed"] = True
            try:
                train_step(model, ids)
                raise AssertionError("the armed step did not fail")
            except (ValueError, smp.StepFailedError):
                pass
            fail["armed"] = False
            continue
        optimizer.zero_grad()
        loss = train_step(model, ids).reduce_mean().item()
        reference_optimizer.zero_grad()
        ref_loss = reference(input_ids=ids.to(device), labels=ids.to(device)).loss
        ref_loss.backward()
        assert abs(loss - ref_loss.item()) <= 1e-4 * (1 + abs(loss)), (step, loss, ref_loss)
        optimizer.step()
        reference_optimizer.step()
        assert_same_state(model, reference)
    print(f"rank {state.rank}: nccl pipeline ok", flush=True)
    smp.shutdown()


if __name__ == "__main__":
    main()
