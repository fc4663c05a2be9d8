"""Buffers and per-member inputs that a forward edits in place, where members run in turns
(``backend="loop"``, ``chunk_size`` below ``n``).

Each member's (or chunk's) rows of a stacked buffer are views of one storage, and torch gives
all views of a storage one version counter. A forward that edits its buffer in place and then
uses it in a differentiable op (``self.calls += 1; return y * self.calls``) saves its rows
for the backward; the next member's edit of *its* rows bumps the shared counter, and the
backward of the member before raises "modified by an inplace operation", though no value it
saved changed. Alone, every member has a storage of its own. A member's slice of a
per-member input (``in_dims``) shares its base's counter in the same way.

``Turns`` hands each turn its rows: views of the buffers no turn has edited yet (no copy for
a forward that edits none), copies of those one did; a turn's copies go back into the stacked
storage right after it, through a view with a version counter of its own (``Tensor.data``),
so that the saved rows of the turn that edited in place stay valid. The values saved by no
other turn change: each turn writes only its own rows. ``Slices`` does the same for the
per-member inputs, so that they end edited by every member, as alone and under one vmap.
"""

from __future__ import annotations

import optree
import torch
from torch import Tensor
from torch._C._functorch import is_functorch_wrapped_tensor

from ._batch_edits import shared_versions

__all__ = ["Slices", "Turns"]

#: Which rows a turn runs: one member (an int: its rows are ``t[i]``) or a chunk (a slice).
Rows = int | slice


class Turns:
    """The stacked state as members or chunks run in turns on it, one ``take`` per turn.

    Trained parameters are watched too: alone, a forward may edit its own weight in place
    under ``torch.no_grad()`` (a max-norm or non-negativity constraint applied in the
    forward); a turn after such an edit gets a copy of its rows that keeps the graph to the
    stacked parameter (``clone``). Nothing is watched (and ``take`` gives views only) where no
    backward can follow (grad off) or no version can be read (a traced call; tensors of an
    enclosing ``torch.func`` transform).
    """

    def __init__(self, state: dict[str, Tensor], watch: bool = True) -> None:
        self.state = state
        self.traced = torch.compiler.is_compiling() or torch.compiler.is_exporting()
        #: Whether a backward may follow the turns (grad on, outside a traced call).
        self.backward = torch.is_grad_enabled() and not self.traced
        self.watched = (
            []
            if not (watch and self.backward)
            else [
                (k, t._version)
                for k, t in state.items()
                if not t.is_inference() and not is_functorch_wrapped_tensor(t)
            ]
        )
        self.copied: list[str] = []
        self.given: list[tuple[str, Tensor]] = []
        self.views: list[tuple[str, Tensor, int]] = []  # each view a turn got, its data_ptr

    def take(self, rows: Rows) -> dict[str, Tensor]:
        """The state of the members at ``rows``; copies of the rows of the watched tensors
        that a turn before edited (``give_back`` after the turn writes them back)."""
        part = {k: v[rows] for k, v in self.state.items()}
        if self.watched:
            edited = [k for k, v in self.watched if self.state[k]._version != v]
            if edited:  # from now on these are copied; the rest are watched on
                self.copied += edited
                self.watched = [(k, v) for k, v in self.watched if k not in edited]
        if self.copied:
            self.given = [(k, part[k].clone()) for k in self.copied]
            part.update(self.given)
        self.views = [
            (k, t, t.data_ptr())  # a traced or transformed tensor has no data pointer
            for k, t in part.items()
            if k not in self.copied and not self.traced and not is_functorch_wrapped_tensor(t)
        ]
        return part

    def give_back(self, rows: Rows) -> None:
        """After the turn at ``rows``: its copies go into the stacked storage, the counter
        unbumped. Each of them: a kernel's own edit (BatchNorm's running statistics) bumps
        no version, and a reassigned buffer was written into its copy
        (``_fastcall.write_back_``). A view the turn's forward gave new data
        (``self.weight.data = torch.renorm(self.weight.data, ...)``: alone, the parameter
        keeps it) is written into the stacked storage the same way."""
        for k, copy in self.given:
            self.state[k].data[rows] = copy.detach()
        for k, view, ptr in self.views:
            if view.data_ptr() != ptr:
                self.state[k].data[rows] = view.detach()
        self.given, self.views = [], []

    @property
    def active(self) -> bool:
        """Whether a turn may get copies: some tensor is watched or copied."""
        return bool(self.watched or self.copied)


class Slices:
    """The per-member inputs as members or chunks run in turns, one ``take`` per turn: views
    of the caller's tensors until a turn edited its own slice, copies after that (written
    back by ``give_back``)."""

    def __init__(self, args: tuple, in_dims: tuple, watch: bool = True) -> None:
        self.args, self.in_dims = args, in_dims
        self.watched = shared_versions(args, in_dims, per_member=True) if watch else []
        self.copying = False
        self.given: list[tuple[Tensor, Tensor]] = []  # (the caller's slice, its copy)

    def take(self, rows: Rows) -> tuple:
        """Every argument, a per-member one cut to the members at ``rows``."""
        self.copying = self.copying or any(t._version != v for t, v in self.watched)
        return tuple(
            a if d is None else optree.tree_map(lambda t, d=d: self._cut(t, d, rows), a)
            for a, d in zip(self.args, self.in_dims, strict=True)
        )

    def _cut(self, t: Tensor, dim: int, rows: Rows) -> Tensor:
        if isinstance(rows, int):  # torch's functions: a leaf that is no tensor raises
            part = torch.select(t, dim, rows)
        else:
            part = torch.narrow(t, dim, rows.start, rows.stop - rows.start)
        if not self.copying or part.is_inference():  # an inference tensor is never edited
            return part
        copy = part.clone()
        self.given.append((part, copy))
        return copy

    def give_back(self) -> None:
        """After a turn: its copies into the caller's tensors, their counters unbumped."""
        for part, copy in self.given:
            part.data.copy_(copy)
        self.given = []
