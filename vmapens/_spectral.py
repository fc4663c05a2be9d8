"""``torch.nn.utils.parametrizations.spectral_norm`` in ops that ``torch.func.vmap`` batches.

torch's ``_SpectralNorm`` parametrization runs its power iteration in the forward, in
training mode, and writes each new ``_u``/``_v`` into the buffer with ``F.normalize(...,
out=self._u)``. ``vmap`` cannot batch an ``out=`` write into a buffer, so an ensemble of
members holding it could only run with ``backend="loop"``. ``_batchable.batchable``
re-classes the parametrization of the module the ensemble runs (``ens.runner``) to
:class:`BatchableSpectralNorm`: the same buffers (so the same ``state_dict`` keys,
``parametrizations.weight.0._u`` and ``_v``), attributes and maths, its iteration computed
out of place and copied into the buffers afterwards, as BatchNorm writes its running
statistics: into the member's row of the stacked storage. ``ens[i]`` keeps torch's own class.

This file imports only torch: it sits at the bottom of the package.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.utils.parametrizations import _SpectralNorm

__all__ = ["BatchableSpectralNorm"]


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
