"""Building, comparing and copying member modules: what ``Ensemble`` stacks, one at a time."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import optree
import torch
from torch import nn

from ._checks import check_int
from ._fastcall import vmap_members
from ._precision import autocast_members
from .distributed import member_block
from .seeds import member_seed

__all__ = [
    "Factory",
    "build_members",
    "check_member",
    "check_seeds",
    "check_same",
    "looped",
    "member_ids_for",
    "meta_copy",
    "named_tensors",
    "non_persistent_buffers",
    "signature",
    "vmapped",
]

Factory = Callable[[], nn.Module]


def build_members(
    factory: Factory | Sequence[Factory],
    seed: int | None,
    seeds: Sequence[int] | None,
    member_ids: Sequence[int],
) -> Iterator[nn.Module]:
    """Yield member ``i`` for each id, built as the user would build it alone.

    ``seeds`` (one torch seed per member) wins over ``seed`` (hash-derived per member, see
    ``member_seed``); with neither, members come from the global RNG one after another.
    ``factory`` is one factory for all members or one per member.
    """

    def make(i: int) -> nn.Module:
        return factory[i]() if isinstance(factory, Sequence) else factory()

    if seed is None and seeds is None:
        for i in member_ids:
            yield check_member(make(i), i, "Ensemble")
        return
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
    seed_all = torch.manual_seed if _accelerators() else torch.default_generator.manual_seed
    for i in member_ids:
        with torch.random.fork_rng(devices=devices):
            seed_all(seeds[i] if seeds is not None else member_seed(seed or 0, i))
            member = make(i)
        yield check_member(member, i, "Ensemble")
        del member


def _accelerators() -> bool:
    """Whether torch could draw from a generator other than the CPU's (CUDA, XPU, MPS, MTIA,
    a custom backend).

    Without one, ``torch.manual_seed(s)`` seeds the CPU generator and queues a lazy seed (with a
    formatted stack, ~1 ms) per device module that can never run: seeding the CPU generator
    alone builds the same members, 2-3x faster for small members.
    """
    devices = (torch.cuda, torch.xpu, torch.mps, torch.mtia)
    custom = hasattr(torch, torch._C._get_privateuse1_backend_name())
    return custom or any(d.is_available() for d in devices)


def check_member(member: Any, i: int, api: str) -> nn.Module:
    """``member`` if it is an initialised ``nn.Module``; a clear error otherwise."""
    if not isinstance(member, nn.Module):
        from_modules = api.endswith("from_modules")
        what = (
            "`modules` must hold nn.Modules"
            if from_modules
            else "`factory` must return an nn.Module"
        )
        raise TypeError(f"{api}: {what}, but member {i} is {type(member).__name__}")
    for name, t in named_tensors(member):
        if nn.parameter.is_lazy(t):
            raise ValueError(
                f"{api}: member {i} has an uninitialised lazy tensor `{name}`; run one forward "
                "pass on the member (or give the layer its input size) before stacking"
            )
    return member


def named_tensors(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Unique parameters then buffers, by their first name (tied tensors appear once)."""
    yield from module.named_parameters()
    yield from module.named_buffers()


def signature(module: nn.Module) -> tuple[type, dict[str, tuple], dict[str, bool]]:
    """What members must share: class, each tensor's name, shape, dtype, device, grad flag,
    and each submodule's train/eval mode (a BatchNorm frozen in eval mode stays frozen)."""
    tensors = {
        name: (tuple(t.shape), t.dtype, t.device, t.requires_grad)
        for name, t in named_tensors(module)
    }
    return type(module), tensors, {name: m.training for name, m in module.named_modules()}


def check_same(
    reference: tuple[type, dict[str, tuple], dict[str, bool]],
    other: nn.Module,
    i: int,
    api: str,
    shapes: bool = True,
) -> None:
    """Raise ValueError naming the first tensor or submodule mode where ``other`` differs from
    member 0 (in anything but its shape with ``shapes=False``)."""
    ref_type, ref, ref_modes = reference
    got_type, got, got_modes = signature(other)
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
            if a != b and (shapes or what != "shape"):
                raise ValueError(
                    f"{api}: member {i} differs from member 0 at `{key}`: {what} {b} vs {a}"
                )
    for name, mode in ref_modes.items():
        if got_modes.get(name, mode) != mode:
            where = f"submodule `{name}`" if name else "the module itself"
            raise ValueError(
                f"{api}: member {i} differs from member 0 in the train/eval mode of {where}: "
                f"training={got_modes[name]} vs {mode}; put every member in the same modes "
                "(call .train() / .eval() the same way on each) before building the ensemble"
            )


