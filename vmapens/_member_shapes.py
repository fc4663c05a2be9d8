"""Members of several sizes (``Ensemble.from_factories``) in a checkpoint: each member's own
shapes, as an ensemble holds them and as a file records them, and a file's ensemble (and
optimizer) tensors padded as the ensemble pads them."""

from __future__ import annotations

from typing import Any

from ._padding import corner, gates_of
from .ensemble import Ensemble

__all__ = ["held_shapes", "own_shapes", "relaid"]


def own_shapes(ens: Ensemble) -> list[dict[str, tuple[int, ...]]]:
    """Every member's own shape of every stored tensor, by stacked name."""
    padding, state, names = ens._padding, ens.stacked_state(), set(ens._state_keys.values())
    if padding is None:
        return [{name: tuple(state[name].shape[1:]) for name in names}] * len(ens)
    return [{name: padding.shape(name, row) for name in names} for row in range(len(ens))]


def held_shapes(held: Any, state: Any, ens: Ensemble) -> list[dict[str, tuple]] | None:
    """:func:`own_shapes` of a file's members (None: it does not say). A file of one size
    records no ``sizes``: its tensors have its members' shapes."""
    try:
        sizes, names = held.get("sizes"), ens._state_keys
        if sizes is None:
            return [{name: tuple(state[k].shape[1:]) for k, name in names.items()}] * len(ens)
        kinds = [{name: tuple(kind[name]) for name in names.values()} for kind in sizes["shapes"]]
        return [kinds[kind] for kind in sizes["kind_of"]]
    except (AttributeError, KeyError, IndexError, TypeError):
        return None


def relaid(payload: dict[str, Any], ens: Ensemble, optimizer: Any = None) -> dict[str, Any]:
    """``payload`` with its ensemble (and optimizer) tensors padded as ``ens`` pads them.

    A sub-ensemble (``select``, ``selection.best_k``) keeps the storage of the ensemble it
    came from, padded to that one's largest member, where ``from_factories`` of the same
    members pads to the largest of them: each member's own corner moves over, the rest is
    zero, and so does optimizer state shaped like its parameter (a padded ensemble's optimizer
    is elementwise). Unchanged unless the members' shapes match
    (:func:`~vmapens.checkpoint.check_members`).
    """
    state, rows = payload.get("ensemble"), own_shapes(ens)
    if not isinstance(state, dict) or held_shapes(payload.get("members"), state, ens) != rows:
        return payload
    names, ours, gates = ens._state_keys, ens.stacked_state(), gates_of(ens.template)
    full = {names[k]: v.shape for k, v in state.items() if k in names and hasattr(v, "shape")}

    def move(held: Any, name: str) -> Any:  # if shaped like the file's tensor `name`
        if getattr(held, "shape", 0) != full.get(name) or held.shape == ours[name].shape:
            return held
        shape = ours[name].shape
        big = any(a > b for own in rows for a, b in zip(own[name], held.shape[1:], strict=True))
        if held.dim() != len(shape) or held.shape[0] != shape[0] or big:
            return held  # not what vmapens writes: check_ensemble_state names it
        out, count = held.new_zeros(shape), gates.get(name, 1)
        for row, own in enumerate(rows):
            corner(out[row], own[name], count).copy_(corner(held[row], own[name], count))
        return out

    out = {**payload, "ensemble": {k: move(v, names.get(k, "")) for k, v in state.items()}}
    saved = payload.get("optimizer")
    if optimizer is not None and isinstance(saved, dict) and isinstance(saved.get("state"), dict):
        of = {id(p): name for name, p in ens.stacked_params().items()}
        at = dict(enumerate(of.get(id(p), "") for g in optimizer.param_groups for p in g["params"]))
        entries = saved["state"].items()
        moved = {
            k: {s: move(v, at.get(k, "")) for s, v in e.items()} if isinstance(e, dict) else e
            for k, e in entries
        }
        out["optimizer"] = {**saved, "state": moved}
    return out
