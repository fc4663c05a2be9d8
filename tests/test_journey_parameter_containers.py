"""Members that keep parameters in ``nn.ParameterList`` and ``nn.ParameterDict``: a stack of
weight matrices walked in a loop, biases looked up by name, as hand-written MLPs and
hypernetworks do. Twelve list entries, so ``ws.10`` comes after ``ws.9`` as torch orders them
(a string sort would put it after ``ws.1``); dict keys given out of order, which torch sorts.

Truth: each member trained alone with ``torch.optim.Adam`` (tests/truth.py); torch's own
optimizer ``state_dict`` of that member; the member files loaded into a fresh module with plain
``load_state_dict``.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from truth import assert_members_equal, float64_batches, train_each, twins

import vmapens

N, DEPTH, WIDTH = 3, 12, 4


class Stack(nn.Module):
    def __init__(self, depth: int = DEPTH) -> None:
        super().__init__()
        self.ws = nn.ParameterList(
            nn.Parameter(torch.randn(WIDTH, WIDTH) / 2) for _ in range(depth)
        )
        self.bs = nn.ParameterDict({"odd": nn.Parameter(torch.randn(WIDTH)),
                                    "even": nn.Parameter(torch.randn(WIDTH))})  # fmt: skip
        self.scale = nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, w in enumerate(self.ws):
            x = torch.tanh(x @ w + self.bs["odd" if i % 2 else "even"])
        return self.scale * x


def _members(depth: int = DEPTH) -> list[nn.Module]:
    torch.manual_seed(0)
    return [Stack(depth).double() for _ in range(N)]


# Compiled: 3 list entries (the graph unrolls the loop; 12 took ~12 s more to compile).
@pytest.mark.parametrize("compile,depth", [(False, DEPTH), (True, 3)], ids=["eager", "compiled"])
def test_parameter_containers_train_as_alone_with_torchs_optimizer_state(
    compile: bool, depth: int
) -> None:
    members = _members(depth)
    alone = twins(members)
    ens = vmapens.Ensemble.from_modules(members)
    opt = vmapens.StackedAdam(ens, lr=0.05, weight_decay=0.01)
    step = vmapens.make_step(ens, nn.MSELoss(), opt, compile=compile)
    batches = float64_batches(3, rows=6, inputs=WIDTH, outputs=WIDTH)
    for x, y in batches:
        step(x, y)
    opts = train_each(alone, batches,
                      make_opt=lambda i, m: torch.optim.Adam(m.parameters(), lr=0.05, weight_decay=0.01))  # fmt: skip
    assert_members_equal(ens, alone)
    for i, member in enumerate(ens.unstack()):
        assert type(member.ws) is nn.ParameterList and type(member.bs) is nn.ParameterDict
        got, want = opt.member_state_dict(i), opts[i].state_dict()
        # Integer ids in the module's parameter order: ws.0, ws.1, ..., bs.even, bs.odd, scale.
        assert got["param_groups"][0]["params"] == want["param_groups"][0]["params"]
        assert set(got["state"]) == set(want["state"]) == set(range(depth + 3))
        for k, state in want["state"].items():
            for field, value in state.items():
                torch.testing.assert_close(got["state"][k][field], value, rtol=1e-10,
                                           atol=1e-12, msg=f"member {i} param {k} {field}")  # fmt: skip
        # torch's Adam takes the member's state as its own and steps on from it as alone.
        resumed = torch.optim.Adam(member.parameters(), lr=0.05, weight_decay=0.01)
        resumed.load_state_dict(got)
        x, y = batches[0]
        for model, o in ((member, resumed), (alone[i], opts[i])):
            o.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            o.step()
        torch.testing.assert_close(
            member.state_dict(), alone[i].state_dict(), rtol=1e-10, atol=1e-12
        )


def test_member_files_of_parameter_containers_load_into_a_fresh_module(tmp_path) -> None:
    ens = vmapens.Ensemble.from_modules(_members())
    paths = vmapens.save_members(ens, tmp_path / "members")
    assert len(paths) == N
    for i, path in enumerate(paths):
        fresh = Stack().double()
        fresh.load_state_dict(torch.load(path, weights_only=True))  # strict: every key
        torch.testing.assert_close(fresh.state_dict(), ens[i].state_dict(), rtol=0, atol=0)
    x = torch.randn(5, WIDTH, dtype=torch.float64)
    want = torch.stack([m(x) for m in ens.unstack()])
    torch.testing.assert_close(ens(x), want, rtol=1e-12, atol=1e-12)
