"""Ensemble: N initialisations of one ``nn.Module`` class, stacked and run at once."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, cast

import optree
import torch
from torch import nn
from torch.func import functional_call, vmap

__all__ = ["Ensemble", "per_member"]

Factory = Callable[[], nn.Module]

_RANDOMNESS = ("different", "same", "error")
_BACKENDS = ("vmap", "loop")
# Substrings of torch.func errors that mean "this forward cannot be batched", as opposed to
# an ordinary bug in the user's forward that would fail for a single model too.
_UNBATCHABLE = ("Batching rule not implemented", "vmap: ", "We could not generate a fallback")


class Ensemble(nn.Module):
    """N members of one architecture, stored stacked and run together.

    Every parameter and buffer of the member module is stored once, with a leading member
    dimension: ``ens.parameters()`` yields leaf tensors of shape ``[n, *member_shape]``.
    Calling the ensemble runs all members on the same inputs through
    ``torch.func.functional_call`` under ``torch.func.vmap`` (or one after another with
    ``backend="loop"``) and every output tensor gains a leading member dimension.

    Member ``i`` is ``factory()``, built exactly as you would build it alone:

    * ``seed=None``: members are drawn from the global RNG one after another, exactly as
      ``[factory() for _ in range(n)]`` would draw them.
    * ``seed=s``: member ``i`` is what ``torch.manual_seed(s + i); factory()`` gives, so any
      member can be rebuilt alone; the caller's global RNG state is left untouched.

    Members are built one at a time and copied into the stacked storage, so building peaks
    at about the stacked size plus one member (``torch.func.stack_module_state`` would need
    all n members alive at once); no per-member module is kept afterwards (the module that
    ``functional_call`` runs lives on the ``meta`` device).

    Args:
        factory: zero-argument callable returning an ``nn.Module``: the class itself,
            ``functools.partial(MLP, 20)`` or a lambda.
        n: number of members, ``>= 1``.
        seed: ``None`` (global RNG) or an int (member ``i`` is seeded with ``seed + i``).
        randomness: how random ops (dropout) draw per member, as in ``torch.func.vmap``:
            ``"different"`` (independent per member), ``"same"`` or ``"error"``.
        chunk_size: run at most this many members at once under ``vmap`` (bounds memory).
        backend: ``"vmap"`` (batched, fast) or ``"loop"`` (members one after another through
            ``functional_call`` on the same storage, for forwards that ``vmap`` cannot batch,
            such as ``nn.GRU`` / ``nn.LSTM`` or data-dependent Python control flow).
        shard: build only this process's block of members when a ``torch.distributed``
            process group is initialised (see ``docs/distributed.md``); needs an int ``seed``.

    Raises:
        ValueError: ``n < 1``, an unknown ``randomness``/``backend``, members that differ,
            an uninitialised lazy module.
        TypeError: ``factory`` is not callable or does not return an ``nn.Module``.

    Example:
        >>> ens = Ensemble(lambda: nn.Linear(3, 2), n=4, seed=0)
        >>> ens(torch.randn(8, 3)).shape
        torch.Size([4, 8, 2])
    """

    # The meta-device member that functional_call runs, kept out of nn.Module's registry.
    _template: nn.Module

    def __init__(
        self,
        factory: Factory,
        n: int,
        *,
        seed: int | None = None,
        randomness: str = "different",
        chunk_size: int | None = None,
        backend: str = "vmap",
        shard: bool = False,
    ) -> None:
        super().__init__()
        if isinstance(factory, nn.Module):
            raise TypeError(
                f"Ensemble: `factory` must build a new member on each call, got an instance of "
                f"{type(factory).__name__}; pass the class (or a lambda), or use "
                "Ensemble.from_modules([...]) to stack existing modules"
            )
        if not callable(factory):
            raise TypeError(
                f"Ensemble: `factory` must be a zero-argument callable returning an nn.Module, "
                f"got {type(factory).__name__}"
            )
        _check_int("Ensemble", "n", n, minimum=1)
        if seed is not None:
            _check_int("Ensemble", "seed", seed)
        self._configure(randomness, chunk_size, backend, "Ensemble")
        member_ids = _member_ids(n, shard, seed, "Ensemble")
        rng = torch.get_rng_state()
        try:
            self._init_storage(_build_members(factory, seed, member_ids), member_ids, n, "Ensemble")
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
            ValueError: ``modules`` is empty, or a member differs from member 0 (the message
                names the first member and key that differ).

        Example:
            >>> ens = Ensemble.from_modules([nn.Linear(3, 2) for _ in range(4)])
            >>> len(ens)
            4
        """
        if isinstance(modules, nn.Module) or not isinstance(modules, Sequence):
            raise TypeError(
                "Ensemble.from_modules: `modules` must be a sequence (list or tuple) of "
                f"nn.Module, got {type(modules).__name__}"
            )
        if len(modules) == 0:
            raise ValueError("Ensemble.from_modules: `modules` must not be empty")
        for i, module in enumerate(modules):
            _check_member(module, i, "Ensemble.from_modules")
        reference = _signature(modules[0])
        for i, module in enumerate(modules[1:], start=1):
            _check_same(reference, module, i, "Ensemble.from_modules")
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        self._configure(randomness, chunk_size, backend, "Ensemble.from_modules")
        member_ids = _member_ids(len(modules), shard, 0, "Ensemble.from_modules")
        self._init_storage(
            (modules[i] for i in member_ids), member_ids, len(modules), "Ensemble.from_modules"
        )
        return self

    # -- construction ---------------------------------------------------------------------

    def _configure(self, randomness: str, chunk_size: int | None, backend: str, api: str) -> None:
        if randomness not in _RANDOMNESS:
            raise ValueError(
                f"{api}: `randomness` must be one of {_RANDOMNESS}, got {randomness!r}"
            )
        if backend not in _BACKENDS:
            raise ValueError(f"{api}: `backend` must be one of {_BACKENDS}, got {backend!r}")
        if chunk_size is not None:
            _check_int(api, "chunk_size", chunk_size, minimum=1)
        self.randomness = randomness
        self.chunk_size = chunk_size
        self.backend = backend

    def _init_storage(
        self, members: Iterable[nn.Module], member_ids: range, n_total: int, api: str
    ) -> None:
        """Copy members one at a time into stacked storage and keep a meta template."""
        stacked: dict[str, torch.Tensor] = {}
        reference = None
        # A plain counter: enumerate()/zip() recycle their result tuple, which would keep the
        # previous member alive while the next one is built.
        slot = 0
        for member in members:
            if reference is None:
                reference = _signature(member)
                training = member.training
                # Kept out of nn.Module's registry: its meta tensors are not ours to train.
                self.__dict__["_template"] = _meta_copy(member)
                stacked = {
                    name: torch.empty((len(member_ids), *t.shape), dtype=t.dtype, device=t.device)
                    for name, t in _named_tensors(member)
                }
            else:
                _check_same(reference, member, member_ids[slot], api)
            with torch.no_grad():
                for name, t in _named_tensors(member):
                    stacked[name][slot].copy_(t)
            del member  # drop our reference before the next member is built
            slot += 1  # noqa: SIM113
        params = dict(self._template.named_parameters())
        for name, t in stacked.items():
            if name in params:
                # Written straight into _parameters: register_parameter forbids the dots of
                # the member's own names, and those names are what state_dict must show.
                self._parameters[name] = nn.Parameter(t, requires_grad=params[name].requires_grad)
            else:
                self._buffers[name] = t
        self._non_persistent_buffers_set = _non_persistent_buffers(self._template)
        self.member_ids = member_ids
        self.n_total = n_total
        # Member state_dict key -> stacked name (tied weights map several keys to one name).
        meta_names = {id(t): name for name, t in _named_tensors(self._template)}
        self._state_keys = {
            key: meta_names[id(t)] for key, t in self._template.state_dict(keep_vars=True).items()
        }
        self.training = training

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
            RuntimeError: the member's forward cannot be batched by ``vmap`` (the message
                points to ``backend="loop"``).
        """

        def member(state: dict[str, torch.Tensor], *args: Any) -> Any:
            return functional_call(self._template, state, args, kwargs)

        return self.map_members(member, *args, in_dims=in_dims)

    def map_members(self, fn: Callable[..., Any], *args: Any, in_dims: Any = None) -> Any:
        """Run ``fn(member_state, *member_args)`` for every member, stacking the outputs.

        ``member_state`` is one member's parameters and buffers by name, ready for
        ``torch.func.functional_call(module, member_state, ...)``. This is what ``forward``
        runs, and what a training step uses to compute each member's forward *and* loss in
        one vmap. Runs under ``vmap`` (or the loop backend) with the ensemble's randomness and
        chunk size; buffers are restored if ``fn`` raises.

        Args:
            fn: ``(member_state, *member_args) -> pytree of tensors``.
            *args: the arguments, shared or mapped according to ``in_dims``.
            in_dims: as in ``forward``.

        Returns:
            ``fn``'s output pytree with a leading member dim on every tensor.

        Raises:
            ValueError: a per-member input whose size along its ``in_dims`` is not ``len(ens)``.
            RuntimeError: ``fn`` cannot be batched by ``vmap`` (the message points to
                ``backend="loop"``).
        """
        dims = _expand_in_dims(in_dims, args, len(self))
        state = {**self._stacked_params(), **self._stacked_buffers()}
        buffers = list(self._stacked_buffers().values())
        # vmap can fail after BatchNorm has updated some members' statistics: keep a copy so a
        # failed call changes nothing.
        saved = [b.clone() for b in buffers]
        try:
            if self.backend == "loop":
                return self._loop(fn, state, args, dims)
            return self._vmap(fn, state, args, dims)
        except Exception as err:
            with torch.no_grad():
                for b, s in zip(buffers, saved, strict=True):
                    b.copy_(s)
            if self.backend == "vmap" and any(m in str(err) for m in _UNBATCHABLE):
                raise RuntimeError(
                    f"Ensemble: the forward of {type(self._template).__name__} cannot be batched "
                    f"with torch.func.vmap ({err}). Build the ensemble with backend='loop' to run "
                    "the members one after another on the same stacked storage."
                ) from err
            raise

    def _vmap(self, fn: Callable[..., Any], state: dict, args: tuple, dims: tuple) -> Any:
        if not state:  # a member without tensors (nn.Dropout): give vmap a member dim to map
            state = {"": torch.empty(len(self), 0)}
            inner = fn

            def fn(_: dict, *args: Any) -> Any:
                return inner({}, *args)

        batched = vmap(
            fn, in_dims=(0, *dims), randomness=self.randomness, chunk_size=self.chunk_size
        )
        return batched(state, *args)

    def _loop(self, fn: Callable[..., Any], state: dict, args: tuple, dims: tuple) -> Any:
        rng = torch.get_rng_state() if self.randomness == "same" else None
        outputs = []
        for i in range(len(self)):
            if rng is not None:
                torch.set_rng_state(rng)
            member_args = [
                a if d is None else optree.tree_map(lambda t, d=d, i=i: t.select(d, i), a)
                for a, d in zip(args, dims, strict=True)
            ]
            outputs.append(fn({k: v[i] for k, v in state.items()}, *member_args))
        return optree.tree_map(lambda *xs: torch.stack(xs), *outputs)

    def make_step(
        self,
        loss_fn: Callable[[Any, torch.Tensor], torch.Tensor],
        optimizer: torch.optim.Optimizer,
        *,
        in_dims: int | None = None,
        compile: bool = False,
    ) -> Callable[..., torch.Tensor]:
        """``step(inputs, targets, mask=None) -> losses[n]``; see ``vmapens.step.make_step``."""
        from .step import make_step  # step.py builds on this module

        return make_step(self, loss_fn, optimizer, in_dims=in_dims, compile=compile)

    def fit(
        self, data: Any, loss_fn: Callable[[Any, torch.Tensor], torch.Tensor], **options: Any
    ) -> Any:
        """Train every member and return a ``History``; see ``vmapens.fit.fit`` for options."""
        from .fit import fit  # fit.py builds on this module

        return fit(self, data, loss_fn, **options)

    def save(
        self, path: Any, optimizer: torch.optim.Optimizer | None = None, history: Any = None
    ) -> None:
        """Write a checkpoint atomically; see ``vmapens.checkpoint.save``."""
        from .checkpoint import save

        save(self, path, optimizer=optimizer, history=history)

    @classmethod
    def load(
        cls,
        path: Any,
        factory: Factory,
        optimizer: Callable[[Ensemble], torch.optim.Optimizer] | None = None,
    ) -> Ensemble | tuple[Ensemble, torch.optim.Optimizer]:
        """Rebuild an ensemble (and, given how to build it, its optimizer) from a checkpoint.

        See ``vmapens.checkpoint.load``: ``optimizer`` is a builder such as
        ``vmapens.StackedAdam``, and then ``(ensemble, optimizer)`` is returned.
        """
        from .checkpoint import load

        return load(path, factory, optimizer=optimizer)

    def save_members(self, directory: Any, format: str = "pt") -> list[Any]:
        """One file per member that the user's class loads; see ``vmapens.checkpoint``."""
        from .checkpoint import save_members

        return save_members(self, directory, format=format)

    def gather(self, dst: int = 0) -> Ensemble | None:
        """The full ensemble on rank ``dst`` (None elsewhere); see ``vmapens.distributed``."""
        from .distributed import gather

        return gather(self, dst=dst)

    # -- members ------------------------------------------------------------------------------

    @property
    def template(self) -> nn.Module:
        """The member module ``functional_call`` runs: the user's class on the ``meta`` device.

        It has the member's structure and mode but no values; pass it a member's state (as in
        ``map_members``) to run one member.
        """
        return self._template

    def __len__(self) -> int:
        return len(self.member_ids)

    def __getitem__(self, i: int) -> nn.Module:
        """Member ``i`` as an ordinary module of the user's class, independent of the storage."""
        if not isinstance(i, int) or isinstance(i, bool):
            raise TypeError(f"Ensemble: member index must be an int, got {type(i).__name__}")
        if not -len(self) <= i < len(self):
            raise IndexError(f"Ensemble: member index {i} out of range for {len(self)} members")
        memo: dict[int, Any] = {}
        with torch.no_grad():
            for name, meta in _named_tensors(self._template):
                value = self._stacked(name)[i].clone()
                if isinstance(meta, nn.Parameter):
                    value = nn.Parameter(value, requires_grad=meta.requires_grad)
                memo[id(meta)] = value
        return copy.deepcopy(self._template, memo)

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

    def state_dicts(self) -> list[dict[str, torch.Tensor]]:
        """One state_dict per member, each loadable with ``strict=True`` by the user's class.

        Example:
            >>> sds = Ensemble(lambda: nn.Linear(3, 2), n=4).state_dicts()
            >>> nn.Linear(3, 2).load_state_dict(sds[0])
            <All keys matched successfully>
        """
        result = []
        for i in range(len(self)):
            values = {name: self._stacked(name)[i].detach().clone() for name in self._persistent()}
            result.append({key: values[name] for key, name in self._state_keys.items()})
        return result

    def _stacked_params(self) -> dict[str, nn.Parameter]:
        """``self._parameters``, typed without the None that nn.Module allows: we store none."""
        return cast("dict[str, nn.Parameter]", self._parameters)

    def _stacked_buffers(self) -> dict[str, torch.Tensor]:
        """``self._buffers``, typed without the None that nn.Module allows: we store none."""
        return cast("dict[str, torch.Tensor]", self._buffers)

    def _stacked(self, name: str) -> torch.Tensor:
        params = self._stacked_params()
        return params[name] if name in params else self._stacked_buffers()[name]

    def _persistent(self) -> dict[str, torch.Tensor]:
        buffers = self._stacked_buffers()
        return {
            **self._stacked_params(),
            **{k: v for k, v in buffers.items() if k not in self._non_persistent_buffers_set},
        }

    # -- nn.Module plumbing ----------------------------------------------------------------

    def train(self, mode: bool = True) -> Ensemble:
        super().train(mode)
        self._template.train(mode)
        return self

    def extra_repr(self) -> str:
        return f"n={len(self)}, backend={self.backend!r}, member={self._template!r}"

    def _save_to_state_dict(self, destination: dict, prefix: str, keep_vars: bool) -> None:
        # The member's own keys, in its own order, tied aliases included.
        persistent = self._persistent()
        for key, name in self._state_keys.items():
            t = persistent[name]
            destination[prefix + key] = t if keep_vars else t.detach()

    def _load_from_state_dict(
        self,
        state_dict: dict,
        prefix: str,
        local_metadata: dict,
        strict: bool,
        missing_keys: list,
        unexpected_keys: list,
        error_msgs: list,
    ) -> None:
        # nn.Module's own loader splits keys at the first dot (taking "fc.weight" for a child
        # module) and copies tensors as it goes; ours checks everything before copying.
        persistent = self._persistent()
        ours = {prefix + k: persistent[name] for k, name in self._state_keys.items()}
        unexpected_keys.extend(k for k in state_dict if k.startswith(prefix) and k not in ours)
        missing_keys.extend(k for k in ours if k not in state_dict)
        pending = []
        for key, target in ours.items():
            if key not in state_dict:
                continue
            value = state_dict[key]
            if not isinstance(value, torch.Tensor) or value.shape != target.shape:
                got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value)
                error_msgs.append(
                    f"size mismatch for {key}: copying a param with shape {got} from checkpoint, "
                    f"the shape in current model is {tuple(target.shape)}."
                )
            pending.append((target, value))
        if error_msgs or (strict and (missing_keys or unexpected_keys)):
            return
        with torch.no_grad():
            for target, value in pending:
                target.copy_(value)


