"""A user journey: members whose weights are used more than once, as real models do.

The models a researcher ties weights in: a tiny LM whose output projection is its embedding
(`self.head.weight = self.emb.weight`), an autoencoder whose decoder is the encoder weight
transposed (`F.linear(h, self.enc.weight.t())`), an ALBERT-style stack applying one shared
block three times (held once as an attribute and three times in a `ModuleList`), one `nn.GRU`
used as encoder and decoder under two names, a Parameter and a buffer shared by two
submodules (a call counter both add to in place), a BatchNorm in the shared block (its
statistics updated once per use), and a tie made after construction in the factory. Four
members, float64.

Checked against each member trained alone in plain PyTorch (`torch.optim.AdamW`,
`torch.nn.utils.clip_grad_norm_` over `parameters()`, which counts a tied tensor once, on the
same batches): names (`named_parameters()` as torch's `remove_duplicate=True`, state dict
keys with every alias), the gradient from both uses, one optimizer step and one weight decay
per tied tensor (per-member decay), the clip norms, `make_step`, `fit`, the hand-off of a
member's optimizer state to `torch.optim`, ties kept by `ens[i]`, `unstack()`, `select`,
member files and `load_state_dict`, a refusal of members tied differently. docs/semantics.md
lists tied weights among the models the suite checks; it says nothing more about them.

Two bugs this journey found, fixed in session 30: a member's state dict (`state_dicts()`,
`.pt` member files) held a copy per tied key, so an edit of `sd["emb.weight"]` was lost on
`load_state_dict` (alone it is kept); and members tied to different tensors under the same
names ran, silently, with member 0's tie (now refused at build).

`make_step(compile=True)` on the tied LM was checked by hand (6 steps, ~1e-16 off alone) but
is not pinned here: its first call compiles for ~10 s.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import vmapens
from tests.truth import assert_members_equal, factory_members, seeded_members

pytestmark = pytest.mark.usefixtures("float64_default")

N, V, D = 4, 7, 4
WD = [0.0, 0.1, 0.5, 1.0]  # per-member decoupled weight decay: one decay per tied tensor
LR, MAX_NORM = 0.05, 0.2
TOL = {"rtol": 1e-10, "atol": 1e-12}


class TiedLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.mix = nn.Linear(D, D)
        self.head = nn.Linear(D, V)
        self.head.weight = self.emb.weight

    def forward(self, tok: Tensor) -> Tensor:
        return self.head(torch.tanh(self.mix(self.emb(tok))))


class Untied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.head = nn.Linear(D, V)

    def forward(self, tok: Tensor) -> Tensor:
        return self.head(torch.tanh(self.emb(tok)))


def tied_after() -> nn.Module:
    m = Untied()  # tied by the factory, after the module was built
    m.head.weight = m.emb.weight
    return m


class AE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Linear(5, 3)
        self.dec_bias = nn.Parameter(torch.zeros(5))

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(torch.tanh(self.enc(x)), self.enc.weight.t(), self.dec_bias)


class Block(nn.Module):
    def __init__(self, bn: bool = False) -> None:
        super().__init__()
        # No bias before BatchNorm: its true gradient is 0 and Adam would step on round-off.
        self.fc = nn.Linear(4, 4, bias=not bn)
        self.norm = nn.BatchNorm1d(4) if bn else nn.LayerNorm(4)

    def forward(self, x: Tensor) -> Tensor:
        return self.norm(x + torch.tanh(self.fc(x)))


class Albert(nn.Module):
    def __init__(self, bn: bool = False) -> None:
        super().__init__()
        self.inp = nn.Linear(3, 4, bias=not bn)
        self.block = Block(bn)
        self.layers = nn.ModuleList([self.block] * 3)
        self.out = nn.Linear(4, 2)

    def forward(self, x: Tensor) -> Tensor:
        h = self.inp(x)
        for layer in self.layers:
            h = layer(h)
        return self.out(h)


class Shared(nn.Module):
    """A gain Parameter and a shift buffer held by both layers; a call counter buffer both
    layers add to in place."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(3, 4), nn.Linear(4, 2)
        self.gain = nn.Parameter(torch.tensor([1.5]))
        self.a.gain = self.b.gain = self.gain
        shift, count = torch.tensor([0.7]), torch.zeros(())
        for layer in (self.a, self.b):
            layer.register_buffer("shift", shift)
            layer.register_buffer("count", count)

    def forward(self, x: Tensor) -> Tensor:
        self.a.count += 1
        h = torch.tanh(self.a(x) * self.a.gain + self.a.shift)
        self.b.count += 1
        return (self.b(h) * self.b.gain + self.b.shift) * (1 + 1 / self.b.count)


