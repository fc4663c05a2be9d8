"""Seeded random programs over the Ensemble container, compared with N plain modules after every
call.

Each program builds an ``Ensemble`` (N = 2..4; ``Ensemble(cls, n, seeds=...)``, from the global
RNG, ``from_modules`` of modules trained a little alone, ``from_factories``) of a small member
(an MLP, BatchNorm with ``num_batches_tracked``, tied weights, a ``parametrize``d layer) and
the N plain modules it stands for. It then applies, in any order plain PyTorch allows, the
calls users make on the container between training steps: ``make_step`` and hand-written steps,
optimizers built at any time (before ``.double()``/``.float()`` too), dtype changes (``.to``,
``.double()``, ``.float()``, ``.type``), ``train``/``eval`` (of a submodule through the
template too), ``requires_grad_`` (per stacked parameter, per template layer, on the whole
ensemble), ``apply``, ``zero_grad``, ``state_dict``/``load_state_dict`` round trips (other
dtypes, ``strict=False``), ``unstack`` and ``ens[i]`` with the returned modules edited,
sub-ensembles by int/negative/numpy/tensor/list/slice/bool-mask indices (with or without the
optimizer's state), ``member_state_dict`` into a plain optimizer, and bad calls (a state dict
of an ensemble of another size, indices out of range, masks of the wrong length, an ``apply``
that changes a setting, a step with everything frozen) that must raise, name what is wrong and
change nothing. The truth is plain torch on the list of modules: indexing picks from the list,
``.double()`` runs on each module, each module has its own ``torch.optim`` optimizer.

Run one program by hand: ``python tests/test_fuzz_container.py SEED [SEED ...]``.
"""

from __future__ import annotations

import copy
import random
import sys
from collections.abc import Callable
from typing import Any

import models
import numpy as np
import pytest
import torch
from torch import nn
from torch.nn.utils import parametrize

import vmapens
from vmapens.optim import stacked

# float64 throughout: only the order of sums differs. Once a program has run in float32, the
# two sides have rounded differently and stay within float32's tolerance.
TOL64 = dict(rtol=1e-9, atol=1e-10)
TOL32 = dict(rtol=2e-3, atol=2e-4)


# -- the members ------------------------------------------------------------------------------


MLP, BN = models.TanhMLP, models.TanhBN


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.head = nn.Linear(3, 3), nn.Linear(3, 3), nn.Linear(3, 2)
        self.b.weight = self.a.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.b(torch.tanh(self.a(x)))))


class Symmetric(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.triu() + x.triu(1).transpose(-1, -2)


class Param(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.sym, self.head = nn.Linear(3, 3), nn.Linear(3, 2)
        parametrize.register_parametrization(self.sym, "weight", Symmetric())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.sym(x)))


MODELS: dict[str, type[nn.Module]] = {"mlp": MLP, "bn": BN, "tied": Tied, "param": Param}

#: name -> (torch class, kwargs)
OPTIMIZERS: dict[str, tuple[type[torch.optim.Optimizer], dict[str, Any]]] = {
    "sgd": (torch.optim.SGD, dict(lr=0.05, momentum=0.9)),
    "adam": (torch.optim.Adam, dict(lr=1e-2)),
    "adamw": (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)),
    "rmsprop": (torch.optim.RMSprop, dict(lr=1e-2, momentum=0.5)),
}


# -- both sides -------------------------------------------------------------------------------


