"""From member modules to stacked storage: one size (streamed) or several sizes (padded),
and the meta-device copies of members that the storage runs.

``Ensemble`` takes the result as its storage. Members of one size are copied one at a time,
so building peaks at about the stacked size plus one member; members of several sizes are all
built first (the largest one sets the padded shapes), then copied into their corners.
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch._C._functorch import is_functorch_wrapped_tensor
from torch.nn.utils import prune
from torch.nn.utils.spectral_norm import SpectralNorm
from torch.nn.utils.weight_norm import WeightNorm

from ._batchable import own_parametrized_classes_
from ._boxes import emptied, is_kept
from ._copies import copy_member
from ._ensemble_parts import check_layout, refuse_compiled, stacked_like
from ._members import check_same, class_name, named_tensors, signature
from ._padding import Padding, check_pair, gates_of, largest, setting_advice
from ._plain_turns import INTERNAL
from ._template_parameter import TemplateBuffer, TemplateParameter

#: nn.Module's hook registries: hooks that ``apply``'s ``fn`` registers cannot carry over.
_HOOKS = tuple(k for k, v in vars(nn.Module()).items() if isinstance(v, dict) and "hook" in k)

__all__ = [
    "Stacked",
    "check_applied",
    "check_extra_state",
    "check_settings",
    "first_difference",
    "follow_flags",
    "hooks_of",
    "left_by_forward",
    "meta_copy",
    "migrated_keys",
    "recompute_",
    "recomputed",
    "scrub_",
    "scrubbed",
    "scrubbing",
    "stack_one_size",
    "stack_sizes",
    "staged",
]


@dataclass
class Stacked:
    """Stacked ``[k, ...]`` tensors by the member's names, the meta template the forward runs,
    the members' train/eval mode, and where each member sits when sizes differ."""

    tensors: dict[str, torch.Tensor]
    template: nn.Module
    training: bool
    padding: Padding | None = None


def stack_one_size(members: Iterable[nn.Module], member_ids: Sequence[int], api: str) -> Stacked:
    """Copy members one at a time into stacked storage; each must equal the first in shape."""
    stacked: dict[str, torch.Tensor] = {}
    rows: dict[str, tuple[torch.Tensor, ...]] = {}  # each member's views, made at once
    reference, template, training = None, None, True
    # A plain counter: enumerate()/zip() recycle their result tuple, which would keep the
    # previous member alive while the next one is built.
    slot = 0
    for member in members:
        if reference is None:
            refuse_compiled(api, member, member_ids[slot])
            reference, training = signature(member), member.training
            check_extra_state(api, member)
            template = meta_copy(member)
            stacked = {name: stacked_like(t, len(member_ids)) for name, t in named_tensors(member)}
            rows = {name: s.unbind() for name, s in stacked.items()}
        else:
            theirs = check_same(reference, member, member_ids[slot], api)
            check_settings(reference[3], theirs[3], member_ids[slot], api, member_ids[0])
        with torch.no_grad():
            for name, t in named_tensors(member):
                check_layout(api, name, t, rows[name][0], member_ids[slot])
                rows[name][slot].copy_(t)
        del member  # drop our reference before the next member is built
        slot += 1  # noqa: SIM113
    assert template is not None, "no members"  # callers check n >= 1
    del rows  # views of the storage: the stacked tensors alone are their base
    return Stacked(stacked, template, training)


def stack_sizes(members: list[nn.Module], api: str) -> Stacked:
    """Stack ``members`` padded to the largest (plainly when all have one size).

    Raises:
        ValueError: members differ in anything but sizes, a layer that cannot be padded
            exactly differs in size (``check_pair``), or no member is the largest everywhere.
    """
    refuse_compiled(api, members[0], 0)
    kinds: dict[tuple, int] = {}
    kind_of = [kinds.setdefault(_shapes_key(m), len(kinds)) for m in members]
    signatures = [signature(members[0])]
    for i, member in enumerate(members[1:], start=1):
        check_pair(api, members[0], member, i, padded=len(kinds) > 1)
        signatures.append(check_same(signatures[0], member, i, api, shapes=False))
    if len(kinds) == 1:
        return stack_one_size(members, range(len(members)), api)
    check_extra_state(api, members[0])
    firsts = [members[kind_of.index(k)] for k in range(len(kinds))]
    # Every member runs as the largest one, and the self-check runs the first of each size:
    # the others of that size must share its settings (an int that is not a size, say).
    for i, kind in enumerate(kind_of):
        first = kind_of.index(kind)
        check_settings(signatures[first][3], signatures[i][3], i, api, first)
    big = firsts[largest(api, [dict(_shapes_key(m)) for m in firsts])]
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
    stacked = {
        name: torch.zeros((len(members), *t.shape), dtype=t.dtype, device=t.device)
        for name, t in named_tensors(big)
    }
    with torch.no_grad():
        for row, member in enumerate(members):
            for name, t in named_tensors(member):
                padding.put_(name, stacked[name][row], t, row)
    return Stacked(stacked, meta_copy(big), big.training, padding)