#: Plain values a module keeps as attributes (BatchNorm's ``momentum``, Dropout's ``p``...).
_PLAIN = (bool, int, float, str, type(None), tuple)


def settings(module: nn.Module) -> dict[str, Any]:
    """Every submodule's plain attributes by ``"submodule.attribute"`` (modes excluded)."""
    return {
        f"{name}.{key}" if name else key: value
        for name, m in module.named_modules()
        for key, value in vars(m).items()
        if key != "training" and not key.startswith("_") and isinstance(value, _PLAIN)
    }


def meta_copy(module: nn.Module) -> nn.Module:
    """A deep copy of ``module`` whose tensors live on the meta device (ties preserved)."""
    memo: dict[int, Any] = {}
    for _, t in named_tensors(module):
        meta = torch.empty_like(t, device="meta")
        if isinstance(t, nn.Parameter):
            meta = nn.Parameter(meta, requires_grad=t.requires_grad)
        memo[id(t)] = meta
    return copy.deepcopy(module, memo)


def non_persistent_buffers(module: nn.Module) -> set[str]:
    """Full names of the buffers that ``state_dict`` leaves out."""
    return {
        f"{prefix}.{name}" if prefix else name
        for prefix, sub in module.named_modules()
        for name in sub._non_persistent_buffers_set
    }


def check_seeds(api: str, seeds: Any, n: int, seed: int | None) -> list[int]:
    if seed is not None:
        raise ValueError(f"{api}: give `seed` or `seeds`, not both")
    if isinstance(seeds, (str, bytes)) or not isinstance(seeds, Sequence):
        raise TypeError(
            f"{api}: `seeds` must be a sequence of {n} ints, got {type(seeds).__name__}"
        )
    if len(seeds) != n:
        raise ValueError(f"{api}: `seeds` has {len(seeds)} values, expected n={n}, one per member")
    for k, s in enumerate(seeds):
        check_int(api, f"seeds[{k}]", s)
    return list(seeds)


def looped(n: int, randomness: str, fn: Callable[..., Any], in_dims: tuple) -> Callable:
    """The loop backend: ``fn`` once per member on its slices, outputs stacked."""

    def looped(state: dict[str, torch.Tensor], *args: Any) -> Any:
        rng = torch.get_rng_state() if randomness == "same" else None
        outputs = []
        for i in range(n):
            if rng is not None:
                torch.set_rng_state(rng)
            member_args = [
                a if d is None else optree.tree_map(lambda t, d=d, i=i: t.select(d, i), a)
                for a, d in zip(args, in_dims, strict=True)
            ]
            outputs.append(fn({k: v[i] for k, v in state.items()}, *member_args))
        return optree.tree_map(lambda *xs: torch.stack(xs), *outputs)

    return looped


def vmapped(
    n: int, randomness: str, chunk_size: int | None, fn: Callable, in_dims: tuple
) -> Callable:
    """The vmap backend: ``fn`` batched over the members' stacked state, outputs stacked."""

    def batched(state: dict[str, torch.Tensor], *args: Any) -> Any:
        # torch.autocast would cast vmap's decompositions, not the member's own ops.
        device = next(iter(state.values()), torch.empty(0)).device.type
        member = autocast_members(fn, device)

        def stateless(_: Any, *a: Any) -> Any:
            return member({}, *a)

        mapped = member if state else stateless
        if not state:  # a member without tensors (nn.Dropout): give vmap a dim to map
            state = {"": torch.empty(n, 0)}
        return vmap_members(mapped, n, randomness, state, args, in_dims, chunk_size)

    return batched


def member_ids_for(n: int, shard: bool, seeded: bool, api: str) -> range:
    """The global ids this process builds: all, or its block of a sharded ensemble."""
    if not shard:
        return range(n)
    if not seeded:
        raise ValueError(
            f"{api}: `shard=True` needs an int `seed` (or `seeds`), so that every process builds "
            "member i alike"
        )
    return member_block(n, api)
