"""The row check is continuous: a coupling that appears after ordinary steps is refused at the step it appears.

Each case is one way samples get coupled as people train (issue 30's table): in the loss (in-batch negatives, a
statistic over the batch, a batch-level auxiliary loss) or in the forward on some batches only (mixup of the input,
manifold mixup, CutMix of hidden features). Each is run cold (the hazard at the first step) and warm (two ordinary
steps of the same layer calls first: the layouts are then known) in every mode and on both backward paths where
the path can see it, with DP's own definition as the oracle: noise 0, the clipped sum for a batch D and for D minus
one sample differs by at most R, or the step is refused (nothing is released). Float64.
"""
from __future__ import annotations

import contextlib
import copy
import math
import weakref

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from dptrain.rows import RowsMixSamples
from dptrain.testing import attached_engine, neighbour_test, reference_clipped_gradient
from helpers import MODES, SINGLE_BACKWARD_MODES, Opaque, assert_matches, default_dtype, tag_passes_counted

R_CLIPS_ALL = 1e-4  # below every per-sample gradient norm of these models
R_CLIPS_NONE = 1e4  # above every one
B = 6


def _data(batch=B, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, 6, generator=g, dtype=torch.float64), torch.randint(0, 5, (batch,), generator=g)


def _drop(batch, k):
    return tuple(torch.cat([t[:k], t[k + 1:]]) for t in batch)


# ------------------------------------------------------------------------------------------ models
class Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(6, 8), nn.Linear(8, 5)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


class TwoTowers(nn.Module):
    """CLIP-style: an image tower and a text tower in one model (the text here: the input reversed along features)."""

    def __init__(self):
        super().__init__()
        self.image, self.text = Encoder(), Encoder()

    def forward(self, x):
        return self.image(x), self.text(x.flip(1))


class SoftMoE(nn.Module):
    """A soft mixture of experts returning its router probabilities (for a load-balancing loss)."""

    def __init__(self):
        super().__init__()
        self.router = nn.Linear(6, 3)
        self.experts = nn.ModuleList(nn.Linear(6, 5) for _ in range(3))

    def forward(self, x):
        probs = torch.softmax(self.router(x), -1)
        out = sum(probs[:, e:e + 1] * expert(x) for e, expert in enumerate(self.experts))
        return out, probs


class MixesOnSomeBatches(nn.Module):
    """Mixes samples inside forward when ``mix`` is set (as a training loop does on some batches)."""

    def __init__(self, kind: str):
        super().__init__()
        self.a, self.b = nn.Linear(6, 8), nn.Linear(8, 5)
        self.kind, self.mix = kind, False

    def forward(self, x):
        if self.mix and self.kind == "mixup x.flip(0)":
            x = 0.7 * x + 0.3 * x.flip(0)
        if self.mix and self.kind == "mixup x[randperm]":
            x = 0.7 * x + 0.3 * x[torch.randperm(len(x))]
        h = torch.tanh(self.a(x))
        if self.mix and self.kind == "manifold mixup h.roll(1, 0)":
            h = 0.7 * h + 0.3 * h.roll(1, 0)
        if self.mix and self.kind == "cutmix of hidden features":
            h = torch.cat([h[:, :4], h.roll(1, 0)[:, 4:]], 1)
        return self.b(h)


# ------------------------------------------------------------------------------------------ losses
def cross_entropy(model, x, y):
    out = model(x)
    return F.cross_entropy(out[0] if isinstance(out, tuple) else out, y, reduction="none")


def infonce(model, x, y):
    z = F.normalize(model(x), dim=1)
    logits = z @ z.T / 0.5 - 1e9 * torch.eye(len(x))
    return F.cross_entropy(logits, (torch.arange(len(x)) + 1) % len(x), reduction="none")


def clip_loss(model, x, y):
    zi, zt = (F.normalize(z, dim=1) for z in model(x))
    logits = zi @ zt.T / 0.5
    target = torch.arange(len(x))
    return F.cross_entropy(logits, target, reduction="none") + F.cross_entropy(logits.T, target, reduction="none")


