"""Muon for stacked ensembles: the update rule and its optimizer."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from .._checks import column
from ._hyper import NONNEGATIVE, Hyper, PerMember, Scalar, member_column
from .base import StackedOptimizer

__all__ = ["StackedMuon", "muon_rule", "newton_schulz"]


#: torch's defaults (``torch.optim._muon``): Keller Jordan's quintic coefficients.
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
_ADJUST = (None, "original", "match_rms_adamw")


def newton_schulz(
    update: Tensor, coefficients: tuple[float, float, float], steps: int, eps: Scalar
) -> Tensor:
    """Each member's matrix ``update[i]`` orthogonalised, batched over members, in bfloat16.

    torch's ``_zeropower_via_newtonschulz`` on every ``[rows, cols]`` slice of the
    ``[n, rows, cols]`` stack at once (``bmm``/``baddbmm``): transpose tall matrices, divide
    by the Frobenius norm
    (at least ``eps``), then ``steps`` times ``A = X X^T``, ``B = b A + c A A``,
    ``X = a X + B X``.

    Args:
        update: Stacked matrices ``[n, rows, cols]``.
        coefficients: ``(a, b, c)``.
        steps: Number of iterations.
        eps: Floor of the norm, a float or a float64 ``[n]`` tensor.

    Returns:
        The bfloat16 ``[n, rows, cols]`` result. Each slice equals torch's result on it alone
        up to the rounding of bfloat16 sums: torch's CPU ``baddbmm`` and ``addmm`` accumulate
        in different orders (different kernels by size), so an element now and then differs
        by one bfloat16 ulp (measured: 0-5% of random stacks, none above 1 ulp).
    """
    a, b, c = coefficients
    x = update.bfloat16()
    tall = update.size(-2) > update.size(-1)
    if tall:
        x = x.mT
    norm = torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True)
    floor = column(eps.to(torch.bfloat16), norm) if isinstance(eps, Tensor) else eps
    x = x / torch.clamp(norm, min=floor)
    for _ in range(steps):
        gram = x @ x.mT
        x = torch.baddbmm(x, torch.baddbmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.mT if tall else x


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
        O = newton_schulz(U)   (bfloat16, as torch)
        p *= 1 - lr * wd;  p -= lr * scale(rows, cols) * O
        scale = sqrt(max(1, rows / cols)) ("original", None) or 0.2 * sqrt(max(rows, cols))

    Args:
        params: Stacked matrices [n, rows, cols] sharing one step count, updated in place.
        grads: Their gradients (not modified).
        state: ``momentum_buffer`` (one per parameter) and ``step`` (float32 [n], counted;
            torch's Muon has none).
        group: ``lr``, ``weight_decay``, ``momentum``, ``eps`` (floats or float64 [n]
            tensors), ``nesterov``, ``ns_coefficients``, ``ns_steps`` and ``adjust_lr_fn``.
    """
    lr, wd, momentum, eps = group["lr"], group["weight_decay"], group["momentum"], group["eps"]
    state["step"].add_(1)
    for p, g, buf in zip(params, grads, state["momentum_buffer"], strict=True):

        def col(x: Scalar, like: Tensor = p) -> Any:
            return member_column(x, like)

        buf.lerp_(g, col(1 - momentum))
        update = g.lerp(buf, col(momentum)) if group["nesterov"] else buf
        ortho = newton_schulz(update, group["ns_coefficients"], group["ns_steps"], eps)
        rows, cols = p.shape[1:]
        if group["adjust_lr_fn"] in (None, "original"):
            ratio = math.sqrt(max(1, rows / cols))
        else:
            ratio = 0.2 * math.sqrt(max(rows, cols))
        p.mul_(col(1 - lr * wd))
        if isinstance(lr, Tensor):
            p.add_(ortho.to(p.dtype).mul_(col(-(lr * ratio))))
        else:
            p.add_(ortho, alpha=-(lr * ratio))


class StackedMuon(StackedOptimizer):
    """Muon over stacked matrices, with per-member hyperparameters.

    Member ``i`` is updated exactly as ``torch.optim.Muon`` would update it alone with member
    ``i``'s hyperparameters, its Newton-Schulz iteration batched over members;
    ``member_state_dict(i)`` hands it off to it (the momentum buffers; torch's Muon keeps no
    step count). As torch's Muon, it takes matrices only: every member parameter must be 2-D
    (stacked: ``[n, rows, cols]``); optimise the others (biases, norms, embeddings) with
    another stacked optimizer, as torch's documentation splits them::

        matrices = [p for p in ens.parameters() if p.dim() == 3]
        others = [p for p in ens.parameters() if p.dim() != 3]
        muon, adamw = StackedMuon(matrices), StackedAdam(others, decoupled_weight_decay=True)

    The Newton-Schulz coefficients and step count are shared by all members: the iteration
    runs in bfloat16 through ``baddbmm``'s own scaling, whose rounding a per-member
    coefficient would change.

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
        **implementation: none: torch's Muon takes no implementation flags.

    Raises:
        ValueError: A member parameter that is not 2-D, an unknown ``adjust_lr_fn``,
            ``ns_steps`` >= 100, or out-of-range or wrong-length hyperparameters.

    Example:
        >>> w = torch.zeros(2, 3, 3, requires_grad=True)
        >>> opt = StackedMuon([w], lr=[1e-3, 1e-2], weight_decay=0.0)
        >>> w.grad = torch.eye(3).repeat(2, 1, 1)
        >>> opt.step()
        >>> w[:, 0, 0] / torch.tensor([1e-3, 1e-2])  # the same orthogonalised step, scaled
        tensor([-0.6797, -0.6797], grad_fn=<DivBackward0>)
    """

    hyperparameters: ClassVar[dict[str, Hyper]] = {
        "lr": Hyper("learning rate", ">= 0", NONNEGATIVE.ok),
        "weight_decay": Hyper("weight decay", ">= 0", NONNEGATIVE.ok),
        "momentum": Hyper("momentum", ">= 0", NONNEGATIVE.ok),
        "eps": Hyper("epsilon value", ">= 0", NONNEGATIVE.ok),
    }
    torch_class = torch.optim.Muon
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
        **implementation: Any,
    ) -> None:
        api = type(self).__name__  # not an option: dropped before locals() is taken
        if adjust_lr_fn not in _ADJUST:
            raise ValueError(
                f"{api}: `adjust_lr_fn` must be one of {_ADJUST}, got {adjust_lr_fn!r}"
            )
        if isinstance(ns_steps, bool) or not isinstance(ns_steps, int) or not 0 <= ns_steps < 100:
            raise ValueError(f"{api}: `ns_steps` must be an int in [0, 100), got {ns_steps!r}")
        if len(ns_coefficients) != 3:
            raise ValueError(
                f"{api}: `ns_coefficients` must be 3 floats (a, b, c), got {ns_coefficients!r}"
            )
        ns_coefficients = tuple(map(float, ns_coefficients))  # type: ignore[assignment]
        del api
        super().__init__(params, locals())

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a param group of stacked matrices (checked as the constructor's).

        Args:
            param_group: A dict with ``params`` and optional hyperparameter overrides.

        Raises:
            ValueError: A parameter whose member shape is not 2-D.
        """
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
        return {"momentum_buffer": state["momentum_buffer"][i].clone()}
