"""A user journey: an ensemble of small CLIP-style two-tower models.

Each member: an image tower (MLP), a text tower (`nn.Embedding`, a one-layer
`nn.TransformerEncoder` with a padding mask, mean pooling over the real tokens), projection
heads, and a learned `logit_scale` initialised to log(1/0.07). The symmetric InfoNCE loss
(`F.normalize`, `@`, `logit_scale.exp()`, cross-entropy against `torch.arange` both ways) mixes
the samples of the batch. Checked, against each member a plain module trained alone with
`torch.optim` on the same batches (float64: only the order of sums may differ, hence TOL):

* a hand loop with AdamW param groups built from `ens.named_parameters()` (no decay on biases,
  norms and `logit_scale`, by docs/optim.md's split for stacked tensors), then CLIP's clamp of
  the temperature after every step, written the ways users write it: on `ens.logit_scale`
  (`.data.clamp_`, `clamp_` under `no_grad`), on `ens.stacked_params()["logit_scale"]`, and
  with `ens.apply`; on `ens.template.logit_scale` the write is refused (docs/semantics.md);
* gradient accumulation over micro-batches by hand (docs/fit.md): InfoNCE is not
  decomposable, so the micro-batches give what they give alone, not the full batch's step;
* `fit` with a custom loss over tuple inputs `(images, tokens)` (docs/fit.md);
* zero-shot classification with `predict` on class prompts shared by every image;
* member files loaded into plain modules; one member handed to `torch.optim.AdamW` mid-run
  (`member_state_dict`, its two groups) goes on as alone;
* the members' forward and loss under `torch.autocast(bfloat16)` (docs/semantics.md,
  "Mixed precision": bit for bit for these layers).

Fixed in session 32 (each test failed before): a clamp on `ens.template.logit_scale` right
before `state_dict()`/`state_dicts()`/`save_members` saved the unclamped values silently; a
stacked optimizer over the template's (meta) parameters stepped nothing, silently;
`ens.logit_scale = nn.Parameter(<0-d>)` was accepted and every later call failed with an
IndexError.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from truth import batch_plan

import vmapens

N, B, V, L, D = 3, 6, 12, 5, 8
LR = [3e-2, 1e-2, 5e-2]  # per member
WD = 0.1
# CLIP clamps to [0, log(100)]; a floor near the start bites in a few steps on random pairs
BOUNDS = (math.log(1 / 0.07) - 0.08, math.log(100))
TOL: dict[str, Any] = {"rtol": 1e-9, "atol": 1e-10}  # float64, sums in another order


class Clip(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.image = nn.Sequential(nn.Linear(6, D), nn.ReLU(), nn.Linear(D, D))
        self.embed = nn.Embedding(V, D, padding_idx=0)
        # bias=False: the key bias's true gradient is 0 (softmax ignores it), and Adam turns
        # the round-off there into lr-sized noise, alone too (docs/semantics.md)
        layer = nn.TransformerEncoderLayer(D, 2, 16, dropout=0.0, batch_first=True, bias=False)
        self.text = nn.TransformerEncoder(layer, 1, enable_nested_tensor=False)
        self.image_proj = nn.Linear(D, 4, bias=False)
        self.text_proj = nn.Linear(D, 4, bias=False)
        self.logit_scale = nn.Parameter(torch.ones([]) * math.log(1 / 0.07))

    def forward(self, images: Tensor, tokens: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        pad = tokens == 0
        h = self.text(self.embed(tokens), src_key_padding_mask=pad)
        keep = (~pad).unsqueeze(-1).to(h.dtype)
        pooled = (h * keep).sum(1) / keep.sum(1)
        img = F.normalize(self.image_proj(self.image(images)), dim=-1)
        txt = F.normalize(self.text_proj(pooled), dim=-1)
        return img, txt, self.logit_scale.exp()


def info_nce(out: tuple[Tensor, Tensor, Tensor], _y: Any = None) -> Tensor:
    img, txt, scale = out
    logits = scale * img @ txt.T
    labels = torch.arange(len(img), device=logits.device)
    return (F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels)) / 2


def pairs(count: int, rows: int = B, seed: int = 0) -> list[tuple[Tensor, Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        x = torch.randn(rows, 6, generator=g, dtype=torch.float64)
        t = torch.randint(1, V, (rows, L), generator=g)
        lengths = torch.randint(1, L + 1, (rows,), generator=g)
        t[torch.arange(L) >= lengths[:, None]] = 0  # right padding, at least one real token
        out.append((x, t))
    return out


def build() -> tuple[vmapens.Ensemble, list[nn.Module]]:
    ens = vmapens.Ensemble(Clip, N, seed=0).double()
    return ens, ens.unstack()


def decays(name: str, p: Tensor, stacked: bool) -> bool:
    """The CLIP split: no decay on biases, norms, `logit_scale`; stacked tensors have one more
    dim (docs/optim.md: test `p.ndim <= 2` on them)."""
    return not (p.ndim <= (2 if stacked else 1) or "logit_scale" in name)


def groups(named: Any, stacked: bool) -> list[dict[str, Any]]:
    named = list(named)
    return [
        {"params": [p for n, p in named if decays(n, p, stacked)], "weight_decay": WD},
        {"params": [p for n, p in named if not decays(n, p, stacked)], "weight_decay": 0.0},
    ]


def clamp_alone(m: nn.Module) -> None:
    m.logit_scale.data.clamp_(*BOUNDS)


def train_alone(alone: list[nn.Module], data: list[tuple[Tensor, Tensor]], k: int = 1) -> None:
    for m, lr in zip(alone, LR, strict=True):
        opt = torch.optim.AdamW(groups(m.named_parameters(), stacked=False), lr=lr)
        for x, t in data:
            opt.zero_grad()
            for xs, ts in zip(x.chunk(k), t.chunk(k), strict=True):
                (info_nce(m(xs, ts)) / k).backward()
            opt.step()
            clamp_alone(m)


def assert_members(ens: vmapens.Ensemble, alone: list[nn.Module], how: str = "") -> None:
    for i, m in enumerate(alone):
        got = ens[i].state_dict()
        for name, want in m.state_dict().items():
            torch.testing.assert_close(got[name], want, **TOL, msg=f"{how} member {i} {name}")


CLAMPS = {
    "data": lambda ens: ens.logit_scale.data.clamp_(*BOUNDS),
    "no_grad": lambda ens: ens.logit_scale.clamp_(*BOUNDS),
    "stacked_params": lambda ens: ens.stacked_params()["logit_scale"].data.clamp_(*BOUNDS),
    "get_parameter": lambda ens: ens.get_parameter("logit_scale").clamp_(*BOUNDS),
    "apply": lambda ens: ens.apply(lambda m: clamp_alone(m) if isinstance(m, Clip) else None),
}


def test_adamw_groups_and_clamped_temperature_match_each_member_alone() -> None:
    data = pairs(4)
    alone = build()[1]
    train_alone(alone, data)
    for how, clamp in CLAMPS.items():
        ens = build()[0]
        opt = vmapens.StackedAdam(
            groups(ens.named_parameters(), stacked=True), lr=LR, decoupled_weight_decay=True
        )
        for x, t in data:
            opt.zero_grad()
            vmapens.per_member(info_nce)(ens(x, t), None).sum().backward()
            opt.step()
            with torch.no_grad():
                clamp(ens)
        assert_members(ens, alone, how)
    # the clamp bit (a member at the floor) and another member trained on above it
    scales = ens.get_parameter("logit_scale").detach()
    assert (scales == BOUNDS[0]).any() and (scales > BOUNDS[0]).any(), scales


@pytest.mark.parametrize(
    "write",
    [
        lambda t: t.logit_scale.data.clamp_(BOUNDS[0] + 0.1, BOUNDS[1]),
        lambda t: t.logit_scale.clamp_(BOUNDS[0] + 0.1, BOUNDS[1]),
    ],
    ids=["data", "no_grad"],
)
def test_a_clamp_on_the_template_is_refused_and_changes_nothing(write: Any) -> None:
    ens, _ = build()
    x, t = pairs(1)[0]
    before = ens.get_parameter("logit_scale").detach().clone()
    with torch.no_grad():
        write(ens.template)
    with pytest.raises(ValueError, match=r"ens\.template\.logit_scale.*ens\.apply"):
        ens(x, t)
    torch.testing.assert_close(ens.get_parameter("logit_scale").detach(), before, rtol=0, atol=0)


def test_gradient_accumulation_over_micro_batches_as_alone() -> None:
    ens, alone = build()
    data, k = pairs(3, rows=8), 2
    opt = vmapens.StackedAdam(
        groups(ens.named_parameters(), stacked=True), lr=LR, decoupled_weight_decay=True
    )
    for x, t in data:
        opt.zero_grad()
        for xs, ts in zip(x.chunk(k), t.chunk(k), strict=True):
            (vmapens.per_member(info_nce)(ens(xs, ts), None) / k).sum().backward()
        opt.step()
        ens.logit_scale.data.clamp_(*BOUNDS)
    full = [m for m in build()[1]]
    train_alone(alone, data, k=k)
    train_alone(full, data, k=1)
    assert_members(ens, alone)
    # InfoNCE over two halves is not the full batch's loss: the accumulated run is its own
    diff = (alone[0].image[0].weight - full[0].image[0].weight).abs().max()
    assert diff > 1e-4, diff


def test_one_member_goes_on_alone_with_adamw_from_its_optimizer_state() -> None:
    ens, alone = build()
    data = pairs(4)
    opt = vmapens.StackedAdam(
        groups(ens.named_parameters(), stacked=True), lr=LR, decoupled_weight_decay=True
    )
    for x, t in data[:2]:
        opt.zero_grad()
        vmapens.per_member(info_nce)(ens(x, t), None).sum().backward()
        opt.step()
        ens.logit_scale.data.clamp_(*BOUNDS)
    train_alone(alone, data)
    best = ens[2]  # its two groups (the 0-d logit_scale in the second), as torch's AdamW
    own = torch.optim.AdamW(groups(best.named_parameters(), stacked=False), lr=LR[2])
    own.load_state_dict(opt.member_state_dict(2, module=best))
    for x, t in data[2:]:
        own.zero_grad()
        info_nce(best(x, t)).backward()
        own.step()
        clamp_alone(best)
    for name, want in alone[2].state_dict().items():
        torch.testing.assert_close(best.state_dict()[name], want, **TOL, msg=name)


class ClampTemperature(vmapens.Callback):
    def on_step_end(self, ctx: Any) -> None:
        ctx.ensemble.logit_scale.data.clamp_(*BOUNDS)  # CLIP's line, on the stacked scales


def test_fit_on_image_text_tuples_then_member_files_and_zero_shot_as_alone(tmp_path) -> None:
    ens, alone = build()
    (images, tokens), rows = pairs(1, rows=12, seed=3)[0], 12
    targets = torch.zeros(rows)  # InfoNCE's labels are the batch's own order: none to give
    with pytest.raises(TypeError, match="accumulate_grad_batches"):  # docs/fit.md: by hand
        vmapens.fit(ens, ((images, tokens), targets), info_nce, accumulate_grad_batches=2)
    vmapens.fit(
        ens, ((images, tokens), targets), info_nce, epochs=2, batch_size=4, progress=False,
        optimizer=lambda e: vmapens.StackedAdam(
            groups(e.named_parameters(), stacked=True), lr=LR, decoupled_weight_decay=True
        ),
        callbacks=[ClampTemperature()], seed=0,
    )  # fmt: skip
    plan = batch_plan(rows, 4, 6, seed=0)
    train_alone(alone, [(images[r], tokens[r]) for r in plan])
    assert_members(ens, alone)

    # member files: each loads into a plain Clip
    paths = vmapens.save_members(ens, tmp_path / "members")
    for path, m in zip(paths, alone, strict=True):
        plain = Clip().double()
        plain.load_state_dict(vmapens.load_member(path))
        for name, want in m.state_dict().items():
            torch.testing.assert_close(plain.state_dict()[name], want, **TOL, msg=name)

    # zero-shot: every image against the same class prompts, the logits out of the forward
    class ZeroShot(Clip):
        def forward(self, images: Tensor, prompts: Tensor) -> Tensor:  # type: ignore[override]
            img, txt, scale = super().forward(images, prompts)
            return scale * img @ txt.T  # [images, classes]

    zero = vmapens.Ensemble(ZeroShot, N, seed=0).double()
    zero.load_state_dict(ens.state_dict())
    test, prompts = pairs(1, rows=7, seed=4)[0][0], pairs(1, rows=3, seed=5)[0][1]
    with pytest.raises(ValueError, match=r"predict: `batch_size` cuts every input"):
        vmapens.predict(zero, (test, prompts), batch_size=4)  # the prompts are no samples
    batches = [(test[i : i + 4], prompts) for i in range(0, 7, 4)]
    probs = vmapens.predict(zero, batches, reduce="mean", softmax=True)
    each = vmapens.predict(zero, batches)
    with torch.no_grad():
        want = []
        for m in alone:
            z = ZeroShot().double()
            z.load_state_dict(m.state_dict())
            want.append(z.eval()(test, prompts))
    torch.testing.assert_close(each, torch.stack(want), **TOL)
    torch.testing.assert_close(probs, torch.stack(want).softmax(-1).mean(0), **TOL)
    assert probs.shape == (7, 3)


def test_members_forward_and_info_nce_under_bf16_autocast_as_alone() -> None:
    ens = vmapens.Ensemble(Clip, N, seed=0)  # float32 parameters, bf16 compute
    alone = ens.unstack()
    x, t = pairs(1)[0]
    x = x.float()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        out = ens(x, t)
        loss = vmapens.per_member(info_nce)(out, None)
        for i, m in enumerate(alone):
            mine = m(x, t)
            for got, want in zip(out, mine, strict=True):
                assert got.dtype == want.dtype
                torch.testing.assert_close(got[i], want, rtol=0, atol=0)
            # cross_entropy's float32 sums over a batch of (transposed) logits run in another
            # order: an ulp, as torch.vmap's own (float32 without autocast too)
            torch.testing.assert_close(loss[i], info_nce(mine), rtol=1e-6, atol=0)
            assert loss.dtype == torch.float32


SAVES = {
    "state_dict": lambda ens, d: ens.state_dict()["logit_scale"][0],
    "state_dicts": lambda ens, d: ens.state_dicts()[0]["logit_scale"],
    "save_members": lambda ens, d: vmapens.load_member(vmapens.save_members(ens, d)[0])[
        "logit_scale"
    ],
}


@pytest.mark.parametrize("save", list(SAVES))
def test_a_template_clamp_right_before_saving_is_refused(save: str, tmp_path) -> None:
    ens, _ = build()
    x, t = pairs(1)[0]
    ens(x, t)
    with torch.no_grad():
        ens.template.logit_scale.clamp_(0, 1.0)  # the final clamp, then the files
    with pytest.raises(ValueError, match=r"ens\.template\.logit_scale.*ens\.apply"):
        print(SAVES[save](ens, tmp_path))  # alone: 1.0; here log(1/0.07), silently


def test_a_stacked_optimizer_over_the_template_parameters_is_refused() -> None:
    ens, _ = build()
    x, t = pairs(1)[0]
    before = {k: v.clone() for k, v in ens.state_dict().items()}
    decay = [m.weight for m in ens.template.image.modules() if isinstance(m, nn.Linear)]
    try:
        opt = vmapens.StackedAdam(decay, lr=1e-2, decoupled_weight_decay=True)
    except ValueError as e:
        assert "ens.get_parameter" in str(e)
        return
    opt.zero_grad()
    vmapens.per_member(info_nce)(ens(x, t), None).sum().backward()
    opt.step()  # alone, image.0.weight and image.2.weight move; here nothing does
    changed = [k for k, v in ens.state_dict().items() if not torch.equal(v, before[k])]
    assert "image.0.weight" in changed, changed


def test_assigning_a_members_shaped_parameter_to_the_ensemble_is_refused_clearly() -> None:
    ens, _ = build()
    x, t = pairs(1)[0]
    before = ens.get_parameter("logit_scale")
    with pytest.raises(ValueError, match=r"ens\.logit_scale.*\(3,\).*copy_"):
        ens.logit_scale = nn.Parameter(torch.tensor(math.log(1 / 0.07), dtype=torch.float64))
    assert ens.get_parameter("logit_scale") is before  # nothing changed: the ensemble runs on
    ens(x, t)
    with torch.no_grad():  # the way out: every member's scale, in place
        ens.logit_scale.copy_(torch.tensor(2.0))
    assert ens[2].logit_scale.item() == 2.0
