"""How vmapens checks itself: one member run alone against the same member in the ensemble.

Inside ``torch.func.vmap`` a member's parameters are batched tensors: they report
``requires_grad=False``, refuse ``.data`` and cannot be edited in place as the module's own
tensors. A forward that looks at any of these can compute something else in the ensemble than
alone, without an error (``nn.LinearCrossEntropyLoss``'s chunked path gave its weight no
gradient). ``check`` runs one member both ways on the same batch and compares what a training
step uses: outputs, loss, the state after the forward, which parameters get a gradient and the
gradients. ``make_step`` runs it on its first call (docs/semantics.md, "How vmapens checks
itself").
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from ._batch_edits import refuse_edits_in_turns
from ._checks import check_loss_fn, positional, tolerance
from ._generator_draws import refuse_own_generators
from ._locate import first_padded_difference
from ._padding import masked
from ._plain_turns import plain_value
from ._selfcheck_parts import differences, in_turns, refuse_carried
from ._selfcheck_runs import (
    DRAWS,
    IN_FORWARD,
    loss_state_kept,
    member_slice,
    own_generator,
    run_alone,
    run_together,
)
from ._unbatchable import explain_failure, follow_sparse
from .ensemble import Ensemble, check_ensemble

__all__ = [
    "MEMBER",
    "TRIES",
    "Probe",
    "check",
    "check_step_arguments",
    "tolerance",
]

#: Calls of a step on which member 0 could not run alone before its probe gives up: the step
#: reports those batches itself, and the probe costs no more than a member's step per call.
TRIES = 3
#: The member the probe runs. Members share their code, so any one exercises the same paths;
#: member 0 makes a failure reproducible run after run, and ``ens[0]`` is the module to debug.
MEMBER = 0


def check_step_arguments(api: str, ens: Any, loss_fn: Any, in_dims: Any) -> None:
    """What ``check`` and ``make_step`` take first: an Ensemble, a callable loss, ``in_dims``,
    and no trained layer built with ``sparse=True`` (``nn.Embedding``: a sparse gradient)."""
    check_ensemble(api, ens)
    if in_dims not in (None, 0):
        raise ValueError(f"{api}: `in_dims` must be None or 0, got {in_dims!r}")
    check_loss_fn(api, loss_fn)
    ens._follow_template()  # the grad flags follow_sparse reads
    follow_sparse(api, ens._sparse, True)


def check(
    ens: Ensemble,
    inputs: Any,
    targets: Tensor,
    loss_fn: Callable[[Any, Tensor], Tensor],
    *,
    in_dims: int | None = None,
    autocast: torch.dtype | None = None,
) -> None:
    """Check that member 0 computes inside the ensemble what it computes alone, on one batch
    (with members of different sizes: the first member of every size).

    Member 0 runs twice on the same batch, from the same RNG state: once as a plain module of
    your class (``ens[0]``, forward, ``loss_fn``, ``backward()``), once through the ensemble's
    member map as a training step runs it. Compared: every output tensor and the loss, every
    parameter and buffer after the forward (BatchNorm statistics, in-place edits), which
    parameters receive a gradient, and the gradients. Nothing of ``ens`` changes, and the
    global RNG is left as it was. ``make_step`` (hence ``fit``) runs this on its first step.

    Args:
        ens: the ensemble (``backend="vmap"`` or ``"loop"``).
        inputs: the member's single positional input, or a tuple of them.
        targets: the targets ``loss_fn`` takes.
        loss_fn: ``(output, target) -> scalar`` for one member.
        in_dims: ``None`` (every member sees ``inputs``) or ``0`` (one slice per member along
            dim 0; member 0's slice is used).
        autocast: run both forwards under ``torch.autocast(device, autocast)``, as
            ``make_step(precision=...)`` does.

    Raises:
        RuntimeError: member 0 differs inside the ensemble (the message names the module, what
            differs, by how much, and the way out: ``backend="loop"``), or runs alone but
            fails inside the ensemble.
        TypeError: ``ens`` is not an Ensemble, ``loss_fn`` not callable.
        ValueError: ``in_dims`` is not ``None`` or ``0``; member 0 fails when run alone
            (that error is chained).

    Example:
        >>> ens = Ensemble(lambda: torch.nn.Linear(3, 1), n=4, seed=0)
        >>> check(ens, torch.randn(8, 3), torch.randn(8, 1), torch.nn.MSELoss())
    """
    api = "check"
    check_step_arguments(api, ens, loss_fn, in_dims)
    if autocast not in (None, torch.bfloat16, torch.float16):  # torch.autocast only warns
        raise ValueError(f"{api}: `autocast` must be None, bfloat16 or float16, got {autocast!r}")
    args = positional(inputs)
    for member in probed(ens):
        try:
            alone = run_alone(ens, member, loss_fn, args, targets, in_dims, autocast)
        except Exception as err:
            raise ValueError(
                f"{api}: member {member} of {type(ens.template).__name__} fails when run alone "
                f"on these `inputs` and `targets` ({type(err).__name__}: {err}); fix that first"
            ) from err
        _compare(api, ens, member, alone, loss_fn, args, targets, in_dims, autocast)


def probed(ens: Ensemble) -> list[int]:
    """The members the probe runs: member ``MEMBER``, and with members of different sizes
    the first member of every size (a padded forward can differ by size)."""
    padding = ens._padding
    return [MEMBER] if padding is None else padding.rows_of_kinds()


class Probe:
    """``make_step``'s self-check: ``check`` on the first batch a step is called with.

    It runs once per step object, before the step changes anything. The compiled step is
    probed the same way, eagerly, before its first compiled call: ``torch.compile`` traces a
    member's parameters as the eager member map sees them (``requires_grad`` False). A batch
    member 0 cannot run alone (wrong shapes...) is left to the step itself, which then raises
    its usual error, and the probe waits for the next call (``TRIES`` calls at most).

    Args:
        ens: the ensemble the step trains.
        loss_fn: the step's loss.
        in_dims: the step's ``in_dims``.
        autocast: the step's autocast dtype (``precision``), or None.
        enabled: ``make_step(check=...)``; a disabled probe does nothing.
        compiled: ``make_step(compile=...)``: the compiled step's chunks run inside its graph,
            where members in turns read the plain values the one before left (no
            ``_plain_turns``).
    """

    def __init__(
        self,
        ens: Ensemble,
        loss_fn: Callable[[Any, Tensor], Tensor],
        in_dims: int | None,
        autocast: torch.dtype | None,
        enabled: bool = True,
        compiled: bool = False,
    ) -> None:
        if not isinstance(enabled, bool):
            raise TypeError(f"make_step: `check` must be a bool, got {type(enabled).__name__}")
        self.ens, self.loss_fn, self.in_dims = ens, loss_fn, in_dims
        self.compiled = compiled
        self.autocast = autocast
        self.pending, self.tries = enabled, 0

    def wrap(
        self, step: Callable[..., Tensor], first: Callable[..., Any] | None = None
    ) -> Callable[..., Tensor]:
        """``step`` probed on its first call (``step`` itself when the probe is disabled).
        ``first(inputs, targets, mask)``, the step's own argument checks, runs before the
        probe: a batch the step refuses (a float in per-member targets) gets the step's
        error, not the probe's "fails inside the ensemble" and its way out."""
        if not self.pending:
            return step

        def checked(inputs: Any, targets: Tensor, mask: Tensor | None = None) -> Tensor:
            if self.pending and first is not None:
                first(inputs, targets, mask)
            self(positional(inputs), targets)
            return step(inputs, targets, mask)

        return checked

    def __call__(self, args: tuple, targets: Tensor) -> None:
        """Probe on this batch if no batch has been probed yet (``args``: positional inputs)."""
        if not self.pending:
            return
        batch = (self.loss_fn, args, targets, self.in_dims, self.autocast)
        with loss_state_kept(self.loss_fn):
            runs = []
            for m in probed(self.ens):
                try:
                    runs.append((m, run_alone(self.ens, m, *batch)))
                except Exception as err:
                    _refuse_if_it_runs_together(self.ens, m, batch, err)
                    self.tries += 1  # the step reports it, as without the probe
                    self.pending = self.tries < TRIES
                    return
            for member, alone in runs:
                _compare("step", self.ens, member, alone, *batch, compiled=self.compiled)
        self.pending = False


def _refuse_if_it_runs_together(ens: Ensemble, member: int, batch: tuple, err: Exception) -> None:
    """A batch the member fails on alone is left to the step, which raises its usual error
    (wrong shapes fail inside the ensemble too); one that runs inside the ensemble computes
    what no member alone computes (vmap's ``F.one_hot`` skips torch's class range check and
    gives a zero row): refused, before anything changed. An error of ``loss_fn`` is left to
    the step (a loss that reads what the forward kept on ``ens.runner`` runs in the ensemble
    only), but torch's dtype check: vmap's losses take a float64 class `weight` in float32."""
    dtypes = isinstance(err, RuntimeError) and "expected scalar type" in str(err)
    if not getattr(err, IN_FORWARD, False) and not dtypes:
        return
    try:
        run_together(ens.select([member]), member, *batch, template=ens.template)
    except Exception:
        return
    raise RuntimeError(
        f"step: member {member} of {type(ens.template).__name__} fails alone on this batch "
        f"({type(err).__name__}: {err}) but runs inside the ensemble, so the step would train "
        "what no member alone computes (vmap skips some of torch's checks: `F.one_hot` of a "
        "class out of range gives a zero row). Make the forward and the loss run alone on the "
        "batch (a class `weight` in the members' dtype), or build the ensemble with "
        "backend='loop' to run each member as it runs alone"
        + (_PADDED_INPUT if ens._padding is not None else "")
    ) from err


# -- the comparison -------------------------------------------------------------------------


def _compare(
    api: str,
    ens: Ensemble,
    member: int,
    alone: dict[str, Any],
    loss_fn: Callable,
    args: tuple,
    targets: Tensor,
    in_dims: int | None,
    autocast: torch.dtype | None,
    compiled: bool = False,
) -> None:
    """Run the member inside the ensemble and raise if it differs from ``alone`` (``compiled``:
    for the compiled step)."""
    name = type(ens.template).__name__
    refuse_own_generators(
        api, ens, own_generator(ens, member, loss_fn, args, targets, in_dims, autocast)
    )
    if alone["reads"]:
        raise ValueError(
            f"{api}: `loss_fn` reads the ensemble's own stacked parameters "
            f"({', '.join(f'`{k}`' for k in alone['reads'][:4])}) besides the member's output: "
            "inside the step each member's loss would hold every member's term, so the summed "
            f"loss would train each member on {len(ens)} times its own part (alone: once). "
            "Compute a penalty in the member's forward from its own parameters (return it "
            "with the output), or write the step by hand: "
            "`(vmapens.per_member(loss_fn)(ens(x), y) + penalty).sum().backward()` with "
            "`penalty` one value per member from `ens.stacked_params()`"
        )
    if alone["edits"] and in_dims is None:  # shared by all members
        refuse_edits_in_turns(api, name, ens.backend, ens.chunk_size, len(ens))
    how = in_turns(ens.backend, ens.chunk_size, len(ens))
    # Tensors it set alone (``self.h = h``, ``(h, c)``): each turn of the eager step gets its
    # members' own (``vmapens._kept``). Not with more state (a cache keyed on an int kept
    # beside it, ``weight._version``), nor compiled (refused there: ``CompileFailed``).
    set_only = not compiled and alone["carried"].keys() <= alone["kept"]
    if alone["carried"] and how is not None and not set_only:
        batch = (loss_fn, args, targets, in_dims, autocast)
        _refuse_reads_of_carried(api, ens, member, alone, how, compiled, *batch)
    sub = ens.select([member])  # a copy: the probe's forward changes nothing of ens
    try:
        batch = (loss_fn, args, targets, in_dims, autocast)
        together = run_together(sub, member, *batch, template=ens.template)
    except Exception as err:
        explained = explain_failure(api, name, sub.backend, err, loss=True)
        if explained is not None:
            raise explained from err
        narrow = "Expected dtype int32/int64 for index" in str(err)  # uint8 class targets
        how = _WAY_OUT["narrow" if narrow else sub.backend]
        raise RuntimeError(
            f"{api}: member {member} of {name} runs alone on this batch but fails inside the "
            f"ensemble ({type(err).__name__}: {err}). {how}"
        ) from err
    found = list(differences(alone, together, autocast))
    if found and alone.get("python_rng"):
        raise RuntimeError(
            f"{api}: member {member} of {name} draws from {alone['python_rng']} in its "
            f"forward ({'; '.join(found[:2])} between two runs on the same batch): torch's RNG "
            "is the one the ensemble follows, and inside it one such draw would serve every "
            "member, with either backend. Draw with torch (`torch.randint`, `torch.rand`), "
            "which follows `randomness` (docs/semantics.md, 'Randomness in the forward pass')"
        )
    if found:
        padded = ens._padding is not None
        where = _padded_layer(sub, member, args, in_dims) if padded else None
        raise RuntimeError(
            f"{api}: member {member} of {name} computes something else inside the "
            f"{'padded ' * padded}ensemble than alone on the same batch: "
            f"{'; '.join(found[:4])}. {'' if where is None else f'It first differs at {where}. '}"
            f"{'' if padded or not alone.get('torch_rng') else DRAWS}"
            f"{_PADDED if padded else _VMAPPED if ens.backend == 'vmap' else _WAY_OUT['loop']}"
        )


def _refuse_reads_of_carried(
    api: str, ens: Ensemble, member: int, alone: dict[str, Any], how: str, compiled: bool,
    *batch: Any,
) -> None:  # fmt: skip
    """Raise if the next member in turn reads the attributes ``member``'s forward set
    (``alone["carried"]``) where alone it reads its own (``batch``: ``run_alone``'s loss,
    inputs, targets, ``in_dims`` and autocast)."""
    why = _read_back(ens, member, alone, compiled, batch)
    if why is not None:
        refuse_carried(api, type(ens.template).__name__, how, alone["carried"], why)


def _read_back(
    ens: Ensemble,
    member: int,
    alone: dict[str, Any],
    compiled: bool,
    batch: tuple[Callable, tuple, Any, int | None, torch.dtype | None],
) -> str | None:
    """How a member run in turn after ``member`` computes something else than alone, or None.

    Eager turns each start from the plain values (``bool``, ``int``...) held before the call
    (``_plain_turns``), and the next call's first turn from those the last turn left. Under
    vmap (chunks) a plain value is the same for every member: one that differs needs a
    member's number in Python (``.item()``), which vmap refuses. So there a member must
    compute as alone with the other state (a kept tensor, a list) ``member`` left, and with
    all of it as with its own (a counter or a first-call flag passes; a cache keyed on a
    parameter's ``_version``, 0 for every member's slice, does not). With the loop, a plain
    value may be the member's own (a float read with ``.item()``), which the next call's turns
    would all read from the last member, and the compiled step's chunks run in one graph: any
    state ``member`` left that a member reads back is refused.
    """
    mine = alone["carried"]
    # The member itself too: state keyed on what every member shares (a parameter's
    # `_version`, 0 for each) reads back the same for member 0 and another member's for it.
    others = [member + 1] if member + 1 < len(ens) else []
    other = member
    try:
        for other in [member, *others]:
            fresh = alone if other == member else run_alone(ens, other, *batch)
            runs = [(fresh, mine)]
            if not compiled and ens.backend == "vmap":
                kept = {k: v for k, v in mine.items() if not plain_value(v)}
                runs = [(fresh, kept)] if kept else []
                if other != member:  # the member with its own state: the same run twice
                    own = run_alone(ens, other, *batch, _copied(fresh["carried"]))
                    runs.append((own, mine))
            for want, attributes in runs:
                again = run_alone(ens, other, *batch, _copied(attributes))
                if any(differences(want, again, batch[-1])):
                    return f"member {other} {_after(member, other)} computes something else"
    except Exception as err:
        return f"member {other} {_after(member, other)} fails: {type(err).__name__}"
    return None


def _copied(attributes: dict) -> dict:
    """``attributes`` with their lists, dicts and sets copied: a run appends to its own."""
    return {
        k: copy.copy(v) if isinstance(v, list | dict | set) else v for k, v in attributes.items()
    }


def _after(member: int, other: int) -> str:
    same = other == member
    return "run again on the same batch" if same else f"run after member {member}"


def _padded_layer(sub: Ensemble, member: int, args: tuple, in_dims: int | None) -> str | None:
    """The first layer of the probed member whose padded output differs (see _locate)."""
    state = sub.stacked_state()
    masks = sub._padding.masks(sub.stacked_params()) if sub._padding is not None else {}
    row = {k: v[0].detach() for k, v in masked(state, masks).items()}
    inputs = member_slice(args, member, in_dims, False)
    try:
        return first_padded_difference(sub[0], sub.runner, row, inputs)
    except Exception:  # a diagnosis only: the probe's own message stands without it
        return None


_VMAPPED = (
    "Its forward probably depends on something vmap changes (a parameter's requires_grad "
    "reads False under vmap; .data, in-place edits of parameters; a torch.autocast entered in "
    "the forward casts only some ops under vmap: make_step's precision= runs it per member). "
    "Build the ensemble with backend='loop' (members one after another, exact), or pass "
    "check=False to train anyway (docs/semantics.md, 'How vmapens checks itself')"
)
_WAY_OUT = {
    "vmap": "Build the ensemble with backend='loop' to run the members one after another, "
    "each as it runs alone",
    # the loop backend runs the member as a plain module: what differs is vmapens's to fix
    "loop": "With backend='loop' the member runs as ens.runner through torch.func."
    "functional_call: compare ens[0] with it, or pass check=False to train anyway",
    "narrow": "uint8 class targets cannot index in vmap's gather (int64, int32): pass .long()",
}
_PADDED_INPUT = (
    ". Members of different sizes run at the largest one's size: an input padded to it runs "
    "there but not alone; pass the whole input and pick each member's columns in its forward"
)
_PADDED = (
    "Members of different sizes run padded to the largest one, exact only when no operation "
    "mixes a padded dimension (a mean, softmax or norm over it, a reshape that moves it; "
    "docs/semantics.md, 'Members of different sizes'). Give these members one size, or "
    "train each size as its own Ensemble"
)