def triplet_mining(model, x, y):
    z = model(x)
    distance = torch.cdist(z, z) + 1e9 * torch.eye(len(x))
    hardest = z[distance.argmin(1)]
    return F.relu((z - 0.1 * x[:, :5]).norm(dim=1) - (z - hardest).norm(dim=1) + 1)


def variance_penalty(model, x, y):
    losses = F.cross_entropy(model(x), y, reduction="none")
    return losses + (losses - losses.mean()) ** 2


def softmax_weights(model, x, y):
    losses = F.cross_entropy(model(x), y, reduction="none")
    return losses * torch.softmax(losses, 0) * len(losses)


def load_balancing(model, x, y):
    out, probs = model(x)
    balance = 3 * (probs.mean(0) ** 2).sum()
    return F.cross_entropy(out, y, reduction="none") + balance


LOSSES = {
    "InfoNCE with in-batch negatives": (Encoder, infonce),
    "CLIP two towers, symmetric": (TwoTowers, clip_loss),
    "triplet with hard-negative mining": (Encoder, triplet_mining),
    "variance-penalised risk": (Encoder, variance_penalty),
    "losses weighted by a softmax over the batch": (Encoder, softmax_weights),
    "mixture of experts with a load-balancing loss": (SoftMoE, load_balancing),
}
FORWARDS = ["mixup x.flip(0)", "mixup x[randperm]", "manifold mixup h.roll(1, 0)", "cutmix of hidden features"]
ENGINE_PATHS = [(m, "engine") for m in MODES]
BOTH_PATHS = ENGINE_PATHS + [(m, "mean") for m in SINGLE_BACKWARD_MODES]


def _mixed(losses_fn):
    def losses(model, x, y):
        model.mix = True
        try:
            return losses_fn(model, x, y)
        finally:
            model.mix = False
    return losses


# ------------------------------------------------------------------------------------------ running steps
def steps_of(model, steps, mode, R, path="engine", engine_options=None) -> list:
    """One engine over ``steps`` ((losses_fn, batch) each: a private step each, lr 0, noise 0): for each step its
    p.grad, or the RowsMixSamples it raised (the loop goes on after a refusal, as a user's would)."""
    engine, opt = attached_engine(model, mode=mode, max_grad_norm=R, **(engine_options or {}))
    out = []
    try:
        for losses_fn, batch in steps:
            opt.zero_grad(set_to_none=True)
            losses = losses_fn(model, *batch)
            try:
                if path == "engine":
                    engine.backward(losses)
                else:
                    losses.mean().backward()
            except RowsMixSamples as refusal:
                out.append(refusal)
                continue
            opt.step()
            out.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        return out
    finally:
        engine.detach()


def run(model, steps, mode, R, path="engine"):
    """The last step's outcome of ``steps_of``."""
    return steps_of(model, steps, mode, R, path)[-1]


def neighbour_distance(build, warm: int, hazard, batch, mode, R, path, k):
    """||G(D) - G(D \\ {k})|| / R of the hazard step after ``warm`` ordinary steps on the same batch, or the
    refusal (of either run: a refused step releases nothing)."""
    torch.manual_seed(1)
    first = build().double()
    second = copy.deepcopy(first)
    out = []
    for model, data in ((first, batch), (second, _drop(batch, k))):
        torch.manual_seed(2)  # (the same draws in both runs: x[randperm])
        got = run(model, [(cross_entropy, data)] * warm + [(hazard, data)], mode, R, path)
        if isinstance(got, RowsMixSamples):
            return got
        out.append(got)
    return math.sqrt(sum(float((out[0][n] - out[1][n]).square().sum()) for n in out[0])) / R


def assert_refused_or_bounded(build, warm, hazard, mode, path, refusal: str):
    """The neighbour test at an R that clips every sample and at one that clips none, removing the last sample:
    each is refused (with ``refusal`` in its message), or moves the update by at most R."""
    batch = _data()
    for R in (R_CLIPS_ALL, R_CLIPS_NONE):
        for k in (B - 1,):
            got = neighbour_distance(build, warm, hazard, batch, mode, R, path, k)
            if isinstance(got, RowsMixSamples):
                assert refusal in str(got), str(got)
            else:
                assert got <= 1 + 1e-9, f"R={R}, without sample {k}: the update moved by {got:.3f} R"


