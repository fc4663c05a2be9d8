"""Reinforcement-learning helpers for Q-ensembles: target ensembles and random member subsets."""

from __future__ import annotations

import numbers

import torch
from torch import Tensor

from ._checks import check_int, to_index
from .ensemble import Ensemble, check_ensemble

__all__ = ["make_target", "polyak_", "random_members"]


def make_target(online: Ensemble) -> Ensemble:
    """A target ensemble: a copy of ``online`` whose parameters take no gradient.

    Follow ``online`` with :func:`polyak_` (soft updates) or ``polyak_(target, online, 1.0)``
    (hard copies). The copy has the same members, mode and options; its tensors are its own.

    Example:
        >>> online = Ensemble(lambda: torch.nn.Linear(3, 1), n=4, seed=0)
        >>> target = make_target(online)
        >>> any(p.requires_grad for p in target.parameters())
        False
    """
    check_ensemble("make_target", online, "online")
    target = online.select(slice(None))
    target.requires_grad_(False)
    return target


def polyak_(target: Ensemble, online: Ensemble, tau: float) -> None:
    """Soft update ``target <- (1 - tau) * target + tau * online``, every member at once.

    The parameters move in one fused ``torch._foreach_lerp_`` over the stacked tensors (the
    update of TD3/SAC/REDQ target networks, Lillicrap et al., 2016); buffers (BatchNorm
    statistics), non-persistent ones included, are copied from ``online``.

    Args:
        target: the ensemble updated in place (e.g. from :func:`make_target`).
        online: the ensemble it follows: same members, names and shapes.
        tau: the step toward ``online``, a real number in ``[0, 1]`` (``1.0``: a hard copy,
            exact as ``load_state_dict``'s, also over a NaN or inf in ``target``).

    Raises:
        TypeError: not Ensembles, or ``tau`` not a number.
        ValueError: ``tau`` outside ``[0, 1]``, or the ensembles do not match: other members
            (``member_ids``: a target must follow the members it was copied from) or other
            tensors (names, shapes, dtypes, devices). Nothing changes then.

    Example:
        >>> online = Ensemble(lambda: torch.nn.Linear(3, 1), n=4, seed=0)
        >>> target = make_target(online)
        >>> with torch.no_grad():
        ...     _ = online.stacked_params()["bias"].add_(1.0)
        >>> polyak_(target, online, tau=0.5)
        >>> torch.allclose(target.stacked_params()["bias"],
        ...                online.stacked_params()["bias"] - 0.5)
        True
    """
    api = "polyak_"
    for name, ens in (("target", target), ("online", online)):
        check_ensemble(api, ens, name)
    # A NumPy float32 or a 0-dim tensor is a number too, as torch's own lerp_ takes it.
    real = isinstance(tau, numbers.Real) or (
        isinstance(tau, Tensor) and tau.dim() == 0 and not tau.is_complex()
    )
    if isinstance(tau, bool) or not real:
        raise TypeError(f"{api}: `tau` must be a float, got {type(tau).__name__}")
    # detach: a tau that requires grad (a learned rate) is a number here, as lerp_ takes it.
    tau = float(tau.detach()) if isinstance(tau, Tensor) else float(tau)
    if not 0.0 <= tau <= 1.0:
        raise ValueError(f"{api}: `tau` must be in [0, 1], got {tau}")
    # Same shapes do not make the same members: a target of all members following a reordered
    # or re-selected online ensemble (`online.select(...)`, `best_k`) would move member i
    # toward another member, silently.
    if list(target.member_ids) != list(online.member_ids):
        raise ValueError(
            f"{api}: `target` holds members {list(target.member_ids)!r:.80} and `online` "
            f"members {list(online.member_ids)!r:.80}; a target follows the members it was "
            "copied from: select the same members of both, or build the target again with "
            "`make_target(online)`"
        )
    ours, theirs = target.stacked_state(), online.stacked_state()
    _check_same_tensors(api, ours, theirs)
    params = target.stacked_params()
    # Complex parameters move as real ones do; an integer "parameter" (requires_grad=False)
    # cannot be interpolated and is copied. tau == 1 is a hard copy, as load_state_dict is:
    # lerp's `end - (end - self) * 0` keeps a NaN or inf of the target.
    movable = [k for k in params if ours[k].is_floating_point() or ours[k].is_complex()]
    names = movable if tau < 1.0 else []
    with torch.no_grad():
        if names:
            torch._foreach_lerp_([ours[k] for k in names], [theirs[k] for k in names], tau)
        for k, t in ours.items():
            if k not in names:
                t.copy_(theirs[k])


