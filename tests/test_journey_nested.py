"""User journey: the ensemble as a child of the user's own model, against the naive model.

RL and uncertainty people write ``Agent(nn.Module)`` with a shared encoder feeding an
``Ensemble`` of heads (``forward = heads(encoder(x))``) and treat the Agent as any model:
a plain ``torch.optim.Adam(agent.parameters())`` (elementwise, so exact per member over
stacked tensors) with name-based param groups and torch's global ``clip_grad_norm_``, or a
stacked optimizer for the heads beside a torch one for the encoder; ``agent.to(float64)``
after the optimizer, ``train()/eval()``, ``state_dict`` round trips (``weights_only`` too)
into a fresh Agent and a resume, ``torch.save(agent)``, a ``copy.deepcopy`` target network
Polyak-averaged, ``agent.apply(init)``. The truth: the naive Agent, an ``nn.ModuleList`` of 5
plain heads holding the ensemble's initial members (``ens.unstack()``), whose gradients from
all heads sum in the encoder, trained with the same torch optimizers, float64.
"""

from __future__ import annotations

import copy
import io
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import Tensor, nn

import vmapens

N, B = 5, 10
TOL: dict[str, Any] = dict(
    rtol=1e-10, atol=1e-12
)  # float64: batched and per-member kernels sum in other orders
LRS = [0.003, 0.005, 0.01, 0.02, 0.03]


class Head(nn.Module):
    def __init__(self, p: float = 0.0) -> None:
        super().__init__()
        # No bias before BatchNorm: its true gradient is 0 (docs/semantics.md, round-off).
        self.fc, self.bn = nn.Linear(8, 8, bias=False), nn.BatchNorm1d(8)
        self.out = nn.Linear(8, 2)
        self.drop = nn.Dropout(p)

    def forward(self, h: Tensor) -> Tensor:
        return self.out(self.drop(torch.tanh(self.bn(self.fc(h)))))


class Agent(nn.Module):
    def __init__(self, p: float = 0.0) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(6, 8), nn.ReLU())
        self.heads = vmapens.Ensemble(lambda: Head(p), N, seed=0)

    def forward(self, x: Tensor) -> Tensor:
        return self.heads(self.encoder(x))


class Naive(nn.Module):
    """What the researcher writes without vmapens: the same encoder and the Agent's members."""

    def __init__(self, agent: Agent) -> None:
        super().__init__()
        self.encoder = copy.deepcopy(agent.encoder)
        self.heads = nn.ModuleList(agent.heads.unstack())

    def forward(self, x: Tensor) -> Tensor:
        h = self.encoder(x)
        return torch.stack([head(h) for head in self.heads])


def agent64(p: float = 0.0) -> tuple[Agent, Naive]:
    agent = Agent(p).to(torch.float64)
    return agent, Naive(agent)


def batches(steps: int, seed: int = 1) -> Iterator[tuple[Tensor, Tensor]]:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(B, 6, generator=g, dtype=torch.float64)
        yield x, torch.randn(B, 2, generator=g, dtype=torch.float64)


def loss_of(out: Tensor, y: Tensor) -> Tensor:
    return ((out - y) ** 2).mean(dim=(1, 2)).sum()  # every head's MSE, summed


def naive_name(name: str, i: int) -> str:
    return name.replace("heads.", f"heads.{i}.", 1) if name.startswith("heads.") else name


def assert_same(agent: nn.Module, naive: nn.Module, what: str = "state_dict") -> None:
    """Every tensor of the agent's state dict, member by member, against the naive model's."""
    truth = naive.state_dict()
    for name, v in agent.state_dict().items():
        for i in range(N) if name.startswith("heads.") else [None]:
            mine = v if i is None else v[i]
            torch.testing.assert_close(
                mine, truth[naive_name(name, i or 0)], **TOL, msg=f"{what}: {name} member {i}"
            )


