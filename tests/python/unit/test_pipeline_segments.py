"""Time-sliced backward: simulated remote calls reproduce plain autograd exactly."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from smp import _C
from smp.pipeline.segments import Uses, accumulate, edge_of, mark, run_segment


def _boundary(t: torch.Tensor) -> torch.Tensor:
    """What crossing a stage does to a value: a fresh leaf on the other side."""
    return t.detach().clone().requires_grad_(t.requires_grad)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(10, 8)
        self.block = nn.Linear(8, 8)  # "remote"
        self.inner = nn.Linear(8, 8)  # called back on the caller's stage by the remote block
        self.head = nn.Linear(8, 3)

    def forward(self, ids):  # the reference: plain autograd
        x = self.emb(ids)
        y = self.inner(torch.tanh(self.block(x))) * 2
        z = x + y  # x has a local and a remote consumer
        return self.head(torch.relu(z)).square().mean()


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def test_segments_with_local_and_remote_consumers_and_a_bounce():
    ref = Net()
    ids = torch.tensor([[1, 2, 3], [4, 5, 6]])
    ref(ids).backward()
    expected = _grads(ref)

    model = Net()
    emb_calls = []
    model.emb.weight.register_hook(lambda g: emb_calls.append(1))

    # Forward. Caller interval 0: embedding; then "remote" block on the owner.
    c0 = mark()
    x = model.emb(ids)
    x_owner = _boundary(x)  # owner, served call: interval 0
    o0 = mark()
    h = torch.tanh(model.block(x_owner))
    h_back = _boundary(h)  # the owner calls `inner`, which lives on the caller (a bounce)
    i0 = mark()
    inner_out = model.inner(h_back)  # served on the caller
    inner_ret = _boundary(inner_out)  # back on the owner: interval 1 of the served call
    o1 = mark()
    y_owner = inner_ret * 2
    y = _boundary(y_owner)  # reply reaches the caller: interval 1
    c1 = mark()
    loss = model.head(torch.relu(x + y)).square().mean()

    # Backward, event by event, as the runtime will schedule it.
    caller1 = run_segment([loss], [torch.ones(())], c1, boundary_leaves=[y])
    ((edge_x, gx_local),) = caller1.edge_grads.values()
    assert emb_calls == []  # autograd stopped at x: the embedding has not run yet
    gy = caller1.leaf_grads[id(y)]
    owner1 = run_segment([y_owner], [gy], o1, boundary_leaves=[inner_ret])
    g_inner = owner1.leaf_grads[id(inner_ret)]
    served = run_segment([inner_out], [g_inner], i0, boundary_leaves=[h_back])
    g_h = served.leaf_grads[id(h_back)]
    owner0 = run_segment([h], [g_h], o0, boundary_leaves=[x_owner])
    gx_remote = owner0.leaf_grads[id(x_owner)]
    caller0 = run_segment([edge_x], [gx_local + gx_remote], c0)
    assert emb_calls == [1]  # the upstream ran once, with the full gradient
    assert caller0.edge_grads == {} and caller0.leaf_grads == {}
    assert edge_x.node is edge_of(x).node

    got = _grads(model)
    for name, grad in expected.items():
        torch.testing.assert_close(got[name], grad, rtol=1e-6, atol=1e-7, msg=name)


@pytest.mark.parametrize("shared", [False, True], ids=["walk", "uses"])
def test_module_reused_across_intervals_accumulates(shared):
    uses = Uses() if shared else None  # the caller's segments share one (as a worker's do)
    torch.manual_seed(1)
    lin = nn.Linear(4, 4)
    x = torch.randn(3, 4)
    ref = lin(torch.sin(lin(x))).sum()
    ref.backward()
    expected = lin.weight.grad.clone()
    lin.weight.grad = None
    lin.bias.grad = None

    c0 = mark()
    a = lin(x)
    a_remote = _boundary(a)
    r0 = mark()
    b = torch.sin(a_remote)  # "remote"
    b_back = _boundary(b)
    c1 = mark()
    out = lin(b_back).sum()
    seg1 = run_segment([out], [torch.ones(())], c1, boundary_leaves=[b_back], uses=uses)
    remote = run_segment([b], [seg1.leaf_grads[id(b_back)]], r0, boundary_leaves=[a_remote])
    run_segment([a], [remote.leaf_grads[id(a_remote)]], c0, uses=uses)
    torch.testing.assert_close(lin.weight.grad, expected)


def test_mark_is_the_next_nodes_sequence_number_and_moves_only_with_nodes():
    import threading

    w = torch.randn(3, requires_grad=True)
    before = mark()
    with torch.no_grad():
        torch.sin(w)  # no node: the mark stays
    assert mark() == before
    y = w * 2
    assert y.grad_fn._sequence_nr() == before
    assert mark() == before + 1
    other = []  # another thread's nodes do not move this thread's counter
    thread = threading.Thread(target=lambda: other.append((mark(), (w * 3).grad_fn)))
    thread.start()
    thread.join()
    assert mark() == before + 1 and other[0][1]._sequence_nr() == other[0][0]


def test_sole_gradient_is_true_only_for_a_tensor_nothing_else_holds():
    def alone(make):
        return _C.sole_gradient((make(),), 0)

    assert alone(lambda: torch.ones(3))
    held = torch.ones(3)
    assert not _C.sole_gradient((held,), 0)  # a Python reference besides the tuple's
    twice = torch.ones(3)
    pair = (twice, twice)
    del twice
    assert not _C.sole_gradient(pair, 0) and not _C.sole_gradient(pair, 1)  # one tensor, twice
    base = torch.ones(4, 4)
    assert not alone(lambda: base[1])  # a view of a base held elsewhere
    assert not alone(lambda: base.detach())  # another tensor over base's storage
    pair = (base[0], base[1])  # two views of one base (each holds it)
    assert not _C.sole_gradient(pair, 0)
    assert not alone(lambda: torch.empty_strided((4, 4), (1, 4)))  # not contiguous
    assert not alone(lambda: torch.ones(3, requires_grad=True))
    assert not alone(lambda: torch.ones(3).to_sparse())
    assert not _C.sole_gradient((None,), 0)
    with pytest.raises(ValueError, match="index 1 of a tuple of 1"):
        _C.sole_gradient((torch.ones(1),), 1)


def test_accumulate_takes_an_unshared_first_gradient_and_copies_any_other():
    """The first gradient of a parameter becomes its ``.grad`` without a copy when nothing else
    holds it, as autograd's accumulator does; a gradient that is shared (held elsewhere, or the
    same tensor for two parameters) is copied, so adding into one ``.grad`` later changes no
    other tensor."""
    p, q, r = (torch.zeros(3, requires_grad=True) for _ in range(3))
    fresh = torch.ones(3)
    address = fresh.data_ptr()
    grads = (None, fresh)
    del fresh
    accumulate([p], grads, 1)
    assert p.grad.data_ptr() == address  # taken as it is
    accumulate([p], (torch.full((3,), 2.0),))
    torch.testing.assert_close(p.grad, torch.full((3,), 3.0))

    shared = torch.ones(3)
    accumulate([q, r], (shared, shared))  # autograd may return one tensor for two inputs
    s = torch.zeros(3, requires_grad=True)
    kept = torch.ones(3)
    accumulate([s], (kept,))  # the caller still holds it
    accumulate([s], (torch.ones(3),))
    torch.testing.assert_close(s.grad, torch.full((3,), 2.0))
    accumulate([q, r], [torch.ones(3), torch.ones(3)])  # not the engine's tuple: copied
    for grad in (q.grad, r.grad):
        assert grad.data_ptr() != shared.data_ptr()
        torch.testing.assert_close(grad, torch.full((3,), 2.0))
    torch.testing.assert_close(shared, torch.ones(3))
    torch.testing.assert_close(kept, torch.ones(3))


def test_accumulate_from_the_engine_matches_autograd_and_shares_nothing():
    """Through run_segment: the engine's gradients become the parameters' ``.grad`` (no copy,
    as autograd's accumulator takes them), and the results over two backward passes equal
    autograd's own accumulation."""
    torch.manual_seed(3)
    lin = nn.Linear(4, 4)
    xs = [torch.randn(2, 4) for _ in range(2)]
    for x in xs:
        (lin(x) * lin.bias).sum().backward()  # the bias used twice: two gradient paths
    expected = [lin.weight.grad.clone(), lin.bias.grad.clone()]
    lin.zero_grad(set_to_none=True)
    for x in xs:
        start = mark()
        out = (lin(x) * lin.bias).sum()
        run_segment([out], [torch.ones(())], start)
    torch.testing.assert_close(lin.weight.grad, expected[0])
    torch.testing.assert_close(lin.bias.grad, expected[1])
    # The weight's gradient is the engine's own tensor (the transpose of a product, a view over
    # memory nothing else holds), not a copy, which would not be a view.
    assert lin.weight.grad._is_view()
    assert lin.weight.grad.data_ptr() != lin.bias.grad.data_ptr()


def test_unused_and_integer_outputs_are_skipped():
    c0 = mark()
    w = torch.randn(3, requires_grad=True)
    y = (w * 2).sum()
    result = run_segment([y, torch.arange(3)], [torch.ones(()), torch.zeros(3)], c0)
    torch.testing.assert_close(w.grad, torch.full((3,), 2.0))
    assert result.edge_grads == {} and result.leaf_grads == {}


@pytest.mark.parametrize("shared", [False, True], ids=["walk", "uses"])
def test_a_value_and_one_derived_from_it_both_used_by_a_later_interval(shared):
    """x and ln(x) come from interval 0 and are both used in interval 1 (and ln(x) in interval 0
    too): autograd must run LayerNorm's backward to reach x's producer from interval 1, so the
    segment runs it there with interval 1's share and again in interval 0 with the rest."""
    torch.manual_seed(2)
    lin, ln, head = nn.Linear(4, 4), nn.LayerNorm(4), nn.Linear(4, 1)
    inp = torch.randn(3, 4)

    def forward(cuts):
        marks = [mark()]
        x = lin(inp)
        y = ln(x)
        w = (y * 3).tanh()  # interval 0 also consumes y
        marks.append(mark())
        if cuts:
            return marks, head(x + y + w).sum()
        return None, head(x + y + w).sum()

    _, ref = forward(False)
    ref.backward()
    expected = {m: {n: p.grad.clone() for n, p in m.named_parameters()} for m in (lin, ln, head)}
    for m in (lin, ln, head):
        m.zero_grad(set_to_none=True)

    marks, out = forward(True)
    uses = Uses() if shared else None
    late = run_segment([out], [torch.ones(())], marks[1], uses=uses)
    early = run_segment(
        [e for e, _ in late.edge_grads.values()],
        [g for _, g in late.edge_grads.values()],
        marks[0],
        uses=uses,
    )
    assert not early.edge_grads
    for m, grads in expected.items():
        for n, p in m.named_parameters():
            torch.testing.assert_close(p.grad, grads[n])


@pytest.mark.parametrize("shared", [False, True], ids=["walk", "uses"])
def test_a_later_interval_using_a_leaf_that_an_earlier_value_came_from(shared):
    """Interval 1 uses a parameter and a boundary leaf directly and also values interval 0
    derived from them: autograd must run interval 0's nodes between those values and the
    leaves to give the leaves interval 1's gradient, so the segment runs them with its share
    (keeping what they saved) and interval 0 runs them again with the rest."""
    torch.manual_seed(3)
    lin = nn.Linear(4, 4)
    src = torch.randn(3, 4, requires_grad=True)

    def forward(cuts):
        b = _boundary(src) if cuts else src  # a served call's input
        marks = [mark()]
        x = lin(b)
        y = torch.tanh(x)
        w = (y * 2).sin()  # interval 0 also consumes y
        marks.append(mark())
        out = (y * lin.weight.sum() + b * 3 + w).square().sum()
        return marks, b, out

    _, _, ref = forward(False)
    ref.backward()
    expected = {n: p.grad.clone() for n, p in lin.named_parameters()}
    expected_src = src.grad.clone()
    lin.zero_grad(set_to_none=True)

    marks, b, out = forward(True)
    uses = Uses() if shared else None
    late = run_segment([out], [torch.ones(())], marks[1], boundary_leaves=[b], uses=uses)
    early = run_segment(
        [e for e, _ in late.edge_grads.values()],
        [g for _, g in late.edge_grads.values()],
        marks[0],
        boundary_leaves=[b],
        uses=uses,
    )
    assert not early.edge_grads
    leaf_grad = late.leaf_grads[id(b)] + early.leaf_grads.get(id(b), 0)
    torch.testing.assert_close(leaf_grad, expected_src)
    for n, p in lin.named_parameters():
        torch.testing.assert_close(p.grad, expected[n])


def test_uses_tells_which_leaves_an_earlier_interval_takes():
    """A deep chain of intervals, each with its own layer, and one weight shared by the first
    and the last: only that weight is taken before the last interval, so only its segment
    looks below its earlier intervals; the gradients are plain autograd's."""
    torch.manual_seed(4)
    layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(12))
    shared = nn.Parameter(torch.randn(4))
    inp = torch.randn(2, 4)

    def forward(marks):
        h = inp * shared
        for layer in layers:
            marks.append(mark())
            h = torch.tanh(layer(h))
        return (h * shared).sum()

    forward([]).backward()
    expected = [p.grad.clone() for p in (*layers.parameters(), shared)]
    for p in (*layers.parameters(), shared):
        p.grad = None

    marks: list[int] = []
    out = forward(marks)
    uses = Uses()
    roots, grads = [out], [torch.ones(())]
    for j in reversed(range(len(marks))):
        uses.walk([edge_of(out)])
        layer = layers[j]
        assert not uses.used_before(id(layer.weight), marks[j])  # first taken in interval j
        assert uses.used_before(id(shared), marks[j])  # taken before the first layer too
        result = run_segment(roots, grads, marks[j], uses=uses)
        roots = [e for e, _ in result.edge_grads.values()]
        grads = [g for _, g in result.edge_grads.values()]
    run_segment(roots, grads, 0, uses=uses)  # the part before the first mark
    got = [p.grad for p in (*layers.parameters(), shared)]
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e)
    assert Uses().used_before(id(shared), marks[-1])  # not walked: assumed taken before