def follow_flags(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], synced: list[bool]) -> None:
    """Each stacked parameter's ``requires_grad`` and its template twin's (``pairs``) made one,
    from whichever changed since the last call (``synced``: the flags then, updated), so that
    ``ens.stacked_params()[name].requires_grad_(False)`` and, as on a plain module,
    ``ens.template.<layer>.requires_grad_(False)`` both freeze the layer (the template's was
    set back before). Written only on a change: torch refuses ``requires_grad_`` under a
    functorch transform (an ensemble called inside jacrev or an outer vmap).

    A flag set on the template reaches its stacked twin at once (``TemplateParameter``, linked
    here): otherwise a flag set on one side, then the other side set to the value it already
    had (``ens.template.fc1.requires_grad_(False)``, then ``p.requires_grad_(True)`` for every
    ``p`` of ``ens.parameters()``) would keep the first, where a plain module keeps the last.
    """
    for k, (p, meta) in enumerate(pairs):
        if meta.requires_grad != p.requires_grad:
            if meta.requires_grad != synced[k]:  # the template's flag was set
                p.requires_grad_(meta.requires_grad)
            else:
                meta.requires_grad_(p.requires_grad)
        synced[k] = p.requires_grad
    if pairs and pairs[0][1].__dict__.get("_twin", (None, None))[1] is not synced:
        for k, (p, meta) in enumerate(pairs):  # new storage (built, selected, copied, assigned)
            meta.__dict__["_twin"] = (p, synced, k)


def meta_copy(module: nn.Module) -> nn.Module:
    """A deep copy of ``module`` whose tensors live on the meta device (ties preserved)."""
    memo: dict[int, Any] = {}
    for _, t in named_tensors(module):
        meta = torch.empty_like(t, device="meta")
        param = isinstance(t, nn.Parameter)
        memo[id(t)] = TemplateParameter(meta, t.requires_grad) if param else TemplateBuffer.of(meta)
    for m, name, _ in recomputed(module):  # a non-leaf (weight_norm's): deepcopy refuses it
        memo[id(m.__dict__[name])] = torch.empty_like(m.__dict__[name], device="meta")
    # The user's parametrized modules keep their classes (remove_parametrizations on one of
    # them deletes a property from its class): the template gets classes of its own.
    return own_parametrized_classes_(copy_member(module, memo))


def migrated_keys(module: nn.Module, prefix: str, metadata: Any) -> set[str]:
    """The state-dict keys of ``module`` (under ``prefix``) that its own loader fills in where
    a state dict of an older version lacks them, instead of reporting them missing.

    BatchNorm before version 2 had no ``num_batches_tracked``: torch's loader keeps the
    module's count when the state dict's ``_metadata`` says an older version or has no entry
    for the layer (a dict rebuilt by a comprehension has no ``_metadata``).
    """
    keys = set()
    for name, m in module.named_modules():
        if isinstance(m, nn.modules.batchnorm._NormBase) and m.track_running_stats:
            where = f"{prefix}{name}." if name else prefix  # torch's metadata key: no dot
            version = (metadata or {}).get(where[:-1], {}).get("version")
            if version is None or version < 2:
                keys.add(f"{where}num_batches_tracked")
    return keys