def per_member(loss_fn: Callable[..., torch.Tensor], in_dims: Any = (0, None)) -> Callable:
    """Wrap a loss so it returns one value per member, shape ``[n]``.

    The ensemble's training loss is the *sum* of these: the gradient of the sum with respect
    to member ``i``'s parameters is exactly the gradient of member ``i``'s own loss, so every
    member trains as it would alone. A mean would scale each member's gradient by ``1/n``.

    Args:
        loss_fn: ``(output, target) -> scalar``, e.g. ``nn.BCELoss()`` or a function.
        in_dims: as in ``torch.func.vmap``; the default ``(0, None)`` maps the stacked output
            and shares the target. Use ``(0, 0)`` for per-member targets.

    Returns:
        ``(output, target) -> Tensor[n]``.

    Example:
        >>> loss = per_member(nn.MSELoss())(torch.zeros(4, 8, 1), torch.ones(8, 1))
        >>> loss.shape
        torch.Size([4])
    """
    if not callable(loss_fn):
        raise TypeError(f"per_member: `loss_fn` must be callable, got {type(loss_fn).__name__}")
    return vmap(loss_fn, in_dims=in_dims)


# -- helpers ---------------------------------------------------------------------------------


def _check_int(api: str, name: str, value: Any, minimum: int | None = None) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{api}: `{name}` must be an int, got {type(value).__name__}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{api}: `{name}` must be >= {minimum}, got {value}")


