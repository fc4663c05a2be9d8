"""Each epoch's history row: mean training loss, validation loss and metrics per member."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping
from typing import Any

import optree
import torch
from torch import Tensor, nn

from ._attributes import INTERNAL
from ._batch_edits import EditedInTurns
from ._boxes import put_back, snapshot
from ._checks import positional
from ._kept import kept_stacks
from ._kept_loans import held_rows, lent_row
from ._metrics import Metric, average, metric_pair, score
from ._plain_turns import PlainTurns
from ._selfcheck_runs import forked_rng
from .ensemble import Ensemble
from .history import History
from .losses import per_member

__all__ = ["Evaluator", "to_device"]


class Evaluator:
    """Scores the members on validation data in one eval-mode forward and writes the row.

    Args:
        ens: the ensemble.
        loss_fn: the loss of one member, as ``fit`` takes it.
        val_data: shared (or per-member, ``val_dims=0``) ``(X, Y)``, or ``None``.
        val_dims: ``0`` when ``val_data`` is per member.
        metrics: name -> metric of one member (see ``vmapens._metrics.metric_pair``).
    """

    def __init__(
        self,
        ens: Ensemble,
        loss_fn: Callable,
        val_data: tuple[Any, Tensor] | None,
        val_dims: int | None,
        metrics: Mapping[str, Any],
    ) -> None:
        self.ens, self.loss_fn, self.dims = ens, loss_fn, val_dims
        device = next(ens.parameters()).device
        self.val = None if val_data is None else to_device(val_data, device)
        self.val_loss = per_member(loss_fn, in_dims=(0, val_dims))
        self.metrics: dict[str, Metric] = {k: metric_pair(fn) for k, fn in metrics.items()}
        self.oob: Tensor | None = None
        self.in_map = True  # the loss runs in the member map (see ``_forward``)
        self.oob_checked = False  # ``_out_of_bag``'s refusal of a loss reading kept values

    def use_out_of_bag(self, data: tuple, mask: Tensor, in_dims: int | None) -> None:
        """Validate each member on the training rows its resample left out (``mask`` [n, S])."""
        self.val, self.dims = data, in_dims
        self.oob = mask.to(data[1].device)

    def check(self, api: str) -> None:
        """One eval-mode forward, the loss and every metric on the validation data (nothing
        changes; out-of-bag validation runs on the training data: no check).

        Raises:
            ValueError: the forward or the loss fails; a metric fails (``TypeError`` when it
                raised one) or does not give a real scalar per member.
        """
        if self.val is None or self.oob is not None:
            return
        # A forward may edit the members' tensors in place (nn.Embedding(max_norm=...)
        # renormalises its weight): they get theirs back, as members alone that never ran this.
        state = list(self.ens.stacked_state().values())
        saved = [t.clone() for t in state]
        # And the plain values it sets on the modules the members run (a first-call flag, as
        # Glow's ActNorm's `initialized`; a Python counter): members alone never ran this.
        plain = [(vars(m), dict(vars(m))) for m in self.ens.runner.modules()]
        # And the tensors it kept, stacked on the template (a hidden state): ``ens[i]`` and the
        # first step's self-check read them there, where the runner holds its own from before.
        plain += [(vars(m), dict(vars(m))) for m in self.ens.template.modules()]
        # And the dicts and lists among them as they are (a cache edited in place), put back
        # in place: modules that share one share it still.
        boxes = [
            shot
            for _, d in plain
            for k, v in d.items()
            if k not in INTERNAL and (shot := snapshot(v))
        ]
        # Forked: a forward that draws in eval mode (a VAE's noise) would otherwise shift every
        # draw of the run after it, the shuffle's too, from a plain loop's from the same seed.
        with forked_rng(self.ens):
            try:
                out = self._forward(lambda out, loss, y: out)
            except (RuntimeError, ValueError, TypeError, IndexError) as err:
                if isinstance(err.__cause__, EditedInTurns):  # the forward, not the data
                    name = type(self.ens.template).__name__
                    raise RuntimeError(err.__cause__.message(api, name)) from err
                raise ValueError(
                    f"{api}: `val_data` does not fit the ensemble (one forward and `loss_fn` in "
                    f"eval mode failed): {err}"
                ) from err
            finally:
                with torch.no_grad():
                    torch._foreach_copy_(state, saved)
                for now, before in plain:
                    for key in [k for k in now if k not in INTERNAL and k not in before]:
                        del now[key]
                    now.update((k, v) for k, v in before.items() if k not in INTERNAL)
                put_back(boxes)
            with torch.no_grad():
                for name, metric in self.metrics.items():
                    _check_metric(api, name, metric, out, self.val[1])

    def record(self, h: History, mean_loss: Tensor, running: Tensor, diverged: Tensor) -> None:
        """Append this epoch's row to ``h``: NaN for members that did not train (``running``
        False); the ensemble metrics average the members that have not ``diverged``.

        A member that diverged during this epoch (``running`` and ``diverged``) keeps its
        non-finite training loss, but its validation loss and metrics are NaN: they would
        score the weights a non-finite loss left it (an accuracy of NaN outputs is a number),
        which no best-epoch restore gives back. Early stopping, schedulers, ``selection``,
        ``Sweep`` and ``PBT`` read these tables, so this is the one place that rule lives.
        """
        nan = torch.tensor(math.nan, dtype=torch.float64)
        h.train_loss = torch.cat([h.train_loss, torch.where(running, mean_loss.cpu(), nan)[None]])
        if self.val is None:
            return
        frozen = held_rows(self.ens.template, running)  # stopped members do not run alone
        val, (per, whole) = self._forward(lambda out, loss, y: self._score(out, loss, y, diverged))
        frozen()
        scored = running & ~diverged
        assert h.val_loss is not None  # History.empty made it: there is validation data
        h.val_loss = torch.cat([h.val_loss, torch.where(scored, val, nan)[None]])
        if h.metrics is not None and h.ensemble_metrics is not None:
            for k, value in per.items():
                h.metrics[k] = torch.cat([h.metrics[k], torch.where(scored, value, nan)[None]])
                h.ensemble_metrics[k] = torch.cat([h.ensemble_metrics[k], whole[k][None]])

    def _forward(self, then: Callable[[Any, Tensor | None, Tensor], Any]) -> Any:
        """``then(outputs, losses, targets)`` of one eval-mode forward on the validation data.

        Each member's loss runs right after its forward, in the member map, as in the step: a
        ``loss_fn`` that reads what the forward kept (``ens.runner.aux_loss``, or the
        template's) reads that member's, not the last chunk's or member's. A loss that cannot
        run there (``.item()`` under vmap, not one value) is computed from the outputs by
        ``per_member`` instead, which falls back to one member at a time; so is the
        out-of-bag loss of a member's own rows (``losses`` is None then)."""
        assert self.val is not None  # called only with validation data
        x, y = self.val
        args = positional(x)
        with torch.no_grad(), self.ens._evaluating():
            if self.oob is None and self.in_map:
                try:
                    out, losses = self.ens._run(args, {}, self.dims, (self.loss_fn, y, self.dims))
                    return then(out, losses, y)
                except (RuntimeError, ValueError, TypeError, IndexError, AttributeError):
                    self.in_map = False  # from now on, as below
            out = self.ens(*args, in_dims=self.dims)
            return then(out, None if self.oob is not None else self.val_loss(out, y), y)

    def _score(self, out: Any, loss: Tensor | None, y: Tensor, diverged: Tensor) -> Any:
        scores = score(self.metrics, out, y, diverged)
        if loss is not None:
            return loss.double().cpu(), scores
        assert self.oob is not None  # ``_forward`` gives no loss for out-of-bag rows only
        return self._out_of_bag(out, y, self.oob).double().cpu(), scores

    def _out_of_bag(self, out: Any, y: Tensor, mask: Tensor) -> Tensor:
        """Each member's ``loss_fn`` on its out-of-bag rows (NaN when it has none).

        One call per member on that member's rows, as alone: a loss is not always the mean of
        its rows' losses (a class ``weight`` divides by the rows' weights, ``reduction="sum"``
        adds them), so the rows' losses cannot be averaged under one vmap instead.
        """
        losses = []
        stacks = kept_stacks(len(mask))
        for i, rows in enumerate(mask):
            if not bool(rows.any()):
                losses.append(torch.tensor(math.nan, dtype=torch.float64))
                continue
            mine = optree.tree_map(functools.partial(_rows_of_member, i=i, rows=rows), out)
            target = y[i][rows] if self.dims == 0 else y[rows]
            if stacks and not self.oob_checked:  # once a fit, the first member's
                _refuse_kept_reads(functools.partial(self.loss_fn, mine, target), stacks, i)
                self.oob_checked = True
            losses.append(torch.as_tensor(self.loss_fn(mine, target)).double().cpu())
        return torch.stack(losses)


def _refuse_kept_reads(loss: Callable[[], Any], stacks: list, i: int) -> None:
    """A member's out-of-bag loss that reads what the forward kept (``ens.template.kl``): that
    is of the forward over every row, not the member's left-out rows alone. Refused: run with
    the stacks and with member ``i``'s rows lent, from the same RNG state and loss state (a
    loss module's counter), the two differ."""
    fn = getattr(loss, "func", None)
    turns = PlainTurns(fn) if isinstance(fn, nn.Module) else None
    with torch.random.fork_rng(devices=[]):
        whole = torch.as_tensor(loss())
    if turns is not None:
        turns.next_turn()
        turns.next_turn()
    with torch.random.fork_rng(devices=[]):
        lent = torch.as_tensor(lent_row(loss, stacks, i))
    if turns is not None:
        turns.next_turn()
    same = lent.shape == whole.shape and torch.allclose(lent, whole, rtol=0, atol=0, equal_nan=True)
    if not same:
        raise ValueError(
            "fit: `loss_fn` reads what the forward keeps on its module (`ens.template.<name>`), "
            "which val_data='oob' cannot give per member: the forward runs on every row, each "
            "member's loss on its left-out rows, and a member alone would keep the value of its "
            "rows only. Pass val_data=(x, y), or return the value from the forward"
        )


def _rows_of_member(t: Tensor, i: int, rows: Tensor) -> Tensor:
    return t[i][rows]


def _check_metric(api: str, name: str, metric: Metric, out: Any, y: Tensor) -> None:
    """``metric`` run as ``record`` runs it, on the members' outputs and on their mean: a real
    scalar for each, or an error naming it."""
    members, one = metric
    try:
        per, whole = members(out, y), torch.as_tensor(one(average(out), y))
    except Exception as err:
        kind = TypeError if isinstance(err, TypeError) else ValueError
        raise kind(
            f"{api}: `metrics[{name!r}]` failed on `val_data` (a metric maps one member's "
            f"output and the targets to a real scalar tensor; a callable runs under vmap): "
            f"{type(err).__name__}: {err}"
        ) from err
    for value, where in ((per, "for each member"), (whole, "for the averaged output")):
        if not isinstance(value, Tensor):
            got = type(value).__name__
        else:
            shape = tuple(value.shape[1:] if value is per else value.shape)  # per: [n, ...]
            if shape == () and not value.is_complex():
                continue
            got = f"a {value.dtype} tensor of shape {shape}"
        raise ValueError(
            f"{api}: `metrics[{name!r}]` must return a real scalar (a 0-dim tensor) from one "
            f"member's output and the targets, got {got} {where}"
        )


def to_device(tree: Any, device: torch.device) -> Any:
    """``tree`` with every tensor moved to ``device``."""
    return optree.tree_map(lambda t: t.to(device), tree)