class World:
    """An Ensemble with (maybe) its stacked optimizer; N plain modules with their own."""

    def __init__(self, seed: int, model: str, build: str, n: int) -> None:
        self.cls, self.n = MODELS[model], n
        self.g = torch.Generator().manual_seed(seed)
        self.dtype, self.was32 = torch.float64, False
        cls = self.cls
        seeds = [seed * 10 + i for i in range(n)]

        def made(s: int) -> nn.Module:
            torch.manual_seed(s)
            return cls().double()

        if build == "seeds":
            self.ens = vmapens.Ensemble(lambda: cls().double(), n, seeds=seeds)
            self.models = [made(s) for s in seeds]
        elif build == "global":
            torch.manual_seed(seed)
            self.ens = vmapens.Ensemble(lambda: cls().double(), n)
            torch.manual_seed(seed)
            self.models = [cls().double() for _ in range(n)]
        elif build == "factories":
            self.ens = vmapens.Ensemble.from_factories([lambda: cls().double()] * n, seeds=seeds)
            self.models = [made(s) for s in seeds]
        else:  # from_modules: trained a little alone first, BatchNorm counts included
            self.models = [made(s) for s in seeds]
            for m in self.models:
                opt = torch.optim.SGD(m.parameters(), lr=0.1)
                for _ in range(1 + seed % 2):
                    nn.functional.mse_loss(m(self.x(4)), self.y(4)).backward()
                    opt.step()
            self.ens = vmapens.Ensemble.from_modules(self.models)
            self.models = [copy.deepcopy(m) for m in self.models]
        self.opt: Any = None
        self.opts: list[torch.optim.Optimizer] = []
        self.kind = ""
        self.step: Any = None
        self.stepped = False  # whether the last call stepped the optimizer

    @property
    def tol(self) -> dict[str, float]:
        return TOL32 if self.was32 else TOL64

    def x(self, rows: int) -> torch.Tensor:
        return torch.randn(rows, 3, generator=self.g, dtype=torch.float64)

    def y(self, rows: int) -> torch.Tensor:
        return torch.randn(rows, 2, generator=self.g, dtype=torch.float64)

    # the comparison
    def compare(self, where: str) -> None:
        ens, tol = self.ens, self.tol
        # A flag set on the template reaches the stacked parameter at the next call of the
        # ensemble, ens[i] or a step (docs/semantics.md, "Buffers and train/eval").
        ens[0]
        assert len(ens) == len(self.models) == self.n, where
        params, buffers = ens.stacked_params(), ens.stacked_buffers()
        assert ens.training == self.models[0].training, where
        for i, m in enumerate(self.models):
            assert [k for k, _ in m.named_parameters()] == list(params), where
            for name, p in m.named_parameters():
                s = params[name]
                msg = f"{where}: member {i} `{name}`"
                assert s.dtype == p.dtype, f"{msg}: dtype {s.dtype} vs {p.dtype}"
                assert s.requires_grad == p.requires_grad, f"{msg}: requires_grad"
                torch.testing.assert_close(
                    s[i].detach(), p.detach(), **tol, msg=lambda e, msg=msg: f"{msg}: {e}"
                )
                assert (s.grad is None) == (p.grad is None), f"{msg}: grad {s.grad is None}"
                if p.grad is not None:
                    assert s.grad.dtype == p.grad.dtype, f"{msg}: grad dtype"
                    torch.testing.assert_close(
                        s.grad[i], p.grad, **tol, msg=lambda e, msg=msg: f"{msg}.grad: {e}"
                    )
            assert [k for k, _ in m.named_buffers()] == list(buffers), where
            for name, b in m.named_buffers():
                s = buffers[name]
                assert s.dtype == b.dtype, f"{where}: member {i} buffer `{name}` dtype"
                torch.testing.assert_close(
                    s[i], b, **tol, msg=lambda e, name=name: f"{where}: buffer {name}: {e}"
                )
            modes = {k: sub.training for k, sub in m.named_modules()}
            assert modes == {k: sub.training for k, sub in ens.template.named_modules()}, where
            if self.opt is not None:
                self.compare_opt(i, where)

    def compare_opt(self, i: int, where: str) -> None:
        ours, theirs, tol = self.opt, self.opts[i], self.tol
        for g, h in zip(ours.param_groups, theirs.param_groups, strict=True):
            assert float(g["lr"]) == h["lr"], where
            for p, q in zip(g["params"], h["params"], strict=True):
                state, truth = ours.state.get(p, {}), theirs.state.get(q, {})
                for key, value in truth.items():
                    if key == "step" or value is None:
                        continue
                    got = state[key][i]
                    # The stacked state follows the parameters' dtype when it next steps
                    # (docs/optim.md), torch's as its load_state_dict casts it (``_recast``);
                    # a parameter without a gradient keeps its state as it is (session 44).
                    if not self.stepped or p.grad is None:
                        got = got.to(value.dtype)
                    assert got.dtype == value.dtype, f"{where}: member {i} state `{key}` dtype"
                    torch.testing.assert_close(
                        got, value, **tol, msg=lambda e, k=key: f"{where}: state {k}: {e}"
                    )
                if "step" in truth:
                    assert float(state["step"][i]) == float(truth["step"]), where

    def snapshot(self) -> dict[str, Any]:
        """Everything a refused call must leave as it was, bit for bit."""
        ens = self.ens
        snap: dict[str, Any] = {
            "tensors": {k: (t.detach().clone(), t.dtype) for k, t in ens.stacked_state().items()},
            "grads": {
                k: None if p.grad is None else p.grad.clone()
                for k, p in ens.stacked_params().items()
            },
            "flags": {k: p.requires_grad for k, p in ens.stacked_params().items()},
            "modes": [ens.training, *(m.training for m in ens.template.modules())],
            "ids": list(ens.member_ids),
        }
        if self.opt is not None:
            sd = copy.deepcopy(self.opt.state_dict())
            # Entries without state: what reading ``opt.state[p]`` (a defaultdict) adds, as
            # ``member_state_dict`` does; they hold nothing.
            sd["state"] = {k: v for k, v in sd["state"].items() if v}
            snap["opt"] = sd
        return snap

    def same_as(self, snap: dict[str, Any], where: str) -> None:
        now = self.snapshot()
        assert now.keys() == snap.keys(), where
        for k, (t, dtype) in snap["tensors"].items():
            assert now["tensors"][k][1] == dtype and torch.equal(now["tensors"][k][0], t), (
                where,
                k,
            )
        for k, g in snap["grads"].items():
            h = now["grads"][k]
            assert (g is None) == (h is None) and (g is None or torch.equal(g, h)), (where, k)
        assert now["flags"] == snap["flags"] and now["modes"] == snap["modes"], where
        assert now["ids"] == snap["ids"], where
        if "opt" in snap:
            assert _same_tree(now["opt"], snap["opt"]), where

    def refused(self, call: Callable[[], Any], error: type[Exception], match: str) -> None:
        snap = self.snapshot()
        with pytest.raises(error, match=match):
            call()
        self.same_as(snap, f"refused call matching {match!r}")


