"""``export``'s parity probe: the exported program against the member run alone.

Member ``vmapens.selfcheck.MEMBER`` (the first of every size) runs in the program and alone as a
plain module on ``example_inputs``, twice in a row (state a forward carries in a plain attribute
is a constant in the program, seen on the second call), compared as ``vmapens.check`` compares,
with the same tolerance. The program's buffers are given back afterwards.
"""

from __future__ import annotations

from typing import Any

import optree
import torch
from torch import Tensor
from torch.export import ExportedProgram

from ._attention import batched_attention
from ._checks import tolerance
from .ensemble import Ensemble
from .selfcheck import probed

__all__ = ["input_copies", "probe"]


def probe(api: str, ens: Ensemble, program: ExportedProgram, args: tuple[Tensor, ...]) -> None:
    """Member 0 (the first of every size) in the program against that member run alone, as
    ``vmapens.check``. The program's buffers are given back afterwards: a forward that updates
    a buffer in eval mode (a call counter, a running average of its inputs) would otherwise
    leave the served program calls ahead of the member alone."""
    signature = program.graph_signature
    held = {**program.constants, **program.state_dict}
    buffers = [held[name] for name in signature.buffers if isinstance(held.get(name), Tensor)]
    saved = [b.clone() for b in buffers]
    try:
        for member in probed(ens):
            _probe_member(api, ens, member, program, args)
    finally:
        with torch.no_grad():
            for b, s in zip(buffers, saved, strict=True):
                b.copy_(s)


def _probe_member(
    api: str, ens: Ensemble, member: int, program: ExportedProgram, args: tuple[Tensor, ...]
) -> None:
    name, alone_module = type(ens.template).__name__, ens[member]
    # The eval-mode fast path of nn.TransformerEncoder writes zeros at padded positions, which
    # the program (traced with it off, as every call of the ensemble) computes: the member
    # alone is run the ensemble's way too. Twice: state carried to the next call in a plain
    # attribute (a list appended to) is a constant in the program, seen on the second call.
    served, found = program.module(), []
    for call in ("", " on a second call"):
        with torch.no_grad(), batched_attention():
            alone = alone_module(*input_copies(args))
        with torch.no_grad():
            inside = served(*input_copies(args))
        alone_leaves, alone_spec = optree.tree_flatten(alone)
        inside_leaves, inside_spec = optree.tree_flatten(inside)
        if alone_spec != inside_spec:
            found.append(f"the output is {inside_spec} in the program and {alone_spec} alone")
        else:
            for i, (a, t) in enumerate(zip(alone_leaves, inside_leaves, strict=True)):
                what = (f"output {i}" if len(alone_leaves) > 1 else "the output") + call
                found.extend(_differs(what, a, t[member]))
        if found:
            break
    if not found:
        return
    # A padded member runs at the largest size with either backend: loop is no way out there.
    way_out = (
        "keep what the forward carries from one call to the next in a buffer (one row per "
        "member), which the program updates; a plain attribute is a constant in it"
        if "on a second call" in found[0]
        else "build the ensemble with backend='loop' to export the members one after another, "
        "each as it runs alone"
        if ens._padding is None
        else "members of different sizes run padded with either backend, so export the "
        "members of each size apart (vmapens.export(vmapens.Ensemble.from_modules([ens[i] "
        "for i in rows]), example_inputs), rows of one size)"
    )
    raise RuntimeError(
        f"{api}: member {member} of {name} computes something else in the exported "
        f"program than alone on `example_inputs`: {'; '.join(found[:4])}. Its forward "
        f"probably depends on something vmap changes (vmapens.check says what); {way_out}"
    )


def input_copies(args: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
    """Copies of the inputs: a forward's in-place edit (``x.mul_(2)``) stays in one run."""
    return tuple(a.clone() for a in args)


def _differs(what: str, alone: Any, inside: Any) -> list[str]:
    if not (isinstance(alone, Tensor) and isinstance(inside, Tensor)):
        return [] if alone == inside else [f"{what} is {inside!r} and {alone!r} alone"]
    if alone.shape != inside.shape or alone.dtype != inside.dtype:
        return [
            f"{what} is {inside.dtype} {tuple(inside.shape)} in the program and "
            f"{alone.dtype} {tuple(alone.shape)} alone"
        ]
    if not alone.is_floating_point():
        return [] if torch.equal(alone, inside) else [f"{what} differs ({alone.dtype})"]
    if not torch.equal(alone.isnan(), inside.isnan()):
        return [f"{what} is NaN in other places"]
    a, t = alone.nan_to_num(0.0, 0.0, 0.0), inside.nan_to_num(0.0, 0.0, 0.0)
    scale = float(a.abs().max()) if a.numel() else 0.0
    gap = float((a - t).abs().max()) if a.numel() else 0.0
    tol = tolerance(a.dtype)
    if gap <= tol * scale:
        return []
    return [f"{what} differs by {gap:.3g} (tolerance {tol:.2g} x scale {scale:.3g})"]
