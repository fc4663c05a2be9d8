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

import math
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, cast

import torch
from torch import Tensor, nn

from .._checks import check_mask, column, index_rows
from ._hyper import (
    NONNEGATIVE,
    UNIT,
    Hyper,
    Scalar,
    check_hyper,
    group_args,
    local_values,
    member_column,
    pick_group,
)

__all__ = ["NONNEGATIVE", "UNIT", "Hyper", "Scalar", "StackedOptimizer", "member_column"]


def _rows(t: Tensor) -> Tensor:
    """View a stacked tensor as [n, k] (k may be 0) so per-member scalars broadcast as [n, 1]."""
    return t.reshape(t.shape[0], math.prod(t.shape[1:]))


def _params_of(params: Any) -> list[Any]:
    if isinstance(params, nn.Module):
        return list(params.parameters())
    if isinstance(params, Tensor):
        return [params]
    return list(params)


class StackedOptimizer(torch.optim.Optimizer):
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
        items = _params_of(params)
        tensors = [
            t for it in items for t in (_params_of(it["params"]) if isinstance(it, dict) else [it])
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

    @property
    def _api(self) -> str:
        return type(self).__name__

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
        group["params"] = _params_of(group["params"])
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
            if changed or flat is None or flat["key"] != _layout(group["params"]):
                self._pack(index)

    def _pack(self, index: int) -> None:
        """Move the group's state into flat ``[n, total]`` buffers that the state keeps views of.

        While every parameter of the group has a gradient and one shared step count, a step
        is then one update on a single ``[n, total]`` tensor.
        """
        group = self.param_groups[index]
        params = group["params"]
        key = _layout(params)
        if len({(p.dtype, p.device) for p in params}) != 1:
            self._flat[index] = {"key": key, "step": None}  # mixed: per-tensor updates only
            return
        states = [self.state[p] for p in params]
        scalars = {}
        for name in self.scalar_state(group):
            shared = states[0][name]
            if not torch.compiler.is_compiling() and all(
                torch.equal(s[name], shared) for s in states
            ):
                for s in states:  # equal counts (e.g. after load_state_dict): share them again
                    s[name] = shared
            scalars[name] = shared
        flat: dict[str, Any] = {"key": key, "step": scalars["step"], "scalars": scalars}
        flat["views"] = {}
        # Kept between steps for the concatenated parameters, gradients and a scratch tensor:
        # on CPU, fresh [n, total] temporaries every step make the system allocator hand pages
        # back and fault them in again (3x slower at n=4096). CUDA's allocator reuses blocks.
        total = sum(p[0].numel() for p in params)
        p0 = params[0]
        flat["workspace"] = (
            torch.empty(3, self.num_members, total, dtype=p0.dtype).unbind()
            if p0.device.type == "cpu"
            else (None, None, None)
        )
        for name in self.state_names(group):
            flat[name] = torch.cat([_rows(s[name]) for s in states], dim=1)
            offset, views = 0, []
            for s, p in zip(states, params, strict=True):
                size = p[0].numel()
                s[name] = flat[name][:, offset : offset + size].view(p.shape)
                views.append(s[name])
                offset += size
            flat["views"][name] = views
        self._flat[index] = flat

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict saved by ``state_dict()`` (then re-flatten the state)."""
        super().load_state_dict(state_dict)
        self._flat = [None] * len(self.param_groups)
        if self.state:
            self.prepare()

    def _flat_state(self, index: int, grads: list[Tensor | None]) -> dict | None:
        """Group ``index``'s flat buffers when the single-tensor update applies, else None."""
        flat = self._flat[index]
        if flat is None or flat["step"] is None or any(g is None for g in grads):
            return None
        params = self.param_groups[index]["params"]
        for k, p in enumerate(params):
            s = self.state[p]
            if not p.is_contiguous() or any(s[c] is not v for c, v in flat["scalars"].items()):
                return None
            if any(s[key] is not views[k] for key, views in flat["views"].items()):
                return None
        return flat

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
        backup = [t.clone() for t in saved]
        try:
            with torch.no_grad():
                for index, group, g, flat in plan:
                    self._update_group(index, group, g, flat, mask)
        except BaseException:
            with torch.no_grad():
                for t, b in zip(saved, backup, strict=True):
                    t.copy_(b)
            raise

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
            rows = [_rows(p) for p in params]  # views: the params are contiguous
            work = flat["workspace"]
            p = torch.cat(rows, dim=1, out=work[0])
            dense = cast("list[Tensor]", g)  # _flat_state found no None gradient
            flat_grad = torch.cat([_rows(x) for x in dense], dim=1, out=work[1])
            state = {k: flat[k] for k in flat["views"]}
            state.update(flat["scalars"])
            if work[2] is not None:
                state["_workspace"] = work[2]
            self._masked(p, flat_grad, state, args, mask)
            torch._foreach_copy_(rows, list(p.split([r.shape[1] for r in rows], dim=1)))
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
        tensors = [param, *(v for k, v in state.items() if not k.startswith("_"))]
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

    def member_state_dict(self, i: int, module: nn.Module | None = None) -> dict[str, Any]:
        """Member ``i``'s optimizer state, loadable by the plain torch optimizer.

        Build ``torch_class`` over the member's parameters with the same param-group layout,
        then ``opt.load_state_dict(stacked.member_state_dict(i))`` continues member ``i``
        alone on exactly its ensemble trajectory.

        Args:
            i: Member index (negative counts from the end).
            module: Optional member module; its parameters are checked against the stacked
                ones (count and shapes, in order).

        Returns:
            A ``torch.optim.Optimizer`` state dict with member ``i``'s float hyperparameters
            and cloned slices of its state.

        Raises:
            IndexError: ``i`` out of range.
            ValueError: ``module``'s parameters do not match.
        """
        api = f"{self._api}.member_state_dict"
        n = self.num_members
        if not -n <= i < n:
            raise IndexError(f"{api}: `i`={i} out of range for n={n}")
        i %= n
        params = [p for g in self.param_groups for p in g["params"]]
        if module is not None:
            shapes = [tuple(p.shape) for p in module.parameters()]
            expected = [tuple(p.shape[1:]) for p in params]
            if shapes != expected:
                raise ValueError(
                    f"{api}: `module` parameters do not match the stacked ones; got shapes "
                    f"{shapes}, expected {expected} (same order)"
                )
        groups, state, start = [], {}, 0
        for group in self.param_groups:
            ids = list(range(start, start + len(group["params"])))
            start += len(ids)
            groups.append({**pick_group(group, self.hyperparameters, [i]), "params": ids})
            for k, p in zip(ids, group["params"], strict=True):
                member = self.member_state(self.state[p], group, i) if self.state[p] else {}
                if member:
                    state[k] = member
        return {"state": state, "param_groups": groups}

    def select(self, index: Any, params: Any) -> StackedOptimizer:
        """A new optimizer of this class for a sub-ensemble, with its members' state.

        Args:
            index: the members kept, as for ``Ensemble.select``.
            params: the sub-ensemble (``ens.select(index)``) or its stacked parameters, in the
                same order as this optimizer's.

        Returns:
            An optimizer whose member ``k`` has member ``index[k]``'s hyperparameters and state.

        Raises:
            ValueError: ``params`` does not match this optimizer's parameters.
        """
        rows = index_rows(f"{self._api}.select", index, self.num_members)
        new_params = _params_of(params)
        old = [p for g in self.param_groups for p in g["params"]]
        shapes = [tuple(p.shape[1:]) for p in new_params]
        if shapes != [tuple(p.shape[1:]) for p in old]:
            raise ValueError(
                f"{self._api}.select: `params` do not match this optimizer's parameters "
                f"(member shapes {shapes})"
            )
        picked = rows.tolist()
        groups, start = [], 0
        for group in self.param_groups:
            size = len(group["params"])
            groups.append(
                {
                    **pick_group(group, self.hyperparameters, picked),
                    "params": new_params[start : start + size],
                }
            )
            start += size
        new = type(self).__new__(type(self))
        defaults = pick_group(self.defaults, self.hyperparameters, picked)
        StackedOptimizer.__init__(new, groups, defaults)
        for p_old, p_new in zip(old, new_params, strict=True):
            if self.state[p_old]:
                new.state[p_new] = {
                    k: v[rows.to(v.device)].clone() for k, v in self.state[p_old].items()
                }
        if new.state:
            new.prepare()
        return new


def _layout(params: list[Tensor]) -> tuple:
    return tuple((p.dtype, p.device, tuple(p.shape)) for p in params)
