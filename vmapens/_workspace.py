"""Large CPU buffers kept from one call to the next: no fresh page faults every step.

torch's CPU allocator does not cache: every tensor of more than glibc's mmap threshold (128 KB,
rising to at most 32 MB) is mapped when it is made and unmapped when it is freed, and glibc
returns freed heap memory above its trim threshold to the system. A buffer of a few MB made
anew every step is then faulted in page by page, every step. On a virtual machine a fault
costs microseconds, more on a loaded host: the eager LSTM node (``_lstm_fused``), whose
buffers for 16 members of ``LSTM(8, 32)`` total 10 MB, took 500-2,500 page faults a step, and
0.63-0.96x the time with its buffers kept here (docs/performance.md, "The LSTM node's buffers
kept").

:func:`take` hands out a view of a buffer it keeps, once nothing else holds the buffer: no view
of it alive (an autograd graph that saved one, a caller's variable), checked by the storage's
reference count, as torch's CUDA graph trees check their outputs. Pools are per thread, and
hold at most :data:`CAPACITY` bytes each; a buffer past it is made and freed as usual.
Elsewhere than on the CPU (CUDA's allocator caches), for a tensor subclass and under a
``TorchDispatchMode`` (``FakeTensorMode`` makes fake tensors) it makes a plain ``new_empty``.

This file imports only torch.
"""

from __future__ import annotations

import threading

import torch
from torch import Tensor

__all__ = ["CAPACITY", "take"]

#: Bytes a thread's pool keeps at most (the least recently used free buffers go first).
CAPACITY = 64 * 2**20

_LOCAL = threading.local()


class _Kept:
    """One buffer of the pool and the reference count its storage has when nothing holds it."""

    __slots__ = ("key", "tensor", "free_count")

    def __init__(self, key: tuple, tensor: Tensor) -> None:
        self.key, self.tensor = key, tensor
        self.free_count = _count(tensor)

    def free(self) -> bool:
        return _count(self.tensor) == self.free_count


def _count(t: Tensor) -> int:
    """The reference count of ``t``'s storage (a view of ``t`` is one more)."""
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata)


def take(like: Tensor, *shape: int) -> Tensor:
    """An uninitialised tensor of ``shape`` with ``like``'s dtype and device (``new_empty``).

    On the CPU, a view of a kept buffer where one of that shape and dtype (made in or out of
    inference mode, as now) is free, the most recently used first; its contents are whatever
    its last user left.
    """
    if (
        like.device.type != "cpu"
        or type(like) is not torch.Tensor  # a subclass: its own tensors
        or torch._C._len_torch_dispatch_stack()  # a dispatch mode may make other tensors
    ):
        return like.new_empty(shape)
    pool: list[_Kept] = _LOCAL.__dict__.setdefault("pool", [])
    # A buffer made under inference mode is an inference tensor, which no graph may save.
    key = (shape, like.dtype, torch.is_inference_mode_enabled())
    for k in range(len(pool) - 1, -1, -1):  # the most recently used first: likelier in cache
        kept = pool[k]
        if kept.key == key and kept.free():
            pool.append(pool.pop(k))  # most recently used last
            return kept.tensor.view(shape)
    tensor = like.new_empty(shape)
    size = tensor.untyped_storage().nbytes()
    if size > CAPACITY:
        return tensor
    held = sum(kept.tensor.untyped_storage().nbytes() for kept in pool)
    for kept in [kept for kept in pool if kept.free()]:  # least recently used first
        if held + size <= CAPACITY:
            break
        pool.remove(kept)
        held -= kept.tensor.untyped_storage().nbytes()
    if held + size <= CAPACITY:
        pool.append(_Kept(key, tensor))
    return tensor.view(shape)
