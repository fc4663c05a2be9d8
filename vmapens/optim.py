"""Adam for stacked ensembles: per-member hyperparameters, masks and gradient clipping.

Every tensor here carries a leading member dim of size n; member ``i`` owns ``p[i]``.
The maths lives once, in :func:`adam_update_`; :class:`StackedAdam` is the
``torch.optim.Optimizer`` shell around it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, cast

import torch
from torch import Tensor, nn

__all__ = ["MemberValues", "StackedAdam", "adam_update", "adam_update_", "clip_grad_norm_"]

_LOW_PRECISION = (torch.float16, torch.bfloat16)
_MOMENTS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")
Scalar = float | Tensor


class MemberValues:
    """An immutable per-member hyperparameter: one Python float per member.

    ``group["lr"]`` holds one of these when learning rates differ across members. It is not
    a Tensor on purpose: torch's LR schedulers ``fill_`` tensor learning rates with a single
    value, but apply plain arithmetic to anything else, so elementwise float arithmetic here
    gives each member exactly the float its own scheduler on a plain Adam would compute.

    Args:
        values: One float per member.
    """

    __slots__ = ("tensor", "values")

    values: tuple[float, ...]
    tensor: Tensor

    def __init__(self, values: Iterable[float]) -> None:
        object.__setattr__(self, "values", tuple(float(v) for v in values))
        # What the optimizer reads: a compiled step sees a tensor input, not n constants, so a
        # scheduler changing the values does not trigger a recompile.
        object.__setattr__(self, "tensor", torch.tensor(self.values, dtype=torch.float64))

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("MemberValues is immutable")

    def __reduce__(self) -> tuple[Any, ...]:
        return (MemberValues, (self.values,))

    def __len__(self) -> int:
        return len(self.values)

    def __getitem__(self, i: int) -> float:
        return self.values[i]

    def __iter__(self) -> Iterator[float]:
        return iter(self.values)

    def __repr__(self) -> str:
        return f"MemberValues({list(self.values)})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, MemberValues) and self.values == other.values

    def __hash__(self) -> int:
        return hash(self.values)

    def tolist(self) -> list[float]:
        """Return the values as a list of floats."""
        return list(self.values)

    def _map(self, other: Any, op: Callable[[float, float], float]) -> MemberValues:
        if isinstance(other, MemberValues):
            return MemberValues(op(a, b) for a, b in zip(self.values, other.values, strict=True))
        if isinstance(other, (int, float)):
            return MemberValues(op(a, other) for a in self.values)
        return NotImplemented

    def __add__(self, o: Any) -> MemberValues:
        return self._map(o, lambda a, b: a + b)

    def __radd__(self, o: Any) -> MemberValues:
        return self._map(o, lambda a, b: b + a)

    def __sub__(self, o: Any) -> MemberValues:
        return self._map(o, lambda a, b: a - b)

    def __rsub__(self, o: Any) -> MemberValues:
        return self._map(o, lambda a, b: b - a)

    def __mul__(self, o: Any) -> MemberValues:
        return self._map(o, lambda a, b: a * b)

    def __rmul__(self, o: Any) -> MemberValues:
        return self._map(o, lambda a, b: b * a)

    def __truediv__(self, o: Any) -> MemberValues:
        return self._map(o, lambda a, b: a / b)

    def __rtruediv__(self, o: Any) -> MemberValues:
        return self._map(o, lambda a, b: b / a)

    def __neg__(self) -> MemberValues:
        return MemberValues(-a for a in self.values)


# State dicts (optimizer and scheduler) hold MemberValues; let weights_only torch.load read them.
torch.serialization.add_safe_globals([MemberValues])


def _rows(t: Tensor) -> Tensor:
    """View a stacked tensor as [n, k] (k may be 0) so per-member scalars broadcast as [n, 1]."""
    return t.reshape(t.shape[0], math.prod(t.shape[1:]))


def adam_update_(
    param: Tensor,
    grad: Tensor,
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    max_exp_avg_sq: Tensor | None,
    step: Tensor,
    *,
    lr: Scalar,
    beta1: Scalar,
    beta2: Scalar,
    eps: Scalar,
    weight_decay: Scalar,
    decoupled_weight_decay: bool = False,
    amsgrad: bool = False,
    maximize: bool = False,
    mask: Tensor | None = None,
    workspace: Tensor | None = None,
) -> None:
    r"""One Adam step on a stacked tensor, in place, each member with its own hyperparameters.

    Follows ``torch.optim.Adam``'s single-tensor update (Kingma & Ba, 2015, Algorithm 1;
    AdamW's decoupled decay from Loshchilov & Hutter, 2019) per member ``i`` with step ``t``:

    .. code-block:: text

        g   = -g if maximize;  g += wd * p   (or p *= 1 - lr * wd if decoupled)
        m   = lerp(m, g, 1 - beta1)
        v   = v * beta2 + (1 - beta2) * g * g;  v_max = max(v_max, v) if amsgrad
        p  += -(lr / (1 - beta1**t)) * m / (sqrt(v) / sqrt(1 - beta2**t) + eps)

    Per-member scalars are computed in float64 (torch computes them in Python floats) and
    broadcast as ``[n, 1, ...]`` columns. No ``.item()`` and no branching on tensor values, so
    it traces under ``torch.compile(fullgraph=True)``. ``StackedAdam`` calls it once per
    parameter group, on all parameters concatenated into one ``[n, total]`` tensor.

    Args:
        param: Stacked parameter [n, ...], updated in place.
        grad: Its gradient (not modified).
        exp_avg: First moment, shaped like ``param``, updated in place.
        exp_avg_sq: Second moment, shaped like ``param``, updated in place.
        max_exp_avg_sq: Running maximum of the second moment (``amsgrad``), else None.
        step: Float32 [n] per-member step counts, updated in place.
        lr: Learning rate, a float or a float64 [n] tensor.
        beta1: First-moment decay, a float or a float64 [n] tensor.
        beta2: Second-moment decay, a float or a float64 [n] tensor.
        eps: Denominator term, a float or a float64 [n] tensor.
        weight_decay: L2 (or decoupled) weight decay, a float or a float64 [n] tensor.
        decoupled_weight_decay: Use AdamW's decoupled weight decay.
        amsgrad: Normalise by the running maximum of the second moment.
        maximize: Ascend instead of descend.
        mask: Optional bool [n]; members where it is False come out bit-identical.
        workspace: Optional tensor shaped like ``param`` to hold the denominator, so that a
            step allocates no ``param``-sized temporary.

    Example:
        >>> p, g = torch.zeros(3, 2), torch.ones(3, 2)
        >>> m, v, s = torch.zeros(3, 2), torch.zeros(3, 2), torch.zeros(3)
        >>> adam_update_(p, g, m, v, None, s, lr=torch.tensor([0.1, 0.2, 0.3]),
        ...              beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0)
        >>> p[:, 0], s
        (tensor([-0.1000, -0.2000, -0.3000]), tensor([1., 1., 1.]))
    """
    if amsgrad and max_exp_avg_sq is None:
        raise TypeError(
            "adam_update_: `max_exp_avg_sq` must be a tensor when `amsgrad=True`, got None"
        )
    v_max = max_exp_avg_sq if amsgrad else None
    state = (param, exp_avg, exp_avg_sq, *([] if v_max is None else [v_max]), step)
    before = None if mask is None else [t.clone() for t in state]
    # Low-precision tensors take float32 columns: in-place ops compute in the promoted dtype.
    dtype = torch.float32 if param.dtype in _LOW_PRECISION else param.dtype
    shape = (param.shape[0],) + (1,) * (param.dim() - 1)

    def col(x: Scalar) -> Scalar:
        return x.to(dtype).view(shape) if isinstance(x, Tensor) else x

    g = -grad if maximize else grad
    if isinstance(weight_decay, Tensor) or weight_decay != 0:
        if decoupled_weight_decay:
            param.mul_(col(1 - lr * weight_decay))
        else:
            g = g + col(weight_decay) * param
    exp_avg.lerp_(g, col(1 - beta1))
    if isinstance(beta2, Tensor):
        exp_avg_sq.mul_(col(beta2)).addcmul_(g, g * col(1 - beta2))
    else:
        exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    step.add_(1)
    t = step.double()
    bias_correction1 = 1 - torch.pow(beta1, t)
    bias_correction2_sqrt = (1 - torch.pow(beta2, t)).sqrt()
    if v_max is not None:
        torch.maximum(v_max, exp_avg_sq, out=v_max)
    denom = torch.sqrt(exp_avg_sq if v_max is None else v_max, out=workspace)
    denom.div_(col(bias_correction2_sqrt)).add_(col(eps))
    # torch's capturable Adam folds the step size into the denominator the same way.
    param.addcdiv_(exp_avg, denom.div_(col(-lr / bias_correction1)))
    if mask is not None and before is not None:
        for t, old in zip(state, before, strict=True):
            t.copy_(torch.where(mask.view((-1,) + (1,) * (t.dim() - 1)), t, old))


def adam_update(
    param: Tensor,
    grad: Tensor,
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    max_exp_avg_sq: Tensor | None,
    step: Tensor,
    **hyperparameters: Any,
) -> tuple[Tensor, Tensor, Tensor, Tensor | None, Tensor]:
    """The pure form of :func:`adam_update_`: returns new tensors, mutates nothing.

    Takes the same arguments and returns ``(param, exp_avg, exp_avg_sq, max_exp_avg_sq,
    step)``, for functional training steps (``torch.func``, ``torch.compile``).

    Example:
        >>> p, g, z, s = torch.zeros(2, 3), torch.ones(2, 3), torch.zeros(2, 3), torch.zeros(2)
        >>> new_p, *_ = adam_update(p, g, z, z, None, s, lr=0.1, beta1=0.9, beta2=0.999,
        ...                         eps=1e-8, weight_decay=0.0)
        >>> new_p[0], p[0]
        (tensor([-0.1000, -0.1000, -0.1000]), tensor([0., 0., 0.]))
    """
    new_param, new_exp_avg, new_exp_avg_sq = param.clone(), exp_avg.clone(), exp_avg_sq.clone()
    new_max = None if max_exp_avg_sq is None else max_exp_avg_sq.clone()
    new_step = step.clone()
    adam_update_(new_param, grad, new_exp_avg, new_exp_avg_sq, new_max, new_step, **hyperparameters)
    return new_param, new_exp_avg, new_exp_avg_sq, new_max, new_step


def _flat_params(params: Any) -> list[Any]:
    if isinstance(params, nn.Module):
        return list(params.parameters())
    if isinstance(params, Tensor):
        return [params]
    return list(params)


def _leading_n(api: str, tensors: Sequence[Tensor]) -> int:
    if not tensors:
        raise ValueError(f"{api}: `params` is empty; expected at least one stacked tensor")
    if any(t.dim() == 0 for t in tensors):
        raise ValueError(f"{api}: every parameter needs a leading member dim, got a 0-dim tensor")
    sizes = sorted({t.shape[0] for t in tensors})
    if len(sizes) != 1:
        raise ValueError(
            f"{api}: all parameters must share the leading member dim n, got sizes {sizes}"
        )
    return sizes[0]


_CHECKS = {
    "lr": ("learning rate", ">= 0", lambda v: v >= 0),
    "eps": ("epsilon value", ">= 0", lambda v: v >= 0),
    "weight_decay": ("weight_decay value", ">= 0", lambda v: v >= 0),
    "betas[0]": ("beta parameter at index 0", "in [0, 1)", lambda v: 0 <= v < 1),
    "betas[1]": ("beta parameter at index 1", "in [0, 1)", lambda v: 0 <= v < 1),
}


def _hyper(name: str, value: Any, n: int) -> float | MemberValues:
    """Validate a hyperparameter: a float (shared) or n values (per member)."""
    out: float | MemberValues
    if isinstance(value, Tensor):
        if value.dim() > 1:
            raise ValueError(
                f"StackedAdam: `{name}` must be a float or 1-D, got shape {tuple(value.shape)}"
            )
        value = value.item() if value.dim() == 0 else value.tolist()
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        vals, out = [float(value)], float(value)
    elif isinstance(value, (Sequence, MemberValues)) and not isinstance(value, str):
        if len(value) != n:
            raise ValueError(
                f"StackedAdam: `{name}` has {len(value)} values, expected n={n}, one per member"
            )
        vals = [float(v) for v in value]
        out = MemberValues(vals)
    else:
        raise TypeError(
            f"StackedAdam: `{name}` must be a float or a sequence/1-D tensor of n={n} floats, "
            f"got {type(value).__name__}"
        )
    what, rule, ok = _CHECKS[name]
    for v in vals:
        if not ok(v):
            raise ValueError(f"StackedAdam: Invalid {what}: {v} (`{name}` must be {rule})")
    return out


def _arg(v: float | MemberValues, device: torch.device) -> Scalar:
    """Group value -> adam_update argument."""
    return v.tensor.to(device) if isinstance(v, MemberValues) else v


def _pick(v: float | MemberValues, i: int) -> float:
    return v[i] if isinstance(v, MemberValues) else v


class StackedAdam(torch.optim.Optimizer):
    """Adam/AdamW over stacked ensemble parameters, with per-member hyperparameters.

    Member ``i`` is updated exactly as ``torch.optim.Adam`` (``AdamW`` when
    ``decoupled_weight_decay``) would update it alone with member ``i``'s hyperparameters.
    A hyperparameter given per member is stored in ``param_groups`` as :class:`MemberValues`
    (a float when shared), which torch's LR schedulers update member by member.

    Args:
        params: Stacked tensors [n, ...], param-group dicts, or an ``nn.Module`` (an Ensemble).
        lr: Learning rate: a float, or a sequence / 1-D tensor with one per member.
        betas: ``(beta1, beta2)``, each a float or one per member.
        eps: Denominator term, a float or one per member.
        weight_decay: Weight decay, a float or one per member.
        decoupled_weight_decay: AdamW-style decay.
        amsgrad: Use the AMSGrad variant.
        maximize: Maximise the objective.

    Raises:
        ValueError: Empty params, mismatched leading sizes, out-of-range or wrong-length
            hyperparameters.
        TypeError: A hyperparameter of an unsupported type.

    Example:
        >>> w = torch.zeros(4, 3, requires_grad=True)
        >>> opt = StackedAdam([w], lr=torch.logspace(-3, 0, 4))
        >>> w.grad = torch.ones(4, 3)
        >>> opt.step(mask=torch.tensor([True, True, False, True]))
        >>> [round(v, 6) for v in w[:, 0].tolist()]
        [-0.001, -0.01, 0.0, -1.0]
    """

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]] | nn.Module,
        lr: float | Sequence[float] | Tensor = 1e-3,
        betas: tuple[float | Sequence[float] | Tensor, float | Sequence[float] | Tensor] = (
            0.9,
            0.999,
        ),
        eps: float | Sequence[float] | Tensor = 1e-8,
        weight_decay: float | Sequence[float] | Tensor = 0.0,
        *,
        decoupled_weight_decay: bool = False,
        amsgrad: bool = False,
        maximize: bool = False,
    ) -> None:
        items = _flat_params(params)
        tensors = [
            t
            for it in items
            for t in (_flat_params(it["params"]) if isinstance(it, dict) else [it])
        ]
        self.num_members = _leading_n("StackedAdam", tensors)
        # A sharded Ensemble holds one block of its n_total members: per-member values given
        # for all of them are cut to the block's global ids (docs/distributed.md).
        n_total = getattr(params, "n_total", self.num_members)
        self._block = getattr(params, "member_ids", None) if n_total != self.num_members else None
        self._n_total = n_total
        defaults = dict(
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            decoupled_weight_decay=decoupled_weight_decay,
            amsgrad=amsgrad,
            maximize=maximize,
        )
        self._normalise(defaults)
        self._flat: list[dict[str, Any] | None] = []  # per param group, see _pack
        super().__init__(items, defaults)

    def _normalise(self, group: dict[str, Any]) -> None:
        for key in ("lr", "eps", "weight_decay"):
            group[key] = _hyper(key, self._local(group[key]), self.num_members)
        betas = group["betas"]
        if not isinstance(betas, (tuple, list)) or len(betas) != 2:
            raise ValueError(f"StackedAdam: `betas` must be a pair (beta1, beta2), got {betas!r}")
        group["betas"] = tuple(
            _hyper(f"betas[{j}]", self._local(b), self.num_members) for j, b in enumerate(betas)
        )

    def _local(self, value: Any) -> Any:
        """This block's values of a per-member hyperparameter given for all n_total members."""
        sized = isinstance(value, (Sequence, MemberValues)) and not isinstance(value, str)
        sized = sized or isinstance(value, Tensor) and value.dim() == 1
        if self._block is None or not sized or len(value) != self._n_total:
            return value
        return [value[i] for i in self._block]

    # Not `n`: dynamo's OptimizerVariable intercepts any attribute name that is a substring of
    # "_init_group" (torch 2.13), which breaks the graph.
    num_members: int

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a param group (validated like the constructor's arguments) and create its state.

        Args:
            param_group: A dict with ``params`` and optional hyperparameter overrides.
        """
        group = dict(param_group)
        group["params"] = _flat_params(group["params"])
        n = _leading_n("StackedAdam", group["params"])
        if n != self.num_members:
            raise ValueError(
                f"StackedAdam: all parameters must share the leading member dim n, "
                f"got sizes {sorted({n, self.num_members})}"
            )
        for key, default in self.defaults.items():
            group.setdefault(key, default)
        self._normalise(group)
        super().add_param_group(group)
        # Eager state keeps step() free of data-dependent initialisation (compile-friendly).
        for p in group["params"]:
            state = self.state[p]
            if not state:
                state["step"] = torch.zeros(self.num_members, dtype=torch.float32, device=p.device)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                if group["amsgrad"]:
                    state["max_exp_avg_sq"] = torch.zeros_like(p)
        self._pack(group)

    def _pack(self, group: dict[str, Any]) -> None:
        """Move the group's state into flat ``[n, total]`` buffers that the state keeps views of.

        While every parameter of the group has a gradient and one shared step count, a step
        is then one ``adam_update`` on a single ``[n, total]`` tensor: a handful of kernels
        whatever the depth of the model, instead of a handful per parameter.
        """
        index = next(i for i, g in enumerate(self.param_groups) if g is group)
        del self._flat[index:]
        params = group["params"]
        if len({(p.dtype, p.device) for p in params}) != 1:
            self._flat.append(None)  # mixed dtypes or devices: per-tensor updates only
            return
        states = [self.state[p] for p in params]
        shared = states[0]["step"]
        if all(torch.equal(s["step"], shared) for s in states):
            for s in states:
                s["step"] = shared
        flat: dict[str, Any] = {"step": shared, "views": {}}
        # Kept between steps for the concatenated parameters, gradients and the denominator:
        # on CPU, allocating fresh [n, total] temporaries every step makes the system
        # allocator hand pages back and fault them in again (3x slower at n=4096 on workload
        # A). CUDA's caching allocator reuses blocks by itself.
        total = sum(p[0].numel() for p in params)
        flat["workspace"] = (
            torch.empty(3, self.num_members, total, dtype=params[0].dtype).unbind()
            if params[0].device.type == "cpu"
            else (None, None, None)
        )
        for key in _MOMENTS:
            if key not in states[0]:
                continue
            flat[key] = torch.cat([_rows(s[key]) for s in states], dim=1)
            offset, views = 0, []
            for s, p in zip(states, params, strict=True):
                size = p[0].numel()
                s[key] = flat[key][:, offset : offset + size].view(p.shape)
                views.append(s[key])
                offset += size
            flat["views"][key] = views
        self._flat.append(flat)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict saved by ``state_dict()`` (then re-flatten the state)."""
        super().load_state_dict(state_dict)
        for group in self.param_groups:
            self._pack(group)

    def _flat_state(self, index: int, grads: list[Tensor | None]) -> dict | None:
        """Group ``index``'s flat buffers when the single-tensor update applies, else None."""
        flat = self._flat[index]
        if flat is None or any(g is None for g in grads):
            return None
        params = self.param_groups[index]["params"]
        for k, p in enumerate(params):
            s = self.state[p]
            if not p.is_contiguous() or s["step"] is not flat["step"]:
                return None
            if any(s[key] is not views[k] for key, views in flat["views"].items()):
                return None
        return flat

    def _check_mask(self, mask: Tensor | None) -> None:
        if mask is None:
            return
        if not isinstance(mask, Tensor) or mask.dtype != torch.bool:
            got = mask.dtype if isinstance(mask, Tensor) else type(mask).__name__
            raise TypeError(f"StackedAdam: `mask` must be a bool tensor of shape [n], got {got}")
        if tuple(mask.shape) != (self.num_members,):
            raise ValueError(
                f"StackedAdam: `mask` must have shape [{self.num_members}] (one per member), "
                f"got {list(mask.shape)}"
            )

    def _update(self, grads: Sequence[Tensor | None], mask: Tensor | None) -> None:
        with torch.no_grad():
            start = 0
            for index, group in enumerate(self.param_groups):
                params = group["params"]
                g = list(grads[start : start + len(params)])
                start += len(params)
                flat = self._flat_state(index, g)
                if flat is not None:
                    # The whole group as one [n, total] tensor (see _pack).
                    rows = [_rows(p) for p in params]  # views: the params are contiguous
                    dense = cast("list[Tensor]", g)  # _flat_state found no None gradient
                    work = flat["workspace"]
                    p = torch.cat(rows, dim=1, out=work[0])
                    flat_grad = torch.cat([_rows(x) for x in dense], dim=1, out=work[1])
                    self._adam(group, p, flat_grad, flat, mask, workspace=work[2])
                    torch._foreach_copy_(rows, list(p.split([r.shape[1] for r in rows], dim=1)))
                    continue
                states = [self.state[p] for p in params]
                if len({id(s["step"]) for s in states}) < len(states):
                    for s in states:  # per-parameter counts from here on, as torch keeps them
                        s["step"] = s["step"].clone()
                for p, grad, state in zip(params, g, states, strict=True):
                    if grad is not None:  # no gradient: skipped, as torch.optim.Adam does
                        self._adam(group, p, grad, state, mask)

    def _adam(
        self,
        group: dict[str, Any],
        param: Tensor,
        grad: Tensor,
        state: dict,
        mask: Tensor | None,
        workspace: Tensor | None = None,
    ) -> None:
        """``adam_update_`` with the group's hyperparameters."""
        b1, b2 = group["betas"]
        device = param.device
        amsgrad = group["amsgrad"]
        adam_update_(
            param,
            grad,
            state["exp_avg"],
            state["exp_avg_sq"],
            state["max_exp_avg_sq"] if amsgrad else None,
            state["step"],
            lr=_arg(group["lr"], device),
            beta1=_arg(b1, device),
            beta2=_arg(b2, device),
            eps=_arg(group["eps"], device),
            weight_decay=_arg(group["weight_decay"], device),
            decoupled_weight_decay=group["decoupled_weight_decay"],
            amsgrad=amsgrad,
            maximize=group["maximize"],
            mask=mask,
            workspace=workspace,
        )

    def step(  # type: ignore[override]
        self, mask: Tensor | None = None, closure: Callable[[], Any] | None = None
    ) -> Any:
        """Update every member from ``p.grad``; members with ``mask`` False stay unchanged.

        Args:
            mask: Optional bool [n]: which members step. Masked-out members keep their
                parameters, moments and step counts bit for bit.
            closure: Optional callable that re-evaluates the model and returns the loss.

        Returns:
            The closure's loss, or ``None``.

        Raises:
            TypeError: ``mask`` is not a bool tensor.
            ValueError: ``mask`` is not of shape [n].
        """
        self._check_mask(mask)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._update([p.grad for g in self.param_groups for p in g["params"]], mask)
        return loss

    def apply_gradients(self, grads: Sequence[Tensor | None], mask: Tensor | None = None) -> None:
        """Update every member from explicit gradients instead of ``p.grad``.

        Meant for compiled steps that compute gradients functionally (``torch.func.grad``).

        Args:
            grads: One gradient (or ``None``) per parameter, in the order of the parameters
                flattened over ``param_groups``.
            mask: Optional bool [n]: which members step.

        Raises:
            ValueError: Wrong number or shapes of gradients, or a bad ``mask``.
            TypeError: ``mask`` is not a bool tensor.
        """
        params = [p for g in self.param_groups for p in g["params"]]
        if len(grads) != len(params):
            raise ValueError(
                f"StackedAdam.apply_gradients: `grads` has {len(grads)} entries, "
                f"expected {len(params)} (one per parameter)"
            )
        for k, (p, g) in enumerate(zip(params, grads, strict=True)):
            if g is not None and g.shape != p.shape:
                raise ValueError(
                    f"StackedAdam.apply_gradients: `grads[{k}]` has shape {list(g.shape)}, "
                    f"expected {list(p.shape)}"
                )
        self._check_mask(mask)
        self._update(grads, mask)

    def member_state_dict(self, i: int, module: nn.Module | None = None) -> dict[str, Any]:
        """Member ``i``'s optimizer state, loadable by ``torch.optim.Adam`` / ``AdamW``.

        Build the member optimizer with the same param-group layout, then
        ``opt.load_state_dict(stacked.member_state_dict(i))`` continues member ``i`` alone on
        exactly its ensemble trajectory.

        Args:
            i: Member index (negative counts from the end).
            module: Optional member module; its parameters are checked against the stacked
                ones (count and shapes, in order).

        Returns:
            A ``torch.optim.Optimizer`` state dict with member ``i``'s float hyperparameters
            and cloned slices of its moments (``step`` as a 0-dim float32 tensor).

        Raises:
            IndexError: ``i`` out of range.
            ValueError: ``module``'s parameters do not match.
        """
        if not -self.num_members <= i < self.num_members:
            raise IndexError(
                f"StackedAdam.member_state_dict: `i`={i} out of range for n={self.num_members}"
            )
        i %= self.num_members
        params = [p for g in self.param_groups for p in g["params"]]
        if module is not None:
            shapes = [tuple(p.shape) for p in module.parameters()]
            expected = [tuple(p.shape[1:]) for p in params]
            if shapes != expected:
                raise ValueError(
                    "StackedAdam.member_state_dict: `module` parameters do not match the stacked "
                    f"ones; got shapes {shapes}, expected {expected} (same order)"
                )
        groups, state, start = [], {}, 0
        for group in self.param_groups:
            b1, b2 = group["betas"]
            ids = list(range(start, start + len(group["params"])))
            start += len(ids)
            groups.append(
                dict(
                    lr=_pick(group["lr"], i),
                    betas=(_pick(b1, i), _pick(b2, i)),
                    eps=_pick(group["eps"], i),
                    weight_decay=_pick(group["weight_decay"], i),
                    amsgrad=group["amsgrad"],
                    maximize=group["maximize"],
                    decoupled_weight_decay=group["decoupled_weight_decay"],
                    params=ids,
                )
            )
            for k, p in zip(ids, group["params"], strict=True):
                state[k] = {key: v[i].clone() for key, v in self.state[p].items()}
        return {"state": state, "param_groups": groups}


def clip_grad_norm_(
    ens_or_params: nn.Module | Tensor | Iterable[Tensor], max_norm: float, norm_type: float = 2.0
) -> Tensor:
    """Clip each member's gradients by that member's own total norm, in place.

    Member ``i`` is treated exactly as ``torch.nn.utils.clip_grad_norm_`` would treat it alone:
    ``g *= min(max_norm / (norm_i + 1e-6), 1)``. A member with non-finite gradients gets a
    non-finite norm and leaves the others untouched.

    Args:
        ens_or_params: An ensemble (``nn.Module``), a stacked tensor or an iterable of them.
        max_norm: Maximum total norm per member.
        norm_type: p of the p-norm (``inf`` allowed).

    Returns:
        The per-member total gradient norms, shape [n] (before clipping).

    Raises:
        ValueError: No parameters, or mismatched leading sizes.

    Example:
        >>> w = torch.zeros(2, 3, requires_grad=True)
        >>> w.grad = torch.tensor([[3.0, 4.0, 0.0], [0.3, 0.4, 0.0]])
        >>> clip_grad_norm_([w], max_norm=1.0)
        tensor([5.0000, 0.5000])
    """
    params = _flat_params(ens_or_params)
    n = _leading_n("clip_grad_norm_", params)
    norm_type = float(norm_type)
    grads = [p.grad for p in params if p.grad is not None and p.grad.numel() > 0]
    if not grads:
        return torch.zeros(n, device=params[0].device)
    per_tensor = [torch.linalg.vector_norm(_rows(g), norm_type, dim=1) for g in grads]
    norms = torch.linalg.vector_norm(torch.stack(per_tensor, dim=0), norm_type, dim=0)
    coef = torch.clamp(max_norm / (norms + 1e-6), max=1.0)
    torch._foreach_mul_(
        grads, [coef.to(g.device, g.dtype).view(n, *[1] * (g.dim() - 1)) for g in grads]
    )
    return norms
