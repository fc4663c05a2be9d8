"""Spectral normalisation, new and old style, in ops that ``torch.func.vmap`` batches.

torch's ``_SpectralNorm`` parametrization (``torch.nn.utils.parametrizations.spectral_norm``)
and its older forward pre-hook ``SpectralNorm`` (``torch.nn.utils.spectral_norm``) run their
power iteration in the forward, in training mode, and write each new ``u``/``v`` into its
buffer with ``F.normalize(..., out=u)``. ``vmap`` cannot batch an ``out=`` write into a
buffer, so an ensemble of members holding either could only run with ``backend="loop"``.
``_batchable.batchable`` re-classes them in the module the ensemble runs (``ens.runner``) to
:class:`BatchableSpectralNorm` and :class:`BatchableSpectralNormHook`: the same buffers (so
the same ``state_dict`` keys: ``parametrizations.weight.0._u`` and ``_v``; ``weight_u`` and
``weight_v``), attributes and maths, the iteration computed out of place and copied into the
buffers afterwards, as BatchNorm writes its running statistics: into the member's row of the
stacked storage. ``ens[i]`` keeps torch's own classes.

This file imports only torch: it sits at the bottom of the package.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.utils.parametrizations import _SpectralNorm
from torch.nn.utils.spectral_norm import SpectralNorm

__all__ = ["BatchableSpectralNorm", "BatchableSpectralNormHook"]


class BatchableSpectralNorm(_SpectralNorm):
    """torch's ``_SpectralNorm`` whose power iteration ``vmap`` batches and dynamo traces.

    ``forward`` is torch's: a 1-D weight is normalised; otherwise, in training mode,
    ``n_power_iterations`` steps of ``u = normalize(W v)``, ``v = normalize(W^H u)`` (``W``
    the weight reshaped to a matrix with ``dim`` first) update ``_u`` and ``_v`` without
    grad, and the weight is divided by ``sigma = u . (W v)``, the vectors taken as constants.
    Eval mode uses the stored vectors. Only the writes differ: torch's go through ``out=``
    into each buffer after every half step, these are one ``copy_`` per buffer at the end,
    of the same values.

    Example:
        >>> from torch import nn
        >>> from torch.nn.utils import parametrizations
        >>> layer = parametrizations.spectral_norm(nn.Linear(3, 4))
        >>> layer.parametrizations.weight[0].__class__ = BatchableSpectralNorm
        >>> tuple(layer(torch.randn(2, 3)).shape)
        (2, 4)
    """

    def forward(self, weight: Tensor) -> Tensor:
        if weight.ndim == 1:
            return F.normalize(weight, dim=0, eps=self.eps)
        weight_mat = self._reshape_weight_to_matrix(weight)
        if self.training:
            with torch.no_grad():
                u, v = self._u, self._v
                for _ in range(self.n_power_iterations):
                    u = F.normalize(torch.mv(weight_mat, v), dim=0, eps=self.eps)
                    v = F.normalize(torch.mv(weight_mat.H, u), dim=0, eps=self.eps)
                # torch writes in place too: the same buffer objects keep the new values.
                self._u.copy_(u)
                self._v.copy_(v)
        # Clones, as torch's: a second forward's writes must not reach the first's backward.
        u = self._u.clone(memory_format=torch.contiguous_format)
        v = self._v.clone(memory_format=torch.contiguous_format)
        sigma = torch.vdot(u, torch.mv(weight_mat, v))
        return weight / sigma


class BatchableSpectralNormHook(SpectralNorm):
    """torch's old-style ``SpectralNorm`` forward pre-hook whose power iteration ``vmap`` batches.

    ``compute_weight`` is torch's: with ``do_power_iteration`` (the hook passes
    ``module.training``), ``n_power_iterations`` steps of ``v = normalize(W^T u)``,
    ``u = normalize(W v)`` (``W`` the ``<name>_orig`` parameter reshaped to a matrix with
    ``dim`` first) update ``<name>_u`` and ``<name>_v`` without grad, and the weight is
    divided by ``sigma = u . (W v)`` with clones of the new vectors, taken as constants;
    without it, by the stored vectors themselves. Only the writes differ: torch's go through
    ``out=`` into each buffer after every half step, these are one ``copy_`` per buffer at the
    end, of the same values.

    Example:
        >>> from torch import nn
        >>> layer = nn.utils.spectral_norm(nn.Linear(3, 4))
        >>> next(iter(layer._forward_pre_hooks.values())).__class__ = BatchableSpectralNormHook
        >>> tuple(layer(torch.randn(2, 3)).shape)
        (2, 4)
    """

    def compute_weight(self, module: nn.Module, do_power_iteration: bool) -> Tensor:
        weight = getattr(module, self.name + "_orig")
        u = getattr(module, self.name + "_u")
        v = getattr(module, self.name + "_v")
        weight_mat = self.reshape_weight_to_matrix(weight)
        if do_power_iteration:
            with torch.no_grad():
                new_u, new_v = u, v
                for _ in range(self.n_power_iterations):
                    new_v = F.normalize(torch.mv(weight_mat.t(), new_u), dim=0, eps=self.eps)
                    new_u = F.normalize(torch.mv(weight_mat, new_v), dim=0, eps=self.eps)
                # torch writes in place too: the same buffer objects keep the new values.
                u.copy_(new_u)
                v.copy_(new_v)
                if self.n_power_iterations > 0:
                    # Clones, as torch's: a second forward's writes must not reach the
                    # first's backward.
                    u = u.clone(memory_format=torch.contiguous_format)
                    v = v.clone(memory_format=torch.contiguous_format)
        sigma = torch.dot(u, torch.mv(weight_mat, v))
        return weight / sigma
