"""The self-check's comparisons: what differs between member 0 alone and inside the ensemble,
and state a forward carries from one call to the next in plain attributes.

A member's parameters and buffers are stacked per member; anything else on its modules (a
Python counter, a flag set on the first call, a tensor kept for the next call) lives once, on
the runner all members share. Run in turns (``backend="loop"``, ``chunk_size`` below ``n``),
member ``i`` would read what member ``i - 1`` left there, where alone it reads its own.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import optree
import torch
from torch import Tensor, nn

from ._attributes import INTERNAL
from ._checks import tolerance

__all__ = [
    "Attributes",
    "carried",
    "differences",
    "fingerprints",
    "in_turns",
    "own_attributes",
    "plain_attributes",
    "refuse_carried",
    "set_attributes",
]

_HALF = (torch.float16, torch.bfloat16)

#: A module's plain attributes, by (submodule path, attribute name).
Attributes = dict[tuple[str, str], Any]


def own_attributes(module: nn.Module) -> dict[str, Any]:
    """The attributes of ``module`` itself (not its submodules') that are not torch's own
    bookkeeping, a parameter, a buffer or a submodule, by name: a new dict."""
    # INTERNAL: nn.Module's own entries, RNNs' views of their weights.
    return {key: value for key, value in vars(module).items() if key not in INTERNAL}


def plain_attributes(module: nn.Module) -> Attributes:
    """``own_attributes`` of ``module`` and of each of its submodules, at every path."""
    return {
        (path, key): value
        for path, sub in module.named_modules(remove_duplicate=False)
        for key, value in own_attributes(sub).items()
    }


def fingerprints(attributes: Attributes) -> dict[tuple[str, str], tuple]:
    """What ``carried`` compares: each value, a tensor's version (edited in place) and a
    list's, tuple's, set's or dict's items (appended to, set), compared by identity. The
    objects themselves are kept, so that a replaced one cannot lend its id to the new one."""
    return {k: _fingerprint(v) for k, v in attributes.items()}


def _fingerprint(value: Any) -> tuple:
    if isinstance(value, Tensor):
        return value, None if value.is_inference() else value._version
    if isinstance(value, dict):
        return value, *(x for item in value.items() for x in item)
    if isinstance(value, list | tuple | set):
        return value, *value
    return (value,)


def _same(a: tuple, b: tuple) -> bool:
    return len(a) == len(b) and all(x is y or (type(x) is int and x == y) for x, y in zip(a, b))


def carried(before: dict[tuple[str, str], tuple], after: Attributes) -> Attributes:
    """The attributes a forward set or edited (a counter, a flag, a kept tensor, a list it
    appends to), with their values after it (``before``: ``fingerprints`` before it)."""
    return {
        k: v for k, v in after.items() if k not in before or not _same(before[k], _fingerprint(v))
    }


def set_attributes(module: nn.Module, attributes: Attributes) -> None:
    """Set ``attributes`` (as ``carried`` gives them) on ``module``'s submodules."""
    for (path, key), value in attributes.items():
        object.__setattr__(module.get_submodule(path), key, value)


def in_turns(backend: str, chunk_size: int | None, n: int) -> str | None:
    """How the members run in turns on one runner (for a message), or None for one run."""
    if backend == "loop":
        return "backend='loop'" if n > 1 else None
    return f"chunk_size={chunk_size}" if (chunk_size or n) < n else None


def refuse_carried(api: str, name: str, how: str, attributes: Attributes, why: str) -> None:
    """Raise: the forward reads state it left in plain attributes, and members run in turns.

    Raises:
        RuntimeError: always, naming the attributes, ``how`` the members run and the way out.
    """
    shown = ", ".join(
        f"`{_dotted(path, key)}` ({_shown(v)})" for (path, key), v in attributes.items()
    )
    raise RuntimeError(
        f"{api}: the forward of {name} sets or edits {shown} on its module, which is no "
        f"parameter or buffer, and a second call reads it ({why}). With {how} the members run "
        "in turns on one module, so each member would read what a member before it left there "
        "(a plain value such as a number or a flag: at the next call), where alone it reads "
        "its own. Keep that state in a buffer (self.register_buffer(...): one row per member), "
        "or build the ensemble with backend='vmap' and no chunk_size (one run for all members "
        "sets it once per call, as alone). Nothing was changed"
    )


def _dotted(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _shown(value: Any) -> str:
    if isinstance(value, Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    if isinstance(value, bool | int | float | str) or value is None:
        text = repr(value)
        return text if len(text) <= 40 else f"a {type(value).__name__}"
    return f"a {type(value).__name__}"  # its items: after the probe's two runs, not one


def differences(
    alone: dict[str, Any], together: dict[str, Any], low: torch.dtype | None
) -> Iterator[str]:
    """What differs, in words, beyond ``tolerance``."""
    outs_a, spec_a = optree.tree_flatten(alone["out"])
    outs_t, spec_t = optree.tree_flatten(together["out"])
    if spec_a != spec_t:
        yield f"the output is {spec_t} inside the ensemble and {spec_a} alone"
    else:
        for i, (a, t) in enumerate(zip(outs_a, outs_t, strict=True)):
            yield from _close(f"output {i}" if len(outs_a) > 1 else "the output", a, t, low)
    # A loss is summed from terms the size of the outputs: at its minimum (a consistency or
    # KL term between equal outputs) its value is round-off of those terms, not of itself.
    terms = [o for o in outs_a if isinstance(o, Tensor) and o.is_floating_point() and o.numel()]
    loss_floor = max(map(_finite_max, terms), default=0.0)
    yield from _close("the loss", alone["loss"], together["loss"], low, loss_floor)
    layers: dict[str, float] = {}  # each layer's largest float tensor, a floor for its own:
    for key, a in alone["state"].items():  # a running mean of normalised inputs is round-off
        if a.is_floating_point() and a.numel():
            layer, at = key.rpartition(".")[0], _finite_max(a)
            layers[layer] = max(layers.get(layer, 0.0), at)
    for key, a in alone["state"].items():
        floor = layers.get(key.rpartition(".")[0], 0.0)
        if key not in together["state"]:  # a buffer registered as None, set by the forward
            yield (
                f"`{key}` is a buffer the forward sets alone and no member holds inside the "
                "ensemble (registered as None: nothing to stack); register it with a tensor of "
                "its final shape, or keep it as a plain attribute"
            )
            continue
        yield from _close(f"`{key}` after the forward", a, together["state"][key], low, floor)
    grads = [g for g in alone["grads"].values() if g is not None]
    scale = max((_finite_max(g) for g in grads if g.numel()), default=0.0)
    if _at_round_off(alone["loss"], loss_floor):  # every gradient is round-off too: a floor of
        weights = [alone["state"].get(k) for k in alone["grads"]]  # 256 ulps of the weights
        scale = max([scale, *(_ulps(w) for w in weights if w is not None and w.numel())])
    for key, a in alone["grads"].items():
        t = together["grads"].get(key)
        if (a is None) != (t is None):
            yield (
                f"`{key}` gets {'no' if t is None else 'a'} gradient inside the ensemble and "
                f"{'no' if a is None else 'a'} gradient alone"
            )
        elif a is not None and t is not None:
            # Relative to the member's largest gradient: a gradient that is 0 in exact
            # arithmetic (a bias before BatchNorm) is round-off of the terms around it.
            yield from _close(f"the gradient of `{key}`", a, t, low, floor=scale)


def _at_round_off(loss: Any, terms: float) -> bool:
    """Whether a floating loss is 0 up to the round-off of terms of size ``terms`` (a loss at
    its minimum): only there are its gradients round-off, and compared against the weights."""
    if not (isinstance(loss, Tensor) and loss.is_floating_point() and loss.numel() == 1):
        return False
    return abs(float(loss)) <= tolerance(loss.dtype) * terms


def _ulps(weight: Tensor) -> float:
    """A gradient scale whose ``tolerance`` is 256 ulps of ``weight``'s largest value."""
    if not weight.is_floating_point():
        return 0.0
    return 256 * torch.finfo(weight.dtype).eps * _finite_max(weight) / tolerance(weight.dtype)


def _finite_max(t: Tensor) -> float:
    """The largest finite magnitude in ``t`` (0 if none): a scale that one inf or NaN of a
    diverged member does not turn into "anything goes"."""
    return float(t.detach().abs().nan_to_num(0.0, 0.0, 0.0).max())


def _close(
    what: str, alone: Any, together: Any, low: torch.dtype | None, floor: float = 0.0
) -> Iterator[str]:
    if not (isinstance(alone, Tensor) and isinstance(together, Tensor)):
        if alone != together:
            yield f"{what} is {together!r} inside the ensemble and {alone!r} alone"
        return
    if alone.shape != together.shape or alone.dtype != together.dtype:
        yield (
            f"{what} is {together.dtype} {tuple(together.shape)} inside the ensemble and "
            f"{alone.dtype} {tuple(alone.shape)} alone"
        )
        return
    a, t = alone.detach(), together.detach().to(alone.device)
    if not a.is_floating_point() and not a.is_complex():
        if not torch.equal(a, t):
            yield f"{what} differs (exact values expected for {a.dtype})"
        return
    if not torch.equal(a.isnan(), t.isnan()):
        yield f"{what} is NaN in other places"
        return
    if not a.is_complex():
        # +inf against -inf is never round-off; inf against a number is, only where a half
        # precision rounds at its largest value (a loss scaler's overflow): then both read 0
        a_inf, t_inf = a.isinf(), t.isinf()
        if bool((a_inf & t_inf & ((a > 0) != (t > 0))).any()):
            yield f"{what} is +inf where the other is -inf"
            return
        if not torch.equal(a_inf, t_inf):
            if low is None and a.dtype not in _HALF:
                yield f"{what} is infinite in other places"
                return
            a, t = a.masked_fill(t_inf, 0.0), t.masked_fill(a_inf, 0.0)
    a, t = a.nan_to_num(0.0, 0.0, 0.0), t.nan_to_num(0.0, 0.0, 0.0)
    dtypes = [a.dtype] if low is None else [a.dtype, low]
    tol = max(tolerance(d) for d in dtypes)
    scale = max(float(a.abs().max()) if a.numel() else 0.0, floor)
    diff = float((a - t).abs().max()) if a.numel() else 0.0
    if diff > tol * scale:
        yield f"{what} differs by {diff:.3g} (tolerance {tol:.2g} x scale {scale:.3g})"