class _Block(nn.Module):
    """A transformer-like block with the awkward cases of the weight split: a weight used twice
    (``tied``), and an output that depends on parameters only."""

    def __init__(self, c: int = 16):
        super().__init__()
        torch.manual_seed(3)
        self.ln = nn.LayerNorm(c)
        self.attn = nn.MultiheadAttention(c, 2, batch_first=True)
        self.fc, self.proj = nn.Linear(c, 4 * c), nn.Linear(4 * c, c)
        self.tied = nn.Linear(c, c)
        self.scale = nn.Parameter(torch.ones(c))

    def forward(self, x):
        h = self.ln(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        x = x + self.proj(torch.nn.functional.gelu(self.fc(x)))
        return self.tied(self.tied(x)), self.scale * 3


def _split_run(split: bool):
    block = _Block()
    x = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(1)).requires_grad_()
    start = mark()
    out, side = block(x)
    grads = [torch.ones_like(out), torch.full_like(side, 0.5)]
    result = run_segment([out, side], grads, start, boundary_leaves=[x], split_weights=split)
    eager = {n for n, p in block.named_parameters() if p.grad is not None}
    if result.weights is not None:
        result.weights.run()
    return result, eager, {n: p.grad for n, p in block.named_parameters()}


def test_weight_split_gives_the_same_gradients_bit_for_bit():
    """The input half computes the boundary leaf's gradient and the parameters that cannot
    wait; the weight half the rest, with the same products, so nothing differs in any bit."""
    plain, plain_eager, expected = _split_run(split=False)
    split, eager, got = _split_run(split=True)
    assert plain.weights is None and split.weights is not None
    (x_grad,) = plain.leaf_grads.values()
    assert torch.equal(next(iter(split.leaf_grads.values())), x_grad)
    assert set(got) == set(expected) == plain_eager
    for name in expected:
        assert torch.equal(got[name], expected[name]), name
    # Waited: everything reached only through one node on the path to x. Not: the weight used
    # twice, and the parameter behind the output that does not depend on x.
    assert eager == {"tied.weight", "tied.bias", "scale"}


