"""Weight normalisation, new and old style, in ops that ``torch.func.vmap`` batches.

torch's ``_WeightNorm`` parametrization (``torch.nn.utils.parametrizations.weight_norm``) and
its older forward pre-hook ``WeightNorm`` (``torch.nn.utils.weight_norm``) compute the weight
with ``torch._weight_norm``, whose fused CPU/CUDA kernel (``_weight_norm_interface``, for
``dim`` 0 or the last dim) has no batching rule: under ``vmap`` torch ran it member after
member, with a performance warning, and ``torch.compile`` traced one copy per member.
``_batchable.batchable`` re-classes them in the module the ensemble runs (``ens.runner``) to
:class:`BatchableWeightNorm` and :class:`BatchableWeightNormHook`: the same parameters
(``parametrizations.weight.original0`` / ``original1``; ``weight_g`` / ``weight_v``) and the
same maths, ``v * (g / norm_except_dim(v, 2, dim))``, which torch's own ``_weight_norm`` runs
for every other ``dim``. The fused kernel sums the squares in another order: results agree
to rounding (docs/semantics.md). ``ens[i]`` keeps torch's own classes.

This file imports only torch: it sits at the bottom of the package.
"""

from __future__ import annotations

import sys

from torch import Tensor, nn
from torch.nn.utils.parametrizations import _WeightNorm

__all__ = ["BatchableWeightNorm", "BatchableWeightNormHook", "WeightNorm"]

#: torch's old-style hook class (``torch.nn.utils.weight_norm`` is the function of that name).
WeightNorm = sys.modules["torch.nn.utils.weight_norm"].WeightNorm


def _norm_except_dim(v: Tensor, dim: int) -> Tensor:
    """``torch.norm_except_dim(v, 2, dim)`` (no batching rule: vmap ran it member after
    member) in ops vmap batches, step for step as torch's C++: the whole norm for ``dim`` -1
    (``weight_norm(dim=None)``), else each slice's norm along ``dim``, in torch's order."""
    if dim == -1:
        return v.norm(2)
    shape = [1] * v.dim()
    shape[dim] = v.size(dim)
    if dim != 0 and dim == v.dim() - 1:
        return v.reshape(-1, v.size(dim)).norm(2, 0).reshape(shape)
    return v.transpose(0, dim).reshape(v.size(dim), -1).norm(2, 1).reshape(shape)


def _normed(v: Tensor, g: Tensor, dim: int) -> Tensor:
    """``torch._weight_norm(v, g, dim)`` in ops vmap batches (its unfused formula)."""
    return v * (g / _norm_except_dim(v, dim))


class BatchableWeightNorm(_WeightNorm):
    """torch's ``_WeightNorm`` parametrization whose weight ``vmap`` batches.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> from torch.nn.utils import parametrizations
        >>> layer = parametrizations.weight_norm(nn.Linear(3, 4))
        >>> layer.parametrizations.weight[0].__class__ = BatchableWeightNorm
        >>> tuple(layer(torch.randn(2, 3)).shape)
        (2, 4)
    """

    def forward(self, weight_g: Tensor, weight_v: Tensor) -> Tensor:
        return _normed(weight_v, weight_g, self.dim)


class BatchableWeightNormHook(WeightNorm):  # type: ignore[misc, valid-type]
    """torch's old-style ``WeightNorm`` forward pre-hook whose weight ``vmap`` batches.

    Example:
        >>> import warnings
        >>> import torch
        >>> from torch import nn
        >>> with warnings.catch_warnings():  # torch deprecates the old style
        ...     warnings.simplefilter("ignore", FutureWarning)
        ...     layer = nn.utils.weight_norm(nn.Linear(3, 4))
        >>> next(iter(layer._forward_pre_hooks.values())).__class__ = BatchableWeightNormHook
        >>> tuple(layer(torch.randn(2, 3)).shape)
        (2, 4)
    """

    def compute_weight(self, module: nn.Module) -> Tensor:
        g = getattr(module, self.name + "_g")
        v = getattr(module, self.name + "_v")
        return _normed(v, g, self.dim)
