"""StackedModule: stacked member tensors under the member's own names, as an nn.Module.

The storage half of ``Ensemble``: it keeps every parameter and buffer of the member once,
with a leading member dim, in ``_parameters``/``_buffers`` under the member's dotted names, so
that ``state_dict()`` has the member's keys (tied aliases included); it loads state dicts all
or nothing; the module that runs follows the meta-device template's submodule modes and
attributes and the stacked parameters' grad flags; ``apply`` runs a function on every member.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Sequence
from typing import Any, TypeVar, cast

import torch
from torch import nn

from ._checks import as_ids, index_rows
from ._copies import copy_holding, copy_member
from ._cut_from import follow_cuts, record_cuts
from ._kept_loans import carry_kept_
from ._member_apply import apply_members
from ._member_state_dicts import member_state_dicts
from ._members import named_tensors, non_persistent_buffers
from ._padding import Padding
from ._stacking import follow_flags, migrated_keys, scrub_, scrubbed
from ._state_loading import loadable, warn_member_hooks
from ._storage_parts import in_mode, member_format, metadata_of_member, paired
from ._unbatchable import SparseLayer, sparse_layers

__all__ = ["StackedModule"]

_M = TypeVar("_M", bound="StackedModule")


class StackedModule(nn.Module):
    """Stacked ``[n, ...]`` tensors by the member's names, and the member's meta template."""

    # The meta-device member that functional_call runs, kept out of nn.Module's registry.
    _template: nn.Module
    member_ids: Sequence[int]
    n_total: int
    _state_keys: dict[str, str]
    #: The ``_metadata`` (each submodule's ``_version``) of the member's own state_dict.
    _member_metadata: dict[str, Any] | None
    _sparse: list[SparseLayer]
    _runner: nn.Module
    backend: str
    #: Where each member sits in storage padded to the largest member, or None when all
    #: members have one size (``Ensemble.from_factories``).
    _padding: Padding | None = None

    def _adopt(
        self,
        stacked: dict[str, torch.Tensor],
        member_ids: Sequence[int],
        n_total: int,
        training: bool,
    ) -> None:
        """Take ``stacked`` (name -> [k, ...]) as this ensemble's storage."""
        params = dict(self._template.named_parameters())
        for name, t in stacked.items():
            if name in params:
                # Written straight into _parameters: register_parameter forbids the dots of
                # the member's own names, and those names are what state_dict must show.
                # assign=True keeps the Parameters it is given, with the module's flag (torch's)
                had = self._parameters.get(name)
                flag = (params[name] if had is None else had).requires_grad
                p = t if isinstance(t, nn.Parameter) else nn.Parameter(t, requires_grad=flag)
                p.requires_grad_(flag)
                if self._padding is not None:  # what optimizers read (vmapens.optim)
                    p._member_padding = (self._padding, name)  # type: ignore[attr-defined]
                self._parameters[name] = p
            else:
                self._buffers[name] = t
        self._non_persistent_buffers_set = non_persistent_buffers(self._template)
        self.member_ids, self.n_total = member_ids, n_total
        if self._padding is not None:
            self._padding.prepare(self.stacked_params())
        # Member state_dict key -> stacked name (tied weights map several keys to one name).
        meta_names = {id(t): name for name, t in named_tensors(self._template)}
        own_sd = self._template.state_dict(keep_vars=True)
        self._state_keys = {key: meta_names[id(t)] for key, t in own_sd.items()}
        self._member_metadata = getattr(own_sd, "_metadata", None)
        self.__dict__["_sparse"] = sparse_layers(self._template)
        self.training = training  # the template keeps each submodule's own mode
        padded = [] if self._padding is None else self._padding.templates
        flags = self.stacked_params()  # what _follow_template syncs, paired once (``paired``)
        self.__dict__["_followers"] = paired(self._template, self._runner, padded, flags)
        self._follow_template()  # links each template parameter to its twin (follow_flags)

    def _follow_template(self) -> None:
        """The runner (and padded templates) in the template's train/eval modes and with its
        attributes (``Watched.follow``), and the grad flags of the template and the stacked
        parameters made one (``follow_flags``)."""
        modules, params, _, synced, attributes = self._followers
        for template, m in modules:
            if m.training != template.training:  # nn.Module's setattr costs ~1 us: on a change
                m.training = template.training
        attributes.follow()
        follow_flags(params, synced)

    def _evaluating(self) -> contextlib.AbstractContextManager[None]:
        """``eval()`` inside; afterwards every submodule is back in its own mode, where
        ``train()`` would also switch a BatchNorm the user froze in eval mode."""
        return in_mode(self, False, [self, *self._template.modules()], self._follow_template)

    def __len__(self) -> int:
        return len(self.member_ids)

    @property
    def runner(self) -> nn.Module:
        """The module ``functional_call`` runs: the template, its layers vmap batches badly
        (recurrent, attention...) swapped for twins with the same names and maths
        (``vmapens._batchable``), unless ``backend="loop"``."""
        return self._template if self.backend == "loop" else self._runner

    @property
    def template(self) -> nn.Module:
        """The member module ``functional_call`` runs: the user's class on the ``meta`` device."""
        return self._template

    def stacked_params(self) -> dict[str, nn.Parameter]:
        """The stacked parameters by the member's names, each ``[n, ...]`` (tied ones once)."""
        return cast("dict[str, nn.Parameter]", self._parameters)

    def stacked_buffers(self) -> dict[str, torch.Tensor]:
        """The stacked buffers by the member's names, each ``[n, ...]``."""
        return cast("dict[str, torch.Tensor]", self._buffers)

    def stacked_state(self) -> dict[str, torch.Tensor]:
        """Parameters then buffers: what ``_member_map`` functions receive, stacked."""
        return {**self.stacked_params(), **self.stacked_buffers()}

    def _persistent(self) -> dict[str, torch.Tensor]:
        buffers = self.stacked_buffers()
        kept = {k: v for k, v in buffers.items() if k not in self._non_persistent_buffers_set}
        return {**self.stacked_params(), **kept}

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        """nn.Module's, after the check ``ens(x)`` makes of writes on the template (on meta:
        they kept nothing, and the values saved would not be what the user wrote)."""
        if "_followers" in self.__dict__:  # built
            self._followers[4].check_written()
        return super().state_dict(*args, **kwargs)

    def state_dicts(self) -> list[dict[str, torch.Tensor]]:
        """One state_dict per member, each loadable with ``strict=True`` by the user's class:
        what ``ens[i].state_dict()`` gives (detached copies), ``_metadata`` included.

        Example:
            >>> from vmapens import Ensemble
            >>> sds = Ensemble(lambda: nn.Linear(3, 2), n=4).state_dicts()
            >>> nn.Linear(3, 2).load_state_dict(sds[0])
            <All keys matched successfully>
        """
        self._followers[4].check_written()  # a write on the template refused, as by ens(x)
        persistent, keys, metadata = self._persistent(), self._state_keys, self._member_metadata
        return member_state_dicts(persistent, keys, len(self), self._padding, metadata)

    def select(self: _M, index: Any) -> _M:
        """A new Ensemble of the chosen members (copies; this one is unchanged).

        Args:
            index: a slice, a sequence of integer-likes, a 1-D integer tensor or a bool
                mask of length ``n`` (torch or numpy).

        Returns:
            An Ensemble whose member ``k`` is member ``index[k]`` of this one, with the same
            options and the chosen members' global ids.

        Raises:
            TypeError: ``index`` is not one of the above.
            IndexError: an index out of range.

        Example:
            >>> from vmapens import Ensemble
            >>> ens = Ensemble(lambda: nn.Linear(3, 2), n=6, seed=0)
            >>> sub = ens.select([4, 1])
            >>> len(sub), list(sub.member_ids)
            (2, [4, 1])
        """
        rows = index_rows("Ensemble", index, len(self))
        if not len(rows):  # an empty slice or an all-False mask (a list is refused above)
            raise IndexError("Ensemble: selecting no members; an Ensemble needs at least one")
        self._follow_template()
        with scrubbed(self._template, self._runner):  # copy.copy scrubs too (__getstate__)
            sub = copy.copy(self)
            nn.Module.__init__(sub)  # fresh registries; the options are shared
            # Copies of the meta modules: sub.train()/eval() must not switch this one's mode.
            sub.__dict__["_template"] = copy_member(self._template)
            sub.__dict__["_runner"] = copy_member(self._runner)
        if self._padding is not None:
            sub.__dict__["_padding"] = self._padding.select(rows.tolist())
        with torch.no_grad():
            stacked = {k: v[rows].clone() for k, v in self.stacked_state().items()}
        ids = [self.member_ids[r] for r in rows.tolist()]
        sub._adopt(stacked, as_ids(ids), self.n_total, self.training)
        carry_kept_(self._template, sub, rows)  # the chosen members' hidden states, copied
        record_cuts(self.stacked_params(), sub.stacked_params(), tuple(rows.tolist()))
        return sub

    def __getitem__(self, index: Any) -> Any:  # Ensemble's: member ``i`` as a module
        raise NotImplementedError

    def apply(self: _M, fn: Callable[[nn.Module], None]) -> _M:  # type: ignore[override]
        """Apply ``fn`` to every submodule of every member, as ``member.apply(fn)`` would alone.

        Members are visited in order, so a custom initialisation that draws from the global
        RNG gives member ``i`` what ``models[i].apply(fn)`` gives after members ``0..i-1``.
        Train/eval modes and ``requires_grad`` flags that ``fn`` sets carry over (the same on
        every member), and a parameter it replaces with a new ``nn.Parameter`` becomes a new
        stacked Parameter (an optimizer made before holds the old one, as alone); any other
        change to the members' structure is refused. Members of different sizes each run
        ``fn`` at their own size.

        Raises:
            TypeError: ``fn`` is not callable.
            ValueError: ``fn`` changed a tensor's shape, dtype or device, an attribute
                (BatchNorm's ``momentum``, an activation function), a submodule's class, or
                hooks, or did not treat every member alike (a parameter replaced in some
                members only). Nothing changes then.

        Example:
            >>> from vmapens import Ensemble
            >>> ens = Ensemble(lambda: nn.Linear(3, 2), n=2, seed=0)
            >>> _ = ens.apply(lambda m: nn.init.zeros_(m.bias) if hasattr(m, "bias") else None)
            >>> float(ens.stacked_params()["bias"].detach().abs().sum())
            0.0
        """
        api = "Ensemble.apply"
        if not callable(fn):
            raise TypeError(f"{api}: `fn` must be callable, got {type(fn).__name__}")
        apply_members(api, self, fn)
        return self

    def __setattr__(self, name: str, value: Any) -> None:
        old = self.__dict__.get("_parameters", {}).get(name)  # a member's top-level parameter
        if isinstance(value, torch.Tensor) and old is not None and value.shape != old.shape:
            raise ValueError(
                f"Ensemble: `ens.{name}` is the members' stacked parameter, of shape "
                f"{tuple(old.shape)}, got {tuple(value.shape)}; write the members' values in "
                f"place: with torch.no_grad(): ens.{name}.copy_(value)"
            )
        super().__setattr__(name, value)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            template = self.__dict__.get("_template")
            if template is not None and hasattr(template, name):
                raise AttributeError(
                    f"Ensemble: `{name}` is an attribute of the members, not of the ensemble; "
                    f"use ens.template.{name} for the member's structure (meta tensors) or "
                    f"ens[i].{name} for member i's values"
                ) from None
            raise

    def get_parameter(self, target: str) -> nn.Parameter:
        """``nn.Module.get_parameter``; a member's dotted name (``"fc1.weight"``, a tied alias
        too) gives the stacked ``[n, ...]`` parameter, held under the member's own name."""
        name = self._state_keys.get(target, target)
        if name in self._parameters:
            return self.stacked_params()[name]
        return super().get_parameter(target)

    def get_buffer(self, target: str) -> torch.Tensor:
        """``nn.Module.get_buffer``; a member's dotted name gives the stacked buffer."""
        name = self._state_keys.get(target, target)
        if name in self._buffers:
            return self.stacked_buffers()[name]
        return super().get_buffer(target)

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:  # the meta modules' lambdas rebound
        metas = [] if self._padding is None else self._padding.templates
        with scrubbed(self._template, self._runner):
            new = copy_holding(self, memo, [self._template, self._runner, *metas])
        carry_kept_(self._template, new)
        return new

    def __getstate__(self) -> dict[str, Any]:  # pickle, torch.save, copy.copy
        state = super().__getstate__()
        # Last: pickle writes it after the meta modules, and it gives back what scrub_ took.
        state["_vmapens_kept"] = _Kept([*scrub_(self._template), *scrub_(self._runner)])
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        kept = state.pop("_vmapens_kept", None)
        if isinstance(kept, _Kept):  # copy.copy: the state was not pickled
            kept.restore()
        # Parameter.__deepcopy__ and TemplateParameter.__reduce_ex__ drop the stacked parameters'
        # padding marks (sizes, for the optimizers) and the template's links to them (now).
        super().__setstate__(state)
        for name, p in self._parameters.items() if self._padding is not None else ():
            p._member_padding = (self._padding, name)  # type: ignore[union-attr]
        if "_followers" in self.__dict__:
            self._follow_template()

    def to(self, *args: Any, **kwargs: Any) -> Any:
        """``nn.Module.to``; a ``memory_format`` applies to each member's tensors, as torch
        applies it to a member's 4-D and 5-D tensors (a stacked tensor has one more dim)."""
        device, dtype, non_blocking, fmt = torch._C._nn._parse_to(*args, **kwargs)
        if fmt is None:
            return super().to(*args, **kwargs)
        for t in self.stacked_state().values():
            member_format(t, fmt)  # raises before anything changes, as torch would
        super().to(device=device, dtype=dtype, non_blocking=non_blocking)
        return self._apply(lambda t: member_format(t, fmt))

    def _apply(self, fn: Any, recurse: bool = True) -> Any:
        before = list(self._parameters.values())
        out = super()._apply(fn, recurse)
        if any(p is not q for p, q in zip(before, self._parameters.values(), strict=True)):
            # set_overwrite_module_params_on_conversion(True): new Parameters, to link afresh
            # (and to mark for optimizers, ``_member_padding``); the template's edits first.
            self._follow_template()
            self._adopt(self.stacked_state(), self.member_ids, self.n_total, self.training)
            follow_cuts(before, self._parameters.values())  # select's record, too
        elif self._padding is not None:  # .to() / .double(): the masks follow the parameters
            self._padding.prepare(self.stacked_params())
        return out

    def train(self: _M, mode: bool = True) -> _M:
        super().train(mode)
        self._template.train(mode)
        self._follow_template()  # the runner and padded templates
        return self

    def extra_repr(self) -> str:
        sizes = "" if self._padding is None else f", sizes={len(self._padding.templates)} (padded)"
        return f"n={len(self)}, backend={self.backend!r}{sizes}, member={self._template!r}"

    def _save_to_state_dict(self, destination: dict, prefix: str, keep_vars: bool) -> None:
        # The member's own keys, in its own order, tied aliases included, and its `_metadata`.
        metadata_of_member(destination, prefix, self._member_metadata)
        persistent = self._persistent()
        for key, name in self._state_keys.items():
            destination[prefix + key] = persistent[name] if keep_vars else persistent[name].detach()

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        """``nn.Module.load_state_dict``, all or nothing (torch's own loader copies the keys before
        one it raises on). ``assign=True`` makes the state dict's tensors the stacked tensors, as
        in torch: an optimizer built before holds the old ones."""
        self.__dict__["_loading"] = (strict, getattr(state_dict, "_metadata", None))
        try:
            return super().load_state_dict(state_dict, strict, assign)
        finally:
            del self.__dict__["_loading"]

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
        # Every key checked and value readied before anything changes (nn.Module's copies as it
        # goes); `strict` is known in ``ens.load_state_dict`` only (torch passes True here).
        lists = (missing_keys, unexpected_keys, error_msgs)
        for hook in self._load_state_dict_pre_hooks.values():  # the ensemble's own, as torch's
            hook(state_dict, prefix, local_metadata, strict, *lists)
        warn_member_hooks(self._template, prefix, getattr(state_dict, "_metadata", None))
        persistent, (whole, metadata) = self._persistent(), self.__dict__.get("_loading", (0, 0))
        assign = bool(local_metadata.get("assign_to_params_buffers"))
        if assign:
            self._follow_template()  # the grad flags the assigned Parameters take
        ready = loadable(
            state_dict,
            {prefix + k: (name, persistent[name]) for k, name in self._state_keys.items()},
            prefix=prefix,
            whole=bool(whole),
            kept=migrated_keys(self._template, prefix, metadata),  # BatchNorm's old versions
            n=len(self),
            padding=self._padding,
            flags={k: p.requires_grad for k, p in self.stacked_params().items()}
            if assign
            else None,
            missing_keys=missing_keys,
            unexpected_keys=unexpected_keys,
            error_msgs=error_msgs,
        )
        if ready is None:
            return
        if assign:
            # The state dict's tensors become the storage, in their own dtype and device, as
            # torch's loader assigns them (an ensemble built on the meta device).
            stacked = {**self.stacked_state(), **{name: v for name, _, v in ready}}
            self._adopt(stacked, self.member_ids, self.n_total, self.training)
            return
        with torch.no_grad():
            for _, target, value in ready:
                target.copy_(value)


class _Kept:
    """What ``scrub_`` took from the modules that ran, for ``__getstate__``: given back once
    the state is written (pickle reduces this entry after the meta modules) or dropped, so
    ``torch.save(ens)`` leaves the ensemble's own forward state (a key/value cache) as it was,
    as ``torch.save(module)`` leaves a module's."""

    def __init__(self, dropped: list[tuple[nn.Module, str, torch.Tensor]]) -> None:
        self.dropped = dropped

    def restore(self) -> None:
        for m, key, v in self.dropped:
            m.__dict__[key] = v
        self.dropped = []

    def __reduce__(self) -> tuple[Any, ...]:
        self.restore()
        return (type(None), ())  # None in the file; __setstate__ drops the key

    def __del__(self) -> None:  # the state was not written whole (pickling failed)
        self.restore()
