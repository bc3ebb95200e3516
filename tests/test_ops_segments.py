"""``falcon_attention(segments=n)``: the sequence in pieces, each recomputed in the backward (ops/segments.py).

Segmenting must change nothing but memory: outputs, the final state and the gradients of
every input (and of an initial state) equal those of one whole call, for every rule and
form, and the float64 reference of ``conftest`` on a fresh sequence."""
from __future__ import annotations

import pytest
import torch
from conftest import FORMS, RULE_NAMES, SLIDING, random_inputs, reference_falcon, rel_err

from falcon_fwa import falcon_attention
from falcon_fwa.ops.segments import packed_groups, segment_bounds

TOL = 1e-10


def _loss(o, state):
    """A fixed random projection of the output and of every tensor of the final state."""
    g = torch.Generator().manual_seed(7)
    total = (o * torch.randn(o.shape, generator=g, dtype=o.dtype)).sum()
    for name in ("S", "last_key", "tail_x", "tail_y"):
        t = getattr(state, name)
        if t is not None:
            total = total + (t * torch.randn(t.shape, generator=g, dtype=t.dtype)).sum()
    return total


def _run(inp, leaves, **options):
    o, state = falcon_attention(**inp, output_final_state=True, **options)
    return o, state, torch.autograd.grad(_loss(o, state), leaves)


def _same_as_one_call(inp, leaves, segments, **options):
    """The output, the final ``S`` and the gradients of ``leaves`` with ``segments`` pieces equal one
    call's; returns both final states."""
    o1, st1, g1 = _run(inp, leaves, **options)
    o, st, g = _run(inp, leaves, segments=segments, **options)
    assert rel_err(o, o1) <= TOL and rel_err(st.S, st1.S) <= TOL
    for a, b in zip(g, g1):
        assert rel_err(a, b) <= TOL
    return st, st1


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("rule", RULE_NAMES)
def test_segments_match_one_call(rule, form):
    inp = random_inputs(rule, B=2, T=45, seed=3, with_gate=True, lam_range=(0.0, 2.0))
    leaves = [t.requires_grad_() for t in inp.values()]
    options = dict(rule=rule, window=3, form=form, chunk_size=8)
    o1, st1, g1 = _run(inp, leaves, **options)
    for segments in (2, 3, 9):  # 9 asks for more pieces than the 6 chunks: whole chunks, 6 pieces
        o, st, g = _run(inp, leaves, segments=segments, **options)
        assert rel_err(o, o1) <= TOL and rel_err(st.S, st1.S) <= TOL, segments
        assert torch.equal(st.last_key, st1.last_key)
        if rule in SLIDING:
            assert torch.equal(st.tail_valid, st1.tail_valid)
            assert rel_err(st.tail_x, st1.tail_x) <= TOL and rel_err(st.tail_y, st1.tail_y) <= TOL
        for name, a, b in zip(inp, g, g1):
            assert rel_err(a, b) <= TOL, (segments, name)


@pytest.mark.parametrize("rule", ["3", "2A"])
def test_segments_against_the_reference(rule):
    inp = random_inputs(rule, B=1, T=40, seed=5, with_gate=True)
    o, _ = falcon_attention(**inp, rule=rule, window=4, chunk_size=4, segments=4)
    want, _, _ = reference_falcon(**inp, rule=rule, window=4)
    assert rel_err(o, want) <= TOL


@pytest.mark.parametrize("rule", ["1", "3A"])
def test_segments_continue_a_state_and_carry_its_gradient(rule):
    inp = random_inputs(rule, B=2, T=50, seed=11, with_gate=True)
    first = {n: t[:, :13] for n, t in inp.items()}
    rest = {n: t[:, 13:].clone().requires_grad_() for n, t in inp.items()}
    _, start = falcon_attention(**first, rule=rule, window=4, output_final_state=True)
    start.S.requires_grad_()
    leaves = [start.S, *rest.values()]
    _same_as_one_call(rest, leaves, 4, rule=rule, window=4, chunk_size=8, initial_state=start)


