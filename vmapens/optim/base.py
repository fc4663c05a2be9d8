"""StackedOptimizer: what every stacked optimizer shares, written once.

A concrete optimizer is its update rule (one in-place function over stacked tensors) plus a
table of its hyperparameters. The base does the rest: per-member hyperparameters (validated,
cut to a shard's block, kept as :class:`MemberValues` for torch's schedulers), state created
lazily and following the parameters' dtype and device, one flat ``[n, total]`` buffer per
param group (a step is then a handful of kernels whatever the depth), masks, gradients given
explicitly (``apply_gradients``, for compiled steps), the hand-off of one member's state to
the plain torch optimizer, and sub-ensemble selection.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, ClassVar, cast

import torch
from torch import Tensor

from .._checks import check_mask, column
from ._flat import FlatState, fusable, layout, rows, run_fused
from ._handoff import MemberHandOff
from ._hyper import (
    NONNEGATIVE,
    UNIT,
    Hyper,
    Scalar,
    check_hyper,
    group_args,
    local_values,
    member_column,
    params_of,
)

__all__ = [
    "NONNEGATIVE",
    "UNIT",
    "Hyper",
    "Scalar",
    "StackedOptimizer",
    "fusable",
    "member_column",
    "run_fused",
]


class StackedOptimizer(MemberHandOff, FlatState, torch.optim.Optimizer):
    """Base class of stacked optimizers: member ``i`` of every tensor is ``p[i]``.

    Subclasses set :attr:`hyperparameters` (name -> :class:`Hyper`, in torch's order),
    :attr:`torch_class` (the plain optimizer a member hands off to, None where torch has
    none) and implement :meth:`state_names` and :meth:`update_`; :meth:`scalar_state` and
    :meth:`initial_state` add per-member counters and non-zero initial state.

    Args:
        params: stacked tensors ``[n, ...]``, param-group dicts, or an ``Ensemble``.
        defaults: every hyperparameter and option, as the subclass's constructor got them.
    """

    hyperparameters: ClassVar[dict[str, Hyper]] = {}
    torch_class: ClassVar[type[torch.optim.Optimizer] | None]
    # Not `n`: dynamo's OptimizerVariable intercepts any attribute name that is a substring of
    # "_init_group" (torch 2.13), which breaks the graph.
    num_members: int

    def __init__(self, params: Any, defaults: dict[str, Any]) -> None:
        items = params_of(params)
        tensors = [
            t for it in items for t in (params_of(it["params"]) if isinstance(it, dict) else [it])
        ]
        self.num_members = self._leading_n(tensors)
        # A sharded Ensemble holds one block of its n_total members: per-member values given
        # for all of them are cut to the block's global ids (docs/distributed.md).
        n_total = getattr(params, "n_total", self.num_members)
        self._block = getattr(params, "member_ids", None) if n_total != self.num_members else None
        self._n_total = n_total
        self._normalise(defaults)
        self._flat: list[dict[str, Any] | None] = []  # per param group, see _pack
        super().__init__(items, defaults)

    # -- what a subclass provides ---------------------------------------------------------------

    def state_names(self, group: dict[str, Any]) -> tuple[str, ...]:
        """The per-parameter state tensors (shaped like the parameter) this group needs."""
        raise NotImplementedError

    def update_(
        self, param: Tensor, grad: Tensor, state: dict[str, Tensor], group: dict[str, Any]
    ) -> None:
        """One step in place on stacked ``param`` and its ``state`` (incl. ``step`` [n]).

        ``group`` holds the options and, per hyperparameter, a float or a float64 ``[n]``
        tensor on the parameter's device (see :func:`member_column`).
        """
        raise NotImplementedError

    def member_state(
        self, state: dict[str, Tensor], group: dict[str, Any], i: int
    ) -> dict[str, Tensor]:
        """Member ``i``'s state for :attr:`torch_class` (default: every tensor's row ``i``)."""
        return {key: v[i].clone() for key, v in state.items()}

    def scalar_state(self, group: dict[str, Any]) -> dict[str, float]:
        """The per-member float32 ``[n]`` state (name -> starting value), ``step`` first.

        These count per member, not per element (NAdam adds ``mu_product``); they stay
        float32 whatever the parameters' dtype, as torch keeps them.
        """
        return {"step": 0.0}

    def initial_state(self, name: str, param: Tensor, group: dict[str, Any]) -> Tensor:
        """State ``name`` of ``param`` before the first step (default: zeros).

        ``group`` is as :meth:`update_` reads it (hyperparameters as floats or ``[n]``).
        """
        return torch.zeros_like(param, memory_format=torch.contiguous_format)

    # -- hyperparameters ------------------------------------------------------------------------

    def _leading_n(self, tensors: Sequence[Any]) -> int:
        api = self._api
        if not tensors:
            raise ValueError(f"{api}: `params` is empty; expected at least one stacked tensor")
        if any(not isinstance(t, Tensor) for t in tensors):
            raise TypeError(f"{api}: `params` must hold tensors, got {type(tensors[0]).__name__}")
        if any(t.dim() == 0 for t in tensors):
            raise ValueError(
                f"{api}: every parameter needs a leading member dim, got a 0-dim tensor"
            )
        sizes = sorted({t.shape[0] for t in tensors})
        if len(sizes) != 1:
            raise ValueError(
                f"{api}: all parameters must share the leading member dim n, got sizes {sizes}"
            )
        return sizes[0]

    def _normalise(self, group: dict[str, Any]) -> None:
        api, n = self._api, self.num_members

        def local(value: Any) -> Any:
            return local_values(value, self._block, self._n_total)

        for name, hyper in self.hyperparameters.items():
            value = group[name]
            if hyper.pair:
                if not isinstance(value, (tuple, list)) or len(value) != 2:
                    raise ValueError(f"{self._api}: `{name}` must be a pair, got {value!r}")
                group[name] = tuple(
                    check_hyper(api, f"{name}[{j}]", local(v), hyper, n, f" at index {j}")
                    for j, v in enumerate(value)
                )
            else:
                group[name] = check_hyper(api, name, local(value), hyper, n)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a param group, validated like the constructor's arguments.

        Args:
            param_group: A dict with ``params`` and optional hyperparameter overrides.
        """
        group = dict(param_group)
        group["params"] = params_of(group["params"])
        n = self._leading_n(group["params"])
        if n != self.num_members:
            raise ValueError(
                f"{self._api}: all parameters must share the leading member dim n, "
                f"got sizes {sorted({n, self.num_members})}"
            )
        for key, default in self.defaults.items():
            group.setdefault(key, default)
        self._normalise(group)
        super().add_param_group(group)
        self._flat.append(None)

    # -- state ---------------------------------------------------------------------------------

    def prepare(self) -> None:
        """Create missing state and move state that no longer matches its parameter.

        State is created at the first step, as torch's optimizers do, and follows the
        parameters afterwards: ``opt = StackedAdam(ens); ens.double()`` steps in float64. Steps
        call this themselves; a compiled step calls it before entering the graph.
        """
        for index, group in enumerate(self.param_groups):
            flat = self._flat[index]
            # Packed for these parameters as they are: the per-step fast path. Not while
            # tracing: reading every state entry makes dynamo guard on them.
            fast = flat is not None and not torch.compiler.is_compiling()
            if fast and flat is not None and flat["key"] == layout(group["params"]):
                continue
            names = self.state_names(group)
            changed = False
            # New state shares one step count per group (what the flat update needs).
            device, starts = group["params"][0].device, self.scalar_state(group)
            fresh: dict[str, Tensor] = {}
            for p in group["params"]:
                state = self.state[p]
                for key, start in starts.items():
                    t = state.get(key)
                    if t is None:
                        full = torch.full((self.num_members,), start, dtype=torch.float32)
                        new = fresh.setdefault(key, full.to(device))
                        state[key] = new if new.device == p.device else new.to(p.device)
                        changed = True
                    elif t.device != p.device or t.dtype != torch.float32:
                        # torch's load_state_dict casts all but `step` to the param's dtype.
                        state[key] = t.to(dtype=torch.float32, device=p.device)
                        changed = True
                for key in names:
                    t = state.get(key)
                    if t is None:
                        args = group_args(group, self.hyperparameters, p.device)
                        state[key] = self.initial_state(key, p, args)
                        changed = True
                    elif t.dtype != p.dtype or t.device != p.device:
                        state[key] = t.to(dtype=p.dtype, device=p.device)
                        changed = True
            flat = self._flat[index]
            if changed or flat is None or flat["key"] != layout(group["params"]):
                self._pack(index)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict saved by ``state_dict()`` (checked first, then re-flattened).

        Raises:
            ValueError: state for unknown parameters, or tensors whose leading dim is not n.
        """
        params = [p for g in self.param_groups for p in g["params"]]
        for k, state in dict(state_dict.get("state", {})).items():
            if not isinstance(k, int) or not 0 <= k < len(params):
                raise ValueError(f"{self._api}.load_state_dict: state for unknown parameter {k!r}")
            for name, v in state.items():
                if isinstance(v, Tensor) and v.dim() > 0 and v.shape[0] != self.num_members:
                    raise ValueError(
                        f"{self._api}.load_state_dict: `{name}` of parameter {k} has shape "
                        f"{tuple(v.shape)}, expected [n={self.num_members}, ...]"
                    )
        super().load_state_dict(state_dict)
        self._flat = [None] * len(self.param_groups)
        if self.state:
            self.prepare()

    # -- stepping ------------------------------------------------------------------------------

    def _update(self, grads: Sequence[Tensor | None], mask: Tensor | None) -> None:
        self.prepare()
        plan, start = [], 0
        for index, group in enumerate(self.param_groups):
            g = list(grads[start : start + len(group["params"])])
            start += len(g)
            plan.append((index, group, g, self._flat_state(index, g)))
        # Everything an update writes in place before its last op, copied so that a failed
        # step changes nothing (a compiled graph runs whole or not at all: no copy there).
        saved = [] if torch.compiler.is_compiling() else self._written(plan)
        backup = self._backup_of(saved)
        try:
            with torch.no_grad():
                for index, group, g, flat in plan:
                    self._update_group(index, group, g, flat, mask)
        except BaseException:
            with torch.no_grad():
                for t, b in zip(saved, backup, strict=True):
                    t.copy_(b)
            raise

    def _backup_of(self, tensors: list[Tensor]) -> list[Tensor]:
        """Copies of ``tensors`` in buffers kept between steps (one foreach copy, no allocation).

        Fresh clones every step would make the CPU allocator hand pages back and fault them in
        again, as for the flat workspace (see ``_pack``).
        """
        if not tensors:
            return []
        key = tuple((id(t), t.shape, t.dtype, t.device) for t in tensors)
        cached = self.__dict__.get("_backup")
        if cached is None or cached[0] != key:
            cached = (key, [torch.empty_like(t) for t in tensors])
            self.__dict__["_backup"] = cached
        torch._foreach_copy_(cached[1], tensors)
        return cached[1]

    def _written(self, plan: list) -> list[Tensor]:
        out: dict[int, Tensor] = {}
        for _, group, _, flat in plan:
            if flat is not None:
                tensors = [flat[k] for k in flat["views"]] + list(flat["scalars"].values())
            else:
                tensors = list(group["params"])
                tensors += [v for p in group["params"] for v in self.state[p].values()]
            out.update((id(t), t) for t in tensors)
        return list(out.values())

    def _update_group(
        self,
        index: int,
        group: dict,
        g: list[Tensor | None],
        flat: dict | None,
        mask: Tensor | None,
    ) -> None:
        params = group["params"]
        args = group_args(group, self.hyperparameters, params[0].device)
        if flat is not None:
            # Row views of the params, kept while the params keep their storage (a
            # `p.data = ...` elsewhere gives new storage, and new views).
            if torch.compiler.is_compiling():
                views = [rows(p) for p in params]
            else:
                ptrs = [p.data_ptr() for p in params]
                if flat.get("ptrs") != ptrs:
                    flat["ptrs"], flat["rows"] = ptrs, [rows(p) for p in params]
                views = flat["rows"]
            work = flat["workspace"]
            p = torch.cat(views, dim=1, out=work[0])
            dense = cast("list[Tensor]", g)  # _flat_state found no None gradient
            flat_grad = torch.cat([rows(x) for x in dense], dim=1, out=work[1])
            state = {k: flat[k] for k in flat["views"]}
            state.update(flat["scalars"])
            if work[2] is not None:
                state["_workspace"] = work[2]
            state["_mask"] = mask
            self._masked(p, flat_grad, state, args, mask)
            torch._foreach_copy_(views, list(p.split([r.shape[1] for r in views], dim=1)))
            return
        states = [self.state[p] for p in params]
        for name in self.scalar_state(group):
            if len({id(s[name]) for s in states}) < len(states):
                for s in states:  # per-parameter counts from here on, as torch keeps them
                    s[name] = s[name].clone()
        for p, grad, s in zip(params, g, states, strict=True):
            if grad is not None:  # no gradient: skipped, as torch's optimizers do
                self._masked(p, grad, s, args, mask)

    def _masked(
        self, param: Tensor, grad: Tensor, state: dict, group: dict, mask: Tensor | None
    ) -> None:
        """``update_``, after which members where ``mask`` is False get their old values back."""
        tensors = [param, *(v for k, v in state.items() if not k.startswith("_") and v is not None)]
        before = None if mask is None else [t.clone() for t in tensors]
        self.update_(param, grad, state, group)
        if before is not None and mask is not None:
            for t, old in zip(tensors, before, strict=True):
                t.copy_(torch.where(column(mask, t), t, old))

    def step(  # type: ignore[override]
        self, mask: Tensor | None = None, closure: Callable[[], Any] | None = None
    ) -> Any:
        """Update every member from ``p.grad``; members with ``mask`` False stay unchanged.

        Args:
            mask: Optional bool [n]: which members step. Masked-out members keep their
                parameters and optimizer state bit for bit.
            closure: Optional callable that re-evaluates the model and returns the loss.

        Returns:
            The closure's loss, or ``None``.

        Raises:
            TypeError: ``mask`` is not a bool tensor.
            ValueError: ``mask`` is not of shape [n].
        """
        check_mask(self._api, mask, self.num_members)
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
        api = f"{self._api}.apply_gradients"
        params = [p for g in self.param_groups for p in g["params"]]
        if len(grads) != len(params):
            raise ValueError(
                f"{api}: `grads` has {len(grads)} entries, expected {len(params)} (one per parameter)"
            )
        for k, (p, g) in enumerate(zip(params, grads, strict=True)):
            if g is not None and g.shape != p.shape:
                raise ValueError(
                    f"{api}: `grads[{k}]` has shape {list(g.shape)}, expected {list(p.shape)}"
                )
        check_mask(api, mask, self.num_members)
        self._update(grads, mask)

    # -- members -------------------------------------------------------------------------------

    def _fresh(self, groups: list[dict[str, Any]], defaults: dict[str, Any]) -> StackedOptimizer:
        """A new optimizer of this class over ``groups``, with no state (for ``select``)."""
        new = type(self).__new__(type(self))
        StackedOptimizer.__init__(new, groups, defaults)
        return new