# ------------------------------------------------------------------------------------------ the table
@pytest.mark.parametrize("warm", [0, 2], ids=["cold", "warm"])
@pytest.mark.parametrize("mode,path", ENGINE_PATHS)
@pytest.mark.parametrize("case", list(LOSSES))
def test_a_loss_that_couples_samples_is_refused_at_every_step(float64, case, mode, path, warm):
    build, losses_fn = LOSSES[case]
    got = run(build().double(), [(cross_entropy, _data())] * warm + [(losses_fn, _data())], mode, R_CLIPS_ALL, path)
    assert isinstance(got, RowsMixSamples), f"{case} was not refused"
    assert "the loss couples samples" in str(got)
    assert_refused_or_bounded(build, warm, losses_fn, mode, path, "the loss couples samples")


@pytest.mark.parametrize("warm", [0, 2], ids=["cold", "warm"])
@pytest.mark.parametrize("mode,path", BOTH_PATHS)
@pytest.mark.parametrize("case", FORWARDS)
def test_a_forward_that_mixes_samples_on_some_batches_is_refused_at_that_step(float64, case, mode, path, warm):
    build = lambda: MixesOnSomeBatches(case)  # noqa: E731
    got = run(build().double(), [(cross_entropy, _data())] * warm + [(_mixed(cross_entropy), _data())], mode,
              R_CLIPS_ALL, path)
    assert isinstance(got, RowsMixSamples), f"{case} was not refused"
    where = "before its trainable layers" if case.startswith("mixup") else "a (Linear)"
    assert where in str(got)
    assert_refused_or_bounded(build, warm, _mixed(cross_entropy), mode, path, where)


@pytest.mark.parametrize("mode,path", BOTH_PATHS)
def test_ordinary_steps_after_a_refused_one_stay_exact_and_are_not_refused(float64, mode, path):
    """Ordinary steps, a step that mixes samples (refused), ordinary ones again on the same engine: each ordinary
    step exact against the oracle (the refusal left nothing behind, and the refused forward's trace is not kept)."""
    torch.manual_seed(0)
    model = MixesOnSomeBatches("manifold mixup h.roll(1, 0)").double()
    reference = copy.deepcopy(model)
    data = [_data(seed=s) for s in range(5)]
    steps = [(cross_entropy, data[0]), (cross_entropy, data[1]), (_mixed(cross_entropy), data[2]),
             (cross_entropy, data[3]), (_mixed(cross_entropy), data[4]), (cross_entropy, data[0])]
    out = steps_of(model, steps, mode, 0.05, path)
    for k, ((losses_fn, batch), got) in enumerate(zip(steps, out)):
        if losses_fn is cross_entropy:
            expected = reference_clipped_gradient(reference, cross_entropy, batch, max_grad_norm=0.05)
            assert_matches(got, expected, what=f"step {k}")
        else:
            assert isinstance(got, RowsMixSamples), f"step {k} was not refused"


@pytest.mark.parametrize("mode", MODES)
def test_a_separable_loss_after_a_coupled_one_is_exact(float64, mode):
    torch.manual_seed(0)
    model = Encoder().double()
    reference = copy.deepcopy(model)
    data = [_data(seed=s) for s in range(3)]
    out = steps_of(model, [(cross_entropy, data[0]), (infonce, data[1]), (cross_entropy, data[2])], mode, 0.05)
    assert isinstance(out[1], RowsMixSamples)
    assert_matches(out[2], reference_clipped_gradient(reference, cross_entropy, data[2], max_grad_norm=0.05))


# ------------------------------------------------------------------------------------------ split backwards
class BackboneHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.backbone, self.head = nn.Linear(6, 8), nn.Linear(8, 5)

    def forward(self, x):
        return self.head(torch.tanh(self.backbone(x)))