def test_segments_normalized_read():
    inp = random_inputs("1A", B=1, T=33, seed=2)
    inp["q"], inp["k"] = inp["q"].abs(), inp["k"].abs()  # nonnegative features: z^T q stays positive
    leaves = [t.requires_grad_() for t in inp.values()]
    st, st1 = _same_as_one_call(inp, leaves, 3, rule="1A", chunk_size=4, eps_attn=1e-6)
    assert rel_err(st.z, st1.z) <= TOL


def test_segments_without_autograd():
    inp = random_inputs("3", B=2, T=30, seed=4)
    with torch.no_grad():
        o1, st1 = falcon_attention(**inp, rule="3", chunk_size=4, output_final_state=True)
        o, st = falcon_attention(**inp, rule="3", chunk_size=4, output_final_state=True, segments=5)
    assert rel_err(o, o1) <= TOL and rel_err(st.S, st1.S) <= TOL
    assert not o.requires_grad


def test_segment_bounds():
    assert segment_bounds(100, 3, 16) == [0, 48, 96, 100]  # 34 steps a piece, rounded up to 3 chunks
    assert segment_bounds(128, 2, 64) == [0, 64, 128]
    assert segment_bounds(10, 4, 64) == [0, 10]  # one chunk: one piece
    assert segment_bounds(12, 12, 1) == list(range(13))


@pytest.mark.parametrize("bad", [0, -2, 1.5, True, "2"])
def test_segments_must_be_a_positive_integer(bad):
    inp = random_inputs("1", B=1, T=8)
    with pytest.raises(ValueError, match="segments must be an integer >= 1"):
        falcon_attention(**inp, rule="1", segments=bad)


def test_segments_refuse_a_state_of_another_type_by_name():
    inp = random_inputs("1", B=1, T=8)
    with pytest.raises(TypeError, match="initial_state must be a FalconState, got dict"):
        falcon_attention(**inp, rule="1", segments=2, chunk_size=4, initial_state={})


def test_packed_groups():
    # cuts at the sequence boundary nearest each equal cut; coinciding cuts count once
    assert packed_groups([0, 5, 10, 15, 20], 2) == [0, 2, 4]
    assert packed_groups([0, 5, 10, 15, 20], 4) == [0, 1, 2, 3, 4]
    assert packed_groups([0, 1, 2, 30], 3) == [0, 2, 3]  # cuts at 10 and 20: both nearest to 2
    assert packed_groups([0, 30], 4) == [0, 1]  # one sequence stays whole


@pytest.mark.parametrize("rule", ["3", "2", "1A"])
def test_segments_of_packed_sequences_match_one_call(rule, monkeypatch):
    """Packed: groups of whole sequences, each its own call, with their rows of the initial state."""
    from falcon_fwa.ops import segments as module

    pieces = []
    real = module._Pieces.apply
    monkeypatch.setattr(module._Pieces, "apply", lambda *a: pieces.append(a[1]) or real(*a))
    inp = random_inputs(rule, B=1, T=60, seed=12, with_gate=True)
    cu = torch.tensor([0, 7, 19, 20, 41, 60])
    _, start = falcon_attention(**random_inputs(rule, B=5, T=6, seed=13), rule=rule, window=3,
                                output_final_state=True)
    start.S.requires_grad_()
    leaves = [*(t.requires_grad_() for t in inp.values()), start.S]
    options = dict(rule=rule, window=3, chunk_size=4, cu_seqlens=cu, initial_state=start)
    o1, st1, g1 = _run(inp, leaves, **options)
    assert pieces == []
    for segments, lengths in ((2, [20, 40]), (3, [20, 21, 19]), (10, [7, 12, 1, 21, 19])):
        pieces.clear()
        o, st, g = _run(inp, leaves, segments=segments, **options)
        assert [b[-1] for b in pieces] == lengths  # one node per group of whole sequences (bounds [0, length])
        assert rel_err(o, o1) <= TOL and rel_err(st.S, st1.S) <= TOL, segments
        if rule in SLIDING:
            assert rel_err(st.tail_x, st1.tail_x) <= TOL and torch.equal(st.tail_valid, st1.tail_valid)
        for a, b in zip(g, g1):
            assert rel_err(a, b) <= TOL, segments