def adam_groups(model: nn.Module) -> list[dict]:
    """No weight decay on biases and norms, chosen by name, as in every training script."""
    named = list(model.named_parameters())
    decay = [p for n, p in named if n.endswith("weight") and ".bn." not in n]
    rest = [p for n, p in named if not (n.endswith("weight") and ".bn." not in n)]
    return [{"params": decay, "weight_decay": 0.01}, {"params": rest, "weight_decay": 0.0}]


def test_names_match_the_naive_models_with_the_member_index_dropped() -> None:
    agent, naive = agent64()
    names = [n for n, _ in agent.named_parameters()]
    assert names[:2] == ["encoder.0.weight", "encoder.0.bias"]
    assert {naive_name(n, i) for n in names for i in range(N)} == {
        n for n, _ in naive.named_parameters()
    }
    assert agent.heads.get_parameter("fc.weight").shape == (N, 8, 8)
    assert_same(agent, naive, "initial")


@pytest.mark.parametrize("opt_before_to", [False, True])
def test_plain_adamw_over_the_agent_with_global_clipping_is_the_naive_model(
    opt_before_to: bool,
) -> None:
    if opt_before_to:  # plain PyTorch allows the optimizer before .to(): same Parameter objects
        agent = Agent()
        opt = torch.optim.AdamW(adam_groups(agent), lr=0.01)
        agent.to(torch.float64)
        naive = Naive(agent)
    else:
        agent, naive = agent64()
        opt = torch.optim.AdamW(adam_groups(agent), lr=0.01)
    naive_opt = torch.optim.AdamW(adam_groups(naive), lr=0.01)
    scheds = [torch.optim.lr_scheduler.ExponentialLR(o, 0.8) for o in (opt, naive_opt)]
    for x, y in batches(6):
        norms = []
        for model, o in ((agent, opt), (naive, naive_opt)):
            o.zero_grad()
            loss_of(model(x), y).backward()
            # One global norm over the encoder and every head, as the naive model clips.
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
            o.step()
        torch.testing.assert_close(norms[0], norms[1], **TOL)
        assert norms[1] > 1.0  # the clipping acts
        for s in scheds:
            s.step()
    assert_same(agent, naive, "after AdamW")
    named = dict(naive.named_parameters())
    for name, p in agent.named_parameters():
        for i in range(N) if name.startswith("heads.") else [None]:
            state, truth = opt.state[p], naive_opt.state[named[naive_name(name, i or 0)]]
            for key in ("exp_avg", "exp_avg_sq"):
                mine = state[key] if i is None else state[key][i]
                torch.testing.assert_close(mine, truth[key], **TOL)
    agent.eval(), naive.eval()
    x = torch.randn(4, 6, dtype=torch.float64)
    torch.testing.assert_close(agent(x), naive(x), **TOL)


def test_stacked_adam_for_the_heads_beside_torch_adam_for_the_encoder() -> None:
    agent, naive = agent64()
    heads_opt = vmapens.StackedAdam(agent.heads, lr=LRS, weight_decay=0.01)
    enc_opt = torch.optim.Adam(agent.encoder.parameters(), lr=0.01)
    opts = [heads_opt, enc_opt]
    naive_opts = [torch.optim.Adam(naive.encoder.parameters(), lr=0.01)] + [
        torch.optim.Adam(h.parameters(), lr=lr, weight_decay=0.01)
        for h, lr in zip(naive.heads, LRS, strict=True)
    ]
    scheds = [torch.optim.lr_scheduler.StepLR(o, 2, 0.5) for o in opts + naive_opts]
    for x, y in batches(6):
        for o in opts + naive_opts:
            o.zero_grad()
        loss_of(agent(x), y).backward()
        vmapens.optim.clip_grad_norm_(agent.heads, 0.5)  # each head by its own norm
        loss_of(naive(x), y).backward()
        for h in naive.heads:
            torch.nn.utils.clip_grad_norm_(h.parameters(), 0.5)
        for o in opts + naive_opts:
            o.step()
        for s in scheds:
            s.step()
    assert_same(agent, naive, "stacked heads")
    x = torch.randn(4, 6, dtype=torch.float64)
    agent.eval(), naive.eval()
    torch.testing.assert_close(agent(x), naive(x), **TOL)


