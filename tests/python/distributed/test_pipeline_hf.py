"""An unmodified Hugging Face model (built from a tiny config, no weights downloaded) trains
under the pipeline runtime with the same loss and gradients as one process."""

from __future__ import annotations

import pytest
import torch
from models import assert_owned_grads_match

transformers = pytest.importorskip("transformers")

TOL = dict(rtol=1e-5, atol=1e-5)


def _tiny_gpt2():
    config = transformers.GPT2Config(
        vocab_size=64, n_positions=32, n_embd=32, n_layer=4, n_head=2,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
        bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config)


def _hf_worker(pp: int, microbatches: int):
    import smp

    smp.init({"pipeline_parallel_degree": pp, "microbatches": microbatches})
    reference = _tiny_gpt2()
    model = smp.DistributedModel(_tiny_gpt2())

    @smp.step
    def train_step(model, ids):
        out = model(input_ids=ids, labels=ids)
        model.backward(out.loss)
        return out.loss

    ids = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(1))
    loss = train_step(model, ids).reduce_mean()
    ref_loss = (
        sum(reference(input_ids=x, labels=x).loss for x in ids.chunk(microbatches)) / microbatches
    )
    ref_loss.backward()
    assert abs(loss.item() - ref_loss.item()) < 1e-5
    return assert_owned_grads_match(model, reference, smp.pp_rank(), TOL)


@pytest.mark.parametrize("microbatches", [1, 2])
def test_hugging_face_gpt2_two_stages(pools, microbatches):
    checked = pools.run(2, _hf_worker, 2, microbatches)
    assert all(c > 0 for c in checked)
