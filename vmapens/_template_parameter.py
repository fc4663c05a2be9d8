"""The template's parameters (``ens.template``): on meta, linked to their stacked twins.

The template holds no values; what a user does to its parameters must reach the members or
be refused. ``requires_grad`` set on one is set on its stacked parameter too. A write through
``.data`` (``ens.template.logit_scale.data.clamp_(0, 4.6)``, CLIP's clamp, or a WGAN's weight
clipping over ``ens.template.parameters()``) changed nothing, silently: torch's ``.data``
aliases a tensor without sharing its version counter, so ``Watched`` (which refuses in-place
writes to the template by ``_version``) did not see it. Here ``.data`` is ``detach()``, which
shares it: the next call refuses the write, naming the ways to change the members. New
``.data`` assigned (``w.data = F.normalize(w.data, dim=1)``) bumps the version counter too.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["TemplateParameter"]


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

    @property  # type: ignore[override]
    def data(self) -> torch.Tensor:
        return self.detach()  # shares `_version`: a write through it is seen (module docstring)

    @data.setter
    def data(self, value: torch.Tensor) -> None:
        if isinstance(value, torch.Tensor) and not value.is_meta:
            # torch's set_data refuses it too, in words that name neither (vector_to_parameters
            # over ens.template.parameters(), an evolution-strategy step).
            raise ValueError(
                f"ens.template: its parameters are on meta and hold no values, so new data on "
                f"{value.device} would reach no member (`p.data = t`, vector_to_parameters); "
                "write the members' storage instead: ens.parameters() or "
                "ens.stacked_params()[name] (`[n, ...]`, under torch.no_grad()), or ens.apply(fn)"
            )
        torch._C.TensorBase.data.__set__(self, value)  # type: ignore[attr-defined]
        # New data (the TransE recipe's `w.data = F.normalize(w.data, ...)`) keeps `_version`:
        # bump it so that the next call refuses it as it refuses a write through `.data`.
        torch.autograd.graph.increment_version(self)

    def __reduce_ex__(self, proto: Any) -> Any:  # torch.save(ens): one of these, not yet linked
        return TemplateParameter, (self.data, self.requires_grad)
