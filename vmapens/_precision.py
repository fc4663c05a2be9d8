"""Mixed precision per member: autocast as each member alone gets it, and loss scaling.

``torch.autocast`` casts at the dispatcher, *below* ``torch.func.vmap``'s batching rules, so
under vmap it sees the ops a batching rule decomposes into rather than the member's own ops:
a linear layer with a per-member bias becomes ``matmul`` (cast) + ``add`` (not cast) and stays
float32, where the member alone gets one bfloat16 ``addmm``. :class:`MemberAutocast` applies
autocast's cast policy one level up, per ``torch`` function the member calls, so it sees what
the member alone would send to autocast.

Ops on autocast's lower-precision list are *emulated*: inputs rounded to the low dtype,
computed in float32, the result rounded to the low dtype. That is what the CPU kernels do
(float32 accumulation, one rounding at the end) and what the batched decompositions would
otherwise round twice. The price is float32 arithmetic inside those ops.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack
from torch.utils._pytree import tree_leaves, tree_map

from ._loss_scale import LossScale

__all__ = [
    "POLICIES",
    "LossScale",
    "MemberAutocast",
    "active_autocast",
    "autocast_members",
    "member_autocast",
]

_CONV = {"conv1d", "conv2d", "conv3d", "conv_tbc", "conv_transpose1d", "conv_transpose2d"}
_CONV |= {"conv_transpose3d", "convolution", "_convolution", "prelu"}
_LOSSES = {
    "binary_cross_entropy_with_logits",
    "cosine_embedding_loss",
    "hinge_embedding_loss",
    "huber_loss",
    "kl_div",
    "l1_loss",
    "margin_ranking_loss",
    "mse_loss",
    "multi_margin_loss",
    "multilabel_margin_loss",
    "nll_loss",
    "nll_loss2d",
    "poisson_nll_loss",
    "smooth_l1_loss",
    "soft_margin_loss",
    "triplet_margin_loss",
}
# The function names (aten op names, as torch's Python functions and Tensor methods carry them)
# of autocast's lists in aten/src/ATen/autocast_mode.cpp: lower precision, float32, promote.
_CPU_FP32 = _LOSSES | {
    "adaptive_avg_pool3d",
    "adaptive_max_pool3d",
    "avg_pool3d",
    "binary_cross_entropy",
    "cdist",
    "cholesky",
    "cholesky_inverse",
    "cholesky_solve",
    "cross_entropy",
    "cross_entropy_loss",
    "ctc_loss",
    "fake_quantize_per_tensor_affine",
    "fractional_max_pool2d",
    "fractional_max_pool3d",
    "geqrf",
    "grid_sampler",
    "grid_sampler_2d",
    "grid_sampler_3d",
    "inverse",
    "lu_solve",
    "max_pool3d",
    "max_unpool2d",
    "max_unpool3d",
    "multilabel_margin_loss_forward",
    "nanquantile",
    "orgqr",
    "ormqr",
    "pinverse",
    "polar",
    "prod",
    "qr",
    "quantile",
    "reflection_pad1d",
    "reflection_pad2d",
    "replication_pad1d",
    "replication_pad2d",
    "replication_pad3d",
    "stft",
    "svd",
    "trace",
    "triangular_solve",
    "view_as_complex",
}
_CPU_FP32 |= {f"fft_{k}" for k in ("fft", "ifft", "fft2", "ifft2", "fftn", "ifftn", "hfft")}
_CPU_FP32 |= {f"fft_{k}" for k in ("rfft", "irfft", "rfft2", "irfft2", "rfftn", "irfftn", "ihfft")}
_CPU_FP32 |= {
    f"linalg_{k}"
    for k in (
        "cholesky",
        "cholesky_ex",
        "cond",
        "eig",
        "eigh",
        "eigvals",
        "eigvalsh",
        "householder_product",
        "inv",
        "inv_ex",
        "lstsq",
        "matrix_rank",
        "qr",
        "solve",
        "svd",
        "svdvals",
        "tensorinv",
        "tensorsolve",
    )
}
_CUDA_FP32 = _LOSSES | {
    "acos",
    "asin",
    "cdist",
    "cosh",
    "cosine_similarity",
    "cross_entropy",
    "cumprod",
    "cumsum",
    "dist",
    "erfinv",
    "exp",
    "expm1",
    "frobenius_norm",
    "group_norm",
    "layer_norm",
    "linalg_matrix_norm",
    "linalg_vector_norm",
    "log",
    "log10",
    "log1p",
    "log2",
    "log_softmax",
    "logsumexp",
    "norm",
    "nuclear_norm",
    "pdist",
    "pow",
    "prod",
    "reciprocal",
    "renorm",
    "rms_norm",
    "rsqrt",
    "sinh",
    "softmax",
    "softplus",
    "sum",
    "tan",
}
_CUDA_FP32 |= {f"upsample_{k}" for k in ("nearest1d", "nearest2d", "nearest3d", "linear1d")}
_CUDA_FP32 |= {f"upsample_{k}" for k in ("bilinear2d", "bicubic2d", "trilinear3d")}
_MATMUL = {"addbmm", "addmm", "baddbmm", "bmm", "linalg_vecdot", "linear", "matmul", "mm"}
_MATMUL |= {"__matmul__", "__rmatmul__", "scaled_dot_product_attention"}
#: device type -> (lower precision, float32, promote): the names of each autocast list.
POLICIES: dict[str, tuple[frozenset[str], frozenset[str], frozenset[str]]] = {
    "cpu": (
        frozenset(_CONV | _MATMUL | {"_addmm_activation", "_native_multi_head_attention"}),
        frozenset(_CPU_FP32),
        frozenset({"cat", "concat", "concatenate", "index_copy", "stack"}),
    ),
    "cuda": (
        frozenset(
            _CONV
            | _MATMUL
            | {"addmv", "addr", "chain_matmul", "einsum", "linalg_multi_dot", "mv"}
            | {"gru_cell", "lstm_cell", "rnn_relu_cell", "rnn_tanh_cell"}
        ),
        frozenset(_CUDA_FP32),
        frozenset({"addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "grid_sampler"})
        | frozenset({"index_put", "scatter_add", "tensordot", "vdot"}),
    ),
}
# Normalisation with a low-precision input and float32 weights: the member alone gets the
# mixed-dtype kernel (float32 arithmetic, output in the input's dtype); the batched rule has none.
_NORMS = frozenset({"batch_norm", "group_norm", "instance_norm", "layer_norm"})
_NO_BATCH_RULE = frozenset({"scaled_dot_product_attention"})
# C++ composites on no autocast list whose decompositions call listed products (einsum and
# tensordot become bmm/mm): alone autocast casts those inner products, which no torch function
# reaches. vmap decomposes them into the same products; autocast on around them casts those.
_COMPOSITES = frozenset({"bilinear", "einsum", "inner", "tensordot"})
_COMPOSITES |= frozenset({"linalg_matmul", "linalg_multi_dot"})
# Found in session 48 (tests/test_hunt_session48_h.py): affine_grid's generator calls bmm,
# cov / corrcoef / matrix_power / pinv call mm or matmul, and pad's reflect and replicate
# modes call reflection_pad / replication_pad (autocast's float32 list): each flipped a dtype.
_COMPOSITES |= frozenset({"affine_grid_generator", "cov", "corrcoef", "pad", "pinverse"})
_COMPOSITES |= frozenset({"matrix_power", "linalg_matrix_power", "linalg_pinv"})
_redispatch = getattr(torch.overrides, "redispatch_function", None)


def active_autocast(device_type: str) -> torch.dtype | None:
    """The dtype of the ``torch.autocast`` active for ``device_type``, or None."""
    if not torch.is_autocast_enabled(device_type):
        return None
    return torch.get_autocast_dtype(device_type)


def autocast_members(fn: Callable[..., Any], device_type: str) -> Callable[..., Any]:
    """``fn`` (one member's function, about to be vmapped) made exact under ``torch.autocast``.

    With no autocast active for ``device_type`` this is ``fn`` itself. Otherwise ``fn`` runs
    with ``torch.autocast`` off and :class:`MemberAutocast` on, so that each member gets what
    ``torch.autocast`` would give it alone.
    """
    dtype = active_autocast(device_type)
    if dtype is None:
        return fn

    def member(*args: Any, **kwargs: Any) -> Any:
        with torch.autocast(device_type, enabled=False), MemberAutocast(device_type, dtype):
            return fn(*args, **kwargs)

    return member


class MemberAutocast(TorchFunctionMode):
    """Inside one member's function under vmap: autocast's policy, applied per torch function.

    Enter it inside the function that vmap maps, with ``torch.autocast`` itself disabled
    there (it would also cast the batched decompositions).

    Args:
        device_type: the members' device type (``"cpu"``, ``"cuda"``).
        dtype: the low-precision dtype (``torch.bfloat16`` or ``torch.float16``).
    """

    def __init__(self, device_type: str, dtype: torch.dtype) -> None:
        super().__init__()
        self.device_type, self.dtype = device_type, dtype
        self.low, self.fp32, self.promote = POLICIES.get(
            device_type, (frozenset(), frozenset(), frozenset())
        )

    def _eligible(self, t: Any) -> bool:
        # autocast casts floating tensors of its device type, never float64 ones.
        return (
            isinstance(t, torch.Tensor)
            and t.is_floating_point()
            and t.device.type == self.device_type
            and t.dtype != torch.float64
        )

    def _mixed(self, args: tuple, kwargs: dict | None) -> bool:
        """A norm's low-precision input with float32 weights or statistics: torch's mixed
        kernel alone. Without any (affine=False), alone runs the input dtype's own kernel."""
        if not (self._eligible(args[0]) and args[0].dtype != torch.float32):
            return False
        rest = tree_leaves((args[1:], kwargs or {}))
        return any(self._eligible(t) and t.dtype == torch.float32 for t in rest)

    def _cast(self, tree: Any, dtype: torch.dtype) -> Any:
        return tree_map(lambda t: t.to(dtype) if self._eligible(t) else t, tree)

    def __torch_function__(
        self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        name = getattr(func, "__name__", "")
        inputs = (args, kwargs or {})
        if name in _NO_BATCH_RULE:
            # vmap runs these member by member: the member's own low-precision kernel.
            inputs = self._cast(inputs, self.dtype)
        elif name in self.low:
            rounded = self._cast(self._cast(inputs, self.dtype), torch.float32)
            return self._cast(func(*rounded[0], **rounded[1]), self.dtype)
        elif name in self.fp32:
            inputs = self._cast(inputs, torch.float32)
        elif name in self.promote:
            dtypes = {t.dtype for t in tree_leaves(inputs) if self._eligible(t)}
            inputs = self._cast(inputs, torch.float32 if torch.float32 in dtypes else self.dtype)
        elif name in _COMPOSITES:
            with torch.autocast(self.device_type, dtype=self.dtype):
                return func(*inputs[0], **inputs[1])
        elif name in _NORMS and self._mixed(args, kwargs):
            out = func(*self._cast(args, torch.float32), **self._cast(kwargs or {}, torch.float32))
            return out.to(args[0].dtype)
        if (
            _redispatch is not None
            and getattr(func, "__module__", "") == "torch.nn.functional"
            and not torch.compiler.is_compiling()  # dynamo cannot trace the re-entry
        ):
            # Python composites (multi-head attention, interpolate): the member alone would
            # autocast the ops inside them, so keep the policy on for those.
            with self:
                return _redispatch(func, types, *inputs)
        return func(*inputs[0], **inputs[1])


def member_autocast(t: torch.Tensor) -> torch.dtype | None:
    """The low dtype an active :class:`MemberAutocast` computes ``t``'s ops in, or None.

    None outside the ensemble's calls, for a tensor autocast leaves alone (float64, another
    device), and while dynamo traces (it cannot read the mode stack).
    """
    if torch.compiler.is_compiling():
        return None
    for mode in _get_current_function_mode_stack():
        if isinstance(mode, MemberAutocast) and mode._eligible(t):
            return mode.dtype
    return None
