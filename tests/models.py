"""Member modules for the tests: torch's own layers and the awkward cases on purpose."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn


class MLP(nn.Module):
    def __init__(self, d_in: int = 4, hidden: int = 8, d_out: int = 3) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_in, hidden)
        self.fc2 = nn.Linear(hidden, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


class CNN(nn.Module):
    """Conv + BatchNorm2d: the running statistics are per member."""

    def __init__(self) -> None:
        super().__init__()
        # No conv bias: BatchNorm cancels its gradient, leaving round-off that Adam would
        # amplify to lr-sized noise in any implementation.
        self.conv = nn.Conv2d(1, 4, 3, bias=False)
        self.bn = nn.BatchNorm2d(4)
        self.head = nn.Linear(4 * 4 * 4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.bn(self.conv(x))).flatten(1))


class TokenModel(nn.Module):
    """Embedding + LayerNorm, integer inputs."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 6)
        self.norm = nn.LayerNorm(6)
        self.out = nn.Linear(6, 3)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(self.emb(tokens)).mean(1))


class Tied(nn.Module):
    """Decoder weight tied to the embedding: must stay one tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 6)
        self.dec = nn.Linear(6, 10, bias=False)
        self.dec.weight = self.emb.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.dec(torch.tanh(self.emb(tokens))).mean(1)[:, :3]


class Awkward(nn.Module):
    """A frozen parameter, an unused parameter (grad None) and a zero-size parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.scale = nn.Parameter(torch.rand(3), requires_grad=False)
        self.unused = nn.Linear(4, 3)
        self.empty = nn.Parameter(torch.zeros(0))
        self.register_buffer("offset", torch.randn(3))
        self.register_buffer("scratch", torch.zeros(3), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * self.scale + self.offset + self.empty.sum()


class Recurrent(nn.Module):
    """nn.GRU has no vmap batching rule: runs through backend="loop"."""

    def __init__(self) -> None:
        super().__init__()
        self.gru = nn.GRU(4, 5, batch_first=True)
        self.head = nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.gru(x)[0][:, -1])


class Encoder(nn.Module):
    """torch's own TransformerEncoderLayer, dropout off."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.layer(x).mean(1))


class DataDependent(nn.Module):
    """Python branching on a tensor value: vmap cannot batch it."""

    def __init__(self) -> None:
        super().__init__()
        self.bn = nn.BatchNorm1d(4)
        self.fc = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.bn(x)
        if h.sum() > 0:
            return self.fc(h)
        return -self.fc(h)


class UsesItem(DataDependent):
    """``.item()`` on a batched tensor: vmap cannot batch it either."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.bn(x)
        return self.fc(h) * h.abs().max().item()


# -- the small members of the seeded searches (tests/test_fuzz_*.py): 3 inputs, 4 hidden -------


class TanhMLP(nn.Module):
    def __init__(self, d_out: int = 2) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(3, 4), nn.Linear(4, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


class TanhBN(nn.Module):
    def __init__(self, d_out: int = 2) -> None:
        super().__init__()
        # No bias before BatchNorm: its true gradient is 0 (docs/semantics.md, round-off).
        self.fc1, self.bn = nn.Linear(3, 4, bias=False), nn.BatchNorm1d(4)
        self.fc2 = nn.Linear(4, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.bn(self.fc1(x))))


class TanhDropout(nn.Module):
    def __init__(self, d_out: int = 2) -> None:
        super().__init__()
        self.fc1, self.drop, self.fc2 = nn.Linear(3, 4), nn.Dropout(0.3), nn.Linear(4, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.drop(torch.tanh(self.fc1(x))))


class TwoInputs(nn.Module):
    """Two positional inputs, ``(x [.., 3], z [.., 2]) -> [.., 2]``."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(3, 2), nn.Linear(2, 2)

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return self.a(x) + torch.tanh(self.b(z))


class Zoo(nn.Module):
    """Every part of ``parts`` (name -> factory) on the same input, outputs flattened and
    joined: one member that exercises several layers at once."""

    def __init__(self, parts: dict[str, Callable[[], nn.Module]]) -> None:
        super().__init__()
        self.parts = nn.ModuleDict({name: make() for name, make in parts.items()})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([part(x).flatten(1) for part in self.parts.values()], 1)
