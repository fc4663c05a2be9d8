"""Ensemble: N initialisations of one ``nn.Module`` class, stacked and run at once."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from ._checks import expand_in_dims
from ._construction import (
    check_factory,
    check_options,
    check_seeding,
    factories_members,
    factory_members,
    rng_kept,
    runner_for,
)
from ._container_ops import check_call, member_index, member_module, refused_assignment, set_flags_
from ._ensemble_parts import check_factories, check_modules
from ._fastcall import tracked, untraced
from ._hooks import checked_hooks, refuse_template_hooks
from ._kept import call_noting, keep_, kept_anywhere, kept_rows
from ._kept_loans import loss_with_kept, rows_of_kept_
from ._linalg_failure import linalg_failure
from ._member_maps import looped, vmapped
from ._members import Factory, member_ids_for
from ._stacking import Stacked, scrubbed, stack_one_size
from ._storage import StackedModule
from ._unbatchable import Guard, follow_sparse, guarded

__all__ = ["Ensemble", "check_ensemble"]


class Ensemble(StackedModule):
    """N members of one architecture, stored stacked and run together.

    Every parameter and buffer of the member module is stored once, with a leading member
    dimension: ``ens.parameters()`` yields leaf tensors of shape ``[n, *member_shape]``, and
    ``ens.state_dict()`` has the member's own keys. Calling the ensemble runs all members on
    the same inputs through ``torch.func.functional_call`` under ``torch.func.vmap`` (or one
    after another with ``backend="loop"``); every output tensor gains a leading member dim.

    Member ``i`` is ``factory()``, built exactly as you would build it alone:

    * ``seed=None, seeds=None``: members come from the global RNG one after another, exactly
      as ``[factory() for _ in range(n)]`` would draw them.
    * ``seed=s``: member ``i`` is ``torch.manual_seed(vmapens.seeds.member_seed(s, i)); factory()``,
      a stream derived from ``(s, i)``: ensembles with different seeds share no member, any
      member can be rebuilt alone, and the caller's global RNG is left untouched.
    * ``seeds=[k0, k1, ...]``: member ``i`` is ``torch.manual_seed(seeds[i]); factory()``, to
      reproduce a naive loop over explicit seeds.

    Members are built one at a time and copied into the stacked storage, so building peaks
    at about the stacked size plus one member. The module ``functional_call`` runs lives on
    the ``meta`` device (``ens.template``).

    The verbs that act on an ensemble are free functions: ``vmapens.fit``,
    ``vmapens.make_step``, ``vmapens.save``, ``vmapens.save_members``, ``vmapens.gather``.

    Args:
        factory: zero-argument callable returning an ``nn.Module``: the class itself,
            ``functools.partial(MLP, 20)`` or a lambda.
        n: number of members, ``>= 1``.
        seed: ``None`` or an int (see above).
        seeds: ``None`` or one int per member (see above); excludes ``seed``.
        randomness: how random ops (dropout) draw per member, as in ``torch.func.vmap``:
            ``"different"`` (independent per member), ``"same"`` or ``"error"``.
        chunk_size: run at most this many members at once under ``vmap`` (bounds memory).
        backend: ``"vmap"`` (batched) or ``"loop"`` (members one after another through
            ``functional_call`` on the same storage, for forwards that ``vmap`` cannot batch,
            such as data-dependent Python control flow).
        shard: build only this process's block of members when a ``torch.distributed``
            process group is initialised (see ``docs/distributed.md``); needs ``seed``.

    Raises:
        ValueError: ``n < 1``, an unknown ``randomness``/``backend``, members that differ,
            an uninitialised lazy module, ``seeds`` of the wrong length, ``shard=True`` with
            ``nn.SyncBatchNorm`` (build the members with ``nn.BatchNorm*d``).
        TypeError: ``factory`` is not callable or does not return an ``nn.Module``.

    Example:
        >>> ens = Ensemble(lambda: nn.Linear(3, 2), n=4, seed=0)
        >>> ens(torch.randn(8, 3)).shape
        torch.Size([4, 8, 2])
    """

    def __init__(
        self,
        factory: Factory,
        n: int,
        *,
        seed: int | None = None,
        seeds: Sequence[int] | None = None,
        randomness: str = "different",
        chunk_size: int | None = None,
        backend: str = "vmap",
        shard: bool = False,
    ) -> None:
        super().__init__()
        api = "Ensemble"
        seeds = check_factory(api, factory, n, seed, seeds)
        self._configure(randomness, chunk_size, backend, api)
        member_ids = member_ids_for(n, shard, seed is not None or seeds is not None, api)
        with rng_kept():  # a failed build leaves the caller's RNG as it was
            self._take(factory_members(api, factory, seed, seeds, member_ids, shard), member_ids, n)

    @classmethod
    def from_modules(
        cls,
        modules: Sequence[nn.Module],
        *,
        randomness: str = "different",
        chunk_size: int | None = None,
        backend: str = "vmap",
        shard: bool = False,
    ) -> Ensemble:
        """Stack existing modules into an Ensemble (the modules are not modified).

        Args:
            modules: a non-empty sequence (or ``nn.ModuleList``) of modules of one class with
                the same parameter and buffer names, shapes, dtypes, devices and ``requires_grad``.
            randomness: see ``Ensemble``.
            chunk_size: see ``Ensemble``.
            backend: see ``Ensemble``.
            shard: keep only this process's block of ``modules`` (see ``Ensemble``).

        Returns:
            An Ensemble whose member ``i`` equals ``modules[i]``.

        Raises:
            TypeError: ``modules`` is not a sequence of ``nn.Module``.
            ValueError: ``modules`` is empty, a member differs from member 0, ``shard``
                with ``nn.SyncBatchNorm``.

        Example:
            >>> ens = Ensemble.from_modules([nn.Linear(3, 2) for _ in range(4)])
            >>> len(ens)
            4
        """
        api = "Ensemble.from_modules"
        modules = check_modules(api, modules, shard)
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        self._configure(randomness, chunk_size, backend, api)
        member_ids = member_ids_for(len(modules), shard, True, api)
        stacked = stack_one_size((modules[i] for i in member_ids), member_ids, api)
        self._take(stacked, member_ids, len(modules))
        return self

    @classmethod
    def from_factories(
        cls,
        factories: Sequence[Factory],
        *,
        seed: int | None = None,
        seeds: Sequence[int] | None = None,
        randomness: str = "different",
        chunk_size: int | None = None,
        backend: str = "vmap",
    ) -> Ensemble:
        """One member per factory (``factories[i]()``, seeded as for ``Ensemble``); sizes may
        differ.

        Members whose layers differ only in size (a width sweep:
        ``[partial(MLP, hidden=h) for h in (16, 32, 64)]``) are stored padded to the largest
        member and trained in one step, each exactly as alone at its own size; ``ens[i]``,
        ``unstack()``, ``state_dicts()`` and ``save_members`` give each at its own size
        (docs/semantics.md, "Members of different sizes"). All members are built before they
        are stacked: building peaks at about twice the stacked size.

        Args:
            factories: one zero-argument callable per member.
            seed, seeds, randomness, chunk_size, backend: as for ``Ensemble``.

        Raises:
            TypeError: ``factories`` is not a sequence of callables returning nn.Modules.
            ValueError: ``factories`` is empty; members differ in anything but sizes (a
                dropout rate); a layer that cannot be padded exactly differs in size
                (LayerNorm, attention: named); no member is the largest everywhere.

        Example:
            >>> from functools import partial
            >>> mlp = lambda h: nn.Sequential(nn.Linear(3, h), nn.Tanh(), nn.Linear(h, 1))
            >>> ens = Ensemble.from_factories([partial(mlp, h) for h in (4, 8)], seed=0)
            >>> ens(torch.randn(5, 3)).shape, ens[0][0].weight.shape
            (torch.Size([2, 5, 1]), torch.Size([4, 3]))
        """
        api = "Ensemble.from_factories"
        check_factories(api, factories)
        n = len(factories)
        seeds = check_seeding(api, n, seed, seeds)
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        self._configure(randomness, chunk_size, backend, api)
        with rng_kept():
            self._take(factories_members(api, factories, seed, seeds), range(n), n)
        return self

    def _configure(self, randomness: str, chunk_size: int | None, backend: str, api: str) -> None:
        check_options(api, randomness, chunk_size, backend)
        self.randomness, self.chunk_size, self.backend = randomness, chunk_size, backend

    def _take(self, stacked: Stacked, member_ids: Sequence[int], n_total: int) -> None:
        self.__dict__["_padding"] = stacked.padding
        self.__dict__["_template"] = stacked.template
        self.__dict__["_runner"] = runner_for(stacked.template)
        self._adopt(stacked.tensors, member_ids, n_total, stacked.training)

    # -- running ----------------------------------------------------------------------------

    def forward(self, *args: Any, in_dims: Any = None, **kwargs: Any) -> Any:
        """Run every member on the inputs; each output tensor gains a leading member dim.

        Args:
            *args: the member's positional inputs.
            in_dims: ``None`` (every member sees the same inputs), an int (every positional
                argument holds one slice per member along that dim) or a tuple with one entry
                (int or None) per positional argument, as in ``torch.func.vmap``.
            **kwargs: the member's keyword inputs, shared by all members.

        Returns:
            The member's output pytree with a leading member dim on every tensor.

        Raises:
            ValueError: a per-member input whose size along its ``in_dims`` is not ``len(ens)``;
                ``in_dims`` with keyword inputs only.
            RuntimeError: the member's forward cannot be batched by ``vmap``, draws random
                numbers with ``randomness="error"``, or reassigns a buffer to a value the
                stacked storage cannot hold (a buffer it reassigns is kept, as alone).
        """
        check_call(args, kwargs, in_dims, self.backend)
        return untraced(self._run)(args, kwargs, in_dims)

    def _run(self, args: tuple, kwargs: dict, in_dims: Any, loss: tuple | None = None) -> Any:
        """``forward``; with ``loss = (loss_fn, target, its in_dims)``, ``(outputs, losses)``:
        each member's ``loss_fn(output, target)`` after its forward, in the member map as the
        step runs it, reading its rows of what the forwards kept (``fit``'s validation)."""
        runner, template, n = self.runner, self._template, len(self)
        # Tensors the forward keeps (``self.kl = kl``), by turn: member (loop) or chunk (vmap)
        turns: list = []
        loss_fn, target, target_dims = loss or (None, None, None)
        if kept_anywhere(template):  # a write there first (`ens.template.h = ...`)
            self._follow_template()
        # Each member's rows of what the forwards kept before (the loop's: ``KeptTurns``)
        rows = kept_rows(template, n, runner)

        def member(state: dict[str, torch.Tensor], kw: dict, *given: Any) -> Any:
            given, own = (given[:-1], given[-1]) if rows else (given, None)
            args, y = (given, None) if loss_fn is None else (given[:-1], given[-1])
            out, kept = call_noting(runner, state, args, kw, turns, own)
            if loss_fn is None:
                return out
            lent = {} if runner is template else kept
            return out, loss_with_kept(loss_fn, out, y, template, lent).reshape(())

        # kwargs shared: runners in turns check it too; no loss, nothing kept: a plain map
        dims = (None, *expand_in_dims("Ensemble", in_dims, args, n))
        more, more_dims = ((), ()) if loss is None else ((target,), (target_dims,))
        if rows:
            more, more_dims = (*more, rows), (*more_dims, 0)
        out = self.map_members(member, kwargs, *args, *more, in_dims=dims + more_dims)
        self._keep(turns)
        return out

    def _keep(self, turns: list, detach: bool = False, stacked: dict | None = None) -> None:
        """``keep_`` on the template (``detach``: after a step; ``stacked``: the turns')."""
        keep_(self._template, self._followers[4], turns, len(self), detach, self.runner, stacked)

    def map_members(self, fn: Callable[..., Any], *args: Any, in_dims: Any = None) -> Any:
        """Run ``fn(member_state, *member_args)`` for every member, stacking the outputs.

        ``member_state`` is one member's parameters and buffers by name, ready for
        ``torch.func.functional_call(ens.runner, member_state, ...)``: the module the
        ensemble runs, with the layers vmap cannot batch (GRU, LSTM, ...) swapped for twins
        (``ens.template`` keeps torch's). This is what ``forward`` runs; buffers are
        restored if ``fn`` raises (see ``guard``).

        Args:
            fn: ``(member_state, *member_args) -> pytree of tensors``.
            *args: the arguments, shared or mapped according to ``in_dims``.
            in_dims: as in ``forward``.

        Returns:
            ``fn``'s output pytree with a leading member dim on every tensor.

        Raises:
            ValueError: a per-member input whose size along its ``in_dims`` is not ``len(ens)``.
            RuntimeError: ``fn`` cannot be batched by ``vmap``.
        """
        if not callable(fn):
            raise TypeError(f"Ensemble.map_members: `fn` must be callable, got {type(fn).__name__}")
        dims = expand_in_dims("Ensemble", in_dims, args, len(self))
        with self.guard():
            return self._member_map(fn, dims)(self.stacked_state(), *args)

    def _member_map(self, fn: Callable[..., Any], in_dims: tuple) -> Callable[..., Any]:
        """``fn`` lifted to ``(stacked_state, *args) -> stacked outputs``, the ensemble's way.

        The one place that applies ``backend``, ``chunk_size`` and ``randomness``: the eager
        forward and both training steps (eager and compiled) run members through it. It
        touches no state; wrap the call in ``guard()``.

        Args:
            fn: ``(member_state, *member_args) -> pytree of tensors``.
            in_dims: one entry (int or None) per positional argument of ``fn`` after the state.

        Returns:
            The batched function ``(stacked_state, *args, rows=None)``; ``rows`` (a slice)
            says which members ``stacked_state`` holds when it holds a chunk of them.
        """
        padding = self._padding
        member = tracked(fn)  # a buffer the forward reassigns: kept in the storage, as alone
        if padding is None:
            plain = self._lifted(member, in_dims)

            def run(state: dict[str, torch.Tensor], *args: Any, rows: Any = None) -> Any:
                return plain(state, *args)

            return run

        return padding.member_map(self._lifted, member, in_dims, set(self._parameters))

    def _lifted(self, fn: Callable[..., Any], in_dims: tuple) -> Callable[..., Any]:
        if self.backend == "loop":
            return looped(len(self), self.randomness, fn, in_dims, self.runner)
        checked_hooks(refuse_template_hooks, self._template, self._runner)
        return vmapped(len(self), self.randomness, self.chunk_size, fn, in_dims, self.runner)

    @contextlib.contextmanager
    def guard(self, api: str = "Ensemble", *, loss: bool = False) -> Iterator[Guard]:
        """Around a call of the members: what every call of ``_member_map`` runs inside.

        * vmap can fail after BatchNorm has updated some members' statistics: the buffers
          are copied first and given back on any exception, so a failed call changes nothing.
        * "cannot batch" errors of ``torch.func`` become a message that says what to do.
        * CPU attention (``F.scaled_dot_product_attention``, ``nn.MultiheadAttention``,
          ``nn.TransformerEncoder``) runs as one call for all members instead of a member
          loop, and the eval-mode fast path that vmap cannot batch is off
          (``vmapens._attention.batched_attention``). A compiled step enters this outside
          its graph.
        * With grad on, a trained ``sparse=True`` layer is refused first (``follow_sparse``).
        * ``loss``: the call runs ``loss_fn`` too (errors name it).

        Yields a ``Guard``: set its ``members_ran`` once the members' forward and backward
        are done, and a later error (clipping, the optimizer) is raised as it is.
        """
        self._follow_template()
        if self._sparse:
            follow_sparse(api, self._sparse, torch.is_grad_enabled())
        buffers = list(self.stacked_buffers().values())
        g = None
        try:
            with guarded(buffers, api, type(self._template).__name__, self.backend, loss) as g:
                yield g
        except torch.linalg.LinAlgError as err:  # one member's matrix: said as its own
            if g is None or g.members_ran:
                raise
            raise linalg_failure(api, err, len(self), self.chunk_size) from err
        finally:  # weight_norm's tensor, set by its hook: one member's, with its graph
            for m, name, meta in self._followers[2]:
                m.__dict__[name] = meta

    # -- members ------------------------------------------------------------------------------

    def __getitem__(self, index: Any) -> Any:
        """``ens[i]``: member ``i`` as a module of the user's class; ``ens[2:5]``, ``ens[[0, 3]]``:
        a sub-Ensemble (see ``select``).

        Any integer-like works as ``i`` (int, numpy integer, 0-d integer tensor).
        """
        i = member_index(index)
        if i is None:
            return self.select(index)
        if not -len(self) <= i < len(self):
            raise IndexError(f"Ensemble: member index {i} out of range for {len(self)} members")
        i %= len(self)
        self._follow_template()
        with scrubbed(self._template):  # a tensor the forward kept: given back afterwards
            member = member_module(
                self._template, self.runner, self.stacked_state(), self._padding, i
            )
        if self._padding is None:
            rows_of_kept_(member, self._template, i)
        return member

    def __setitem__(self, index: Any, value: Any) -> None:
        raise TypeError(refused_assignment(index))

    def __iter__(self) -> Iterator[nn.Module]:
        return (self[i] for i in range(len(self)))

    def requires_grad_(self, requires_grad: bool = True) -> Ensemble:
        """``nn.Module.requires_grad_`` for every member: the stacked parameters' flags and the
        template's (``ens.template``) set together, so that a flag set afterwards on either side
        counts as on a plain module, on a copy not called yet too (``ens.requires_grad_(False)``,
        then ``ens.template.head.requires_grad_(True)`` trains the head)."""
        self._follow_template()  # flags set before this call, on either side, first
        set_flags_(self._followers[1], requires_grad)
        self._follow_template()
        return self

    def unstack(self) -> list[nn.Module]:
        """All members as a list of ordinary modules of the user's class.

        Example:
            >>> models = Ensemble(lambda: nn.Linear(3, 2), n=4).unstack()
            >>> type(models[0]).__name__
            'Linear'
        """
        return list(self)


def check_ensemble(api: str, value: Any, name: str = "ens") -> None:
    """Raise TypeError unless ``value`` is an :class:`Ensemble`, naming argument ``name``."""
    if not isinstance(value, Ensemble):
        raise TypeError(f"{api}: `{name}` must be a vmapens.Ensemble, got {type(value).__name__}")