def staged(
    pending: Sequence[tuple[str, str, torch.Tensor, Any]], error_msgs: list[str]
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``(target, value)`` for each ``(key, name, target, value)`` of ``pending``, the value in
    its target's dtype and device: converted before anything is copied, so that a value that
    cannot be (one on the meta device) adds torch's message to ``error_msgs`` instead of
    failing after the keys before it were copied."""
    ready = []
    for key, _, target, value in pending:
        try:
            ready.append((target, value.to(device=target.device, dtype=target.dtype)))
        except Exception as err:
            error_msgs.append(
                f'While copying the parameter named "{key}", whose dimensions in the model are '
                f"{target.shape} and whose dimensions in the checkpoint are {value.shape}, an "
                f"exception occurred : {err.args}."
            )
    return ready


def recomputed(module: nn.Module) -> list[tuple[nn.Module, str, Any]]:
    """``(submodule, attribute, hook)`` for each tensor that a forward pre-hook of old-style
    ``weight_norm``, ``spectral_norm`` or ``torch.nn.utils.prune`` computes from the
    submodule's own tensors and keeps as a plain attribute: no state, and not a leaf."""
    return [
        (m, name, h)
        for m in module.modules()
        for h in m._forward_pre_hooks.values()
        if isinstance(name := _sets(h), str) and isinstance(m.__dict__.get(name), torch.Tensor)
    ]


def _sets(hook: Any) -> str | None:
    if isinstance(hook, (WeightNorm, SpectralNorm)):
        return hook.name
    return hook._tensor_name if isinstance(hook, prune.BasePruningMethod) else None


def recompute_(module: nn.Module) -> None:
    """Set each ``recomputed`` tensor from the module's own tensors, as after its last forward
    (without the power iteration, which would move ``spectral_norm``'s ``u``, ``v``)."""
    for m, name, hook in recomputed(module):
        if isinstance(hook, prune.BasePruningMethod):
            setattr(m, name, hook.apply_mask(m))
        else:
            power = {"do_power_iteration": False} if isinstance(hook, SpectralNorm) else {}
            setattr(m, name, hook.compute_weight(m, **power))


def left_by_forward(value: object) -> bool:
    """A tensor a forward stored (``self.last = h``): batched, or with the graph of the last
    member run in turns, or all members' stacked on the template (``is_kept``); no member's
    own value, and what ``scrub_`` drops before a copy. A container holding one counts too
    (an LSTM's ``self.state = (h, c)``: its batched tensors crashed every copy)."""
    if isinstance(value, tuple | list | dict | deque):
        return any(map(left_by_forward, value.values() if isinstance(value, dict) else value))
    return isinstance(value, torch.Tensor) and (
        is_functorch_wrapped_tensor(value) or value.grad_fn is not None or is_kept(value)
    )


def scrub_(module: nn.Module) -> list[tuple[nn.Module, str, torch.Tensor]]:
    """Drop the tensors a forward left in a meta module's plain attributes (``self.last = h``)
    before it is copied: under vmap a batched tensor, dead outside it; with the loop backend
    the last member's, with its graph; stacked on the template (``is_kept``). ``copy.deepcopy``
    refuses the first two, and none is one member's: a copy starts with None there (an empty
    dict or list where the forward keeps one: ``emptied``), as a
    module that has not run. Returns what it dropped, by module and name (``scrubbed`` puts
    it back)."""
    dropped = []
    empty: dict[int, Any] = {}  # one per container: modules that share one share its empty one
    for m in module.modules():
        for key, v in list(vars(m).items()):
            flat = key == "_flat_weights"  # a loop turn's weights (a parametrized RNN's too)
            if (flat or key not in INTERNAL) and left_by_forward(v):
                if not flat and id(v) not in empty:
                    empty[id(v)] = emptied(v)
                m.__dict__[key] = (
                    [w if w is None else w.detach() for w in v] if flat else empty[id(v)]
                )
                dropped.append((m, key, v))
    return dropped


@contextlib.contextmanager
def scrubbed(*modules: nn.Module) -> Iterator[None]:
    """``scrub_`` for the time of a copy (``copy.deepcopy(ens)``, ``select``): the copy starts
    with None there, and the modules copied get their tensors back after it, so the ensemble
    goes on from the state its forward keeps (a key/value cache in ``self.k``), as a plain
    module goes on after ``copy.deepcopy`` of it (it went on from None, silently)."""
    dropped = [d for module in modules for d in scrub_(module)]
    _SCRUBBING[0] += 1
    try:
        yield
    finally:
        _SCRUBBING[0] -= 1
        for m, key, v in dropped:
            m.__dict__[key] = v


#: How many ``scrubbed`` are under way: only then is a kept tensor's None a scrub, not a reset.
_SCRUBBING = [0]


def scrubbing() -> bool:
    """Whether a ``scrubbed`` copy is under way (``Watched.follow`` then ignores its Nones)."""
    return _SCRUBBING[0] > 0


def first_difference(ours: tuple, theirs: tuple) -> tuple[str, Any, str | None, Any, Any] | None:
    """``(path, class name, attribute, ours, theirs)`` at the first difference between two
    ``settings``; the attribute is None where the submodules' classes differ (then ours and
    theirs are class names, None for a missing submodule)."""
    a, b = {n: (c, s) for n, c, s in ours}, {n: (c, s) for n, c, s in theirs}
    for path in [*a, *(p for p in b if p not in a)]:
        (ca, sa), (cb, sb) = a.get(path, (None, {})), b.get(path, (None, {}))
        names = [None if c is None else class_name(c) for c in (ca, cb)]
        if ca != cb:
            return path, names[0] or names[1], None, *names
        for key in [*sa, *(k for k in sb if k not in sa)]:
            if key not in sa or key not in sb or sa[key] != sb[key]:
                return path, names[0], key, sa.get(key, _UNSET), sb.get(key, _UNSET)
    return None


def hooks_of(module: nn.Module) -> list[tuple[str, list[list]]]:
    """Every submodule's hooks, by name: what ``Ensemble.apply``'s ``fn`` must not change."""
    return [(n, [list(getattr(m, k)) for k in _HOOKS]) for n, m in module.named_modules()]


def check_applied(api: str, before: tuple, after: tuple, hooks_before: list, hooks: list) -> None:
    """Refuse what ``apply``'s ``fn`` changed beyond values, modes and grad flags."""
    tensors, settings_before, now = before[1], before[3], after[3]
    found = None if now == settings_before else first_difference(settings_before, now)
    if found is not None and found[2] not in _HOOKS:  # a hook: refused as such below
        path, _, key, a, b = found
        if key is None:
            change = "replaced" if a and b else "removed" if a else "added"
            what = f"{change} `{path}` ({' -> '.join(c for c in (a, b) if c)})"
        else:
            what = f"changed `{f'{path}.{key}' if path else key}` ({a!r} -> {b!r})"
        raise ValueError(
            f"{api}: `fn` {what}; the ensemble keeps one structure for all members and carries "
            "over only tensor values, train/eval modes and requires_grad: set an attribute on "
            "ens.template instead (every member follows it), or build the members with it"
        )
    for name, (shape, dtype, device, *_) in after[1].items():
        if name not in tensors or tensors[name][:3] != (shape, dtype, device):
            raise ValueError(
                f"{api}: `fn` changed the tensor `{name}` (shape, dtype or device); an ensemble's "
                "members share one structure: use ens.to(...) / ens.double(), or build the "
                "members that way"
            )
    for (path, ours), (_, theirs) in zip(hooks_before, hooks, strict=True):
        if ours != theirs:
            raise ValueError(
                f"{api}: `fn` registered or removed a hook on `{path}`; the members are not "
                "modules a hook could run on: register it in the member's __init__ instead"
            )


class _Unset:
    def __repr__(self) -> str:
        return "(unset)"


_UNSET = _Unset()


def check_settings(ours: tuple, theirs: tuple, i: int, api: str, first: int = 0) -> None:
    """Raise ValueError naming the first submodule or attribute where member ``i``'s settings
    (``_members.signature``) differ from ``ours``, member ``first``'s: one forward runs every
    member with those."""
    found = None if theirs == ours else first_difference(ours, theirs)
    if found is None:
        return
    path, cls, key, a, b = found
    if key is None:
        where = f"`{path}`" if path else "the module itself"
        got = f"has a {b} at {where}" if b else f"lacks the submodule {where}"
        raise ValueError(
            f"{api}: member {i} {got} where member {first} has {f'a {a}' if a else 'none'}; "
            f"members must have the same layers (one forward runs them all as member {first})"
        )
    where = f"`{path}` ({cls})" if path else cls
    raise ValueError(
        f"{api}: member {i} differs from member {first} at {where}: `{key}` is {b!r} vs "
        f"{a!r}; {setting_advice(key, a, first)}"
    )


def check_extra_state(api: str, member: nn.Module) -> None:
    """Refuse a member with extra state (``get_extra_state``, or a state_dict hook that adds
    a key): not one of its tensors, it cannot be stacked, and a state_dict without it would
    not load into the member alone."""
    for path, m in member.named_modules():
        if type(m).get_extra_state is not nn.Module.get_extra_state:
            where = f"`{path}` ({type(m).__name__})" if path else type(m).__name__
            raise ValueError(
                f"{api}: {where} has extra state (it defines get_extra_state), which an "
                "ensemble cannot stack per member: keep that state in buffers "
                "(self.register_buffer) or in settings shared by all members"
            )
    tensors = {id(t) for _, t in named_tensors(member)}
    for key, value in member.state_dict(keep_vars=True).items():
        if id(value) not in tensors:
            raise ValueError(
                f"{api}: the member's state_dict holds `{key}`, which is none of its parameters "
                "and buffers (a state_dict hook adds it): an ensemble stacks only those, per "
                "member; register it as a buffer (self.register_buffer) instead"
            )


def _shapes_key(module: nn.Module) -> tuple[tuple[str, tuple[int, ...]], ...]:
    return tuple((name, tuple(t.shape)) for name, t in named_tensors(module))