@pytest.mark.parametrize("inside", [False, True], ids=["layers called outside model(...)", "model(...) then a head"])
@pytest.mark.parametrize("mode", MODES)
def test_a_backward_split_at_a_detached_activation_is_refused(float64, mode, inside):
    """The head's losses back-propagated to a detached activation, then the backbone back-propagated with that
    activation's gradient: two backwards of one forward's samples, each clipped on its own (1.41 R measured),
    whether the layers are called through model(...) or outside it."""
    torch.manual_seed(0)
    model = BackboneHead().double()
    engine, _ = attached_engine(model, mode=mode, max_grad_norm=1e-3)
    try:
        x, y = _data()
        if inside:  # the whole model called, a second head applied outside it on its detached output
            out = model(x)
            detached = out.detach().requires_grad_()
            engine.backward(F.cross_entropy(model.head(torch.tanh(model.backbone(x))) + detached, y, reduction="none"))
            with pytest.raises(RuntimeError, match="already back-propagated in this step"):
                engine.backward((out * detached.grad).sum(1))
        else:
            h = torch.tanh(model.backbone(x))
            detached = h.detach().requires_grad_()
            engine.backward(F.cross_entropy(model.head(detached), y, reduction="none"))
            with pytest.raises(RuntimeError, match="already back-propagated in this step"):
                engine.backward((h * detached.grad).sum(1))
    finally:
        engine.detach()


@pytest.mark.parametrize("mode", MODES)
def test_layers_called_outside_the_model_after_a_step_of_another_batch_size_are_a_group_of_their_own(mode):
    """A step through model(x) of 4 samples, then the layers called directly on 3: the last model call's batch was
    taken for theirs and the losses refused as not one per sample of it (a false refusal an outside probe found; cold,
    the same step passed). After a backward, layer calls outside a model call are their own group (row-check.md 5)."""
    torch.manual_seed(0)
    model = BackboneHead().double()

    def direct(m, x, y):
        return F.cross_entropy(m.head(torch.tanh(m.backbone(x))), y, reduction="none")

    report = neighbour_test(model, direct, _data(3, seed=3), mode=mode, max_grad_norm=[1e-3, 1e3],
                            warm_up=[_data(4, seed=4)], warm_up_losses=lambda m, x, y: F.cross_entropy(m(x), y,
                                                                                                     reduction="none"))
    assert report.refused is None, report
    assert report.worst <= 1.0 + 1e-9, report


# ------------------------------------------------------------------------------------------ sequences of steps
@pytest.mark.slow
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(kinds=st.lists(st.sampled_from(["ordinary", "ordinary", "infonce", "variance", "mixup", "manifold"]),
                      min_size=2, max_size=6),
       sizes=st.lists(st.integers(3, 7), min_size=6, max_size=6),
       mode=st.sampled_from(MODES))
def test_sequences_of_steps_whose_loss_or_forward_changes_are_exact_or_refused(kinds, sizes, mode):
    """Draws a sequence of steps on one engine, each ordinary or coupled (in the loss, or in the forward on that
    batch), with its own batch size: every ordinary step is exact against the oracle, every coupled one refused."""
    with default_dtype(torch.float64):
        torch.manual_seed(0)
        model = MixesOnSomeBatches("mixup x.flip(0)").double()
        manifold = MixesOnSomeBatches("manifold mixup h.roll(1, 0)")
        manifold.load_state_dict(model.state_dict())
        reference = copy.deepcopy(model)
        losses = {"ordinary": cross_entropy, "infonce": infonce, "variance": variance_penalty,
                  "mixup": _mixed(cross_entropy)}

        def manifold_step(m, x, y):  # the same weights, the manifold mixup's forward
            m.kind = "manifold mixup h.roll(1, 0)"
            try:
                return _mixed(cross_entropy)(m, x, y)
            finally:
                m.kind = "mixup x.flip(0)"

        losses["manifold"] = manifold_step
        steps = [(losses[k], _data(sizes[i], seed=i)) for i, k in enumerate(kinds)]
        out = steps_of(model, steps, mode, 0.05)
        for k, (kind, (_, batch), got) in enumerate(zip(kinds, steps, out)):
            if kind == "ordinary":
                expected = reference_clipped_gradient(reference, cross_entropy, batch, max_grad_norm=0.05)
                assert_matches(got, expected, what=f"step {k} of {kinds}")
            else:
                assert isinstance(got, RowsMixSamples), f"step {k} ({kind}) of {kinds} was not refused"


