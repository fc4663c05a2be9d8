"""One exported program for a trained ensemble: every member, or their reduction, in aten ops.

``export`` traces the ensemble's own forward (``functional_call`` under ``vmap`` over the
stacked state, with the batchable recurrent twins and the folded attention rule) with
``torch.export``, and decomposes the result so that no ``vmap`` is left in the graph: the
``ExportedProgram`` is plain aten ops over the stacked ``[n, ...]`` tensors. It runs, is saved
with ``torch.export.save`` and loaded with ``torch.export.load`` without vmapens installed,
and ``torch.onnx.export(program, ..., dynamo=True)`` turns it into an ONNX file.
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

import optree
import torch
from torch import Tensor, nn
from torch.export import ExportedProgram
from torch.func import functional_call

from ._batch_edits import refuse_edits_in_turns
from ._checks import positional
from ._compiling import dispatch_restored
from ._export_probe import input_copies, probe
from ._kept import kept_anywhere
from ._members import named_tensors
from ._selfcheck_parts import own_attributes
from .distributed import member_blocks, rank, world_size
from .ensemble import Ensemble, check_ensemble
from .predict import REDUCTIONS, reduce_members

__all__ = ["export"]

#: Reductions whose data-dependent input check (vmapens.predict) torch.export cannot trace.
_CHECKED = ("entropy", "mutual_information")
#: Plain values a forward may set on its module (constants in a program); mutable holders.
_PLAIN, _ITEMS = (bool, int, float, str, tuple), (list, dict, set)
# torch's run_decompositions deep-copies its module call graph, whose pytree specs warn
# about their own deprecated ``LeafSpec`` alias (torch 2.13): nothing the caller can act on.
_TORCH_NOISE = r"`isinstance\(treespec, LeafSpec\)` is deprecated"


def export(
    ens: Ensemble,
    example_inputs: Tensor | tuple[Tensor, ...],
    *,
    reduce: str | None = None,
    softmax: bool = False,
    check: bool = True,
) -> ExportedProgram:
    """Export the ensemble's eval-mode forward as one ``torch.export.ExportedProgram``.

    The program takes the member's positional inputs, shared by every member (shapes and
    dtypes of ``example_inputs``), and returns what ``vmapens.predict(ens, inputs,
    reduce=reduce, softmax=softmax)`` returns: the members' outputs with a leading member dim
    ``[n, batch, ...]``, or their reduction. It holds a copy of the stacked parameters and
    buffers under the member's own names (``program.state_dict["fc1.weight"]`` is
    ``[n, ...]``); later training of ``ens`` does not change it, and
    ``program.module().load_state_dict(ens.state_dict())`` refreshes its copy.

    The member count is fixed when exporting (export ``ens[idx]`` for a subset): loading the
    state of an ensemble of another size is torch's size-mismatch error naming every
    tensor. So is every size of every input: a call with another size fails torch's input
    guard, ``AssertionError: Guard failed: args_0.size()[0] == 32``; export one program per
    batch size, or pad the last batch. (A symbolic batch size is not offered: torch's vmap
    batching rules for convolution, embedding, GRU and attention fix it while tracing.) The
    program copies its inputs to contiguous memory first: it takes inputs of any strides,
    and a forward that edits its input in place (``x.mul_(2)``) edits that copy, not the
    caller's tensor. ``example_inputs`` are left as they are.

    The graph has no ``vmap`` and no vmapens code: the members' maths is batched over the
    member dim into aten ops (``matmul``, ``convolution``, BatchNorm with running statistics,
    the GRU unrolled over time steps, attention as one call with the members folded into the
    batch). Before returning, the program's output for member ``vmapens.selfcheck.MEMBER`` on
    ``example_inputs`` is compared with that member run alone as a plain module (the parity
    probe of ``vmapens.check``, same tolerance), on two calls in a row. State the forward keeps
    in plain attributes (a counter, a first-call flag) would be constants there: refused, and
    left on ``ens`` as it was.

    Args:
        ens: the ensemble; it is exported in eval mode and its mode is restored afterwards.
        example_inputs: the member's input tensor, or a tuple of its positional inputs.
        reduce: ``None`` (every member's output) or one of ``vmapens.predict``'s reductions,
            same meaning: ``"mean"``, ``"min"``, ``"max"``, ``"variance"``, ``"vote"``,
            ``"disagreement"``. Not ``"entropy"`` or ``"mutual_information"``: they check
            that the outputs are probabilities first, which a traced program cannot.
        softmax: apply ``softmax`` over the last dim of each member's output first, as in
            ``vmapens.predict``.
        check: run the parity probe (about one forward of one member).

    Returns:
        The ``ExportedProgram``; call it with ``program.module()(*inputs)``.

    Raises:
        TypeError: ``ens`` is not an Ensemble, ``example_inputs`` not tensors, a flag not a
            bool, a reduction of a non-tensor output.
        ValueError: an unknown or untraceable ``reduce``; a sharded ensemble (``vmapens.gather``
            it first); members of different sizes (``Ensemble.from_factories``) whose own
            outputs are not the padded program's shape (outputs of several widths): export
            the members of each size apart.
        RuntimeError: ``torch.export`` cannot trace the forward (the message says why), the
            probe finds that member differs in the program from the member alone, the forward
            changes a plain attribute, or it edits its input in place while members run in
            turns (``backend="loop"``, a ``chunk_size`` below n), which ``ens(x)`` refuses too.

    Example:
        >>> ens = Ensemble(lambda: nn.Linear(4, 3), n=5, seed=0)
        >>> x = torch.randn(8, 4)
        >>> program = export(ens, x, reduce="mean")
        >>> torch.allclose(program.module()(x), ens(x).mean(0), atol=1e-6)
        True
    """
    api = "export"
    args = _check_args(api, ens, example_inputs, reduce, softmax, check)
    reduce = "none" if reduce is None else reduce
    with ens._evaluating():
        _refuse_edits_in_turns(api, ens, args)
        _refuse_output_sizes(api, ens, args)
        if reduce != "none":
            _check_reducible(api, ens, args, reduce)
        if check or (reduce == "none" and not softmax):  # the probe needs the members' program
            program = _trace(api, ens, _Program(ens, "none", False), args)
        if check:
            probe(api, ens, program, args)
        if reduce != "none" or softmax:
            program = _trace(api, ens, _Program(ens, reduce, softmax), args)
    return program


class _Program(nn.Module):
    """The traced module: the member's module tree holding stacked copies of its tensors.

    Its parameters and buffers are the member's, by the member's names (tied aliases and
    non-persistent buffers as the member has them), each ``[n, ...]``; its forward is the
    ensemble's forward over them, then the reduction.
    """

    def __init__(self, ens: Ensemble, reduce: str, softmax: bool) -> None:
        super().__init__()
        stacked = ens.stacked_state()
        memo: dict[int, Any] = {}
        # Not inference tensors, also when exporting under torch.inference_mode(): a buffer the
        # forward updates could not be written by the program served outside it.
        with torch.inference_mode(False), torch.no_grad():
            for name, meta in named_tensors(ens.template):
                value = stacked[name].detach().clone()
                if isinstance(meta, nn.Parameter):
                    value = nn.Parameter(value, requires_grad=False)
                memo[id(meta)] = value
        tree = copy.deepcopy(ens.template, memo)
        # The member's own containers, so that state_dict() has exactly the member's keys.
        self._parameters, self._buffers = tree._parameters, tree._buffers
        self._modules = tree._modules
        self._non_persistent_buffers_set = tree._non_persistent_buffers_set
        # In __dict__: setattr refuses a flag over the member's own `softmax` (an nn.Softmax).
        self.__dict__["_ens"] = ens  # not a submodule: its tensors are not the program's
        self.__dict__["_reduction"] = (reduce, softmax)

    def forward(self, *args: Tensor) -> Any:
        ens, (reduce, softmax) = self.__dict__["_ens"], self.__dict__["_reduction"]
        state = dict(named_tensors(self))
        # vmap reshapes a shared input (a Linear on [batch, tokens, features] is one matmul
        # over [batch * tokens, features]); traced on a contiguous example, that reshape is a
        # view, which fails on an input of other strides (a sequence-first batch transposed)
        # that the member alone takes. Copied to contiguous memory, every input is as traced.
        args = tuple(a.clone(memory_format=torch.contiguous_format) for a in args)

        def member(member_state: dict[str, Tensor], *member_args: Tensor) -> Any:
            return functional_call(ens.runner, member_state, member_args)

        out = ens._member_map(member, (None,) * len(args))(state, *args)
        if softmax:
            out = optree.tree_map(lambda t: t.softmax(-1), out)
        return out if reduce == "none" else reduce_members(out, reduce)


def _check_args(
    api: str, ens: Any, example_inputs: Any, reduce: Any, softmax: Any, check: Any
) -> tuple[Tensor, ...]:
    check_ensemble(api, ens)
    # This rank's block of a sharded ensemble is refused; a sub-ensemble (`ens[idx]`, `select`)
    # also holds fewer than `n_total` members, and exporting one is how a subset is served.
    size = world_size()
    block = member_blocks(ens.n_total, size)[rank()] if size > 1 else None
    if len(ens) != ens.n_total and list(ens.member_ids) == list(block or ()):
        raise ValueError(
            f"{api}: `ens` holds {len(ens)} of {ens.n_total} members (a sharded ensemble); "
            "export vmapens.gather(ens) to serve all of them, or ens.select(...) of a "
            "gathered ensemble for a subset"
        )
    args = positional(example_inputs)
    if not args or not all(isinstance(a, Tensor) for a in args):
        got = [type(a).__name__ for a in args] if isinstance(example_inputs, tuple) else None
        raise TypeError(
            f"{api}: `example_inputs` must be a tensor or a non-empty tuple of tensors (the "
            f"member's positional inputs), got {got or type(example_inputs).__name__}"
        )
    if reduce is not None and reduce not in REDUCTIONS:
        raise ValueError(f"{api}: `reduce` must be None or one of {REDUCTIONS}, got {reduce!r}")
    if reduce in _CHECKED:
        raise ValueError(
            f"{api}: `reduce={reduce!r}` first checks the values of the members' outputs "
            "(probabilities, not logits), which a traced program cannot do; export with "
            "reduce=None (softmax=True for logits) and compute it from the [n, ...] "
            "probabilities the program returns, e.g. with vmapens.predict.reduce_members"
        )
    for name, flag in (("softmax", softmax), ("check", check)):
        if not isinstance(flag, bool):
            raise TypeError(f"{api}: `{name}` must be a bool, got {type(flag).__name__}")
    return args


def _refuse_edits_in_turns(api: str, ens: Ensemble, args: tuple[Tensor, ...]) -> None:
    """A forward that edits its input in place, with members run in turns on that one input
    (``backend="loop"``, a ``chunk_size`` below n): each member after the first would see the
    edits before it, which the trace cannot notice and the probe (member 0) does not see.
    Refused as ``ens(x)`` refuses it, from one forward of member 0 alone on a copy."""
    if len(ens) == 1 or (ens.backend == "vmap" and (ens.chunk_size or len(ens)) >= len(ens)):
        return
    with torch.inference_mode(False):  # copies that count their versions
        copies = input_copies(args)
    versions = [c._version for c in copies]
    with torch.no_grad():
        ens[0](*copies)
    if any(c._version != v for c, v in zip(copies, versions, strict=True)):
        name = type(ens.template).__name__
        refuse_edits_in_turns(api, name, ens.backend, ens.chunk_size, len(ens))


def _refuse_output_sizes(api: str, ens: Ensemble, args: tuple[Tensor, ...]) -> None:
    """Members of different sizes whose outputs are not the shape of the padded forward's (an
    output layer of several widths; a sub-ensemble of the smaller members, still padded): the
    program returns every member at that shape, padded with zeros. Said before the traces, with
    or without ``check``, from one forward of the first member of every size alone and one
    padded forward of a copy (``select``: a buffer the forward updates stays as it is)."""
    padding = ens._padding
    if padding is None:
        return
    firsts = padding.rows_of_kinds()

    def shapes(out: Any, row: bool = False) -> str:  # row: the member dim first, dropped
        def shape(leaf: Any) -> Any:  # a non-tensor leaf (an int, a string) as it is
            return tuple(leaf.shape[row:]) if isinstance(leaf, Tensor) else leaf

        return repr(optree.tree_map(shape, out))

    with torch.no_grad():
        padded = shapes(ens.select(firsts[:1])(*input_copies(args)), row=True)
        own = {padding.kind_of[row]: shapes(ens[row](*input_copies(args))) for row in firsts}
    if all(shape == padded for shape in own.values()):
        return
    groups: dict[str, list[int]] = {}
    for row, kind in enumerate(padding.kind_of):
        groups.setdefault(own[kind], []).append(row)
    said = "; ".join(f"members {rows} give {shape}" for shape, rows in groups.items())
    raise ValueError(
        f"{api}: `ens` holds members stored padded (of different sizes, or selected from such "
        "an ensemble) whose outputs are not all the shape the program gives every member, "
        f"{padded} ({said}): a member's own output would come back padded with zeros; neither "
        "backend='loop' nor chunk_size changes that. Export the members of each size apart "
        "(vmapens.export(vmapens.Ensemble.from_modules([ens[i] for i in rows]), example_inputs)"
        " for `rows` of one size, one program each), or build the members with one output "
        "width (sizes that differ only inside)"
    )


def _check_reducible(api: str, ens: Ensemble, args: tuple[Tensor, ...], reduce: str) -> None:
    """A reduction needs one output tensor: said from member 0 alone, before the traces."""
    with torch.no_grad():
        out = ens[0](*input_copies(args))
    if not isinstance(out, Tensor):
        raise TypeError(
            f"{api}: `reduce={reduce!r}` needs the members to return one tensor, got "
            f"{type(out).__name__}; export with reduce=None and reduce the outputs the program "
            "returns"
        )


def _trace(api: str, ens: Ensemble, module: _Program, args: tuple[Tensor, ...]) -> ExportedProgram:
    """``torch.export`` of ``module``, decomposed so that no ``vmap`` is left in the graph."""
    name = type(ens.template).__name__
    kept = _attributes(ens)
    # guard(): the attention batching rule and the fast path off, buffers given back on error.
    try:
        with dispatch_restored(), ens.guard(api), torch.no_grad():
            try:
                program = torch.export.export(module, args, strict=False)
                with warnings.catch_warnings():
                    warnings.filterwarnings("ignore", _TORCH_NOISE, FutureWarning)
                    program = program.run_decompositions({})
            except torch._dynamo.exc.UserError as err:
                raise RuntimeError(f"{api}: torch.export cannot trace {name}: {err}") from err
            except (AttributeError, TypeError) as err:
                if not kept_anywhere(ens.template):  # the user's own (a typo, an argument)
                    raise
                raise RuntimeError(
                    f"{api}: torch.export failed on {name} ({type(err).__name__}: {err}); most "
                    "likely its forward reads back a tensor it keeps on its module (`self.h`, "
                    "state carried from call to call), which one program cannot hold: keep it "
                    "in a buffer (one row per member), which the program updates"
                ) from err
    finally:
        changed = _give_back(kept)
    if changed:
        raise RuntimeError(
            f"{api}: the forward of {name} changes {', '.join(changed)} on its module: the "
            "program would hold this call's value, the member alone goes on from the new one. "
            "A flag set on the first call: run ens(x) once first; state carried from call to "
            "call: keep it in a buffer (one row per member), which the program updates"
        )
    return program


def _attributes(ens: Ensemble) -> list[tuple[nn.Module, dict[str, Any], dict[str, Any]]]:
    """The ``own_attributes`` of the modules the members run, once per module object (the
    self-check keys them by path, to carry values to another module), and copies of the items
    of their lists, dicts and sets. A trace runs the forward there: what it sets (a counter, a
    list it appends to) would change the next ``ens(x)`` and the ``ens[i]`` the probe runs."""
    modules = {id(m): m for root in (ens.template, ens.runner) for m in root.modules()}
    own = [(m, own_attributes(m)) for m in modules.values()]
    return [(m, a, {k: copy.copy(v) for k, v in a.items() if type(v) in _ITEMS}) for m, a in own]


def _give_back(kept: list[tuple[nn.Module, dict[str, Any], dict[str, Any]]]) -> list[str]:
    """The attributes set back as ``_attributes`` kept them; the plain values (not ``None``:
    a cache) the forward changed, which the program holds as constants, said."""
    changed = []
    for m, own, items in kept:
        for key, new in own_attributes(m).items():
            old = own.get(key)
            plain = old is not None and type(old) in _PLAIN and new is not old
            if plain and (type(new), new) != (type(old), old):
                changed.append(f"`{key}` ({old!r} -> {new!r})")
            if key not in own:
                del m.__dict__[key]
        m.__dict__.update(own)
        for key, held in items.items():
            own[key].clear()
            (own[key].update if isinstance(held, dict | set) else own[key].extend)(held)
    return changed
