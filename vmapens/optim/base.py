"""StackedOptimizer: what every stacked optimizer shares, written once.

A concrete optimizer is its update rule (:attr:`~StackedOptimizer.rule`, a function over lists
of stacked tensors) plus a table of its hyperparameters. The base does the rest, once:
per-member hyperparameters (validated, cut to a shard's block, kept as :class:`MemberValues`
for torch's schedulers), state created lazily and following the parameters' dtype and device,
the parameters that share a step count handed to the rule together, masks and the rollback of a
failed update (by its :class:`~vmapens.optim._keep.Snapshot`), gradients given explicitly
(``apply_gradients``, for compiled steps), the hand-off of one member's state to the plain
torch optimizer, and sub-ensemble selection.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from .._checks import check_mask
from .._member_reach import hold, reached_rows
from ._buckets import layout, share_counts
from ._calls import rule_calls, run_calls
from ._eager import EagerOptimizer, hooked_step
from ._flags import IMPLEMENTATION, check_flags, check_implementation, implementation_flags
from ._handoff import check_state_dict, copy_rows, load_hooks, member_state_dict, select_parts
from ._hyper import (
    FREE_ON_LOAD,
    Hyper,
    check_grads,
    check_hypers,
    group_args,
    leading_n,
    local_values,
    params_of,
    unnamed,
)
from ._keep import Snapshot
from ._kinds import check_complex, check_dense, check_ordered
from ._state import fill_state

__all__ = ["StackedOptimizer"]

# What a subclass constructor's locals() holds besides its options.
_NOT_OPTIONS = ("self", "params", "__class__", "implementation")


class StackedOptimizer(EagerOptimizer):
    """Base class of stacked optimizers: member ``i`` of every tensor is ``p[i]``.

    Subclasses set :attr:`rule`, :attr:`hyperparameters` (name -> :class:`Hyper`, in torch's
    order) and :attr:`torch_class` (the plain optimizer a member hands off to, None where
    torch has none), and implement :meth:`state_names`; :meth:`scalar_state` and
    :meth:`initial_state` add per-member counters and non-zero initial state. A subclass
    constructor names its options with torch's defaults, takes ``**implementation`` and
    calls ``super().__init__(params, locals())``.

    torch's implementation flags (``foreach``, ``fused``, ``capturable``, ``differentiable``)
    are accepted where :attr:`torch_class` takes them, at the values that change nothing, and
    kept in ``param_groups`` as torch keeps them; ``fused=False`` keeps the update off torch's
    fused kernels.

    Args:
        params: stacked tensors ``[n, ...]``, param-group dicts, or an ``Ensemble``.
        options: every hyperparameter and flag by name: the subclass constructor's
            ``locals()`` (``self``, ``params`` and ``__class__`` are dropped; its
            ``implementation`` holds torch's implementation flags), or a ``defaults`` dict.

    Raises:
        TypeError: an implementation flag that :attr:`torch_class` does not take.
        ValueError: an implementation flag at a value that would change the results.
    """

    #: The update rule: ``rule(params, grads, state, group)`` steps the stacked ``params``
    #: (which share one step count) in place. ``state`` maps each of :meth:`state_names` to
    #: one tensor per parameter and each :meth:`scalar_state` name to the shared ``[n]``
    #: tensor (float32, or float64 under a float64 default dtype:
    #: :func:`~vmapens.optim._buckets.scalar_dtype`);
    #: ``group`` holds the flags, per hyperparameter a float or a float64 ``[n]`` tensor
    #: on the parameters' device, ``mask`` (None or bool [n], the members that step:
    #: the base gives the others their old values back afterwards) and ``fused`` (whether
    #: the rule may run torch's fused kernel, see ``fusable``).
    rule: ClassVar[staticmethod[[list[Tensor], list[Tensor], dict[str, Any], dict[str, Any]], None]]
    hyperparameters: ClassVar[dict[str, Hyper]] = {}
    torch_class: ClassVar[type[torch.optim.Optimizer] | None]
    #: Whether the rule treats every element on its own. Members of different sizes
    #: (``Ensemble.from_factories``) are stored padded, which only an elementwise rule leaves
    #: exact: a factored or orthogonalised update (Adafactor, Muon) is refused for them.
    elementwise: ClassVar[bool] = True
    # Not `n`: dynamo's OptimizerVariable intercepts any attribute name that is a substring of
    # "_init_group" (torch 2.13), which breaks the graph.
    num_members: int

    def __init__(self, params: Any, options: dict[str, Any]) -> None:
        defaults = {k: v for k, v in options.items() if k not in _NOT_OPTIONS}
        flags = implementation_flags(type(self).torch_class)
        for flag in flags:  # torch's default: every group holds each flag its twin's groups hold
            defaults.setdefault(flag, IMPLEMENTATION[flag][0][0])
        check_implementation(self._api, flags, options.get("implementation", {}))
        defaults.update(options.get("implementation", {}))
        items = params_of(params, self._api)
        tensors = unnamed(
            [t for it in items for t in (params_of(it["params"]) if isinstance(it, dict) else [it])]
        )
        self.num_members = leading_n(self._api, tensors)
        if not type(self).elementwise and any(hasattr(t, "_member_padding") for t in tensors):
            raise ValueError(
                f"{self._api}: the ensemble holds members of different sizes, padded to the "
                "largest, and this rule is not elementwise (its update of an entry depends on "
                "the parameter's whole shape), so padding would change every member's update; "
                "use an elementwise optimizer (StackedAdam, StackedSGD...) or one Ensemble per size"
            )
        # A sharded Ensemble holds one block of its n_total members: per-member values given
        # for all of them are cut to the block's global ids (docs/distributed.md).
        n_total = getattr(params, "n_total", self.num_members)
        self._block = getattr(params, "member_ids", None) if n_total != self.num_members else None
        self._n_total = n_total
        self._normalise(defaults)
        self._ready: list[tuple | None] = []  # per param group: the layout its state matches
        self._complex: set[int] = set()  # the param groups with complex tensors (as of _ready)
        self._snapshot = Snapshot()
        self._layouts = 0  # counts prepare()'s re-checks: the snapshot's layout token
        super().__init__(items, defaults)

    @property
    def _api(self) -> str:
        return type(self).__name__

    @property
    def _who(self) -> dict[str, Any]:
        return {"api": f"{self._api}.step", "n": self.num_members}

    # -- what a subclass provides ---------------------------------------------------------------

    def state_names(self, group: dict[str, Any]) -> tuple[str, ...]:
        """The per-parameter state tensors (shaped like the parameter) this group needs."""
        raise NotImplementedError

    def update_(
        self,
        params: list[Tensor],
        grads: list[Tensor],
        state: dict[str, Any],
        group: dict[str, Any],
    ) -> None:
        """One step in place: :attr:`rule` (override to wrap it)."""
        type(self).rule(params, grads, state, group)

    def member_state(
        self, state: dict[str, Tensor], group: dict[str, Any], i: int
    ) -> dict[str, Tensor]:
        """Member ``i``'s state for :attr:`torch_class` (default: every tensor's row ``i``;
        none before the member's first step, as torch makes its state then)."""
        if "step" in state and state["step"][i] == 0:
            return {}
        return {key: v[i].clone() for key, v in state.items()}

    def scalar_state(self, group: dict[str, Any]) -> dict[str, float]:
        """The per-member ``[n]`` counters (name -> starting value), ``step`` first.

        These count per member, not per element (NAdam adds ``mu_product``). As torch keeps
        them, they are created in torch's scalar dtype whatever the parameters' dtype: float32,
        or float64 under ``torch.set_default_dtype(torch.float64)``
        (:func:`~vmapens.optim._buckets.scalar_dtype`), and keep that dtype when the state
        moves or is loaded.
        """
        return {"step": 0.0}

    def initial_state(self, name: str, param: Tensor, group: dict[str, Any]) -> Tensor:
        """State ``name`` of ``param`` before the first step (default: zeros).

        ``group`` is as :attr:`rule` reads it (hyperparameters as floats or ``[n]``).
        """
        return torch.zeros_like(param, memory_format=torch.contiguous_format)

    # -- hyperparameters ------------------------------------------------------------------------

    def _normalise(self, group: dict[str, Any], free: tuple[str, ...] = ()) -> None:
        flags = {k: v for k, v in group.items() if k in IMPLEMENTATION}
        check_implementation(self._api, implementation_flags(type(self).torch_class), flags)
        check_flags(self._api, group, type(self), self.hyperparameters)
        local = functools.partial(local_values, block=self._block, n_total=self._n_total)
        check_hypers(self._api, group, self.hyperparameters, self.num_members, local, free)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a param group, validated like the constructor's arguments.

        Args:
            param_group: A dict with ``params`` and optional hyperparameter overrides.
        """
        check_ordered(f"{self._api}.add_param_group", param_group.get("params"))
        group = dict(param_group)
        group["params"] = params_of(group["params"], f"{self._api}.add_param_group")
        if group["params"]:  # an empty group is kept, as torch keeps one
            leading_n(self._api, group["params"], self.num_members)
        for key, default in self.defaults.items():
            group.setdefault(key, default)
        check_complex(self._api, unnamed(group["params"]), type(self).elementwise)
        self._normalise(group)
        super().add_param_group(group)
        hold(group["params"])  # steps only the members whose rows a backward reached
        self._ready.append(None)

    # -- state ---------------------------------------------------------------------------------

    def prepare(self) -> None:
        """Create missing state and move state that no longer matches its parameter.

        State is created at the first step, as torch's optimizers do, and follows the
        parameters afterwards: ``opt = StackedAdam(ens); ens.double()`` steps in float64. Steps
        call this themselves; a compiled step calls it before entering the graph.
        """
        compiling = torch.compiler.is_compiling()
        for index, group in enumerate(self.param_groups):
            # Not skipped while tracing: dynamo then guards on the state it reads.
            names = self.state_names(group)  # a flag changed mid-run (momentum) adds state
            # An empty group updates nothing: its flags are moot (dynamo sets capturable=True
            # on one, all() of no parameters being on CUDA), as torch ignores them there.
            impl = (
                {}
                if compiling or not group["params"]
                else {k: group[k] for k in IMPLEMENTATION if k in group}
            )
            ready = not compiling and self._ready[index] == (layout(group["params"]), names, impl)
            if ready and all(map(self.state.get, group["params"])):  # `del opt.state[p]`: anew
                continue
            if not compiling:  # `differentiable=True` set mid-run is refused, not ignored
                check_implementation(self._who["api"], implementation_flags(self.torch_class), impl)
            complex_ = check_complex(self._api, group["params"], type(self).elementwise)
            starts, params = self.scalar_state(group), group["params"]
            args = functools.partial(group_args, group, self.hyperparameters, **self._who)
            complete = fill_state(
                params, self.state, starts, names, self.num_members, self.initial_state, args
            )
            if not compiling:
                share_counts([self.state[p] for p in group["params"]], tuple(starts))
                # Not ready while a state keeps a dtype of its own: cast once it steps.
                self._ready[index] = (layout(group["params"]), names, impl) if complete else None
                (self._complex.add if complex_ else self._complex.discard)(index)
                self._layouts += 1  # tells the snapshot that tensors may have changed in place

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict saved by ``state_dict()``, checked whole first: one that does not
        fit (another optimizer's, say) raises and changes nothing.

        Raises:
            ValueError: param groups or state that do not fit this optimizer (missing or
                invalid hyperparameters, unknown parameters, tensors of other shapes).
            TypeError: a hyperparameter of the wrong type.
        """
        with load_hooks(self, state_dict) as state_dict:  # what the pre-hooks return
            check_state_dict(self, state_dict)
            super().load_state_dict(state_dict)
            for group in self.param_groups:  # as checked: a list of n values -> MemberValues
                self._normalise(group, FREE_ON_LOAD)
            self._ready = [None] * len(self.param_groups)
            if self.state:
                self.prepare()

    def __getstate__(self) -> dict[str, Any]:
        # torch's keeps defaults, state and param_groups only: deepcopy and pickle lost n, block
        kept = {k: self.__dict__[k] for k in ("num_members", "_block", "_n_total")}
        return {**super().__getstate__(), **kept}

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        # torch's __setstate__ (load_state_dict, deepcopy, unpickling) adds `differentiable`
        # to every optimizer's defaults; where the twin has no such flag, add_param_group
        # would then refuse it.
        if "differentiable" not in implementation_flags(type(self).torch_class):
            self.defaults.pop("differentiable", None)
        self._ready = [None] * len(self.param_groups)
        self._snapshot, self._layouts, self._complex = Snapshot(), 0, set()

    # -- stepping ------------------------------------------------------------------------------

    def _update(
        self,
        grads: Sequence[Tensor | None],
        mask: Tensor | None,
        reached: Sequence[Tensor | None] = (),
    ) -> None:
        self.prepare()
        calls = rule_calls(self, grads, mask, reached)
        own = type(self).rule if type(self).update_ is StackedOptimizer.update_ else None
        try:
            with torch.no_grad():  # a failed step changes nothing, masked members keep theirs
                run_calls(self.update_, own, calls, self._snapshot, self._layouts)
        except RuntimeError:  # NotImplementedError too
            check_dense(self._who["api"], grads)  # a sparse gradient: say so
            raise

    @hooked_step
    def step(  # type: ignore[override]
        self, mask: Tensor | None = None, closure: Callable[[], Any] | None = None
    ) -> Any:
        """Update every member from ``p.grad``; members with ``mask`` False stay unchanged.

        Args:
            mask: Optional bool [n]: which members step. Masked-out members keep their
                parameters and optimizer state bit for bit.
            closure: Optional callable that re-evaluates the model and returns the loss;
                also taken first, as torch's ``step(closure)``.

        Returns:
            The closure's loss, or ``None``.

        Raises:
            TypeError: ``mask`` is not a bool tensor.
            ValueError: ``mask`` is not of shape [n].
        """
        if callable(mask) and closure is None:  # torch's step(closure), positionally
            mask, closure = None, mask
        check_mask(self._api, mask, self.num_members)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        params = [p for g in self.param_groups for p in g["params"]]
        # backend="loop": a member whose forward never read p steps no row of it, as alone
        # (not in a graph of your own: dynamo cannot trace the weak dict that says it)
        rows = [] if torch.compiler.is_compiling() else reached_rows(params)
        self._update([_own_grad(p) for p in params], mask, rows)
        return loss

    def apply_gradients(self, grads: Sequence[Tensor | None], mask: Tensor | None = None) -> None:
        """Update every member from explicit gradients instead of ``p.grad``.

        Meant for compiled steps that compute gradients functionally (``torch.func.grad``).

        Args:
            grads: One gradient (or ``None``) per parameter, in the order of the parameters
                flattened over ``param_groups``.
            mask: Optional bool [n]: which members step.

        Raises:
            ValueError: Wrong number, shapes or dtypes of gradients, or a bad ``mask``.
            TypeError: ``mask`` is not a bool tensor.
        """
        api = f"{self._api}.apply_gradients"
        grads = list(grads)
        check_grads(api, [p for g in self.param_groups for p in g["params"]], grads)
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
                ones (by name with ``param_names``, else their shapes in any order).

        Returns:
            A ``torch.optim.Optimizer`` state dict with member ``i``'s float hyperparameters
            and cloned slices of its state.

        Raises:
            IndexError: ``i`` out of range.
            ValueError: ``module``'s parameters do not match.
        """
        return member_state_dict(self, i, module)

    def select(self, index: Any, params: Any) -> StackedOptimizer:
        """A new optimizer of this class for a sub-ensemble, with its members' state.

        Args:
            index: the members kept, as for ``Ensemble.select``.
            params: the sub-ensemble ``ens.select(index)`` (matched by name) or its stacked
                parameters, in this optimizer's order (docs/optim.md).

        Returns:
            An optimizer whose member ``k`` has member ``index[k]``'s hyperparameters and state.

        Raises:
            ValueError: ``params`` does not match this optimizer's parameters.
        """
        rows, groups, defaults = select_parts(self, index, params)
        new = type(self).__new__(type(self))
        StackedOptimizer.__init__(new, groups, defaults)
        copy_rows(self, new, rows)
        if new.state:
            new.prepare()
        return new


def _own_grad(p: Tensor) -> Tensor | None:
    """``p.grad``, zero where a member of another size is padded: a hand-written loss over the
    padded storage (a penalty on ``ens.stacked_params()``) gives those entries gradients, which
    moved them off zero (the step's masked forward gives them none)."""
    padded = getattr(p, "_member_padding", None)
    if padded is None or p.grad is None or p.grad.layout != torch.strided:
        return p.grad
    padding, name = padded
    mask = padding.masks({name: p}).get(name)  # None: no member is padded in this tensor
    return p.grad if mask is None else p.grad * mask
