"""Building, comparing and copying member modules: what ``Ensemble`` stacks, one at a time."""

from __future__ import annotations

import enum
import functools
import types
from collections.abc import Callable, Iterator, Sequence
from typing import Any, cast

import torch
from torch import nn
from torch.nn.utils import parametrize

from ._fastcall import names_by_tensor
from ._hooks import (
    ATOMS,
    DEPTH,
    held_message,
    held_tensor,
    modules_of,
    named_tensors,
    refuse_state_dict_pre_hooks,
)
from .distributed import member_block
from .seeds import lazy_seeds_kept, member_seed

__all__ = [
    "Factory",
    "Names",
    "build_members",
    "check_member",
    "check_same",
    "class_name",
    "class_of",
    "member_ids_for",
    "modules_of",
    "named_tensors",
    "non_persistent_buffers",
    "own_settings",
    "Signature",
    "signature",
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
    with lazy_seeds_kept():  # fork_rng gives back initialized devices only
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
        what = "`modules` must hold nn.Modules" if api.endswith("from_modules") else None
        what = what or "`factory` must return an nn.Module"
        raise TypeError(f"{api}: {what}, but member {i} is {type(member).__name__}")
    modules = modules_of(member)
    if any(m._state_dict_pre_hooks for _, m in modules):  # the error's walk: seldom
        refuse_state_dict_pre_hooks(api, member, i)
    tensors = named_tensors(member, modules)
    for name, t in tensors:
        if nn.parameter.is_lazy(t):
            raise ValueError(
                f"{api}: member {i} has an uninitialised lazy tensor `{name}`; run one forward "
                "pass on the member (or give the layer its input size) before stacking"
            )
        if t._backward_hooks or getattr(t, "_post_accumulate_grad_hooks", None):
            # The stacked tensors are new ones: the hook would be dropped without a word.
            raise ValueError(
                f"{api}: member {i}'s tensor `{name}` has a hook (Tensor.register_hook or "
                "register_post_accumulate_grad_hook), which the stacked tensors cannot carry: "
                "the members would train without it. Register a module hook instead "
                "(register_full_backward_hook, with backend='loop'), or change the gradient "
                "in your loss"
            )
    # Member 0's: the template runs them, and the others' settings must equal them.
    ids = {id(t): name for name, t in tensors} if i == 0 else {}
    # A function (attribute or hook) closing over the member's own modules is rebound to the
    # copy's (``_copies.copy_member``); one holding its tensors is not: those are swapped into
    # module slots only.
    for path, sub in modules if ids else ():  # a list, closure: its own tensor
        for key in sorted((vars(sub).keys() - _INTERNAL) | _HOOKS):
            if (held := held_tensor(vars(sub)[key], ids)) is not None:
                where = f"member {i}'s attribute `{path}{'.' * bool(path)}{key}`"
                raise ValueError(held_message(api, where, held))
    return member


#: class, tensors (shape, dtype, device, requires_grad), modes and settings, by name.
Signature = tuple[Any, dict[str, tuple], dict[str, bool], tuple]


def signature(module: nn.Module) -> Signature:
    """What members must share: class, each tensor's name, shape, dtype, device, grad flag,
    each submodule's train/eval mode (a BatchNorm frozen in eval mode stays frozen), and
    every submodule's name, class and settings (``own_settings``; cheap: mostly ints)."""
    modules, names = modules_of(module), Names(module)
    tied = tied_names(module)
    tensors = {
        name: (tuple(t.shape), t.dtype, t.device, t.requires_grad, tied.get(id(t), ()))
        for name, t in named_tensors(module, modules)
    }
    settings = tuple((n, class_of(m), own_settings(m, names)) for n, m in modules)
    return class_of(module), tensors, {n: m.training for n, m in modules}, settings


def tied_names(module: nn.Module) -> dict[int, tuple[str, ...]]:
    """Each tied tensor's other names (a tensor held under one name is left out), by id."""
    return {k: tuple(v[1:]) for k, v in names_by_tensor(module).items() if len(v) > 1}


#: What ``check_same`` adds where members differ in a tensor's shape (the padded ensemble
#: takes them) or in its ties.
_WAY_OUT = {
    "shape": "; members of different sizes train padded with Ensemble.from_factories("
    "[lambda m=m: m for m in modules]) (docs/semantics.md)",
    "tied names": "; tie the same tensors in every member (a member runs with member 0's ties)",
}


def check_same(
    reference: Signature, other: nn.Module, i: int, api: str, shapes: bool = True
) -> Signature:
    """Raise ValueError naming the first tensor or submodule mode where ``other`` differs from
    member 0 (in anything but its shape with ``shapes=False``); ``other``'s signature if none
    (its settings are compared by ``_stacking.check_settings``)."""
    ref_type, ref, ref_modes, _ = reference
    got_type, got, got_modes, _ = theirs = signature(other)
    if got_type != ref_type:
        raise ValueError(
            f"{api}: member {i} is a {class_name(got_type)}, member 0 is a "
            f"{class_name(ref_type)}; all members must be of one class"
        )
    for key in [*ref, *(k for k in got if k not in ref)] if got != ref else ():
        if key not in got or key not in ref:
            _refuse_other_layers(reference[3], theirs[3], i, api)  # the cause, named
            which = "lacks" if key not in got else "has an extra"
            raise ValueError(f"{api}: member {i} {which} tensor `{key}` (compared to member 0)")
        whats = ("shape", "dtype", "device", "requires_grad", "tied names")
        for what, a, b in zip(whats, ref[key], got[key], strict=True):
            if a != b and (shapes or what != "shape"):
                raise ValueError(
                    f"{api}: member {i} differs from member 0 at `{key}`: {what} {b} vs "
                    f"{a}{_WAY_OUT.get(what, '')}"
                )
    for name, mode in ref_modes.items() if got_modes != ref_modes else ():
        if got_modes.get(name, mode) != mode:
            where = f"submodule `{name}`" if name else "the module itself"
            raise ValueError(
                f"{api}: member {i} differs from member 0 in the train/eval mode of {where}: "
                f"training={got_modes[name]} vs {mode}; put every member in the same modes "
                "(call .train() / .eval() the same way on each) before building the ensemble"
            )
    return theirs


def _refuse_other_layers(ours: tuple, theirs: tuple, i: int, api: str) -> None:
    """Raise ValueError at the first submodule whose class differs from member 0's (a DARTS
    genotype's pooling op where member 0 has a Linear): what a missing tensor comes from."""
    a, b = {n: c for n, c, _ in ours}, {n: c for n, c, _ in theirs}
    for path in [*a, *(p for p in b if p not in a)]:
        if a.get(path) != b.get(path):
            kinds = " vs ".join(
                "none" if c is None else class_name(c) for c in (b.get(path), a.get(path))
            )
            raise ValueError(
                f"{api}: member {i} has another structure than member 0 at `{path}` ({kinds}); "
                "every member must have member 0's layers: build one ensemble per architecture"
            )


#: nn.Module's own bookkeeping (registries, hooks, mode) and the RNNs' lists of their own
#: parameters: in every module's ``__dict__``, never a setting.
_INTERNAL = frozenset(vars(nn.Module())) | {"_flat_weights", "_flat_weight_refs"}
#: Module hooks, which the forward runs: a tensor they hold is read as a setting is.
_HOOKS = {"_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks"}
_HOOKS_SORTED = sorted(_HOOKS)  # once: own_settings reads them for every module of a member
#: Values compared as they are.


def class_of(module: nn.Module) -> Any:
    """What members' classes must share. ``torch.nn.utils.parametrize`` gives every
    parametrized module a class of its own: those compare by the class they extend and their
    parametrized tensors' names (the parametrizations are submodules, compared as such)."""
    cls = type(module)
    if "parametrizations" in module._modules and parametrize.is_parametrized(module):
        return cls.__bases__, tuple(module._modules["parametrizations"]._modules)  # type: ignore[union-attr]
    return cls


def class_name(key: Any) -> str:  # of a class_of
    if isinstance(key, tuple):
        return f"{key[0][0].__name__} with parametrized {', '.join(key[1])}"
    return key.__name__


class Names:
    """A member's tensors and submodules by ``id``, named on first need (seldom needed)."""

    def __init__(self, root: nn.Module) -> None:
        self.root, self.names = root, cast("dict[int, str] | None", None)

    def __call__(self, obj: Any) -> str | None:
        if self.names is None:
            self.names = {id(m): f"module `{n}`" for n, m in self.root.named_modules()}
            self.names.update((id(t), f"tensor `{n}`") for n, t in named_tensors(self.root))
        return self.names.get(id(obj))


class _Same:
    """A setting compared by ``key`` (what the forward reads of it), shown as itself."""

    def __init__(self, raw: Any, key: Any) -> None:
        self.raw, self.key = raw, key

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return False
        try:
            same = self.key == other.key  # type: ignore[attr-defined]
            return bool(same.all() if hasattr(same, "all") else same)
        except Exception:  # a value without one truth value is not ours to judge
            return True

    def __repr__(self) -> str:
        raw = self.raw
        if isinstance(raw, types.FunctionType):  # every lambda of one class has one name
            return _shown(raw)[:200]
        plain = type(raw).__repr__ is object.__repr__ and hasattr(raw, "__dict__")
        if plain and not isinstance(raw, (type, nn.Module)):  # a config object: its contents
            inner = ", ".join(f"{k}={v!r}" for k, v in vars(raw).items())
            return f"{type(raw).__name__}({inner})"[:200]
        name = getattr(raw, "__qualname__", None)
        return name if isinstance(name, str) else repr(raw)[:200]


class _Tensor(_Same):
    """A tensor attribute that is not a parameter or buffer, compared by value; the same
    tensor by its version (``apply``: changed in place or not)."""

    def __init__(self, raw: torch.Tensor) -> None:
        super().__init__(raw, (raw.shape, raw.dtype, raw.device))
        self.version = raw._version
        plain = raw.layout == torch.strided and not raw.is_meta
        self.head = raw.detach().flatten()[:3].tolist() if plain else []  # as it was

    def __eq__(self, other: object) -> bool:
        if not (isinstance(other, _Tensor) and self.key == other.key):
            return False
        a, b = self.raw, other.raw
        if a.is_meta or a is b:
            return a.is_meta or self.version == other.version
        try:  # NaN equals NaN; a tensor torch cannot compare is not ours to judge
            if a.layout != torch.strided or b.layout != torch.strided:
                a, b = a.to_dense(), b.to_dense()
            nan = a.is_floating_point() or a.is_complex()
            return torch.equal(a, b) or nan and bool(torch.isclose(a, b, 0, 0, True).all())
        except Exception:
            return True

    def __repr__(self) -> str:
        head = ", ".join(f"{v:.4g}" for v in self.head)
        return f"a tensor of shape {tuple(self.raw.shape)} ({self.raw.dtype}) [{head}, ...]"


def _value(v: Any, names: Names, depth: int = 0) -> Any:
    """``v`` as members compare it (plain values as they are, copies of containers)."""
    kind = type(v)
    if kind in ATOMS:
        return "nan" if kind is float and v != v else v
    if isinstance(v, (torch.Tensor, nn.Module)) and names(v) is not None:
        return _Same(v, names(v))  # the member's own tensor or submodule, by name
    if depth >= DEPTH:
        return _Same(v, v)
    deeper = depth + 1
    if isinstance(v, torch.Tensor):
        return _Tensor(v)
    if isinstance(v, (tuple, list)):
        if all(type(x) in ATOMS for x in v):
            return v if isinstance(v, tuple) else list(v)
        return _Same(v, (kind, [_value(x, names, deeper) for x in v]))
    if isinstance(v, dict):
        return _Same(v, (kind, {k: _value(x, names, deeper) for k, x in v.items()}))
    if isinstance(v, (set, frozenset)):
        return frozenset(v)
    if isinstance(v, types.FunctionType):  # a lambda made in __init__ is one per member
        cells = [c for c in _cells(v) if c is not v]
        # One level for all it holds: a lambda in a list (`[lambda o: self.fc(o)]`) reached
        # its cells past DEPTH, compared by identity there, and differed per member.
        held = [*(v.__defaults__ or ()), *(v.__kwdefaults__ or {}).items(), *cells]
        return _Same(v, (v.__code__, [_value(x, names, deeper) for x in held]))
    if isinstance(v, types.MethodType):
        return _Same(v, (_value(v.__func__, names, deeper), _value(v.__self__, names, deeper)))
    if isinstance(v, functools.partial):
        return _Same(v, _value((v.func, v.args, v.keywords), names, deeper))
    plain = kind.__eq__ is object.__eq__ and not isinstance(v, (type, enum.Enum, nn.Module))
    if plain and hasattr(v, "__dict__"):  # a config object without __eq__: by its contents
        return _Same(v, (kind, {k: _value(x, names, deeper) for k, x in vars(v).items()}))
    return _Same(v, v)


def own_settings(module: nn.Module, names: Names) -> dict[str, Any]:
    """A module's own non-tensor state: every attribute but its parameters, buffers,
    submodules, hooks and mode. A tensor that a forward pre-hook sets before every call
    (``weight_norm``, ``spectral_norm``) compares by shape and dtype only."""
    own = vars(module)
    ran = _hooks(own, names)
    if own.keys() <= _INTERNAL:  # a set operation: most modules have no or a few settings
        return ran
    found = {k: own[k] for k in sorted(own.keys() - _INTERNAL)}
    for key, v in found.items():
        if type(v) in ATOMS and v == v:  # most settings: ints, floats, strings (no NaN)
            continue
        if isinstance(v, torch.Tensor) and names(v) is None:
            hooks = module._forward_pre_hooks.values()
            if any(key in (getattr(h, "name", 0), getattr(h, "_tensor_name", 0)) for h in hooks):
                v = torch.empty_like(v, device="meta")
        found[key] = _value(v, names)
    return found | ran


def _hooks(own: dict[str, Any], names: Names) -> dict[str, Any]:
    """The module hooks a forward runs, compared as a function attribute is (a lambda by its
    code and what it closes over, a ``partial`` by its arguments): the forward runs member
    0's, so member 1's ``register_forward_hook(lambda m, a, out: out * s)`` ran with member
    0's ``s``, silently. torch's own hook objects (weight_norm, spectral_norm, prune) set a
    tensor the ensemble recomputes per member, and are left out."""
    found = {}
    for key in _HOOKS_SORTED:
        hooks = [h for h in own[key].values() if type(h).__module__.split(".")[0] != "torch"]
        if hooks:
            shown = ", ".join(_shown(h) for h in hooks)
            found[key] = _Same(shown, _value(hooks, names))
    return found


def _shown(hook: Any) -> str:
    """A hook by name and the plain values it holds (its repr shows only an address)."""
    fn = hook.func if isinstance(hook, functools.partial) else hook
    held = _cells(fn)
    if isinstance(hook, functools.partial):
        held += [*hook.args, *hook.keywords.values()]
    atoms = ", ".join(repr(v) for v in held if type(v) in ATOMS)
    name = getattr(fn, "__qualname__", type(hook).__name__)
    return f"{name}({atoms})" if atoms else name


def non_persistent_buffers(module: nn.Module) -> set[str]:
    """Full names of the buffers that ``state_dict`` leaves out."""
    return {
        f"{prefix}.{name}" if prefix else name
        for prefix, sub in module.named_modules()
        for name in sub._non_persistent_buffers_set
    }


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


def _cells(fn: Any) -> list[Any]:
    """What a function closes over; an empty cell (a name deleted after) holds nothing."""
    found = []
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            found.append(cell.cell_contents)
        except ValueError:  # as alone, the forward raises NameError when it reads it
            continue
    return found