def test_segments_second_backward_and_state_only_gradient():
    """A second backward through the same graph (``retain_graph``) gives the first one's gradients;
    a loss on the final state alone reaches the inputs through every piece."""
    inp = random_inputs("3", B=1, T=40, seed=8, with_gate=True)
    leaves = [t.requires_grad_() for t in inp.values()]
    o, st = falcon_attention(**inp, rule="3", window=2, chunk_size=8, segments=3, output_final_state=True)
    loss = _loss(o, st)
    first = torch.autograd.grad(loss, leaves, retain_graph=True)
    second = torch.autograd.grad(loss, leaves, retain_graph=True)
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    _, st1 = falcon_attention(**inp, rule="3", window=2, chunk_size=8, output_final_state=True)
    want = torch.autograd.grad(st1.S.sum(), leaves[1:])  # (no query reaches S)
    got = torch.autograd.grad(st.S.sum(), leaves, allow_unused=True)
    assert got[0] is None or got[0].abs().sum() == 0
    assert all(rel_err(a, b) <= TOL for a, b in zip(got[1:], want))
    assert got[1][:, :8].abs().sum() > 0  # the first piece's keys reach the last state


def test_segments_gradients_reach_every_tensor_of_the_initial_state():
    """The shifted key's carry, the sliding tail and the normalizer ``z`` of an initial state get the
    gradients one call gives them, as ``S`` does, with ``read="before"``, with and without the shift."""
    for rule, shift, read, fields in (("3A", True, "before", 5), ("3", False, "after", 3), ("1A", True, "after", 3)):
        inp = random_inputs(rule, B=2, T=41, seed=21, with_gate=True)
        inp["q"], inp["k"] = inp["q"].abs(), inp["k"].abs()  # (z^T q stays positive)
        eps_attn = 1e-3 if rule.endswith("A") else None  # (the normalized read of the inner-product rules)
        options = dict(rule=rule, window=3, shift=shift, read=read, eps_attn=eps_attn)
        first = {n: t[:, :9] for n, t in inp.items()}
        rest = {n: t[:, 9:].clone().requires_grad_() for n, t in inp.items()}
        _, start = falcon_attention(**first, output_final_state=True, **options)
        names = [f for f in ("S", "last_key", "tail_x", "tail_y", "z") if getattr(start, f) is not None]
        for f in names:
            setattr(start, f, getattr(start, f).detach().clone().requires_grad_())
        assert len(names) == fields
        leaves = [*rest.values(), *(getattr(start, f) for f in names)]
        _same_as_one_call(rest, leaves, 5, chunk_size=4, initial_state=start, **options)


def test_segments_with_only_some_inputs_asking_for_gradients():
    inp = random_inputs("2", B=1, T=30, seed=6, with_gate=True)
    for name in ("k", "lam", "log_gate"):
        x = {n: t.clone() for n, t in inp.items()}
        x[name].requires_grad_()
        want = torch.autograd.grad(falcon_attention(**x, rule="2", chunk_size=4)[0].square().sum(), x[name])[0]
        o, _ = falcon_attention(**x, rule="2", chunk_size=4, segments=3)
        assert rel_err(torch.autograd.grad(o.square().sum(), x[name])[0], want) <= TOL, name


class _SavedBytes:
    """``saved_tensors_hooks`` that count the bytes autograd keeps for the backward: live now and at most."""

    def __init__(self):
        self.live = self.peak = 0

    def pack(self, t):
        self.live += t.numel() * t.element_size()
        self.peak = max(self.peak, self.live)
        return _Released(self, t)

    @staticmethod
    def unpack(box):
        return box.t


class _Released:
    def __init__(self, tally, t):
        self.tally, self.t, self.nbytes = tally, t, t.numel() * t.element_size()

    def __del__(self):
        self.tally.live -= self.nbytes


