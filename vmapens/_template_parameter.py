"""The template's parameters and buffers (``ens.template``): on meta, linked to their twins.

The template holds no values; what a user does to its parameters and buffers must reach the
members or be refused. ``requires_grad`` set on a parameter is set on its stacked parameter
too. A write through ``.data`` (``ens.template.logit_scale.data.clamp_(0, 4.6)``, CLIP's
clamp, or a WGAN's weight clipping over ``ens.template.parameters()``) changed nothing,
silently: torch's ``.data`` aliases a tensor without sharing its version counter, so
``Watched`` (which refuses in-place writes to the template by ``_version``) did not see it.
Here ``.data`` is ``detach()``, which shares it: the next call refuses the write, naming the
ways to change the members. New ``.data`` assigned (``w.data = F.normalize(w.data, dim=1)``)
bumps the version counter too. A buffer's ``.data`` (``bn.running_var.data.fill_(1)``)
likewise, since session 34. A parameter's ``.grad``, read while its stacked twin holds one, is
refused (``TemplateParameter.grad``).
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch import nn

__all__ = ["TemplateBuffer", "TemplateParameter"]


def _data(self: torch.Tensor) -> torch.Tensor:
    return self.detach()  # shares `_version`: a write through it is seen (module docstring)


def _set_data(self: torch.Tensor, value: torch.Tensor) -> None:
    if isinstance(value, torch.Tensor) and not value.is_meta:
        # torch's set_data refuses it too, in words that name neither (vector_to_parameters
        # over ens.template.parameters(), an evolution-strategy step).
        raise ValueError(
            f"ens.template: its tensors are on meta and hold no values, so new data on "
            f"{value.device} would reach no member (`p.data = t`, vector_to_parameters); "
            "write the members' storage instead: ens.parameters() or "
            "ens.stacked_params()[name] (`[n, ...]`, under torch.no_grad()), or ens.apply(fn)"
        )
    torch._C.TensorBase.data.__set__(self, value)  # type: ignore[attr-defined]
    # New data (the TransE recipe's `w.data = F.normalize(w.data, ...)`) keeps `_version`:
    # bump it so that the next call refuses it as it refuses a write through `.data`.
    torch.autograd.graph.increment_version(self)


#: What ``TemplateParameter.grad`` lets ``.half()`` and ``to_empty`` read (refused later).
_APPLY = nn.Module._apply.__code__

#: A template tensor's ``.data`` (module docstring).
_SHARED_DATA = property(_data, _set_data)


class TemplateParameter(nn.Parameter):
    """A parameter of the meta template (``ens.template``) whose ``requires_grad``, when set,
    is set on its stacked parameter too (``follow_flags`` links the two), so that flags set on
    either side count in the order they were set, as on a plain module; its ``.data`` shares
    its version counter (module docstring)."""

    def requires_grad_(self, requires_grad: bool = True) -> TemplateParameter:
        super().requires_grad_(requires_grad)
        twin = self.__dict__.get("_twin")
        if twin is not None:
            p, synced, k = twin
            if p.requires_grad != requires_grad:
                p.requires_grad_(requires_grad)
            synced[k] = requires_grad
        return self

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "requires_grad":  # ``p.requires_grad = False`` sets the stacked one too
            self.requires_grad_(value)
        else:
            super().__setattr__(name, value)

    data = _SHARED_DATA  # type: ignore[assignment]

    @property  # type: ignore[override]
    def grad(self) -> torch.Tensor | None:
        """None, as a meta tensor's; refused while the stacked twin holds a gradient: a
        torch optimizer over ``ens.template.parameters()`` stepped nothing and
        ``ens.template.zero_grad()`` cleared nothing (the members' gradients added up),
        silently. ``nn.Module._apply`` (``.half()``) reads it too: refused at the next call."""
        grad = torch._C.TensorBase.grad.__get__(self)  # type: ignore[union-attr]
        twin = self.__dict__.get("_twin")
        held = grad is None and twin is not None and twin[0].grad is not None
        if held and sys._getframe(1).f_code is not _APPLY:
            raise RuntimeError(
                "ens.template: its parameters are on meta and never get a gradient; the "
                "members' gradients are on ens.parameters() (`[n, ...]`). Pass those (or the "
                "ensemble) to the optimizer, zero_grad and clipping: "
                "torch.optim.Adam(ens.parameters()), ens.zero_grad(), "
                "vmapens.optim.clip_grad_norm_(ens, ...)"
            )
        return grad

    @grad.setter
    def grad(self, value: torch.Tensor | None) -> None:
        torch._C.TensorBase.grad.__set__(self, value)  # type: ignore[union-attr]

    def __reduce_ex__(self, proto: Any) -> Any:  # torch.save(ens): one of these, not yet linked
        return TemplateParameter, (self.data, self.requires_grad)


class TemplateBuffer(torch.Tensor):
    """A buffer of the meta template whose ``.data`` shares its version counter, as a
    ``TemplateParameter``'s does: a write through it (``bn.running_var.data.fill_(1)``) or new
    data assigned is refused at the next call, where it changed nothing, silently."""

    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]
    data = _SHARED_DATA  # type: ignore[assignment]

    @staticmethod
    def of(meta: torch.Tensor) -> TemplateBuffer:
        """``meta`` (a plain tensor on meta) as a template buffer."""
        return torch.Tensor._make_subclass(TemplateBuffer, meta, False)

    def __deepcopy__(self, memo: dict[int, Any]) -> TemplateBuffer:
        memo[id(self)] = copied = TemplateBuffer.of(torch.empty_like(self))
        return copied

    def __reduce_ex__(self, proto: Any) -> Any:  # torch.save(ens)
        return TemplateBuffer.of, (self.data,)
