"""A linear-algebra error of one member (a kernel matrix that is not positive-definite), said
as that member's.

Alone, ``torch.linalg.cholesky`` of one model's bad matrix fails that model only. Inside the
ensemble one call serves every member, so it fails the call for all of them, and torch's
"(Batch element k)" counts the rows of that call: the members (those of one chunk, with
``chunk_size``) times the member's own batch dims. With ``chunk_size`` it named a healthy
member's index, with ``backend="loop"`` no member (``tests/test_journey_linalg.py``). Members
run in turns now say which one failed; the message names the ways out.
"""

from __future__ import annotations

import torch

__all__ = ["FAILED_MEMBER", "linalg_failure"]

#: Set on the error by the loop backend: the index of the member whose turn raised it.
FAILED_MEMBER = "_vmapens_failed_member"


def linalg_failure(
    api: str, err: torch.linalg.LinAlgError, n: int, chunk_size: int | None
) -> torch.linalg.LinAlgError:
    """``err`` (raised by a member's forward or loss) said as a member's, with the ways out;
    still a ``LinAlgError``, which code that catches torch's keeps catching."""
    member = getattr(err, FAILED_MEMBER, None)
    if member is not None:
        where = f"member {member}'s matrix"
    else:
        rows = "members" if chunk_size is None or chunk_size >= n else "members of one chunk"
        where = (
            f"a member's matrix (torch's batch element counts the {rows} times the member's "
            "own batch dims, not member indices)"
        )
    return torch.linalg.LinAlgError(
        f"{api}: a linear-algebra call failed on {where}: {err} Alone it would fail that model "
        "only; inside the ensemble one call serves every member, and nothing was changed. "
        "Find the member with the call's *_ex variant (torch.linalg.cholesky_ex, inv_ex, "
        "solve_ex: its `info` is per member) or by running ens[i] alone; add jitter to the "
        "diagonal; or compute with the *_ex variant and let a failed member's loss be NaN "
        "(fit stops a diverged member; by hand, opt.step(mask=losses.isfinite()))"
    )