def _same_tree(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return (
            isinstance(b, dict) and a.keys() == b.keys() and all(_same_tree(a[k], b[k]) for k in a)
        )
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same_tree(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def _recast(opt: torch.optim.Optimizer) -> None:
    """torch's optimizer state after the parameters' dtype changed, as the stacked optimizer keeps
    it (docs/optim.md: state follows the parameters): torch's load_state_dict casts it."""
    opt.load_state_dict(opt.state_dict())


# -- the calls --------------------------------------------------------------------------------


def op_new_opt(w: World, kind: str, over_module: bool) -> None:
    """An optimizer built now (before or after dtype changes, steps or selections)."""
    torch_cls, kwargs = OPTIMIZERS[kind]
    w.opt = stacked(torch_cls)(w.ens if over_module else w.ens.parameters(), **kwargs)
    w.opts = [torch_cls(m.parameters(), **kwargs) for m in w.models]
    w.kind, w.step = kind, None


def _trainable(w: World) -> bool:
    return any(p.requires_grad for p in w.models[0].parameters())


def op_make_step(w: World, rows: int) -> None:
    if w.opt is None:
        return
    x, y = w.x(rows).to(w.dtype), w.y(rows).to(w.dtype)
    if not _trainable(w):  # documented: nothing to train raises and changes nothing
        if w.step is None:
            w.step = vmapens.make_step(w.ens, nn.MSELoss(), w.opt)
        w.refused(lambda: w.step(x, y), RuntimeError, "no parameter .* requires grad")
        return
    if w.step is None:
        w.step = vmapens.make_step(w.ens, nn.MSELoss(), w.opt)
    w.step(x, y)
    for m, o in zip(w.models, w.opts, strict=True):
        o.zero_grad()
        nn.functional.mse_loss(m(x), y).backward()
        o.step()


def op_manual(w: World, rows: int, set_to_none: bool) -> None:
    """``opt.zero_grad(); per_member(loss)(ens(x), y).sum().backward(); opt.step()``."""
    if w.opt is None or not _trainable(w):
        return
    x, y = w.x(rows).to(w.dtype), w.y(rows).to(w.dtype)
    w.opt.zero_grad(set_to_none=set_to_none)
    vmapens.per_member(nn.MSELoss())(w.ens(x), y).sum().backward()
    w.opt.step()
    for m, o in zip(w.models, w.opts, strict=True):
        o.zero_grad(set_to_none=set_to_none)
        nn.functional.mse_loss(m(x), y).backward()
        o.step()


def op_opt_step(w: World) -> None:
    """``opt.step()`` on whatever gradients are there (stale, of a frozen parameter, none)."""
    if w.opt is None:
        return
    w.opt.step()
    for o in w.opts:
        o.step()


def op_zero_grad(w: World, set_to_none: bool) -> None:
    """The module's own ``zero_grad`` (not the optimizer's)."""
    w.ens.zero_grad(set_to_none=set_to_none)
    for m in w.models:
        m.zero_grad(set_to_none=set_to_none)


def op_dtype(w: World, how: str) -> None:
    """``.double()``, ``.float()``, ``.to(dtype)``, ``.to(dtype=...)``, ``.type(dtype)``; an
    optimizer built before goes on in the new dtype (docs/optim.md)."""
    dtype = torch.float32 if how.endswith("32") or how == "float" else torch.float64
    calls: dict[str, Callable[[nn.Module], Any]] = {
        "double": lambda m: m.double(),
        "float": lambda m: m.float(),
        "to32": lambda m: m.to(torch.float32),
        "to64": lambda m: m.to(dtype=torch.float64),
        "type64": lambda m: m.type(torch.float64),
    }
    out = calls[how](w.ens)
    assert out is w.ens
    for m in w.models:
        calls[how](m)
    for o in w.opts:
        _recast(o)
    w.dtype = dtype
    w.was32 = w.was32 or dtype == torch.float32


def op_mode(w: World, how: str, layer: str) -> None:
    if how == "template":  # one submodule, for all members (docs/semantics.md)
        train = not w.ens.template.get_submodule(layer).training
        w.ens.template.get_submodule(layer).train(train)
        for m in w.models:
            m.get_submodule(layer).train(train)
        return
    w.ens.train(how == "train")
    for m in w.models:
        m.train(how == "train")


def _set_flag(ens: vmapens.Ensemble, models: list[nn.Module], where: str, flag: bool) -> None:
    """``requires_grad`` set one way on the ensemble, the same way on each plain module:
    "all" (``requires_grad_`` on the whole), "each" (on every parameter in turn), a layer
    (``requires_grad_`` on the template's layer), "stacked:<name>" (the stacked parameter),
    "attr:<name>" (``requires_grad = flag`` on the template's parameter)."""
    how, _, name = where.partition(":")
    for owner, stacked_ in [(ens.template, ens.stacked_params()), *((m, None) for m in models)]:
        if how == "all":
            (ens if stacked_ is not None else owner).requires_grad_(flag)
        elif how == "each":
            for p in (ens if stacked_ is not None else owner).parameters():
                p.requires_grad_(flag)
        elif how == "stacked":
            (stacked_[name] if stacked_ is not None else owner.get_parameter(name)).requires_grad_(
                flag
            )
        elif how == "attr":
            owner.get_parameter(name).requires_grad = flag
        else:
            owner.get_submodule(how).requires_grad_(flag)


def op_freeze(w: World, how: str, name: str, flag: bool) -> None:
    """``requires_grad`` set as on a plain module: on a stacked parameter, a template layer, a
    template parameter's attribute, the whole ensemble or each parameter in turn."""
    where = {"stacked": f"stacked:{name}", "template": name.rpartition(".")[0],
             "attr": f"attr:{name}", "all": "all", "each": "each"}[how]  # fmt: skip
    _set_flag(w.ens, w.models, where, flag)


def op_freeze_twice(w: World, hows: list[str], name: str, flags: list[bool]) -> None:
    """Two ``requires_grad`` edits with no call of the ensemble between them."""
    for how, flag in zip(hows, flags, strict=True):
        op_freeze(w, how, name, flag)


def op_apply(w: World, seed: int) -> None:
    def init(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight if m.bias is None else m.bias, std=0.3)

    torch.manual_seed(seed)
    w.ens.apply(init)
    torch.manual_seed(seed)
    for m in w.models:
        m.apply(init)


def op_forward(w: World, rows: int) -> None:
    """A forward outside the step (BatchNorm's statistics move in train mode, as alone)."""
    x = w.x(rows).to(w.dtype)
    with torch.no_grad():
        out = w.ens(x)
        for i, m in enumerate(w.models):
            torch.testing.assert_close(out[i], m(x), **w.tol)


def op_load(w: World, seed: int, how: str) -> None:
    """``load_state_dict`` of another ensemble's state dict of the same size (float32 values
    into float64 storage too: torch casts them), or of some of its keys with strict=False."""
    other = vmapens.Ensemble(lambda: w.cls().double(), w.n, seeds=[seed + i for i in range(w.n)])
    sd = other.state_dict()
    if how == "float":
        sd = {k: v.float() if v.is_floating_point() else v for k, v in sd.items()}
    keys = list(sd)[::2] if how == "partial" else list(sd)
    result = w.ens.load_state_dict({k: sd[k] for k in keys}, strict=how != "partial")
    for i, m in enumerate(w.models):
        truth = m.load_state_dict({k: sd[k][i] for k in keys}, strict=how != "partial")
        assert sorted(result.missing_keys) == sorted(truth.missing_keys)
        assert result.unexpected_keys == truth.unexpected_keys
    if how == "float":  # the values went through float32 on both sides
        w.was32 = True


def op_load_other_size(w: World, delta: int, strict: bool, assign: bool) -> None:
    """A state dict of an ensemble of another size: refused, nothing changes."""
    n = max(1, w.n + delta)
    if n == w.n:
        n += 1
    sd = vmapens.Ensemble(lambda: w.cls().to(w.dtype), n, seeds=list(range(n))).state_dict()
    w.refused(
        lambda: w.ens.load_state_dict(sd, strict=strict, assign=assign),
        RuntimeError,
        "size mismatch",
    )


def _check_member(w: World, got: nn.Module, truth: nn.Module, where: str) -> None:
    assert type(got) is type(truth), where
    tol = w.tol
    for (k, p), (_, q) in zip(got.named_parameters(), truth.named_parameters(), strict=True):
        assert p.dtype == q.dtype and p.requires_grad == q.requires_grad, (where, k)
        torch.testing.assert_close(p.detach(), q.detach(), **tol)
    for b, c in zip(got.buffers(), truth.buffers(), strict=True):
        assert b.dtype == c.dtype, where
        torch.testing.assert_close(b, c, **tol)
    assert list(got.state_dict()) == list(truth.state_dict()), where
    assert [s.training for s in got.modules()] == [s.training for s in truth.modules()], where
    # The member runs alone as its twin does (tied weights, parametrizations in place).
    x = torch.randn(3, 3, generator=w.g, dtype=torch.float64).to(w.dtype)
    with torch.no_grad():
        torch.testing.assert_close(
            copy.deepcopy(got).eval()(x), copy.deepcopy(truth).eval()(x), **tol
        )


def _edit(module: nn.Module) -> None:
    """What a user may do to a module they got back: none of it may reach the ensemble."""
    with torch.no_grad():
        for p in module.parameters():
            p.add_(1.0)
            p.grad = torch.ones_like(p)
        for b in module.buffers():
            b.add_(1)
    module.eval()
    module.requires_grad_(False)
    module.double()


def op_unstack(w: World, how: str, i: int) -> None:
    snap = w.snapshot()
    key: Any = {"int": i, "neg": i - w.n, "numpy": np.int64(i), "tensor": torch.tensor(i)}.get(how)
    got = w.ens.unstack() if how == "unstack" else list(w.ens) if how == "iter" else [w.ens[key]]
    rows = range(w.n) if how in ("unstack", "iter") else [i]
    assert len(got) == len(rows)
    for module, r in zip(got, rows, strict=True):
        _check_member(w, module, w.models[r], f"{how} {r}")
        _edit(module)
    w.same_as(snap, f"after editing what {how} returned")


def _index(how: str, rows: list[int], n: int) -> tuple[Any, list[int]]:
    """An index of a kind, and the rows of the list of modules it picks."""
    if how == "list":
        return rows, rows
    if how == "neg":
        return [r - n for r in rows], rows
    if how == "tensor":
        return torch.tensor(rows), rows
    if how == "numpy":
        return np.array(rows), rows
    if how in ("mask", "npmask"):
        mask = [k in rows for k in range(n)]
        return (torch.tensor(mask) if how == "mask" else np.array(mask)), sorted(set(rows))
    if how == "slice":
        start = min(rows)
        return slice(start, None, 1 + len(rows) % 2), list(range(n))[start :: 1 + len(rows) % 2]
    assert how == "reverse"
    return slice(None, None, -1), list(range(n))[::-1]


def op_select(w: World, how: str, rows: list[int], keep: str) -> None:
    """Go on with ``ens[index]`` (or ``ens.select``): ``keep`` = "new" (a new optimizer),
    "select" (``opt.select``: the kept members' optimizer state), "none" (look only, edit it,
    the ensemble must not change)."""
    index, picked = _index(how, rows, w.n)
    snap = w.snapshot()
    sub = w.ens.select(index) if keep == "select" else w.ens[index]
    w.same_as(snap, f"ens[{how}]")
    assert list(sub.member_ids) == [w.ens.member_ids[r] for r in picked]
    models = [copy.deepcopy(w.models[r]) for r in picked]
    for m in models:
        m.zero_grad()  # a sub-ensemble holds copies, without gradients
    if keep == "none":
        for k, r in enumerate(picked):
            _check_member(w, sub[k], w.models[r], f"ens[{how}][{k}]")
        with torch.no_grad():
            for t in sub.stacked_state().values():
                t.add_(1)
        sub.eval()
        w.same_as(snap, f"after editing ens[{how}]")
        return
    if keep == "select" and w.opt is not None:
        opt = w.opt.select(index, sub)
        torch_cls, kwargs = OPTIMIZERS[w.kind]
        opts = []
        for m, r in zip(models, picked, strict=True):
            o = torch_cls(m.parameters(), **kwargs)
            o.load_state_dict(copy.deepcopy(w.opts[r].state_dict()))  # torch's aliases its tensors
            opts.append(o)
        w.opt, w.opts, w.step = opt, opts, None
    elif w.opt is not None:
        w.ens, w.models, w.n = sub, models, len(picked)
        op_new_opt(w, w.kind, True)
    w.ens, w.models, w.n = sub, models, len(picked)


def op_member_state_dict(w: World, i: int) -> None:
    """``opt.member_state_dict(i)`` into the plain optimizer over ``ens[i]``: its state is
    member i's twin's."""
    if w.opt is None:
        return
    snap = w.snapshot()
    member = w.ens[i]
    torch_cls, kwargs = OPTIMIZERS[w.kind]
    plain = torch_cls(member.parameters(), **kwargs)
    plain.load_state_dict(w.opt.member_state_dict(i, member))
    ours, theirs = plain.state_dict(), w.opts[i].state_dict()
    assert ours["state"].keys() == theirs["state"].keys(), "member_state_dict: which params"
    for k, state in theirs["state"].items():
        for key, value in state.items():
            got = ours["state"][k][key]
            if isinstance(value, torch.Tensor):
                assert got.dtype == value.dtype, f"member_state_dict state {key} dtype"
                torch.testing.assert_close(got, value, **w.tol)
    w.same_as(snap, "member_state_dict")


def op_bad(w: World, what: str) -> None:
    """Bad calls: each raises naming what is wrong, and nothing changes."""
    n = w.n
    cases: dict[str, tuple[Callable[[], Any], type[Exception], str]] = {
        "index_high": (lambda: w.ens[n], IndexError, f"index {n} out of range"),
        "index_low": (lambda: w.ens[-n - 1], IndexError, "out of range"),
        "list_high": (lambda: w.ens[[0, n]], IndexError, "out of range"),
        "empty": (lambda: w.ens[[]], IndexError, "no members"),
        "empty_slice": (lambda: w.ens[n:], IndexError, "no members"),
        "float_tensor": (lambda: w.ens[torch.tensor([0.0])], TypeError, "index"),
        "bools": (lambda: w.ens[[True] * n], TypeError, "index"),
        "mask_short": (lambda: w.ens[torch.ones(n + 1, dtype=torch.bool)], IndexError, "mask"),
        "mask_none": (lambda: w.ens[torch.zeros(n, dtype=torch.bool)], IndexError, "no members"),
        "apply_setting": (
            lambda: w.ens.apply(
                lambda m: setattr(m, "in_features", 7) if isinstance(m, nn.Linear) else None
            ),
            ValueError,
            "`fn` changed `.*in_features`",
        ),
        "apply_dtype": (
            lambda: w.ens.apply(lambda m: m.half() if isinstance(m, nn.Linear) else None),
            ValueError,
            "`fn` changed the tensor",
        ),
        "member_state_dict": (
            (lambda: w.opt.member_state_dict(n)) if w.opt is not None else (lambda: w.ens[n]),
            IndexError,
            "out of range",
        ),
        "load_missing": (
            lambda: w.ens.load_state_dict(dict(list(w.ens.state_dict().items())[1:])),
            RuntimeError,
            "Missing key",
        ),
        "load_extra": (
            lambda: w.ens.load_state_dict({**w.ens.state_dict(), "extra": torch.zeros(n)}),
            RuntimeError,
            "Unexpected key",
        ),
    }
    call, error, match = cases[what]
    w.refused(call, error, match)


OPS: dict[str, Callable[..., None]] = {
    "new_opt": op_new_opt,
    "make_step": op_make_step,
    "manual": op_manual,
    "opt_step": op_opt_step,
    "zero_grad": op_zero_grad,
    "dtype": op_dtype,
    "mode": op_mode,
    "freeze": op_freeze,
    "freeze_twice": op_freeze_twice,
    "apply": op_apply,
    "forward": op_forward,
    "load": op_load,
    "load_other_size": op_load_other_size,
    "unstack": op_unstack,
    "select": op_select,
    "member_state_dict": op_member_state_dict,
    "bad": op_bad,
}

FREEZE = ["stacked", "template", "attr", "all", "each"]
BAD = ["index_high", "index_low", "list_high", "empty", "empty_slice", "float_tensor", "bools",
       "mask_short", "mask_none", "apply_setting", "apply_dtype", "member_state_dict",
       "load_missing", "load_extra"]  # fmt: skip


# -- programs ---------------------------------------------------------------------------------


def program(seed: int) -> tuple[dict[str, Any], list[tuple[str, dict[str, Any]]]]:
    r = random.Random(seed)
    model = r.choice(sorted(MODELS))
    spec = dict(seed=seed, model=model, build=r.choice(["seeds", "global", "factories", "modules"]),
                n=r.randint(2, 4))  # fmt: skip
    n = spec["n"]
    probe = MODELS[model]()
    names = [k for k, _ in probe.named_parameters()]
    layers = [k for k, m in probe.named_modules() if k and not list(m.children())]
    calls: list[tuple[str, dict[str, Any]]] = []
    if r.random() < 0.6:
        calls.append(
            ("new_opt", dict(kind=r.choice(sorted(OPTIMIZERS)), over_module=r.random() < 0.5))
        )
    kinds = ["make_step", "manual", "opt_step", "zero_grad", "dtype", "mode", "freeze", "apply",
             "forward", "load", "load_other_size", "unstack", "select", "member_state_dict",
             "bad", "new_opt", "freeze_twice"]  # fmt: skip
    weights = [6, 3, 1, 1, 2, 2, 2, 1, 1, 1, 1, 2, 2, 1, 2, 1, 1]
    for _ in range(r.randint(8, 16)):
        kind = r.choices(kinds, weights)[0]
        if kind == "new_opt":
            kw: dict[str, Any] = dict(
                kind=r.choice(sorted(OPTIMIZERS)), over_module=r.random() < 0.5
            )
        elif kind == "make_step":
            kw = dict(rows=r.choice([3, 5]))
        elif kind == "manual":
            kw = dict(rows=r.choice([3, 5]), set_to_none=r.random() < 0.5)
        elif kind == "zero_grad":
            kw = dict(set_to_none=r.random() < 0.5)
        elif kind == "dtype":
            kw = dict(how=r.choice(["double", "double", "to64", "type64", "float", "to32"]))
        elif kind == "mode":
            kw = dict(how=r.choice(["train", "eval", "template"]), layer=r.choice(layers))
        elif kind == "freeze":
            kw = dict(how=r.choice(FREEZE), name=r.choice(names),
                      flag=r.random() < 0.5)  # fmt: skip
        elif kind == "freeze_twice":
            kw = dict(hows=r.sample(FREEZE, k=2), name=r.choice(names),
                      flags=[r.random() < 0.5, r.random() < 0.5])  # fmt: skip
        elif kind == "apply":
            kw = dict(seed=r.randint(0, 99))
        elif kind == "forward":
            kw = dict(rows=r.choice([3, 5]))
        elif kind == "load":
            kw = dict(seed=r.randint(100, 999), how=r.choice(["full", "partial", "float"]))
        elif kind == "load_other_size":
            kw = dict(delta=r.choice([-1, 1]), strict=r.random() < 0.5, assign=r.random() < 0.3)
        elif kind == "unstack":
            kw = dict(how=r.choice(["unstack", "iter", "int", "neg", "numpy", "tensor"]),
                      i=r.randrange(n))  # fmt: skip
        elif kind == "select":
            how = r.choice(["list", "neg", "tensor", "numpy", "mask", "npmask", "slice", "reverse"])
            rows = r.choices(range(n), k=r.randint(1, n + 1))  # repeats too
            if how in ("mask", "npmask", "slice"):
                rows = r.sample(range(n), k=r.randint(1, n))
            index, picked = _index(how, rows, n)
            keep = r.choice(["new", "select", "none"])
            calls.append(("select", dict(how=how, rows=rows, keep=keep)))
            if keep != "none":
                n = len(picked)
            continue
        elif kind == "member_state_dict":
            kw = dict(i=r.randrange(n))
        else:
            kw = dict(what=r.choice(BAD)) if kind == "bad" else {}
        calls.append((kind, kw))
    return spec, calls


def run(
    spec: dict[str, Any], calls: list[tuple[str, dict[str, Any]]], verbose: bool = False
) -> None:
    w = World(spec["seed"], spec["model"], spec["build"], spec["n"])
    w.compare("after building")
    for k, (name, kw) in enumerate(calls):
        if verbose:
            print(k, name, kw)
        # Whether the optimizer steps (a step with nothing to train is refused).
        w.stepped = name == "opt_step" or name in ("make_step", "manual") and _trainable(w)
        OPS[name](w, **kw)
        w.compare(f"call {k} ({name} {kw})")


SEEDS = range(30)


@pytest.mark.parametrize("seed", SEEDS)
def test_random_container_program_matches_the_list_of_modules(seed: int) -> None:
    spec, calls = program(seed)
    run(spec, calls)


if __name__ == "__main__":
    for s in map(int, sys.argv[1:]):
        spec, calls = program(s)
        print(spec)
        run(spec, calls, verbose=True)


# -- what the programs found, one test each -------------------------------------------------


def _twins() -> tuple[vmapens.Ensemble, list[nn.Module]]:
    ens = vmapens.Ensemble(lambda: MLP().double(), 3, seeds=[0, 1, 2])
    return ens, [copy.deepcopy(m) for m in ens.unstack()]


@pytest.mark.parametrize(
    "edits",
    [
        # The fine-tuning idiom: freeze everything, then unfreeze the head.
        [("all", False), ("fc2", True)],
        [("fc1", False), ("all", True)],
        [("fc1", False), ("each", True)],
        [("stacked:fc1.weight", False), ("fc1", True)],
        [("attr:fc2.bias", False), ("stacked:fc2.bias", True)],
        [("each", False), ("attr:fc1.weight", True)],
    ],
    ids=lambda edits: "-then-".join(f"{w}={f}" for w, f in edits),
)
def test_requires_grad_set_on_the_template_and_the_stacked_side_keeps_the_last_as_alone(
    edits: list[tuple[str, bool]],
) -> None:
    """Flags set on the template and on the stacked parameters with no call of the ensemble
    between them: the last one set counts, as on a plain module (each side once kept the
    first when the second set a flag to the value it already had on its own side)."""
    ens, models = _twins()
    for where, flag in edits:
        _set_flag(ens, models, where, flag)
    opt = vmapens.StackedSGD([p for p in ens.parameters() if p.requires_grad] or ens, lr=0.1)
    opts = [torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=0.1) for m in models]
    step = vmapens.make_step(ens, nn.MSELoss(), opt)
    g = torch.Generator().manual_seed(0)
    for _ in range(2):
        x = torch.randn(4, 3, generator=g, dtype=torch.float64)
        y = torch.randn(4, 2, generator=g, dtype=torch.float64)
        step(x, y)
        for m, o in zip(models, opts, strict=True):
            o.zero_grad()
            nn.functional.mse_loss(m(x), y).backward()
            o.step()
    for i, m in enumerate(models):
        for (name, p), (_, q) in zip(ens[i].named_parameters(), m.named_parameters(), strict=True):
            assert p.requires_grad == q.requires_grad, name
            torch.testing.assert_close(p.detach(), q.detach(), **TOL64)


@pytest.mark.parametrize("made", ["select", "deepcopy"])
def test_freezing_all_then_unfreezing_a_template_layer_trains_it_on_a_new_copy(made: str) -> None:
    """``ens.requires_grad_(False); ens.template.fc2.requires_grad_(True)`` on an ensemble that
    has not run yet (a sub-ensemble, a copy): fc2 trains, the rest stays, as on a plain
    module. ``requires_grad_`` once set the stacked flags only, and the template's flag set to
    the value it still had was not seen: nothing trained."""
    ens, models = _twins()
    ens = ens.select([0, 1, 2]) if made == "select" else copy.deepcopy(ens)
    ens.requires_grad_(False)
    ens.template.fc2.requires_grad_(True)
    for m in models:
        m.requires_grad_(False)
        m.fc2.requires_grad_(True)
    opt = vmapens.StackedSGD(ens, lr=0.1)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in models]
    x = torch.randn(4, 3, dtype=torch.float64)
    y = torch.randn(4, 2, dtype=torch.float64)
    vmapens.make_step(ens, nn.MSELoss(), opt)(x, y)
    for m, o in zip(models, opts, strict=True):
        nn.functional.mse_loss(m(x), y).backward()
        o.step()
    for i, m in enumerate(models):
        for (name, p), (_, q) in zip(ens[i].named_parameters(), m.named_parameters(), strict=True):
            assert p.requires_grad == q.requires_grad, name
            torch.testing.assert_close(p.detach(), q.detach(), **TOL64)


