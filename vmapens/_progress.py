"""The progress bar of ``fit``: tqdm on a terminal or a given stream, rank 0 only."""

from __future__ import annotations

import sys
from typing import Any

import torch
from tqdm import tqdm
from tqdm.auto import tqdm as auto_tqdm

__all__ = ["progress_bar"]


class _NoBar:
    disable = True

    def set_description(self, *_: Any) -> None: ...

    def set_postfix_str(self, *_: Any, **__: Any) -> None: ...

    def update(self, *_: Any) -> None: ...

    def close(self) -> None: ...


def progress_bar(progress: Any, total: int | None, done: int) -> Any:
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    if progress is False or (distributed and torch.distributed.get_rank() != 0):
        return _NoBar()
    if progress is True:
        # disable=None: tqdm stays quiet when stderr is not a terminal (logs, CI).
        return auto_tqdm(total=total, initial=done, file=sys.stderr, disable=None, unit="step")
    if not callable(getattr(progress, "write", None)):
        raise TypeError(
            f"fit: `progress` must be True, False or a text stream, got {type(progress).__name__}"
        )
    return tqdm(total=total, initial=done, file=progress, unit="step", ncols=120, mininterval=0)