def test_train_and_eval_reach_the_heads_dropout_and_batchnorm() -> None:
    agent, naive = agent64(p=0.5)
    x = torch.randn(B, 6, dtype=torch.float64)
    agent.eval(), naive.eval()
    template: Any = agent.heads.template
    assert not agent.heads.training and not template.drop.training
    assert not agent.heads[2].bn.training
    torch.testing.assert_close(agent(x), naive(x), **TOL)  # no masks, running statistics
    agent.train()
    assert template.bn.training and agent.heads[0].drop.training
    assert not torch.equal(agent(x), agent(x))  # dropout draws anew


def test_state_dict_round_trip_into_a_fresh_agent_resumes_exactly() -> None:
    agent, naive = agent64()
    opt = torch.optim.Adam(agent.parameters(), lr=0.01)
    naive_opt = torch.optim.Adam(naive.parameters(), lr=0.01)
    data = list(batches(6))

    def train(model: nn.Module, o: torch.optim.Optimizer, part: list) -> None:
        for x, y in part:
            o.zero_grad()
            loss_of(model(x), y).backward()
            o.step()

    train(agent, opt, data[:3])
    buf = io.BytesIO()
    torch.save({"model": agent.state_dict(), "opt": opt.state_dict()}, buf)
    buf.seek(0)
    ckpt = torch.load(buf, weights_only=True)  # the safe default loads a stacked state dict
    fresh = Agent().double()
    with torch.no_grad():
        for p in fresh.parameters():
            p.add_(1.0)  # elsewhere, so that the load has to move everything
    assert str(fresh.load_state_dict(ckpt["model"])) == "<All keys matched successfully>"
    fresh_opt = torch.optim.Adam(fresh.parameters(), lr=0.01)
    fresh_opt.load_state_dict(ckpt["opt"])
    train(fresh, fresh_opt, data[3:])
    train(naive, naive_opt, data)
    assert_same(fresh, naive, "resumed from a state dict")

    # The whole Agent pickled, as torch.save(model) users do, trains on as the naive one.
    buf = io.BytesIO()
    torch.save(fresh, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    loaded_opt = torch.optim.Adam(loaded.parameters(), lr=0.01)
    loaded_opt.load_state_dict(fresh_opt.state_dict())
    more = list(batches(2, seed=7))
    train(loaded, loaded_opt, more)
    train(naive, naive_opt, more)
    assert_same(loaded, naive, "after torch.save(agent)")


def test_partial_load_keeps_what_torch_keeps() -> None:
    agent, naive = agent64()
    for x, _ in batches(2):
        agent(x), naive(x)  # running statistics and num_batches_tracked move
    other, other_naive = agent64()
    sd = {k: v + 1 for k, v in other.state_dict().items() if ".bn." not in k}
    naive_sd = {k: v + 1 for k, v in other_naive.state_dict().items() if ".bn." not in k}
    got, want = (
        agent.load_state_dict(sd, strict=False),
        naive.load_state_dict(naive_sd, strict=False),
    )
    assert got.unexpected_keys == want.unexpected_keys == []
    assert {naive_name(k, i) for k in got.missing_keys for i in range(N)} == set(want.missing_keys)
    assert_same(agent, naive, "partial load")


def test_deepcopy_target_network_with_polyak_averaging() -> None:
    agent, naive = agent64()
    target = copy.deepcopy(agent).requires_grad_(False)
    naive_target = copy.deepcopy(naive).requires_grad_(False)
    opt = torch.optim.Adam(agent.parameters(), lr=0.02)
    naive_opt = torch.optim.Adam(naive.parameters(), lr=0.02)
    for k, (x, r) in enumerate(batches(6)):
        for model, tgt, o in ((agent, target, opt), (naive, naive_target, naive_opt)):
            with torch.no_grad():
                y = r + 0.9 * tgt(x + 0.1)  # a TD target per head, from the target network
            assert not y.requires_grad
            o.zero_grad()
            loss_of(model(x), y).backward()
            o.step()
            with torch.no_grad():
                if k % 3 == 2:  # a hard copy now and then, as DQN does
                    tgt.load_state_dict(model.state_dict())
                else:
                    for pt, p in zip(tgt.parameters(), model.parameters(), strict=True):
                        pt.lerp_(p, 0.1)
    assert all(not p.requires_grad for p in target.parameters())
    assert all(p.requires_grad for p in agent.parameters())
    assert_same(agent, naive, "online")
    assert_same(target, naive_target, "target")
    # vmapens's own soft update of the heads, beside torch's for the encoder, moves alike.
    for pt, p in zip(target.encoder.parameters(), agent.encoder.parameters(), strict=True):
        pt.detach().lerp_(p.detach(), 0.3)
    vmapens.rl.polyak_(target.heads, agent.heads, 0.3)
    with torch.no_grad():
        for pt, p in zip(naive_target.parameters(), naive.parameters(), strict=True):
            pt.lerp_(p, 0.3)
        naive_target.load_state_dict(
            {
                **naive_target.state_dict(),
                **{k: v for k, v in naive.state_dict().items() if "running" in k or "batches" in k},
            }
        )  # polyak_ copies the buffers, as its docstring says
    assert_same(target, naive_target, "after polyak_")


def test_agent_apply_initialises_every_head_as_the_naive_model() -> None:
    agent, naive = agent64()

    def init(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            nn.init.orthogonal_(m.weight, gain=0.5)
            if m.bias is not None:
                nn.init.normal_(m.bias, std=0.1)

    torch.manual_seed(3)
    agent.apply(init)
    torch.manual_seed(3)
    naive.apply(init)  # the same draws in the same module order: encoder, head 0, head 1, ...
    assert_same(agent, naive, "apply")


class Narrow(nn.Module):
    """An Agent whose encoder is 5 wide, as many rows as there are heads."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Linear(6, N)
        self.heads = vmapens.Ensemble(lambda: nn.Linear(N, 2), N, seed=0)

    def forward(self, x: Tensor) -> Tensor:
        return self.heads(self.encoder(x))


@pytest.mark.parametrize("model", [Agent, Narrow])
def test_the_whole_agent_given_to_a_stacked_api_is_refused_naming_the_encoder(
    model: type[nn.Module],
) -> None:
    # The naive model has no per-member lr or norm for a shared encoder: its rows are not
    # members. An encoder as wide as n was read as n members, silently (each row clipped by
    # its own norm, each row its own lr); another width gave "sizes [5, 8]" without a why.
    agent = model().double()
    loss_of(agent(torch.randn(B, 6, dtype=torch.float64)), torch.zeros(B, 2)).backward()
    grads = [torch.clone(p.grad) for p in agent.parameters() if p.grad is not None]
    with pytest.raises(ValueError, match=r"clip_grad_norm_: `ens_or_params` .*`heads`.*encoder"):
        vmapens.optim.clip_grad_norm_(agent, 1e-3)
    for p, g in zip(agent.parameters(), grads, strict=True):
        assert p.grad is not None and torch.equal(p.grad, g)  # nothing clipped
    with pytest.raises(ValueError, match=r"StackedAdam: `params` .*`model.heads`"):
        vmapens.StackedAdam(agent, lr=LRS)
    vmapens.optim.clip_grad_norm_(agent.heads, 1e-3)  # the ensemble itself, as documented
    vmapens.StackedAdam(agent.heads, lr=LRS).step()