def test_load_state_dict_assign_keeps_the_modules_flags_as_torch_does() -> None:
    """``load_state_dict(sd, assign=True)`` with Parameters (``keep_vars=True``) keeps the
    module's ``requires_grad``, as torch does (``input_param.requires_grad_(param.requires_grad)``
    in ``Module._load_from_state_dict``); the ensemble once took the incoming flag, so a layer
    frozen in the source froze it here, without a word."""
    ens, models = _twins()
    src, src_models = _twins()
    src.stacked_params()["fc1.weight"].requires_grad_(False)
    for m in src_models:
        m.fc1.weight.requires_grad_(False)
    ens.load_state_dict(src.state_dict(keep_vars=True), assign=True)
    for m, s in zip(models, src_models, strict=True):
        m.load_state_dict(s.state_dict(keep_vars=True), assign=True)
    want = {n: p.requires_grad for n, p in models[0].named_parameters()}
    assert {n: p.requires_grad for n, p in ens.named_parameters()} == want
    assert want["fc1.weight"]  # the module's own flag, not the source's


def test_member_state_dict_does_not_change_the_optimizers_state_dict() -> None:
    """Reading one member's optimizer state is a read: ``opt.state`` is a defaultdict, and
    looking a parameter up in it added an empty entry per parameter, so ``opt.state_dict()``
    changed from ``{}`` to ``{0: {}, 1: {}, ...}`` (torch's own optimizer never lists those)."""
    ens, _ = _twins()
    opt = vmapens.StackedAdam(ens, lr=0.1)
    before = opt.state_dict()
    opt.member_state_dict(1)
    assert opt.state_dict() == before
    opt.select([0, 2], ens.select([0, 2]))
    assert opt.state_dict() == before