# ------------------------------------------------------------------------------------------ the check's memory
class Wide(nn.Module):
    def __init__(self, width=2048):
        super().__init__()
        self.a, self.b = nn.Linear(6, width), nn.Linear(width, 5)

    def forward(self, x):
        return self.b(Opaque.apply(torch.tanh(self.a(x))))


def test_a_verifying_step_keeps_sketches_of_the_tagged_gradients_never_the_gradients(float64, monkeypatch):
    """Each tag pass's output gradient of a call is reduced at once to per-row sketches (16 numbers a row): what the
    backward holds of its tag passes is a small fraction of the gradients they delivered, and none of them."""
    from dptrain.rows import reader
    from dptrain.rows.sketch import SKETCH_DIM

    delivered, held = [], []
    record = reader.BackwardRows.record_tagged

    def spy(self, state, call, grad):
        record(self, state, call, grad)
        delivered.append(grad.numel() * grad.element_size())
        kept = [t for sketches in (call.tagged or []) for t in sketches.values()]
        rows = grad.shape[0] * (grad.shape[1] if grad.dim() > 2 else 1)
        assert all(t.data_ptr() != grad.data_ptr() and t.numel() <= rows * SKETCH_DIM for t in kept)
        held.append(sum(t.numel() * t.element_size() for t in kept))

    monkeypatch.setattr(reader.BackwardRows, "record_tagged", spy)
    torch.manual_seed(0)
    model = Wide().double()
    engine, opt = attached_engine(model, mode="bk-mixopt", max_grad_norm=1.0)
    try:
        engine.backward(cross_entropy(model, *_data(16)))
    finally:
        engine.detach()
    assert delivered, "no tag pass ran: the test does not test what it says"
    assert max(held) < 0.02 * sum(delivered), (held, delivered)


# ------------------------------------------------------------------------------------------ proven at every step
def test_a_language_model_with_a_padding_mask_is_proven_at_every_step_from_its_graph(float64):
    """GPT-2 with an attention mask: Hugging Face builds the mask by indexing with positions expanded from
    torch.arange (padding_mask[batch_idx, kv_idx]), outside the autograd graph. Every step's graph is proven (no tag
    pass), with batches and lengths that change; the proof of a graph whose structure was proven before is taken from
    the memo (the lengths are not part of the structure), so only the first step proves in full."""
    transformers = pytest.importorskip("transformers")
    from dptrain.losses import sequence_losses

    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=61, n_positions=32)
    model = transformers.GPT2LMHeadModel(config).double()
    engine, opt = attached_engine(model, mode="bk-mixopt", max_grad_norm=1.0)
    try:
        with tag_passes_counted() as passes:
            for B, T in [(4, 12), (4, 14), (4, 12), (4, 16)]:
                ids = torch.randint(0, 61, (B, T))
                attention = torch.ones(B, T, dtype=torch.long)
                attention[1:, T - 3:] = 0
                losses = sequence_losses(model(input_ids=ids, attention_mask=attention).logits, ids,
                                         attention_mask=attention)
                engine.backward(losses)
                opt.step()
                opt.zero_grad()
        memo = engine._rows.proofs
    finally:
        engine.detach()
    assert not passes
    assert memo.reused >= 3 and memo.made <= 2, (memo.made, memo.reused)  # (the loss check's graph, the model's)