class SharedGRU(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.GRU(3, 4, batch_first=True)
        self.dec = self.enc
        self.out = nn.Linear(4, 2)

    def forward(self, x: Tensor) -> Tensor:
        _, h = self.enc(x)
        y, _ = self.dec(x.flip(1), h)
        return self.out(y[:, -1])


def lm_loss(out: Tensor, y: Tensor) -> Tensor:
    return F.cross_entropy(out.reshape(-1, V), y.reshape(-1))


def batches(factory: Callable[[], nn.Module], count: int = 3) -> list[tuple[Tensor, Tensor]]:
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(count):
        if factory in (TiedLM, tied_after):
            x, y = torch.randint(V, (6, 3), generator=g), torch.randint(V, (6, 3), generator=g)
        elif factory is AE:
            x = torch.randn(6, 5, generator=g)
            y = x
        elif factory is SharedGRU:
            x, y = torch.randn(5, 4, 3, generator=g), torch.randn(5, 2, generator=g)
        else:
            x, y = torch.randn(6, 3, generator=g), torch.randn(6, 2, generator=g)
        out.append((x, y))
    return out


def loss_for(factory: Callable[[], nn.Module]) -> Callable[[Tensor, Tensor], Tensor]:
    return lm_loss if factory in (TiedLM, tied_after) else F.mse_loss


def alone(factory, data, wd=WD, clip=True) -> tuple[list[nn.Module], list[Tensor]]:
    """Each member trained alone: torch.optim.AdamW, torch's clip over `parameters()`; the
    clip norms of the last step."""
    members, norms = seeded_members(factory, N), []
    for i, m in enumerate(members):
        opt = torch.optim.AdamW(m.parameters(), lr=LR, weight_decay=wd[i])
        for x, y in data:
            opt.zero_grad()
            loss_for(factory)(m(x), y).backward()
            norm = torch.nn.utils.clip_grad_norm_(m.parameters(), MAX_NORM) if clip else None
            opt.step()
        norms.append(norm)
    return members, norms


def assert_members(ens: vmapens.Ensemble, members: list[nn.Module]) -> None:
    assert_members_equal(ens, members, **TOL)


def stacked_adamw(ens: vmapens.Ensemble) -> torch.optim.Optimizer:
    return vmapens.StackedAdam(
        ens, lr=LR, weight_decay=torch.tensor(WD), decoupled_weight_decay=True
    )


def albert_bn() -> nn.Module:
    return Albert(bn=True)


FACTORIES = [TiedLM, tied_after, AE, Albert, albert_bn, Shared]
IDS = ["lm", "tied_after", "ae", "albert", "albert_bn", "shared"]


# The LM's make_step run is pinned by the hand-off test below; the plain ALBERT stack by the
# names test and by its BatchNorm variant here.
@pytest.mark.parametrize("factory", [tied_after, AE, albert_bn, Shared], ids=IDS[1:3] + IDS[4:])
def test_make_step_with_clip_and_per_member_decay_matches_adamw_alone(factory) -> None:
    data = batches(factory)
    members, _ = alone(factory, data)
    ens = vmapens.Ensemble(factory, N, seeds=range(N))
    step = vmapens.make_step(ens, loss_for(factory), stacked_adamw(ens), clip_grad_norm=MAX_NORM)
    for x, y in data:
        step(x, y)
    assert_members(ens, members)


@pytest.mark.parametrize("factory", [TiedLM, AE, SharedGRU], ids=["lm", "ae", "gru"])
def test_hand_loop_gradients_and_clip_norms_count_each_tied_tensor_once(factory) -> None:
    data = batches(factory)
    members, norms = alone(factory, data)
    ens = vmapens.Ensemble(factory, N, seeds=range(N))
    opt = stacked_adamw(ens)
    for x, y in data:
        opt.zero_grad()
        vmapens.per_member(loss_for(factory))(ens(x), y).sum().backward()
        got = vmapens.optim.clip_grad_norm_(ens, MAX_NORM)
        opt.step()
    torch.testing.assert_close(got, torch.stack(norms), **TOL)
    assert_members(ens, members)
    # One backward more: the tied tensor's gradient holds both uses, as alone.
    x, y = data[0]
    opt.zero_grad()
    vmapens.per_member(loss_for(factory))(ens(x), y).sum().backward()
    for i, m in enumerate(members):
        m.zero_grad()
        loss_for(factory)(m(x), y).backward()
        for name, p in m.named_parameters():
            torch.testing.assert_close(ens.get_parameter(name).grad[i], p.grad, **TOL, msg=name)


def test_torch_adamw_over_ens_parameters_steps_a_tied_weight_once() -> None:
    data = batches(TiedLM)
    members, _ = alone(TiedLM, data, wd=[0.3] * N, clip=False)
    ens = vmapens.Ensemble(TiedLM, N, seeds=range(N))
    opt = torch.optim.AdamW(ens.parameters(), lr=LR, weight_decay=0.3)
    for x, y in data:
        opt.zero_grad()
        vmapens.per_member(lm_loss)(ens(x), y).sum().backward()
        opt.step()
    assert_members(ens, members)


@pytest.mark.parametrize("factory", [*FACTORIES, SharedGRU], ids=[*IDS, "gru"])
def test_names_and_keys_are_the_members_and_copies_keep_the_ties(factory) -> None:
    ens = vmapens.Ensemble(factory, N, seeds=range(N))
    plain = factory()
    # named_parameters() drops a tied alias (torch's remove_duplicate=True); the state dict
    # keeps every alias, as the member's own.
    assert [n for n, _ in ens.named_parameters()] == [n for n, _ in plain.named_parameters()]
    assert list(ens.state_dict()) == list(plain.state_dict())
    assert all(list(sd) == list(plain.state_dict()) for sd in ens.state_dicts())
    pairs = {
        "head.weight": "emb.weight",
        "a.gain": "b.gain",
        "a.shift": "b.shift",
        "a.count": "b.count",
        "layers.2.fc.weight": "block.fc.weight",
        "dec.weight_hh_l0": "enc.weight_hh_l0",
    }
    pairs = {k: v for k, v in pairs.items() if k in plain.state_dict()}
    aliases = dict(plain.named_parameters(remove_duplicate=False))
    for k, v in pairs.items():
        if k in aliases:  # a tied alias's name gives the one stacked tensor
            assert ens.get_parameter(k) is ens.get_parameter(v)
    copies = [ens[1], *ens.unstack(), ens.select([2, 0])[0], copy.deepcopy(ens)[3]]
    for m in copies:
        assert type(m) is type(plain)
        for k, v in pairs.items():
            assert _tensor(m, k) is _tensor(m, v), k


def _tensor(m: nn.Module, name: str) -> Tensor:
    mod, _, leaf = name.rpartition(".")
    return getattr(m.get_submodule(mod), leaf)


@pytest.fixture(scope="module")
def trained() -> tuple[vmapens.Ensemble, torch.optim.Optimizer, list[nn.Module]]:
    """The tied LM after 3 steps of `make_step`, its optimizer, and the members alone after 6
    (built once for the file: the tests read them only)."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        data = batches(TiedLM, 6)
        members, _ = alone(TiedLM, data)
        ens = vmapens.Ensemble(TiedLM, N, seeds=range(N))
        opt = stacked_adamw(ens)
        step = vmapens.make_step(ens, lm_loss, opt, clip_grad_norm=MAX_NORM)
        for x, y in data[:3]:
            step(x, y)
    finally:
        torch.set_default_dtype(before)
    return ens, opt, members


def test_a_member_handed_to_torch_adamw_mid_run_ends_as_alone(trained) -> None:
    ens, opt, members = trained
    for i in (0, 3):
        m = ens[i]
        own = torch.optim.AdamW(m.parameters(), lr=LR, weight_decay=WD[i])
        own.load_state_dict(opt.member_state_dict(i, m))
        for x, y in batches(TiedLM, 6)[3:]:
            own.zero_grad()
            lm_loss(m(x), y).backward()
            torch.nn.utils.clip_grad_norm_(m.parameters(), MAX_NORM)
            own.step()
        assert m.head.weight is m.emb.weight
        for k, v in members[i].state_dict().items():
            torch.testing.assert_close(m.state_dict()[k], v, **TOL, msg=f"member {i} {k}")


@pytest.mark.parametrize("fmt", ["pt", "safetensors"])
def test_member_files_load_into_the_class_keeping_the_tie(trained, tmp_path, fmt) -> None:
    ens, _, _ = trained
    vmapens.save_members(ens, tmp_path, format=fmt)
    for i, sd in enumerate(vmapens.load_members(tmp_path)):
        m = TiedLM()
        m.load_state_dict(sd)
        assert m.head.weight is m.emb.weight
        torch.testing.assert_close(m.state_dict(), ens[i].state_dict(), rtol=0, atol=0)
    # The stacked state dict loads back into a fresh ensemble, the tie kept.
    other = vmapens.Ensemble(TiedLM, N, seed=7)
    other.load_state_dict(ens.state_dict())
    assert [n for n, _ in other.named_parameters()] == [n for n, _ in ens.named_parameters()]
    torch.testing.assert_close(other.state_dict(), ens.state_dict(), rtol=0, atol=0)


def test_fit_on_tied_members_matches_alone() -> None:
    data = batches(TiedLM, 4)
    members, _ = alone(TiedLM, data)
    ens = vmapens.Ensemble(TiedLM, N, seeds=range(N))
    x, y = torch.cat([b[0] for b in data]), torch.cat([b[1] for b in data])
    vmapens.fit(
        ens, (x, y), lm_loss, batch_size=6, shuffle=False, optimizer=stacked_adamw,
        clip_grad_norm=MAX_NORM, progress=False,
    )  # fmt: skip
    assert_members(ens, members)


def test_load_state_dict_with_tied_keys_that_differ_keeps_the_later_key_as_alone() -> None:
    # A state dict whose aliases disagree (edited, or from an untied model): torch's
    # load_state_dict copies `emb.weight`, then `head.weight` into the same tensor.
    ens = vmapens.Ensemble(TiedLM, N, seeds=range(N))
    sd = {k: v.clone() for k, v in ens.state_dict().items()}
    sd["head.weight"] = sd["head.weight"] + 1.0
    ens.load_state_dict(sd)
    for i, m in enumerate(seeded_members(TiedLM, N)):
        own = {k: v[i] for k, v in sd.items()}
        m.load_state_dict(own)
        torch.testing.assert_close(ens[i].state_dict(), m.state_dict(), rtol=0, atol=0)
    assert torch.equal(ens.get_parameter("emb.weight"), sd["head.weight"])


def test_members_tied_differently_are_refused_naming_the_tensor() -> None:
    with pytest.raises(ValueError, match=r"from_factories: member 1 .*head\.weight"):
        vmapens.Ensemble.from_factories([tied_after, Untied], seed=0)
    with pytest.raises(ValueError, match=r"from_modules: member 1 .*head\.weight"):
        vmapens.Ensemble.from_modules([Untied(), tied_after()])


def test_a_member_state_dict_shares_a_tied_tensor_as_alone(tmp_path) -> None:
    # The user zeroes the padding token's embedding row in a member's state dict (or its
    # file) before deploying: alone, `emb.weight` and `head.weight` in `model.state_dict()`
    # (and in `torch.save` of it) share storage, so the edit survives `load_state_dict`
    # copying `head.weight` last. Each state dict here held its own copy per key: the edit
    # was silently overwritten by the unedited `head.weight`.
    ens = vmapens.Ensemble(TiedLM, N, seeds=range(N))
    vmapens.save_members(ens, tmp_path)
    for sd in (ens.state_dicts()[2], vmapens.load_member(tmp_path / "member_0002.pt")):
        assert sd["emb.weight"].untyped_storage().data_ptr() == (
            sd["head.weight"].untyped_storage().data_ptr()
        )
        sd["emb.weight"][0] = 0.0
        m = TiedLM()
        m.load_state_dict(sd)
        assert torch.equal(m.emb.weight[0], torch.zeros(D))


class TiedTo(nn.Module):
    """An architecture sweep's member: the output layer tied to the embedding or to a
    projection of the same shape."""

    def __init__(self, to: str) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.proj = nn.Linear(D, V, bias=False)
        self.head = nn.Linear(D, V)
        self.head.weight = self.emb.weight if to == "emb" else self.proj.weight

    def forward(self, tok: Tensor) -> Tensor:
        h = torch.tanh(self.emb(tok))
        return self.head(h) + 0.5 * self.proj(h)


def test_members_tied_to_different_tensors_are_refused_or_run_as_alone() -> None:
    # Both members have the same unique names (`emb.weight`, `proj.weight`, `head.bias`):
    # member 1 was built, ran, and came back out of `ens[1]` with its head tied to its
    # embedding, as member 0's, with no error (outputs 5.5 off member 1 alone).
    factories = [functools.partial(TiedTo, "emb"), functools.partial(TiedTo, "proj")]
    tok = batches(TiedLM, 1)[0][0]
    try:
        ens = vmapens.Ensemble.from_factories(factories, seed=0)
    except ValueError as e:
        assert "`head.weight`" in str(e) or "tied" in str(e)
        return
    out = ens(tok)
    for i, m in enumerate(factory_members(factories, seed=0)):
        torch.testing.assert_close(out[i], m(tok), **TOL)
        assert (ens[i].head.weight is ens[i].proj.weight) == (m.head.weight is m.proj.weight)