def _trains_as_alone(ens: vmapens.Ensemble, models: list[nn.Module]) -> None:
    """Two SGD steps on the trainable parameters, each member against its plain module: the
    flags and the values after them are the plain modules'."""
    opt = vmapens.StackedSGD([p for p in ens.parameters() if p.requires_grad] or ens, lr=0.1)
    opts = [torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=0.1) for m in models]
    step = vmapens.make_step(ens, nn.MSELoss(), opt)
    g = torch.Generator().manual_seed(0)
    for _ in range(2):
        x = torch.randn(4, 3, generator=g, dtype=torch.float64)
        y = torch.randn(4, 2, generator=g, dtype=torch.float64)
        step(x, y)
        for m, o in zip(models, opts, strict=True):
            o.zero_grad()
            nn.functional.mse_loss(m(x), y).backward()
            o.step()
    for i, m in enumerate(models):
        for (name, p), (_, q) in zip(ens[i].named_parameters(), m.named_parameters(), strict=True):
            assert p.requires_grad == q.requires_grad, name
            torch.testing.assert_close(p.detach(), q.detach(), **TOL64)


def _copied(ens: vmapens.Ensemble, how: str) -> vmapens.Ensemble:
    if how == "select":
        return ens.select([0, 1, 2])
    if how == "getitem":
        return ens[torch.tensor([0, 1, 2])]
    if how == "deepcopy":
        return copy.deepcopy(ens)
    if how == "assign":
        ens.load_state_dict(copy.deepcopy(ens.state_dict()), assign=True)
        return ens
    import io  # here only: this section is appended to the file

    buffer = io.BytesIO()
    torch.save(ens, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


@pytest.mark.parametrize("how", ["select", "getitem", "deepcopy", "assign", "torch.load"])
@pytest.mark.parametrize(
    "edits",
    [[("fc1", False), ("each", True)], [("stacked:fc2.bias", False), ("attr:fc2.bias", True)]],
    ids=lambda edits: "-then-".join(f"{w}={f}" for w, f in edits),
)
def test_flags_set_on_both_sides_of_a_copy_not_called_yet_keep_the_last_as_alone(
    how: str, edits: list[tuple[str, bool]]
) -> None:
    """A copy (sub-ensemble, deepcopy, ``assign=True`` load, ``torch.load``) before its first
    call: a flag set on one side, then the other side set to the value it already had, keeps
    the last, as on a plain module. The copy's template parameters were linked to their
    stacked twins at its first call only, so the first flag set won."""
    ens, models = _twins()
    ens = _copied(ens, how)
    for where, flag in edits:
        _set_flag(ens, models, where, flag)
    _trains_as_alone(ens, models)


def test_flags_reach_the_other_side_after_a_conversion_that_makes_new_parameters() -> None:
    """With ``set_overwrite_module_params_on_conversion(True)``, ``.float()``/``.double()`` put new
    Parameter objects in the ensemble, as in every plain module: a flag set afterwards on the
    template reaches the stacked parameter, and one set on the stacked parameter reaches
    ``ens[i]``. The links once kept the old Parameters, so neither did."""
    ens, models = _twins()
    torch.__future__.set_overwrite_module_params_on_conversion(True)
    try:
        before = ens.stacked_params()["fc1.weight"]
        ens.float().double()
        models = [m.float().double() for m in models]
    finally:
        torch.__future__.set_overwrite_module_params_on_conversion(False)
    assert ens.stacked_params()["fc1.weight"] is not before  # what the setting does
    for where in ["fc1", "stacked:fc2.bias"]:
        _set_flag(ens, models, where, False)
    assert [m.fc2.bias.requires_grad for m in ens] == [False] * 3
    _trains_as_alone(ens, models)


@pytest.mark.parametrize(
    "cls, name, kind",
    [
        (MLP, "fc1.weight", "parameter"),
        (Tied, "b.weight", "parameter"),
        (BN, "bn.running_var", "buffer"),
        (BN, "bn.num_batches_tracked", "buffer"),
    ],  # fmt: skip
)
def test_get_parameter_and_get_buffer_take_the_members_dotted_names(
    cls: type[nn.Module], name: str, kind: str
) -> None:
    """``ens.get_parameter(name)``/``ens.get_buffer(name)`` give the stacked tensor, member ``i``
    at row ``i``, the object ``named_parameters``/``named_buffers`` hold (tied aliases too); a
    name the members lack raises AttributeError, as on a plain module. Both once raised for
    every dotted name: the ensemble holds no submodules."""
    ens = vmapens.Ensemble(lambda: cls().double(), 3, seeds=[0, 1, 2])
    models = ens.unstack()
    got = getattr(ens, f"get_{kind}")(name)
    truth = torch.stack([getattr(m, f"get_{kind}")(name).detach() for m in models])
    torch.testing.assert_close(got.detach(), truth, rtol=0, atol=0)
    held = dict(getattr(ens, f"named_{kind}s")(remove_duplicate=False))
    assert any(got is t for t in held.values())
    for module in [models[0], ens]:
        with pytest.raises(AttributeError):
            getattr(module, f"get_{kind}")("fc1.nothing")


@pytest.mark.parametrize("strict, assign", [(True, False), (False, True)])
def test_a_state_dict_of_another_ensemble_size_is_refused_with_the_member_counts(
    strict: bool, assign: bool
) -> None:
    """The refusal says that the sizes are the members' counts and how to load some of them
    (torch's per-key "size mismatch" text never did), and nothing changes; a mismatch in a
    member's own shape gets no such hint."""
    ens, _ = _twins()
    before = {k: v.clone() for k, v in ens.state_dict().items()}
    other = vmapens.Ensemble(lambda: MLP().double(), 5, seeds=list(range(5)))
    with pytest.raises(RuntimeError, match=r"holds 5 members per tensor, this ensemble 3: select"):
        ens.load_state_dict(other.state_dict(), strict=strict, assign=assign)
    for k, v in ens.state_dict().items():
        torch.testing.assert_close(v, before[k], rtol=0, atol=0)
    wide = {k: torch.cat([v, v], dim=-1) for k, v in ens.state_dict().items()}
    with pytest.raises(RuntimeError, match="size mismatch") as refused:
        ens.load_state_dict(wide, strict=strict, assign=assign)
    assert "members per tensor" not in str(refused.value)
