"""Population-based training (Jaderberg et al., 2017) over the members of one ensemble.

``exploit_`` copies members (parameters, buffers, optimizer state and hyperparameters) row to
row; ``explore`` perturbs members' hyperparameters; ``PBT`` is the ``fit`` callback that does
both every few epochs. Rows are this process's members (``ens[i]``), as everywhere else.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from ._checks import check_choice, check_int, index_rows
from ._hyper_rows import copied_hypers, inherit_base_lrs, perturbed_hypers
from ._precision import LossScale
from ._sweep_parts import warn_recomputing_schedulers
from .callbacks.base import Callback, Context
from .ensemble import Ensemble
from .optim import StackedOptimizer
from .selection import metric_table

__all__ = ["PBT", "exploit_", "explore"]


def exploit_(
    ens: Ensemble,
    optimizer: torch.optim.Optimizer | None,
    src: Any,
    dst: Any,
    loss_scale: LossScale | None = None,
) -> None:
    """Members ``dst[j]`` become copies of members ``src[j]``, in place.

    Copied: parameters, buffers, every per-member optimizer state tensor (moments, step
    counts), per-member hyperparameters (``MemberValues`` or 1-D tensors of one value per
    member in ``param_groups``) and, given ``loss_scale`` (fp16), each member's loss scale
    and growth count, so a copy continues exactly as its source would. All rows are read
    before any is written.

    Args:
        ens: the ensemble.
        optimizer: its optimizer, or ``None`` to copy the members alone. Any optimizer over
            ``ens.parameters()`` works; state tensors without a member dim (a plain Adam's
            shared step count) are left alone.
        src: the source rows (a sequence of ints or a 1-D integer tensor; repeats allowed).
        dst: the destination rows, as many as ``src``, without repeats.
        loss_scale: the run's per-member loss scale (``fit(precision="fp16")``), or ``None``.

    Raises:
        ValueError: ``src`` and ``dst`` differ in length, ``dst`` repeats a row, or
            ``optimizer`` / ``loss_scale`` hold another number of members (nothing changes).
        IndexError: a row out of range.

    Example:
        >>> from vmapens import StackedAdam
        >>> ens = Ensemble(lambda: torch.nn.Linear(2, 1), n=3, seed=0)
        >>> opt = StackedAdam(ens, lr=[0.1, 0.2, 0.3])
        >>> exploit_(ens, opt, [0], [2])
        >>> torch.equal(ens.stacked_params()["weight"][2], ens.stacked_params()["weight"][0])
        True
        >>> opt.param_groups[0]["lr"]
        MemberValues([0.1, 0.2, 0.1])
    """
    api = "exploit_"
    n = len(ens)
    s, d = index_rows(api, src, n), index_rows(api, dst, n)
    if len(s) != len(d):
        raise ValueError(
            f"{api}: `src` and `dst` must have the same length, got {len(s)} and {len(d)}"
        )
    if len(set(d.tolist())) != len(d):
        raise ValueError(f"{api}: `dst` must not repeat a row, got {d.tolist()}")
    # Another ensemble's optimizer or loss scale: its rows are not these members' (its state
    # was skipped, or written in part before an IndexError); refused before anything changes.
    groups = optimizer.param_groups if optimizer is not None else []
    params = [p for g in groups for p in g["params"]]
    rows = sorted({p.shape[0] for p in params if p.dim()})
    if params and n not in rows:
        raise ValueError(
            f"{api}: `optimizer` holds parameters of {rows} members, the ensemble has {n}: "
            "pass the optimizer built over this ensemble's parameters"
        )
    if loss_scale is not None and tuple(loss_scale.scale.shape) != (n,):
        raise ValueError(
            f"{api}: `loss_scale` holds {list(loss_scale.scale.shape)} scales, the ensemble has "
            f"{n} members: pass the loss scale of this ensemble's run"
        )
    padding = ens._padding
    for a, b in zip(s.tolist(), d.tolist(), strict=True):
        if padding is not None and padding.kind_of[a] != padding.kind_of[b]:
            raise ValueError(
                f"{api}: member {b} cannot become a copy of member {a}: they have different "
                "sizes (Ensemble.from_factories); exploit within members of one size"
            )
    tensors: dict[int, Tensor] = {id(t): t for t in ens.stacked_state().values()}
    if loss_scale is not None:
        tensors.update({id(t): t for t in (loss_scale.scale, loss_scale.growth_tracker)})
    if optimizer is not None:
        for group in optimizer.param_groups:
            for p in group["params"]:
                for v in optimizer.state.get(p, {}).values():
                    # Shared tensors (one step count per group) are copied once.
                    if isinstance(v, Tensor) and v.dim() > 0 and v.shape[0] == n:
                        tensors[id(v)] = v
        copies = copied_hypers(optimizer.param_groups, n, s, d)
        for group, copied in zip(optimizer.param_groups, copies, strict=True):
            group.update(copied)
    with torch.no_grad():
        for t in tensors.values():
            t[d.to(t.device)] = t[s.to(t.device)]


def explore(
    optimizer: StackedOptimizer,
    members: Any,
    factors: Sequence[float] = (0.8, 1.2),
    generator: torch.Generator | None = None,
    *,
    names: Sequence[str] = ("lr",),
) -> None:
    """Multiply each of ``members``' hyperparameters by a factor drawn from ``factors``.

    One draw per member and name (uniform over ``factors``, from ``generator``), applied in
    every param group; the values stay ``MemberValues`` (a shared float becomes one value
    per member), so schedulers and compiled steps keep working.

    Args:
        optimizer: a StackedOptimizer.
        members: the rows to perturb (a sequence of ints or a 1-D integer tensor), each once.
        factors: the multipliers to draw from.
        generator: the generator to draw from (``None``: torch's global one).
        names: the hyperparameters to perturb (single-valued ones, not ``betas``).

    Raises:
        TypeError: ``optimizer`` is not a StackedOptimizer, or ``names`` is one string.
        ValueError: an unknown, paired or repeated hyperparameter, a repeated row in
            ``members``, empty ``factors``, or a perturbed value that the optimizer refuses
            (e.g. Adadelta's ``rho`` past 1).

    Example:
        >>> from vmapens import StackedSGD
        >>> ens = Ensemble(lambda: torch.nn.Linear(2, 1), n=3, seed=0)
        >>> opt = StackedSGD(ens, lr=0.1)
        >>> explore(opt, [1], factors=(2.0,))
        >>> opt.param_groups[0]["lr"]
        MemberValues([0.1, 0.2, 0.1])
    """
    api = "explore"
    if not isinstance(optimizer, StackedOptimizer):
        raise TypeError(
            f"{api}: `optimizer` must be a vmapens.StackedOptimizer (per-member "
            f"hyperparameters), got {type(optimizer).__name__}"
        )
    factors = [float(f) for f in factors]
    if not factors:
        raise ValueError(f"{api}: `factors` must not be empty")
    n = optimizer.num_members
    rows = index_rows(api, members, n).tolist()
    # A repeated row (or name) would be multiplied twice: by a factor not in `factors`.
    if len(set(rows)) != len(rows):
        raise ValueError(f"{api}: `members` must not repeat a row, got {rows}")
    if isinstance(names, str):
        raise TypeError(f"{api}: `names` must be a sequence of names, e.g. ({names!r},)")
    if len(set(names)) != len(names):
        raise ValueError(f"{api}: `names` must not repeat a name, got {list(names)}")
    hypers = optimizer.hyperparameters
    for name in names:
        if name not in hypers or hypers[name].pair:
            single = sorted(k for k, h in hypers.items() if not h.pair)
            raise ValueError(f"{api}: `names` must be among {single}, got {name!r}")
    perturbed = perturbed_hypers(
        api, optimizer, optimizer.param_groups, rows, factors, generator, names
    )
    for k, name, new in perturbed:  # all checked: nothing changes on error
        optimizer.param_groups[k][name] = new


class PBT(Callback):
    """Population-based training as a ``fit`` callback: exploit and explore every few epochs.

    Every ``interval`` epochs the members still training are ranked by ``monitor`` (this
    epoch's value; the best infinity, a ``+inf`` PSNR with mode ``"max"``, ranks first, and a
    member at NaN or the worst infinity is neither ranked nor replaced); each of the bottom
    ``fraction`` copies a member drawn uniformly from the top ``fraction`` (:func:`exploit_`,
    its schedulers' base lrs, and ``fit``'s best-so-far bookkeeping, so ``restore_best`` stays
    coherent), then has its hyperparameters perturbed (:func:`explore`). All draws come from
    one generator seeded with ``seed``: a run is deterministic, and its state is in ``fit``'s
    checkpoint, so a resumed run is bit-identical to an uninterrupted one.

    Args:
        interval: epochs between two exploit/explore rounds.
        fraction: the share of members copied from and to, in ``(0, 0.5]`` (at least one
            member each when two or more are ranked).
        monitor: ``"val_loss"``, ``"train_loss"``, or a metric ``name`` / ``"val_<name>"``.
        mode: ``"min"`` or ``"max"``: which end of ``monitor`` is better.
        factors: the multipliers ``explore`` draws from.
        names: the hyperparameters ``explore`` perturbs.
        seed: seeds the generator.

    Attributes:
        log: one ``(epoch, src, dst)`` entry per round: rows ``dst`` copied rows ``src``.

    Raises:
        ValueError: bad settings (``factors`` not finite and > 0); at ``fit``'s start, before
            the first step, a ``monitor`` that ``fit`` does not record or ``names`` the
            optimizer does not take; at a round, a perturbed value the optimizer refuses
            (nothing is copied); on resume, settings other than the checkpoint's.
        TypeError: at ``fit``'s start, an optimizer that is not a ``vmapens.StackedOptimizer``.

    Example:
        >>> from vmapens import fit, StackedAdam
        >>> ens = Ensemble(lambda: torch.nn.Linear(2, 1), n=4, seed=0)
        >>> x, y = torch.randn(16, 2), torch.randn(16, 1)
        >>> pbt = PBT(interval=1, seed=0)
        >>> _ = fit(ens, (x, y), torch.nn.MSELoss(), epochs=2, val_data=(x, y), progress=False,
        ...         optimizer=StackedAdam(ens, lr=[1e-3, 1e-2, 1e-1, 1.0]), callbacks=[pbt])
        >>> len(pbt.log)
        2
    """

    def __init__(
        self,
        interval: int,
        *,
        fraction: float = 0.25,
        monitor: str = "val_loss",
        mode: str = "min",
        factors: Sequence[float] = (0.8, 1.2),
        names: Sequence[str] = ("lr",),
        seed: int = 0,
    ) -> None:
        api = "PBT"
        check_int(api, "interval", interval, minimum=1)
        if not 0 < fraction <= 0.5:
            raise ValueError(f"{api}: `fraction` must be in (0, 0.5], got {fraction}")
        check_choice(api, "mode", mode, ("min", "max"))
        check_int(api, "seed", seed)
        self.interval, self.fraction, self.monitor, self.mode = interval, fraction, monitor, mode
        if isinstance(names, str):
            raise TypeError(f"{api}: `names` must be a sequence of names, e.g. ({names!r},)")
        self.factors, self.names = _factors(api, factors), tuple(names)
        if len(set(self.names)) != len(self.names):
            # explore would refuse it at the first round, after exploit_ had copied members
            raise ValueError(f"{api}: `names` must not repeat a name, got {list(self.names)}")
        self.generator = torch.Generator().manual_seed(seed)
        self.log: list[tuple[int, list[int], list[int]]] = []

    def on_fit_start(self, ctx: Context) -> None:
        # Checked before the first step, not at the first round after `interval` epochs.
        metric_table(ctx.history, self.monitor, "PBT", "monitor")
        if not isinstance(ctx.optimizer, StackedOptimizer):
            raise TypeError(
                f"PBT: needs a vmapens.StackedOptimizer, got {type(ctx.optimizer).__name__}"
            )
        hypers = ctx.optimizer.hyperparameters
        single = sorted(k for k, h in hypers.items() if not h.pair)
        unknown = [name for name in self.names if name not in single]
        if unknown:
            raise ValueError(f"PBT: `names` must be among {single}, got {unknown}")
        padding = ctx.ensemble._padding
        if padding is not None and len(set(padding.kind_of)) > 1:
            # exploit_ refuses to copy a member into one of another size, and the ranking
            # pairs members whatever their sizes: the first round would fail mid-run.
            raise ValueError(
                "PBT: the ensemble holds members of different sizes (Ensemble.from_factories), "
                "and a member can only copy one of its own size; run PBT on each size's "
                "members (ens.select(rows) of one size) or on an ensemble of one size"
            )

    def on_epoch_end(self, ctx: Context) -> None:
        if (ctx.epoch + 1) % self.interval:
            return
        values = metric_table(ctx.history, self.monitor, "PBT", "monitor")[-1].double()
        key = values if self.mode == "min" else -values
        # The best infinity (a +inf PSNR) ranks first, as in EarlyStopping and member_scores.
        eligible = (ctx.active.cpu() & ~torch.isnan(key) & (key != math.inf)).nonzero().flatten()
        m = len(eligible)
        q = min(max(1, int(m * self.fraction)), m // 2)
        if q == 0:
            return
        order = eligible[torch.sort(key[eligible], stable=True).indices]
        top, bottom = order[:q], order[m - q :]
        opt = ctx.optimizer
        assert isinstance(opt, StackedOptimizer)  # on_fit_start checked it
        before = self.generator.get_state()
        src = top[torch.randint(q, (q,), generator=self.generator)]
        # Perturbed on the side first: a value refused (a rho past 1) leaves the members be.
        copies = copied_hypers(opt.param_groups, len(ctx.ensemble), src, bottom)
        groups = [{**g, **c} for g, c in zip(opt.param_groups, copies, strict=True)]
        try:
            perturbed = perturbed_hypers("PBT", opt, groups, bottom.tolist(), list(self.factors),
                                         self.generator, self.names)  # fmt: skip
        except ValueError as err:
            self.generator.set_state(before)
            raise ValueError(
                f"{err}, at epoch {ctx.epoch} (rows {bottom.tolist()} copying rows "
                f"{src.tolist()}); nothing was copied: use `factors` that keep it in range, or "
                "leave it out of `names`"
            ) from err
        warn_recomputing_schedulers(ctx.callbacks)
        exploit_(ctx.ensemble, opt, src, bottom, ctx.loss_scale)
        inherit_base_lrs(ctx.callbacks, len(ctx.ensemble), src, bottom)
        ctx.inherit(src, bottom)
        for k, name, new in perturbed:
            opt.param_groups[k][name] = new
        self.log.append((ctx.epoch, src.tolist(), bottom.tolist()))

    def settings(self) -> dict[str, Any]:
        """What a resumed run must share with the checkpoint's (not the seed: its generator)."""
        return {"interval": self.interval, "fraction": self.fraction, "monitor": self.monitor,
                "mode": self.mode, "factors": self.factors, "names": self.names}  # fmt: skip

    def state_dict(self) -> dict[str, Any]:
        state = {"pbt": self.settings(), "generator": self.generator.get_state()}
        return {**state, "log": list(self.log)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from ``state_dict()`` (checked first; nothing changes on error)."""
        # Checkpoints written before the settings were kept hold none to compare.
        stored = state.get("pbt", self.settings())
        if stored != self.settings():  # the resumed run would be one neither settings give
            raise ValueError(
                f"the checkpoint's PBT has settings {stored}, this run's {self.settings()}; "
                "resume with the same ones"
            )
        log = [(e, list(s), list(d)) for e, s, d in state["log"]]  # read before any write
        self.generator.set_state(state["generator"])
        self.log = log


def _factors(api: str, factors: Sequence[Any]) -> tuple[float, ...]:
    """``factors`` as floats, checked now, not at the first round after `interval` epochs."""
    try:
        values = tuple(float(f) for f in factors)
    except (TypeError, ValueError):
        values = (math.nan,)  # refused below
    if not values:
        raise ValueError(f"{api}: `factors` must not be empty")
    if not all(0 < v < math.inf for v in values):
        raise ValueError(f"{api}: `factors` must be finite numbers > 0, got {factors!r}")
    return values