def _check_same_tensors(api: str, ours: dict[str, Tensor], theirs: dict[str, Tensor]) -> None:
    """Raise ValueError naming the first tensor that ``target`` and ``online`` hold differently
    (missing, or another shape, dtype or device), before anything moves."""
    missing = sorted(ours.keys() ^ theirs.keys())
    if missing:
        side, other = ("`target`", "`online`") if missing[0] in ours else ("`online`", "`target`")
        raise ValueError(
            f"{api}: {side} holds `{missing[0]}` and {other} does not; `target` and `online` "
            "must hold the same tensors: build the target with `make_target(online)`"
        )
    for k, t in ours.items():
        got, want = (f"{list(u.shape)} {u.dtype} on {u.device}" for u in (t, theirs[k]))
        if got != want:
            raise ValueError(
                f"{api}: `{k}` is {got} in `target` and {want} in `online`; they must "
                "match (shape, dtype, device): move or convert both alike (`target.to(...)`)"
            )


def random_members(
    n: int, k: int, generator: torch.Generator | None = None, *, device: torch.device | str = "cpu"
) -> Tensor:
    """A bool ``[n]`` mask with ``k`` members drawn uniformly without replacement.

    REDQ (Chen et al., 2021) takes the minimum over a random subset of ``k`` of its ``n``
    Q-functions for every target: ``q[mask].amin(0)`` for the target ensemble's stacked
    output ``q`` of any shape ``[n, ...]``. To mask per-member values in place, give the mask
    ``q``'s number of dims: ``q.masked_fill(~mask.view(-1, *[1] * (q.dim() - 1)), inf)``
    (``mask[:, None]`` fits a ``[n, B]`` ``q`` only: on ``[n, B, 1]`` it broadcasts along the
    batch, and with ``B == n`` masks rows instead of members without an error).

    Args:
        n: number of members (an int, a NumPy integer or a 0-dim integer tensor).
        k: members to draw, ``1 <= k <= n`` (likewise).
        generator: the generator to draw from (``None``: torch's global one).
        device: where the mask lives.

    Raises:
        TypeError: ``n`` or ``k`` not integer-like, or ``generator`` not a torch.Generator.
        ValueError: ``k`` outside ``[1, n]``.

    Example:
        >>> mask = random_members(10, 2, torch.Generator().manual_seed(0))
        >>> mask.shape, int(mask.sum())
        (torch.Size([10]), 2)
    """
    api = "random_members"
    # An integer-like counts as torch.randperm takes it (`len(ens)`, `np.int64`, a 0-dim tensor).
    n = check_int(api, "n", n if to_index(n) is None else to_index(n), minimum=1)
    k = check_int(api, "k", k if to_index(k) is None else to_index(k), minimum=1)
    if k > n:
        raise ValueError(f"{api}: `k` must be <= `n` ({n}), got {k}")
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(
            f"{api}: `generator` must be a torch.Generator or None, got "
            f"{type(generator).__name__} (for a seed: `torch.Generator().manual_seed(seed)`)"
        )
    # On the generator's device: randperm draws on the CPU by default and refuses a CUDA one.
    where = generator.device if generator is not None else torch.device("cpu")
    rows = torch.randperm(n, generator=generator, device=where)[:k].cpu()
    mask = torch.zeros(n, dtype=torch.bool)
    mask[rows] = True
    return mask.to(device)