def _member_ids(n: int, shard: bool, seed: int | None, api: str) -> range:
    if not shard:
        return range(n)
    if seed is None:
        raise ValueError(
            f"{api}: `shard=True` needs an int `seed`, so that every process builds member i "
            "as torch.manual_seed(seed + i); factory()"
        )
    from .distributed import member_block

    return member_block(n, api)


def _build_members(factory: Factory, seed: int | None, member_ids: range) -> Iterator[nn.Module]:
    """Yield member ``i`` for each id, built as the user would build it alone."""
    if seed is None:
        for i in member_ids:
            yield _check_member(factory(), i, "Ensemble")
        return
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
    for i in member_ids:
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(seed + i)
            member = factory()
        yield _check_member(member, i, "Ensemble")
        del member


def _check_member(member: Any, i: int, api: str) -> nn.Module:
    if not isinstance(member, nn.Module):
        raise TypeError(
            f"{api}: `factory` must return an nn.Module, but member {i} is {type(member).__name__}"
        )
    for name, t in _named_tensors(member):
        if nn.parameter.is_lazy(t):
            raise ValueError(
                f"{api}: member {i} has an uninitialised lazy tensor `{name}`; run one forward "
                "pass on the member (or give the layer its input size) before stacking"
            )
    return member


def _named_tensors(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Unique parameters then buffers, by their first name (tied tensors appear once)."""
    yield from module.named_parameters()
    yield from module.named_buffers()


def _signature(module: nn.Module) -> tuple[type, dict[str, tuple]]:
    """What members must share: class, and each tensor's name, shape, dtype, device, grad flag."""
    return type(module), {
        name: (tuple(t.shape), t.dtype, t.device, t.requires_grad)
        for name, t in _named_tensors(module)
    }


def _check_same(
    reference: tuple[type, dict[str, tuple]], other: nn.Module, i: int, api: str
) -> None:
    ref_type, ref = reference
    got_type, got = _signature(other)
    if got_type is not ref_type:
        raise ValueError(
            f"{api}: member {i} is a {got_type.__name__}, member 0 is a {ref_type.__name__}; "
            "all members must be of one class"
        )
    for key in [*ref, *(k for k in got if k not in ref)]:
        if key not in got or key not in ref:
            which = "lacks" if key not in got else "has an extra"
            raise ValueError(f"{api}: member {i} {which} tensor `{key}` (compared to member 0)")
        for what, a, b in zip(("shape", "dtype", "device", "requires_grad"), ref[key], got[key]):
            if a != b:
                raise ValueError(
                    f"{api}: member {i} differs from member 0 at `{key}`: {what} {b} vs {a}"
                )


def _meta_copy(module: nn.Module) -> nn.Module:
    """A deep copy of ``module`` whose tensors live on the meta device (ties preserved)."""
    memo: dict[int, Any] = {}
    for _, t in _named_tensors(module):
        meta = torch.empty_like(t, device="meta")
        if isinstance(t, nn.Parameter):
            meta = nn.Parameter(meta, requires_grad=t.requires_grad)
        memo[id(t)] = meta
    return copy.deepcopy(module, memo)


def _non_persistent_buffers(module: nn.Module) -> set[str]:
    return {
        f"{prefix}.{name}" if prefix else name
        for prefix, sub in module.named_modules()
        for name in sub._non_persistent_buffers_set
    }


def _expand_in_dims(in_dims: Any, args: tuple, n: int) -> tuple:
    """One in_dim (int or None) per positional argument, after checking per-member sizes."""
    if in_dims is None or isinstance(in_dims, int) and not isinstance(in_dims, bool):
        dims = (in_dims,) * len(args)
    elif isinstance(in_dims, tuple) and len(in_dims) == len(args):
        dims = in_dims
    else:
        raise ValueError(
            f"Ensemble: `in_dims` must be None, an int, or a tuple with one entry per positional "
            f"argument ({len(args)}), got {in_dims!r}"
        )
    for pos, (arg, dim) in enumerate(zip(args, dims, strict=True)):
        if dim is None:
            continue
        if not isinstance(dim, int) or isinstance(dim, bool):
            raise ValueError(f"Ensemble: `in_dims[{pos}]` must be an int or None, got {dim!r}")
        for leaf in optree.tree_leaves(arg):
            if not isinstance(leaf, torch.Tensor):
                continue
            if not -leaf.dim() <= dim < leaf.dim() or leaf.shape[dim] != n:
                size = leaf.shape[dim] if -leaf.dim() <= dim < leaf.dim() else "no such dim"
                raise ValueError(
                    f"Ensemble: argument {pos} is mapped with in_dims={dim} but has size {size} "
                    f"there (shape {tuple(leaf.shape)}); expected {n}, one slice per member"
                )
    return dims