@pytest.mark.parametrize("rule", ["3", "2"])
def test_segments_lower_what_autograd_keeps(rule):
    """What the graph holds between the forward and the backward is the inputs alone, and during the
    backward about one piece's share of what one call keeps (the chunk form's intermediates)."""
    inp = random_inputs(rule, B=1, T=512, H=2, K=16, V=16, seed=1, with_gate=True, dtype=torch.float32)
    leaves = [t.requires_grad_() for t in inp.values()]
    inputs = sum(t.numel() * t.element_size() for t in leaves)
    kept = {}
    for segments in (1, 4, 8):
        tally = _SavedBytes()
        with torch.autograd.graph.saved_tensors_hooks(tally.pack, tally.unpack):
            o, _ = falcon_attention(**inp, rule=rule, window=4, chunk_size=32, segments=segments)
            between = tally.live
            o.sum().backward()
        kept[segments] = between, tally.peak
    assert kept[1][0] > 20 * inputs  # one call keeps the intermediates of the whole sequence
    for n in (4, 8):
        between, peak = kept[n]
        assert between == inputs
        assert peak <= inputs + 1.1 * kept[1][1] / n, (n, kept)


def test_segments_recompute_under_the_forwards_autocast():
    """Each piece's forward runs again in the backward under the autocast the forward ran under (bf16
    matmuls here, as in training), so the gradients are those of the function the forward computed."""
    from falcon_fwa.ops.segments import run_segments

    inp = random_inputs("1", B=2, T=48, seed=1, with_gate=True, dtype=torch.float32)
    leaves = [t.requires_grad_() for t in inp.values()]
    seen = []

    def call(q, k, v, beta, lam, log_gate, *, initial_state, output_final_state):
        seen.append(torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu"))
        return falcon_attention(q, k, v, beta, lam, log_gate=log_gate, rule="1", chunk_size=8,
                                initial_state=initial_state, output_final_state=output_final_state)

    with torch.autocast("cpu", dtype=torch.bfloat16):
        o, _ = run_segments(call, tuple(inp.values()), None, False, segments=3, chunk_size=8)
        o1, _ = falcon_attention(**inp, rule="1", chunk_size=8)
    got, want = (torch.autograd.grad(x.square().sum(), leaves) for x in (o, o1))
    assert seen == [torch.bfloat16] * 6  # three pieces forward, three again in the backward
    assert torch.equal(o, o1)
    # d o_t / d q_t = S_t, the forward's state: q's gradient is one call's (off by 8e-3 when the pieces ran
    # again in float32); the others' paths through the states at the cuts round in bf16 otherwise than one call's
    assert rel_err(got[0], want[0]) <= 1e-6
    assert all(rel_err(a, b) <= 3e-2 for a, b in zip(got, want))


@pytest.mark.parametrize("rule,packed", [("1", False), ("3", False), ("3", True)])
def test_segments_second_order_gradients(rule, packed):
    """``create_graph=True``: the gradients are differentiable again, and their own gradients are one
    call's (a gradient penalty, a Hessian-vector product), an initial state's included."""
    inp = random_inputs(rule, B=1, T=22, seed=9, with_gate=True)
    rows = 3 if packed else 1
    _, start = falcon_attention(**random_inputs(rule, B=rows, T=5, seed=10), rule=rule, window=2,
                                output_final_state=True)
    start.S.requires_grad_()
    start.tail_x = start.tail_x.detach().requires_grad_() if rule == "3" else None
    leaves = [*(t.requires_grad_() for t in inp.values()), start.S, *([start.tail_x] if rule == "3" else [])]
    options = dict(rule=rule, window=2, chunk_size=4, initial_state=start, output_final_state=True,
                   cu_seqlens=torch.tensor([0, 6, 13, 22]) if packed else None)
    got = []
    for segments in (1, 3):
        o, st = falcon_attention(**inp, segments=segments, **options)
        grads = torch.autograd.grad(_loss(o, st), leaves, create_graph=True)
        assert all(g.requires_grad for g in grads)
        penalty = sum(g.square().sum() for g in grads)
        got.append((grads, torch.autograd.grad(penalty, leaves)))
    for (g3, h3), (g1, h1) in zip(zip(*got[1]), zip(*got[0])):
        assert rel_err(g3, g1) <= TOL and rel_err(h3, h1) <= 1e-9
