"""Ensemble: N initialisations of one ``nn.Module`` class, stacked and run at once."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.func import functional_call, vmap
from torch.nn.utils.rnn import PackedSequence

from ._attention import batched_attention
from ._checks import check_choice, check_int, expand_in_dims, to_index
from ._members import (
    Factory,
    build_members,
    check_member,
    check_same,
    check_seeds,
    looped,
    member_ids_for,
    meta_copy,
    named_tensors,
    signature,
)
from ._padding import Padding, check_pair, gates_of, largest
from ._precision import autocast_members
from ._recurrent import batchable
from ._storage import StackedModule
from ._unbatchable import explain_failure, refuse_template_hooks, unchunked

__all__ = ["Ensemble"]

RANDOMNESS = ("different", "same", "error")
BACKENDS = ("vmap", "loop")


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
            an uninitialised lazy module, ``seeds`` of the wrong length.
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
        if isinstance(factory, nn.Module):
            raise TypeError(
                f"{api}: `factory` must build a new member on each call, got an instance of "
                f"{type(factory).__name__}; pass the class (or a lambda), or use "
                "Ensemble.from_modules([...]) to stack existing modules"
            )
        if not callable(factory):
            raise TypeError(
                f"{api}: `factory` must be a zero-argument callable returning an nn.Module, "
                f"got {type(factory).__name__}"
            )
        check_int(api, "n", n, minimum=1)
        if seed is not None:
            check_int(api, "seed", seed)
        if seeds is not None:
            seeds = check_seeds(api, seeds, n, seed)
        self._configure(randomness, chunk_size, backend, api)
        member_ids = member_ids_for(n, shard, seed is not None or seeds is not None, api)
        rng = torch.get_rng_state()
        try:
            self._init_storage(build_members(factory, seed, seeds, member_ids), member_ids, n, api)
        except BaseException:
            torch.set_rng_state(rng)  # a failed build leaves the caller's RNG as it was
            raise

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
            modules: a non-empty sequence of modules of one class with the same parameter and
                buffer names, shapes, dtypes, devices and ``requires_grad``.
            randomness: see ``Ensemble``.
            chunk_size: see ``Ensemble``.
            backend: see ``Ensemble``.
            shard: keep only this process's block of ``modules`` (see ``Ensemble``).

        Returns:
            An Ensemble whose member ``i`` equals ``modules[i]``.

        Raises:
            TypeError: ``modules`` is not a sequence of ``nn.Module``.
            ValueError: ``modules`` is empty, or a member differs from member 0.

        Example:
            >>> ens = Ensemble.from_modules([nn.Linear(3, 2) for _ in range(4)])
            >>> len(ens)
            4
        """
        api = "Ensemble.from_modules"
        if isinstance(modules, nn.Module) or not isinstance(modules, Sequence):
            raise TypeError(
                f"{api}: `modules` must be a sequence (list or tuple) of nn.Module, got "
                f"{type(modules).__name__}"
            )
        if len(modules) == 0:
            raise ValueError(f"{api}: `modules` must not be empty")
        for i, module in enumerate(modules):
            check_member(module, i, api)
        reference = signature(modules[0])
        for i, module in enumerate(modules[1:], start=1):
            check_same(reference, module, i, api)
            check_pair(api, modules[0], module, i, padded=False)
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        self._configure(randomness, chunk_size, backend, api)
        member_ids = member_ids_for(len(modules), shard, True, api)
        self._init_storage((modules[i] for i in member_ids), member_ids, len(modules), api)
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
        """An Ensemble whose member ``i`` is ``factories[i]()``: one member per factory, sizes
        may differ.

        Members of one class whose layers differ only in size (a width sweep:
        ``[functools.partial(MLP, hidden=h) for h in (16, 32, 64)]``) are stored padded to the
        largest member and trained in one vmapped step; each computes what it computes alone
        at its own size (docs/semantics.md, "Members of different sizes"). ``ens[i]``,
        ``unstack()``, ``state_dicts()`` and ``save_members`` give every member at its own
        size. Seeding is as for ``Ensemble`` (``seed``: member ``i`` is
        ``torch.manual_seed(member_seed(seed, i)); factories[i]()``). All members are built
        before they are stacked, so building peaks at about twice the stacked size.

        Args:
            factories: one zero-argument callable per member.
            seed: see ``Ensemble``.
            seeds: see ``Ensemble``.
            randomness: see ``Ensemble``.
            chunk_size: see ``Ensemble``.
            backend: see ``Ensemble``.

        Returns:
            The Ensemble, padded when the members' shapes differ.

        Raises:
            TypeError: ``factories`` is not a sequence of callables, or one returns something
                other than an ``nn.Module``.
            ValueError: ``factories`` is empty; members differ in anything but sizes (class,
                layers, settings such as a dropout rate); a layer that cannot be padded
                exactly has different sizes (LayerNorm, attention...: the message names it);
                no member is the largest in every dimension.

        Example:
            >>> import functools
            >>> ens = Ensemble.from_factories(
            ...     [functools.partial(nn.Linear, 3, h) for h in (2, 4)], seed=0
            ... )
            >>> ens(torch.randn(5, 3)).shape, ens[0].weight.shape
            (torch.Size([2, 5, 4]), torch.Size([2, 3]))
        """
        api = "Ensemble.from_factories"
        if isinstance(factories, nn.Module) or not isinstance(factories, Sequence):
            raise TypeError(
                f"{api}: `factories` must be a sequence (list or tuple) of zero-argument "
                f"callables, got {type(factories).__name__}"
            )
        if len(factories) == 0:
            raise ValueError(f"{api}: `factories` must not be empty")
        for k, factory in enumerate(factories):
            if isinstance(factory, nn.Module) or not callable(factory):
                raise TypeError(
                    f"{api}: `factories[{k}]` must be a zero-argument callable returning an "
                    f"nn.Module, got {type(factory).__name__}"
                )
        n = len(factories)
        if seed is not None:
            check_int(api, "seed", seed)
        if seeds is not None:
            seeds = check_seeds(api, seeds, n, seed)
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        self._configure(randomness, chunk_size, backend, api)
        rng = torch.get_rng_state()
        try:
            members = list(build_members(factories, seed, seeds, range(n)))
            self._init_sized(members, api)
        except BaseException:
            torch.set_rng_state(rng)
            raise
        return self

    def _init_sized(self, members: list[nn.Module], api: str) -> None:
        """Stack ``members`` padded to the largest (plainly when all have one size)."""
        kinds: dict[tuple, int] = {}
        kind_of = [kinds.setdefault(_shapes_key(m), len(kinds)) for m in members]
        reference = signature(members[0])
        for i, member in enumerate(members[1:], start=1):
            check_pair(api, members[0], member, i, padded=len(kinds) > 1)
            check_same(reference, member, i, api, shapes=False)
        firsts = [members[kind_of.index(k)] for k in range(len(kinds))]
        big = firsts[largest(api, [dict(_shapes_key(m)) for m in firsts])]
        if len(kinds) == 1:
            self._init_storage(members, range(len(members)), len(members), api)
            return
        gates = gates_of(big)
        for name, count in gates.items():
            for m in firsts:
                rows = dict(named_tensors(m))[name].shape[0]
                if rows % count:
                    raise ValueError(
                        f"{api}: `{name}` has {rows} rows, not a multiple of its {count} gates"
                    )
        full = {name: tuple(t.shape) for name, t in named_tensors(big)}
        padding = Padding([meta_copy(m) for m in firsts], kind_of, full, gates)
        self.__dict__["_padding"] = padding
        self.__dict__["_template"] = meta_copy(big)
        self.__dict__["_runner"] = unchunked(batchable(self._template))
        stacked = {
            name: torch.zeros((len(members), *t.shape), dtype=t.dtype, device=t.device)
            for name, t in named_tensors(big)
        }
        with torch.no_grad():
            for row, member in enumerate(members):
                for name, t in named_tensors(member):
                    padding.put_(name, stacked[name][row], t, row)
        members.clear()
        self._adopt(stacked, range(len(kind_of)), len(kind_of), big.training)

    def _configure(self, randomness: str, chunk_size: int | None, backend: str, api: str) -> None:
        check_choice(api, "randomness", randomness, RANDOMNESS)
        check_choice(api, "backend", backend, BACKENDS)
        if chunk_size is not None:
            check_int(api, "chunk_size", chunk_size, minimum=1)
        self.randomness, self.chunk_size, self.backend = randomness, chunk_size, backend

    def _init_storage(
        self, members: Iterable[nn.Module], member_ids: Sequence[int], n_total: int, api: str
    ) -> None:
        """Copy members one at a time into stacked storage and keep a meta template."""
        stacked: dict[str, torch.Tensor] = {}
        reference = None
        # A plain counter: enumerate()/zip() recycle their result tuple, which would keep the
        # previous member alive while the next one is built.
        slot = 0
        for member in members:
            if reference is None:
                reference = signature(member)
                training = member.training
                self.__dict__["_template"] = meta_copy(member)
                self.__dict__["_runner"] = unchunked(batchable(self._template))
                stacked = {
                    name: torch.empty((len(member_ids), *t.shape), dtype=t.dtype, device=t.device)
                    for name, t in named_tensors(member)
                }
            else:
                check_same(reference, member, member_ids[slot], api)
            with torch.no_grad():
                for name, t in named_tensors(member):
                    stacked[name][slot].copy_(t)
            del member  # drop our reference before the next member is built
            slot += 1  # noqa: SIM113
        self._adopt(stacked, member_ids, n_total, training)

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
            ValueError: a per-member input whose size along its ``in_dims`` is not ``len(ens)``.
            RuntimeError: the member's forward cannot be batched by ``vmap``.
        """

        packed = [a for a in (*args, *kwargs.values()) if isinstance(a, PackedSequence)]
        if packed and self.backend == "vmap":
            raise TypeError(
                "Ensemble: PackedSequence inputs are not batched by vmap; pad the sequences "
                "(torch.nn.utils.rnn.pad_sequence) or build the ensemble with backend='loop'"
            )

        def member(state: dict[str, torch.Tensor], *args: Any) -> Any:
            return functional_call(self.runner, state, args, kwargs)

        return self.map_members(member, *args, in_dims=in_dims)

    def map_members(self, fn: Callable[..., Any], *args: Any, in_dims: Any = None) -> Any:
        """Run ``fn(member_state, *member_args)`` for every member, stacking the outputs.

        ``member_state`` is one member's parameters and buffers by name, ready for
        ``torch.func.functional_call(ens.template, member_state, ...)``. This is what
        ``forward`` runs; buffers are restored if ``fn`` raises (see ``guard``).

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
        if padding is None:
            plain = self._lifted(fn, in_dims)

            def run_plain(state: dict[str, torch.Tensor], *args: Any, rows: Any = None) -> Any:
                return plain(state, *args)

            return run_plain

        def masked(state: dict[str, torch.Tensor], masks: dict, *args: Any) -> Any:
            # x * 1 is x and x * 0 is 0 exactly: padded entries add exact zeros to every sum,
            # and their gradients are exactly zero (docs/semantics.md).
            return fn({k: v * masks[k] if k in masks else v for k, v in state.items()}, *args)

        lifted = self._lifted(masked, (0, *in_dims))
        names = set(self._parameters)

        def run(state: dict[str, torch.Tensor], *args: Any, rows: slice | None = None) -> Any:
            masks = padding.masks({k: v for k, v in state.items() if k in names})
            if rows is not None:  # a chunk of members (vmapens._chunks)
                masks = {k: m[rows] for k, m in masks.items()}
            return lifted(state, masks, *args)

        return run

    def _lifted(self, fn: Callable[..., Any], in_dims: tuple) -> Callable[..., Any]:
        if self.backend == "loop":
            return looped(len(self), self.randomness, fn, in_dims)
        refuse_template_hooks(self._template, self._runner)
        n = len(self)

        def batched(state: dict[str, torch.Tensor], *args: Any) -> Any:
            # torch.autocast would cast vmap's decompositions, not the member's own ops.
            device = next(iter(state.values()), torch.empty(0)).device.type
            member = autocast_members(fn, device)
            if not state:  # a member without tensors (nn.Dropout): give vmap a dim to map
                state = {"": torch.empty(n, 0)}
                return vmap(
                    lambda _, *a: member({}, *a),
                    in_dims=(0, *in_dims),
                    randomness=self.randomness,
                    chunk_size=self.chunk_size,
                )(state, *args)
            return vmap(
                member,
                in_dims=(0, *in_dims),
                randomness=self.randomness,
                chunk_size=self.chunk_size,
            )(state, *args)

        return batched

    @contextlib.contextmanager
    def guard(self, api: str = "Ensemble") -> Iterator[None]:
        """Around a call of the members: what every call of ``_member_map`` runs inside.

        * vmap can fail after BatchNorm has updated some members' statistics: the buffers
          are copied first and given back on any exception, so a failed call changes nothing.
        * "cannot batch" errors of ``torch.func`` become a message that says what to do.
        * CPU attention (``F.scaled_dot_product_attention``, ``nn.MultiheadAttention``,
          ``nn.TransformerEncoder``) runs as one call for all members instead of a member
          loop, and the eval-mode fast path that vmap cannot batch is off
          (``vmapens._attention.batched_attention``). A compiled step enters this outside
          its graph.
        """
        buffers = list(self.stacked_buffers().values())
        saved = [b.clone() for b in buffers]
        try:
            with batched_attention():
                yield
        except BaseException as err:
            with torch.no_grad():
                for b, s in zip(buffers, saved, strict=True):
                    b.copy_(s)
            if not isinstance(err, Exception):
                raise
            explained = explain_failure(api, type(self._template).__name__, self.backend, err)
            if explained is not None:
                raise explained from err
            if type(err) is RuntimeError and ":" not in str(err).split(" ", 1)[0]:
                # torch's own message (a shape mismatch...) does not say where it came from
                raise RuntimeError(
                    f"{api}: a member's forward or loss failed ({err}); check the inputs "
                    "against one member run alone, e.g. ens[0](inputs)"
                ) from err
            raise

    # -- members ------------------------------------------------------------------------------

    def __getitem__(self, index: Any) -> Any:
        """``ens[i]``: member ``i`` as a module of the user's class; ``ens[2:5]``, ``ens[[0, 3]]``:
        a sub-Ensemble (see ``select``).

        Any integer-like works as ``i`` (int, numpy integer, 0-d integer tensor).
        """
        i = to_index(index)
        if i is None:
            return self.select(index)
        if not -len(self) <= i < len(self):
            raise IndexError(f"Ensemble: member index {i} out of range for {len(self)} members")
        i %= len(self)
        memo: dict[int, Any] = {}
        stacked = self.stacked_state()
        padding = self._padding
        template = self._template if padding is None else padding.templates[padding.kind_of[i]]
        with torch.no_grad():
            for name, meta in named_tensors(template):
                row = stacked[name][i]
                value = (row if padding is None else padding.take(name, row, i)).clone()
                if isinstance(meta, nn.Parameter):
                    value = nn.Parameter(value, requires_grad=meta.requires_grad)
                memo[id(meta)] = value
        return copy.deepcopy(template, memo)

    def __iter__(self) -> Iterator[nn.Module]:
        return (self[i] for i in range(len(self)))

    def unstack(self) -> list[nn.Module]:
        """All members as a list of ordinary modules of the user's class.

        Example:
            >>> models = Ensemble(lambda: nn.Linear(3, 2), n=4).unstack()
            >>> type(models[0]).__name__
            'Linear'
        """
        return list(self)

    def apply(self, fn: Callable[[nn.Module], None]) -> Ensemble:  # type: ignore[override]
        """Apply ``fn`` to every submodule of every member, as ``member.apply(fn)`` would alone.

        Members are visited in order, so a custom initialisation that draws from the global
        RNG gives member ``i`` what ``models[i].apply(fn)`` gives after members ``0..i-1``.

        Example:
            >>> ens = Ensemble(lambda: nn.Linear(3, 2), n=2, seed=0)
            >>> _ = ens.apply(lambda m: nn.init.zeros_(m.bias) if hasattr(m, "bias") else None)
            >>> float(ens.stacked_params()["bias"].detach().abs().sum())
            0.0
        """
        if not callable(fn):
            raise TypeError(f"Ensemble.apply: `fn` must be callable, got {type(fn).__name__}")
        stacked = self.stacked_state()
        saved = {name: t.detach().clone() for name, t in stacked.items()}
        try:
            with torch.no_grad():
                for i in range(len(self)):
                    member = self[i]
                    member.apply(fn)
                    state = dict(named_tensors(member))
                    for name, t in stacked.items():
                        if self._padding is None:
                            t[i].copy_(state[name])
                        else:
                            self._padding.put_(name, t[i], state[name], i)
        except BaseException:  # all members or none: the ones done before get their state back
            with torch.no_grad():
                for name, t in stacked.items():
                    t.copy_(saved[name])
            raise
        return self


def _shapes_key(module: nn.Module) -> tuple[tuple[str, tuple[int, ...]], ...]:
    return tuple((name, tuple(t.shape)) for name, t in named_tensors(module))