def test_weight_split_needs_a_boundary_leaf_and_no_earlier_interval():
    block = _Block()
    x = torch.randn(2, 5, 16)  # needs no gradient: nothing is on a path to a boundary leaf
    start = mark()
    out, _ = block(x)
    result = run_segment([out], [torch.ones_like(out)], start, split_weights=True)
    assert result.weights is None and block.fc.weight.grad is not None

    x = torch.randn(2, 5, 16, requires_grad=True)
    start = mark()
    h = block.fc(x)
    later = mark()  # a second interval: its backward stops at the first one's edge
    reply = _boundary(h)
    out = block.proj(torch.relu(reply + h))
    result = run_segment(
        [out], [torch.ones_like(out)], later, boundary_leaves=[reply], split_weights=True
    )
    assert result.weights is None and result.edge_grads and result.leaf_grads
    assert block.proj.weight.grad is not None


def test_weight_split_of_a_checkpointed_module():
    """A non-reentrant checkpoint recomputes its forward when the input half unpacks what it
    saved; the weight half unpacks again, and the gradients still match."""
    from torch.utils.checkpoint import checkpoint

    def run(split: bool):
        torch.manual_seed(0)
        fc, proj = nn.Linear(8, 16), nn.Linear(16, 8)
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1)).requires_grad_()
        start = mark()
        y = checkpoint(lambda v: proj(torch.tanh(fc(v))), x, use_reentrant=False)
        result = run_segment([y], [torch.ones_like(y)], start, [x], split_weights=split)
        assert (result.weights is not None) == split
        if split:
            result.weights.run()
        return [
            *result.leaf_grads.values(),
            *(p.grad for p in (*fc.parameters(), *proj.parameters())),
        ]

    for got, expected in zip(run(True), run(False)):
        assert torch.equal(got, expected)


