"""Muon for stacked ensembles: the update rule and its optimizer."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from .._checks import column
from ._columns import decay_factor, is_tensor_lr, member_column
from ._hyper import LR, NONNEGATIVE, Hyper, PerMember, Scalar
from .base import StackedOptimizer

__all__ = ["StackedMuon", "muon_rule", "newton_schulz"]


#: torch's defaults (``torch.optim._muon``): Keller Jordan's quintic coefficients.
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
_ADJUST = (None, "original", "match_rms_adamw")
#: How :func:`newton_schulz` runs over members: torch's ops per member (exact) or batched.
MODES = ("per_member", "batched")


def newton_schulz(
    update: Tensor,
    coefficients: tuple[float, float, float],
    steps: int,
    eps: Scalar,
    *,
    mode: str = "per_member",
) -> Tensor:
    """Each member's matrix ``update[i]`` orthogonalised in bfloat16, as torch's Muon does.

    torch's ``_zeropower_via_newtonschulz`` (``torch/optim/_muon.py``) on every
    ``[rows, cols]`` slice of the ``[n, rows, cols]`` stack: round to bfloat16, transpose a
    tall matrix, divide by its Frobenius norm (at least ``eps``), then ``steps`` times
    ``A = X X^T``, ``B = b A + c A A``, ``X = a X + B X``.

    ``mode="per_member"`` runs torch's ops on each slice in turn, so each result is torch's
    bit for bit, whatever kernels the CPU or GPU picks. ``mode="batched"`` runs each op once
    for all members (``bmm``/``baddbmm``, a norm over the last two dims): torch picks other
    kernels for a batch than for one matrix (by size, by batch size, by CPU), which sum the
    bfloat16 products in another order, so an element now and then differs by one bfloat16
    ulp, and the iteration carries it on (docs/semantics.md has the measured deviation).

    As torch's, both divide a bfloat16 ``update`` by its norm in place (``bfloat16()`` returns
    the tensor itself): a bfloat16 Muon without Nesterov normalises its momentum buffer.

    Args:
        update: Stacked matrices ``[n, rows, cols]``.
        coefficients: ``(a, b, c)``.
        steps: Number of iterations.
        eps: Floor of the norm, a float or a float64 ``[n]`` tensor.
        mode: ``"per_member"`` (torch's result exactly) or ``"batched"`` (faster, to one
            bfloat16 ulp per iteration).

    Returns:
        The bfloat16 ``[n, rows, cols]`` result.

    Raises:
        ValueError: An unknown ``mode``.
    """
    if mode not in MODES:
        raise ValueError(f"newton_schulz: `mode` must be one of {MODES}, got {mode!r}")
    # torch's clamp(min=float) rounds the floor to the tensor's dtype: the same as a bf16 one.
    floor = eps.to(torch.bfloat16) if isinstance(eps, Tensor) else eps
    if mode == "per_member":
        floors: list[Scalar] = (
            list(floor.unbind()) if isinstance(floor, Tensor) else [floor] * update.size(0)
        )
        orthos = [
            _newton_schulz_alone(u, coefficients, steps, f)
            for u, f in zip(update.unbind(), floors, strict=True)
        ]
        # In the layout of torch's results (a tall one is a transposed view after an
        # iteration): the update that reads it picks its elementwise kernel by layout, and
        # that kernel rounds bfloat16 parameters.
        if orthos[0].is_contiguous():
            return torch.stack(orthos)
        return torch.stack([o.mT for o in orthos]).mT
    a, b, c = coefficients
    x = update.bfloat16()
    tall = update.size(-2) > update.size(-1)
    if tall:
        x = x.mT
    norm = torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True)
    x.div_(torch.clamp(norm, min=column(floor, norm) if isinstance(floor, Tensor) else floor))
    for _ in range(steps):
        gram = x @ x.mT
        x = torch.baddbmm(x, torch.baddbmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.mT if tall else x


def _check_mode(api: str, mode: Any) -> None:
    if mode not in MODES:
        raise ValueError(f"{api}: `newton_schulz` must be one of {MODES}, got {mode!r}")


def _check_iteration(api: str, ns_steps: Any, ns_coefficients: Any) -> None:
    """Raise where torch's Newton-Schulz iteration raises: ``ns_steps`` >= 100 or not 3
    coefficients (torch checks a param group's at its step, so before anything is written)."""
    if isinstance(ns_steps, bool) or not isinstance(ns_steps, int) or not 0 <= ns_steps < 100:
        raise ValueError(f"{api}: `ns_steps` must be an int in [0, 100), got {ns_steps!r}")
    if not hasattr(ns_coefficients, "__len__") or len(ns_coefficients) != 3:
        raise ValueError(
            f"{api}: `ns_coefficients` must be 3 floats (a, b, c), got {ns_coefficients!r}"
        )


def _newton_schulz_alone(
    update: Tensor, coefficients: tuple[float, float, float], steps: int, eps: Scalar
) -> Tensor:
    """torch's ``_zeropower_via_newtonschulz`` on one matrix, op for op (torch 2.13)."""
    a, b, c = coefficients
    x = update.bfloat16()
    tall = update.size(0) > update.size(1)
    if tall:
        x = x.T
    x.div_(x.norm().clamp(min=eps))
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


def muon_rule(
    params: list[Tensor], grads: list[Tensor], state: dict[str, Any], group: dict[str, Any]
) -> None:
    """One Muon step in place on stacked matrices, each member with its own hyperparameters.

    Follows ``torch.optim.Muon``'s single-tensor update (Jordan et al., 2024, "Muon: An
    optimizer for hidden layers in neural networks"; the ``match_rms_adamw`` scale from Liu
    et al., 2025, "Muon is Scalable for LLM Training") per member, whose parameter is the
    ``[rows, cols]`` matrix ``p[i]``:

    .. code-block:: text

        B = lerp(B, g, 1 - momentum);  U = lerp(g, B, momentum) if nesterov else B
        O = newton_schulz(U)   (bfloat16, as torch; per member or batched)
        p *= 1 - lr * wd;  p -= lr * scale(rows, cols) * O
        scale = sqrt(max(1, rows / cols)) ("original", None) or 0.2 * sqrt(max(rows, cols))

    Args:
        params: Stacked matrices [n, rows, cols] sharing one step count, updated in place.
        grads: Their gradients (not modified).
        state: ``momentum_buffer`` (one per parameter) and ``step`` ([n] counts, counted;
            torch's Muon has none).
        group: ``lr``, ``weight_decay``, ``momentum``, ``eps`` (floats or float64 [n]
            tensors), ``nesterov``, ``ns_coefficients``, ``ns_steps``, ``adjust_lr_fn`` and
            ``newton_schulz`` (the ``mode`` of :func:`newton_schulz`).
    """
    lr, wd, momentum, eps = group["lr"], group["weight_decay"], group["momentum"], group["eps"]
    # A group edited after construction: refused before any write, as torch refuses it.
    _check_iteration("StackedMuon.step", group["ns_steps"], group["ns_coefficients"])
    state["step"].add_(1)
    for p, g, buf in zip(params, grads, state["momentum_buffer"], strict=True):

        def col(x: Scalar, like: Tensor = p) -> Any:
            return member_column(x, like)

        buf.lerp_(g, col(1 - momentum))
        update = g.lerp(buf, col(momentum)) if group["nesterov"] else buf
        ortho = newton_schulz(
            update, group["ns_coefficients"], group["ns_steps"], eps, mode=group["newton_schulz"]
        )
        rows, cols = p.shape[1:]
        if group["adjust_lr_fn"] in (None, "original"):
            ratio = math.sqrt(max(1, rows / cols))
        elif group["adjust_lr_fn"] == "match_rms_adamw":
            ratio = 0.2 * math.sqrt(max(rows, cols))
        else:  # torch's _adjust_lr: any other value (a param group's own) leaves lr as it is
            ratio = 1.0
        p.mul_(col(decay_factor(lr, wd)))
        if is_tensor_lr(lr) and not torch.compiler.is_compiling():
            # torch's add_(update, alpha=-adjusted_lr): lr * ratio rounded in the 0-d tensor's
            # dtype, read as the float alpha of one rounded add (a product then a sum rounds
            # twice: an ulp off in float32). A trace keeps the product (no host read).
            p.add_(ortho, alpha=float(-(lr * ratio)))
        elif isinstance(lr, Tensor):
            p.add_(ortho.to(p.dtype).mul_(col(-(lr * ratio))))
        else:
            p.add_(ortho, alpha=-(lr * ratio))


class StackedMuon(StackedOptimizer):
    """Muon over stacked matrices, with per-member hyperparameters.

    Member ``i`` is updated exactly as ``torch.optim.Muon`` would update it alone with member
    ``i``'s hyperparameters (bit for bit in its Newton-Schulz iteration, to round-off around
    it), all members in one step;
    ``member_state_dict(i)`` hands it off to it (the momentum buffers; torch's Muon keeps no
    step count). As torch's Muon, it takes matrices only: every member parameter must be 2-D
    (stacked: ``[n, rows, cols]``); optimise the others (biases, norms, embeddings) with
    another stacked optimizer, as torch's documentation splits them::

        matrices = [p for p in ens.parameters() if p.dim() == 3]
        others = [p for p in ens.parameters() if p.dim() != 3]
        muon, adamw = StackedMuon(matrices), StackedAdam(others, decoupled_weight_decay=True)

    The Newton-Schulz iteration runs in bfloat16, as torch's. By default
    (``newton_schulz="per_member"``) it runs torch's matrix products on each member in turn:
    torch picks other kernels for a batch of matrices than for one, which round the bfloat16
    sums differently, so only this equals torch's Muon. ``newton_schulz="batched"`` runs
    each product once for all members (``baddbmm``), several times faster for many small
    matrices, and differs from torch's Muon by a bfloat16 ulp now and then, which the
    iteration and later steps carry on (docs/semantics.md: within 0.061 lr over 20 steps). The
    Newton-Schulz coefficients and step count are shared by all members.

    Args:
        params: Stacked matrices [n, rows, cols] or param-group dicts of them.
        lr: Learning rate, a float or one per member.
        weight_decay: Decoupled weight decay, a float or one per member.
        momentum: Momentum factor, a float or one per member.
        nesterov: Nesterov momentum.
        ns_coefficients: ``(a, b, c)`` of the Newton-Schulz polynomial, shared.
        eps: Floor of the norm before the iteration, a float or one per member.
        ns_steps: Newton-Schulz iterations (< 100), shared.
        adjust_lr_fn: ``None``/``"original"`` (``sqrt(max(1, rows / cols))``) or
            ``"match_rms_adamw"`` (``0.2 * sqrt(max(rows, cols))``).
        newton_schulz: ``"per_member"`` (equal to torch's Muon on each member) or
            ``"batched"`` (faster; within bfloat16 rounding of it), keyword only.
        **implementation: none: torch's Muon takes no implementation flags.

    Raises:
        ValueError: A member parameter that is not 2-D, an unknown ``adjust_lr_fn`` or
            ``newton_schulz``, ``ns_steps`` >= 100, or out-of-range or wrong-length
            hyperparameters.

    Example:
        >>> w = torch.zeros(2, 3, 3, requires_grad=True)
        >>> opt = StackedMuon([w], lr=[1e-3, 1e-2], weight_decay=0.0)
        >>> w.grad = torch.eye(3).repeat(2, 1, 1)
        >>> opt.step()
        >>> w[:, 0, 0] / torch.tensor([1e-3, 1e-2])  # the same orthogonalised step, scaled
        tensor([-0.6797, -0.6797], grad_fn=<DivBackward0>)
    """

    hyperparameters: ClassVar[dict[str, Hyper]] = {
        "lr": LR,  # a 0-d tensor lr stays one: torch's Muon computes with it in its dtype
        "weight_decay": Hyper("weight decay", ">= 0", NONNEGATIVE.ok),
        "momentum": Hyper("momentum", ">= 0", NONNEGATIVE.ok),
        "eps": Hyper("epsilon value", ">= 0", NONNEGATIVE.ok),
    }
    torch_class = torch.optim.Muon
    elementwise = False  # Newton-Schulz of the whole matrix; the lr scale reads its shape
    rule = staticmethod(muon_rule)

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]] | nn.Module,
        lr: PerMember = 1e-3,
        weight_decay: PerMember = 0.1,
        momentum: PerMember = 0.95,
        nesterov: bool = True,
        ns_coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
        eps: PerMember = 1e-7,
        ns_steps: int = 5,
        adjust_lr_fn: str | None = None,
        *,
        newton_schulz: str = "per_member",
        **implementation: Any,
    ) -> None:
        api = type(self).__name__  # not an option: dropped before locals() is taken
        _check_mode(api, newton_schulz)
        if adjust_lr_fn not in _ADJUST:
            raise ValueError(
                f"{api}: `adjust_lr_fn` must be one of {_ADJUST}, got {adjust_lr_fn!r}"
            )
        _check_iteration(api, ns_steps, ns_coefficients)
        ns_coefficients = tuple(map(float, ns_coefficients))  # type: ignore[assignment]
        del api
        super().__init__(params, locals())

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a param group of stacked matrices (checked as the constructor's).

        Args:
            param_group: A dict with ``params`` and optional hyperparameter overrides.

        Raises:
            ValueError: A parameter whose member shape is not 2-D, an unknown
                ``newton_schulz``, ``ns_steps`` >= 100 or not 3 ``ns_coefficients``.
        """
        if "newton_schulz" in param_group:
            _check_mode(self._api, param_group["newton_schulz"])
        # A group's own, refused now rather than at its first step (the defaults are checked).
        _check_iteration(
            self._api,
            param_group.get("ns_steps", self.defaults["ns_steps"]),
            param_group.get("ns_coefficients", self.defaults["ns_coefficients"]),
        )
        params = param_group["params"]
        for p in [params] if isinstance(params, Tensor) else list(params):
            if isinstance(p, Tensor) and p.dim() != 3:
                raise ValueError(
                    f"{self._api}: Muon only supports 2D parameters; got a parameter of "
                    f"member size {list(p.shape[1:])} (stacked {list(p.shape)}), expected "
                    "[n, rows, cols]. Optimise the others with another stacked optimizer."
                )
        super().add_param_group({**param_group, "params": params})

    def state_names(self, group: dict[str, Any]) -> tuple[str, ...]:
        return ("momentum_buffer",)

    def member_state(
        self, state: dict[str, Tensor], group: dict[str, Any], i: int
    ) -> dict[str, Tensor]:
        if state["step"][i] == 0:  # torch makes its state at a parameter's first step
            return {}
        return {"momentum_buffer": state["momentum_buffer"][i].clone()}
