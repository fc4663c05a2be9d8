"""What a user or a forward does to the values ``vmapens._kept`` stacks on the template, checked.

An item of a kept dict or list set in place on ``ens.template`` (a reset between sequences,
``ens.template.st["h"] = torch.zeros_like(ens.template.st["h"])``) is each member's rows when
it keeps the shape, or views the old value a row per member (``rows_again``), and refused
otherwise (``refuse_items_set``): the module the members run holds its own container. A
forward that keeps a member's trained parameter for its next call is refused
(``refuse_held_parameters``): the ensemble would hand back a snapshot without its gradient.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn
from torch._C._functorch import get_unwrapped, is_functorch_wrapped_tensor

from ._boxes import KEPT_MARK, cleared, form, is_kept, place, rows_at, tensor_leaves

__all__ = ["note_box", "refuse_held_parameters", "refuse_items_set", "rows_again", "submodule"]

#: The dicts and lists ``set_kept_`` put on each template, with where their tensors' rows lie
#: (``place``): ``rows_again`` tells an item set in place with each member's rows.
_BOXES: weakref.WeakKeyDictionary[nn.Module, dict[tuple[str, str], tuple[Any, Any, list]]] = (
    weakref.WeakKeyDictionary()
)


def note_box(template: nn.Module, path: str, key: str, value: Any) -> None:
    """Note ``value``, a dict or list ``set_kept_`` just set on the template's module ``path``
    as ``key``, with its tensors' places."""
    places = [place(t) for t in tensor_leaves(value) or ()]
    _BOXES.setdefault(template, {})[path, key] = (value, form(value), places)


def rows_again(template: nn.Module, path: str, key: str, value: Any) -> bool:
    """Whether ``value``, a dict or list ``set_kept_`` put there, had an item set in place on
    the template with each member's rows (``ens.template.st["h"] = torch.zeros_like(...)``, a
    reset, or ``st["h"][:, :b]``, a last batch of ``b``), and mark it kept: it was taken for
    one value every member shares (each read neither the reset nor its own rows, silently)."""
    box, shape, leaves = _BOXES.get(template, {}).get((path, key), (None, None, []))
    now = tensor_leaves(value) if box is value else None
    if now is None or form(value) != shape or len(now) != len(leaves):
        return False
    if not all(map(rows_at, now, leaves)):  # of the shape, or a view a row per member
        return False
    for t in now:
        setattr(t, KEPT_MARK, True)
    return True


def refuse_items_set(template: nn.Module) -> None:
    """Refuse a dict or list ``set_kept_`` put on the template given an item in place that is
    not each member's rows (``ens.template.st["h"] = torch.zeros(b, d)``, one member's shape;
    a key added or deleted): the module the members run holds its own container, so they
    would not read it (each went on from its own rows, silently)."""
    for (path, key), (box, _, _) in _BOXES.get(template, {}).items():
        value = vars(module).get(key) if (module := submodule(template, path)) else None
        if value is not box or is_kept(value) or cleared(value):
            continue
        if not rows_again(template, path, key, value):
            where = f"ens.template.{path + '.' if path else ''}{key}"
            raise ValueError(
                f"Ensemble: an item of `{where}`, which holds what the forward kept (one row "
                "per member), was set in place to a value that is not a row per member (of "
                "the shape it had, or a view of it): the members would not read it. Set a new "
                f"container there (`{where} = {{...}}`, read by every member as it is) or give "
                "each member its rows ([n, ...] values)"
            )


def submodule(template: nn.Module, path: str) -> nn.Module | None:
    """``template.get_submodule(path)``, or None where it was deleted since."""
    try:
        return template.get_submodule(path)
    except AttributeError:  # a submodule deleted since
        return None


def _root(t: torch.Tensor) -> torch.Tensor:
    """The plain tensor under ``t``'s functorch wrappers, or the one it views."""
    while is_functorch_wrapped_tensor(t):
        t = get_unwrapped(t)
    return t if t._base is None else t._base  # every view of a view has the first's _base


def refuse_held_parameters(kept: dict[str, Any], state: dict[str, torch.Tensor]) -> None:
    """Refuse a kept value that holds one of the member's trained parameters (or a view of
    one), ``self.cache["w"] = self.lin.weight``: alone the container goes on reading the
    parameter as the optimizer changes it, and the loss's gradient flows into it; the
    ensemble hands back this call's values, without their graph. Under ``no_grad`` those are
    the same values, and it runs."""
    trained = {id(r): name for name, t in state.items() if (r := _root(t)).requires_grad}
    for slot, value in kept.items():
        for t in tensor_leaves(value) or ():
            if (name := trained.get(id(_root(t)))) is not None:
                path, _, key = slot.rpartition(":")
                raise ValueError(
                    f"Ensemble: the forward keeps the member's parameter `{name}` (or a view "
                    f"of it) in `{key}` on {path or 'the module'}: alone that value goes on "
                    "reading the parameter as the optimizer changes it, and the loss's "
                    "gradient flows into it; inside the ensemble the next call would read "
                    "this call's values, without their gradient. Read the parameter in the "
                    f"forward where it is used (`self.get_parameter('{name}')`)"
                )