class _ShortLivedNode:
    """An autograd node as torch 2.11 and earlier hand it to Python: an object that dies with its last Python
    reference and is made anew at the next ``grad_fn`` or ``next_functions``, at another id or at a dead one's."""

    __slots__ = ("_node", "__weakref__")

    def __init__(self, node):
        object.__setattr__(self, "_node", node)

    def __getattr__(self, name):
        return getattr(self._node, name)

    def name(self):
        return self._node.name()

    @property
    def next_functions(self):
        return tuple((_short_lived(n), nr) for n, nr in self._node.next_functions)


_LIVE_NODES = weakref.WeakValueDictionary()


def _short_lived(node):
    if node is None:
        return None
    found = _LIVE_NODES.get(id(node))  # (the node itself is alive: torch's own object keeps its id)
    if found is None or found._node is not node:
        found = _LIVE_NODES[id(node)] = _ShortLivedNode(node)
    return found


@contextlib.contextmanager
def _nodes_as_in_torch_2_11():
    real = torch._C.TensorBase.grad_fn
    torch.Tensor.grad_fn = property(lambda t: _short_lived(real.__get__(t)))
    try:
        yield
    finally:
        del torch.Tensor.grad_fn


@pytest.mark.parametrize("mode", MODES)
def test_layer_calls_are_found_in_the_proof_whatever_python_objects_their_nodes_get(float64, mode):
    """A call remembers where its output gradient is read in the graph. Kept as ``id(node)``, that broke where a
    node's Python object dies with its last reference (torch 2.11, the GPU machine's): the proof found another node
    at the id, and gave the transformer's head (T == B) the layout of a transposed call, or found none and read
    rows at every step. The two-pass modes were wrong there (benchmarks/results/gpu-notes.md). With node objects
    that live as short as they did: every call is proven, no tag pass, and the step is exact."""
    from dptrain.testing import clipped_gradient
    from helpers import get_case, split_max_grad_norm

    case = get_case("transformer")
    assert case.batch[0].shape[0] == case.batch[0].shape[1]  # (T == B: a transposed layout fits the shapes)
    R = split_max_grad_norm(case, "all-layer")
    with tag_passes_counted() as passes, _nodes_as_in_torch_2_11():
        assert isinstance(torch.ones(1, requires_grad=True).exp().grad_fn, _ShortLivedNode)
        got = clipped_gradient(copy.deepcopy(case.model), case.losses_fn, case.batch, mode=mode, max_grad_norm=R)
    assert_matches(got, reference_clipped_gradient(case.model, case.losses_fn, case.batch, max_grad_norm=R),
                   rtol=1e-10, what=mode)
    assert not passes


def test_steps_under_torch_profiler_are_proven_and_exact(float64):
    """torch's profiler reads each module's parameters' ``.grad`` at every module call (with_stack): profiled steps are
    proven from their graphs as the others are (no tag pass), and stay exact."""
    transformers = pytest.importorskip("transformers")
    from torch.profiler import ProfilerActivity, profile

    from dptrain.losses import sequence_losses

    config = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=31, n_positions=16, resid_pdrop=0.0,
                                     embd_pdrop=0.0, attn_pdrop=0.0)

    def make():
        torch.manual_seed(0)
        return transformers.GPT2LMHeadModel(config).double()

    def losses_fn(model, ids):
        return sequence_losses(model(input_ids=ids).logits, ids)

    model = make()
    engine, opt = attached_engine(model, mode="bk-mixopt", max_grad_norm=1.0)
    try:
        batches = [torch.randint(0, 31, (3, 8), generator=torch.Generator().manual_seed(k)) for k in range(4)]
        with tag_passes_counted() as passes:
            for k, ids in enumerate(batches):
                with profile(activities=[ProfilerActivity.CPU], with_stack=True) if k >= 2 else contextlib.nullcontext():
                    losses = losses_fn(model, ids)
                    engine.backward(losses)
                    opt.step()
                    got = {n: p.grad.clone() for n, p in model.named_parameters()}
                    opt.zero_grad()
        assert not passes
        assert_matches(got, reference_clipped_gradient(make(), losses_fn, (batches[-1],), max_grad_norm=1.0),
                       rtol=1e-9)
    finally:
        engine.detach()