def _hooked(block: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Records each post-accumulate-grad hook call of ``block``'s parameters: (name, .grad)."""
    seen: list[tuple[str, torch.Tensor]] = []
    for name, p in block.named_parameters():
        p.register_post_accumulate_grad_hook(lambda t, n=name: seen.append((n, t.grad.clone())))
    return seen


@pytest.mark.parametrize("split", [False, True])
def test_post_accumulate_grad_hooks_run_as_autograd_runs_them(split):
    """Every parameter's post-accumulate-grad hooks run once per accumulation, with ``.grad``
    already holding it, in the whole segment and in a weight half alike: a user's hooks see
    what they would without the pipeline, and the overlapped reduction counts them."""
    x = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(1))
    reference = _Block()
    expected = _hooked(reference)
    out, side = reference(x.clone().requires_grad_())
    torch.autograd.backward([out, side], [torch.ones_like(out), torch.full_like(side, 0.5)])

    block = _Block()
    seen = _hooked(block)
    leaf = x.clone().requires_grad_()
    start = mark()
    out, side = block(leaf)
    grads = [torch.ones_like(out), torch.full_like(side, 0.5)]
    result = run_segment([out, side], grads, start, boundary_leaves=[leaf], split_weights=split)
    assert (result.weights is not None) == split
    if split:
        assert {n for n, _ in seen} == {"tied.weight", "tied.bias", "scale"}  # the input half's
        result.weights.run()
    assert sorted(n for n, _ in seen) == sorted(n for n, _ in expected)  # each once
    want = dict(expected)
    for name, grad in seen:
        torch.testing.assert_close(grad, want[name], msg=name)
