"""A user journey: small Vision Transformers written the timm way, as a seed / learning-rate sweep.

The model a vision researcher writes after timm's `VisionTransformer`: a patch embedding by
`nn.Conv2d(stride=patch)`, a cls token and a learned position embedding as `nn.Parameter`s,
`torch.cat` of the cls token expanded over the batch, pre-norm blocks (`nn.LayerNorm`),
attention through `F.scaled_dot_product_attention` (timm's `Attention`, attention dropout as
`dropout_p=... if self.training else 0.0`) or through `nn.MultiheadAttention`, a GELU MLP,
LayerScale (`gamma * x`, one value per channel) and stochastic depth written as timm's
`drop_path`: `x.new_empty((x.shape[0],) + (1,) * (x.ndim - 1)).bernoulli_(keep_prob)` then
`x.div(keep_prob) * keep`. At eval on another image size the position embedding is resized with
`F.interpolate(..., mode="bicubic", align_corners=False)` (timm's `resample_abs_pos_embed`).

The recipe: timm's param groups (no weight decay for `cls_token`, `pos_embed`, norms, biases
and LayerScale's `gamma`: `p.ndim <= 1 or name.endswith(".bias") or name in no_wd`), AdamW
with one learning rate per member, a warmup + cosine `LambdaLR` stepped every step, label
smoothing and gradient clipping by norm per member; `make_step`, `fit`, `predict` and member
files loaded into a plain module.

The truth is the naive loop: each member a plain module trained alone with `torch.optim.AdamW`,
torch's `LambdaLR` and `clip_grad_norm_`, on the same batches, from the RNG state the
ensemble's step started from (docs/semantics.md, "Randomness in the forward pass": with
`randomness="same"` each member draws what it draws alone from the same RNG state). float64
throughout; members agree to ~5e-11 after 3 AdamW steps (Adam divides round-off of small
gradients by their own size; the ViT without any random op gives the same numbers).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import vmapens
from vmapens.callbacks import LRScheduler

pytestmark = pytest.mark.usefixtures("float64_default")

N, B, STEPS, WARMUP = 3, 4, 3, 1
LRS, WD, CLIP = [1e-2, 3e-3, 2e-2], 0.05, 0.5
TOL = {"rtol": 1e-8, "atol": 1e-9}
CRIT = nn.CrossEntropyLoss(label_smoothing=0.1)
NO_WD = {"cls_token", "pos_embed"}  # timm's `no_weight_decay()`


class DropPath(nn.Module):
    """timm's `drop_path` (`how="bernoulli"`), or the rewrite with `torch.rand(...) < keep`."""

    def __init__(self, p: float, how: str = "bernoulli") -> None:
        super().__init__()
        self.drop_prob, self.how = p, how

    def forward(self, x: Tensor) -> Tensor:
        if self.drop_prob == 0.0 or not self.training:
            return x
        keep_prob = 1 - self.drop_prob
        shape = (x.shape[0],) + (1,) * (x.ndim - 1)
        if self.how == "bernoulli":
            keep = x.new_empty(shape).bernoulli_(keep_prob)
        elif self.how == "empty":  # older code: a fresh tensor, not one made from x
            keep = torch.empty(shape, dtype=x.dtype).bernoulli_(keep_prob)
        else:
            keep = (torch.rand(shape, dtype=x.dtype) < keep_prob).to(x.dtype)
        return x.div(keep_prob) * keep


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int, attn_drop: float) -> None:
        super().__init__()
        self.heads, self.attn_drop = heads, attn_drop
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        b, t, c = x.shape
        qkv = self.qkv(x).reshape(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        p = self.attn_drop if self.training else 0.0
        x = F.scaled_dot_product_attention(q, k, v, dropout_p=p)
        return self.proj(x.transpose(1, 2).reshape(b, t, c))


class MHA(nn.Module):
    def __init__(self, dim: int, heads: int, attn_drop: float) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(dim, heads, dropout=attn_drop, batch_first=True)

    def forward(self, x: Tensor) -> Tensor:
        return self.attn(x, x, x, need_weights=False)[0]


class LayerScale(nn.Module):
    def __init__(self, dim: int, init: float = 0.1) -> None:
        super().__init__()
        self.gamma = nn.Parameter(init * torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        return self.gamma * x


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, dp: float, attn: str, how: str, ad: float) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = (Attention if attn == "sdpa" else MHA)(dim, heads, ad)
        self.ls1, self.drop_path1 = LayerScale(dim), DropPath(dp, how)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))
        self.ls2, self.drop_path2 = LayerScale(dim), DropPath(dp, how)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.drop_path1(self.ls1(self.attn(self.norm1(x))))
        return x + self.drop_path2(self.ls2(self.mlp(self.norm2(x))))


class ViT(nn.Module):
    def __init__(
        self, dp: float = 0.0, attn: str = "sdpa", how: str = "bernoulli", ad: float = 0.0
    ) -> None:
        super().__init__()
        img, patch, dim, depth = 8, 4, 8, 2
        self.grid = img // patch
        self.patch_embed = nn.Conv2d(3, dim, patch, stride=patch)
        self.cls_token = nn.Parameter(0.02 * torch.randn(1, 1, dim))
        self.pos_embed = nn.Parameter(0.02 * torch.randn(1, self.grid**2 + 1, dim))
        # timm's stochastic depth rule: 0 for the first block, `dp` for the last
        rates = [dp * i / (depth - 1) for i in range(depth)]
        self.blocks = nn.Sequential(*[Block(dim, 2, r, attn, how, ad) for r in rates])
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, 3)

    def pos(self, patches: int) -> Tensor:
        if patches == self.grid**2:
            return self.pos_embed
        g = math.isqrt(patches)
        cls_pos, grid_pos = self.pos_embed[:, :1], self.pos_embed[:, 1:]
        grid_pos = grid_pos.reshape(1, self.grid, self.grid, -1).permute(0, 3, 1, 2)
        grid_pos = F.interpolate(grid_pos, size=(g, g), mode="bicubic", align_corners=False)
        return torch.cat((cls_pos, grid_pos.permute(0, 2, 3, 1).reshape(1, g * g, -1)), dim=1)

    def forward(self, x: Tensor) -> Tensor:
        x = self.patch_embed(x).flatten(2).transpose(1, 2)
        x = torch.cat((self.cls_token.expand(x.shape[0], -1, -1), x), dim=1)
        x = self.blocks(x + self.pos(x.shape[1] - 1))
        return self.head(self.norm(x)[:, 0])


def data(steps: int = STEPS, side: int = 8, seed: int = 0) -> list[tuple[Tensor, Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(B, 3, side, side, generator=g), torch.randint(3, (B,), generator=g))
        for _ in range(steps)
    ]


def warm_cosine(k: int, total: int = STEPS) -> float:
    if k < WARMUP:
        return (k + 1) / (WARMUP + 1)
    return 0.5 * (1 + math.cos(math.pi * (k - WARMUP) / (total - WARMUP)))


def no_decay(name: str, p: Tensor) -> bool:
    """timm's rule, as a user writes it for a plain model."""
    return p.ndim <= 1 or name.endswith(".bias") or name in NO_WD


def groups(named: list[tuple[str, Tensor]], rule: Callable[[str, Tensor], bool]) -> list[dict]:
    return [
        {"params": [p for n, p in named if not rule(n, p)], "weight_decay": WD},
        {"params": [p for n, p in named if rule(n, p)], "weight_decay": 0.0},
    ]


def stacked_adamw(ens: vmapens.Ensemble) -> Any:
    """The split read on the template (a member's ndim), tensors taken from the ensemble."""
    named = [(n, ens.get_parameter(n)) for n, p in ens.template.named_parameters() if p.ndim]
    rule = {n for n, p in ens.template.named_parameters() if no_decay(n, p)}
    gs = groups(named, lambda n, p: n in rule)
    return vmapens.StackedAdam(gs, lr=LRS, decoupled_weight_decay=True)


def train_alone(
    models: list[nn.Module], batches: list[Any], rng: list[Tensor] | None, total: int = STEPS
) -> None:
    """The naive loop: AdamW over timm's groups, LambdaLR per step, label smoothing, clipping."""
    for i, m in enumerate(models):
        opt = torch.optim.AdamW(groups(list(m.named_parameters()), no_decay), lr=LRS[i])
        sched = torch.optim.lr_scheduler.LambdaLR(opt, functools.partial(warm_cosine, total=total))
        m.train()
        for k, (x, y) in enumerate(batches):
            if rng is not None:
                torch.set_rng_state(rng[k])
            opt.zero_grad()
            CRIT(m(x), y).backward()
            nn.utils.clip_grad_norm_(m.parameters(), CLIP)
            opt.step()
            sched.step()


def assert_members(ens: vmapens.Ensemble, models: list[nn.Module]) -> None:
    for i, m in enumerate(models):
        got, want = ens[i].state_dict(), m.state_dict()
        assert list(got) == list(want)
        for k in want:
            torch.testing.assert_close(got[k], want[k], **TOL, msg=f"member {i} {k}")


def step_run(ens: vmapens.Ensemble, batches: list[Any]) -> list[Tensor]:
    """The researcher's loop with `make_step`; returns the RNG state each step started from."""
    opt = stacked_adamw(ens)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warm_cosine)
    step = vmapens.make_step(ens, CRIT, opt, clip_grad_norm=CLIP)
    rng = []
    for x, y in batches:
        rng.append(torch.get_rng_state())
        step(x, y)
        sched.step()
    return rng


@pytest.mark.parametrize(
    "model, options",
    [
        (dict(dp=0.3, ad=0.2), dict()),  # timm's drop_path and SDPA's attention dropout
        (dict(dp=0.3, attn="mha", ad=0.2), dict(backend="loop")),
        (dict(dp=0.3, how="rand"), dict(chunk_size=2)),
    ],
    ids=["sdpa-vmap", "mha-loop", "rand-rewrite-chunked"],
)
def test_make_step_with_stochastic_depth_same_randomness_each_member_as_alone(
    model: dict, options: dict
) -> None:
    torch.manual_seed(0)
    ens = vmapens.Ensemble(
        functools.partial(ViT, **model), n=N, seed=0, randomness="same", **options
    )
    models, batches = ens.unstack(), data()
    rng = step_run(ens, batches)
    train_alone(models, batches, rng)
    assert_members(ens, models)


def test_timm_drop_path_with_different_randomness_draws_a_mask_per_member() -> None:
    """`x.new_empty(...)` of a member's tensor is batched: each member draws its own samples'
    keep flags (as alone, in distribution), at the rate `keep_prob`; a DropPath on an input
    every member shares, and `torch.empty(...).bernoulli_()`, are refused naming the ways out."""

    class Scaled(nn.Module):
        def __init__(self, how: str) -> None:
            super().__init__()
            self.w, self.drop = nn.Parameter(torch.ones(1)), DropPath(0.25, how)

        def forward(self, x: Tensor) -> Tensor:
            return self.drop(x * self.w)

    torch.manual_seed(0)
    for how in ("bernoulli", "rand"):
        out = vmapens.Ensemble(functools.partial(Scaled, how), n=64, seed=0)(torch.ones(100, 1))
        kept = out != 0
        assert not torch.equal(kept[0], kept[1])
        assert abs(kept.double().mean().item() - 0.75) < 0.02
        torch.testing.assert_close(out[kept], torch.full_like(out[kept], 1 / 0.75))
    for how, x in (("empty", torch.ones(100, 1)), ("bernoulli", torch.ones(100, 1))):
        drop = vmapens.Ensemble(functools.partial(DropPath, 0.25, how), n=3, seed=0)
        with pytest.raises(RuntimeError, match="in place into a tensor it made") as err:
            drop(x)
        assert "randomness='same'" in str(err.value) and "backend='loop'" in str(err.value)


def test_fit_timm_recipe_each_member_as_alone() -> None:
    torch.manual_seed(0)
    ens = vmapens.Ensemble(functools.partial(ViT, attn="mha"), n=N, seed=0)
    models = ens.unstack()
    x, y = (torch.cat(t) for t in zip(*data()))
    total = 3  # one epoch of 3 batches
    sched = LRScheduler(
        lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, warm_cosine), interval="step"
    )
    vmapens.fit(ens, (x, y), CRIT, optimizer=stacked_adamw, callbacks=[sched],
                batch_size=B, shuffle=False, clip_grad_norm=CLIP, progress=False, seed=0)  # fmt: skip
    batches = [(x[k : k + B], y[k : k + B]) for k in range(0, len(x), B)]
    train_alone(models, batches, None, total)
    assert_members(ens, models)


def test_predict_at_another_image_size_interpolates_each_members_position_embedding() -> None:
    """Trained at 8x8 with DropPath, evaluated on 12x12 (a 3x3 grid: bicubic resize of each
    member's own 2x2 position grid) and one more step at 12x12 (gradient through the resize)."""
    torch.manual_seed(0)
    ens = vmapens.Ensemble(functools.partial(ViT, dp=0.3), n=N, seed=0, randomness="same")
    models, batches = ens.unstack(), data()
    rng = step_run(ens, batches)
    train_alone(models, batches, rng)
    big = torch.randn(5, 3, 12, 12)
    got = vmapens.predict(ens, big, softmax=True)
    assert ens.training  # mode back
    for i, m in enumerate(models):
        m.eval()
        with torch.no_grad():
            torch.testing.assert_close(got[i], m(big).softmax(-1), **TOL)
    ens2 = vmapens.Ensemble(ViT, n=N, seed=1)
    models2, big_batches = ens2.unstack(), data(2, side=12, seed=1)
    step_run(ens2, big_batches)
    train_alone(models2, big_batches, None)
    assert_members(ens2, models2)


def test_timm_no_decay_rule_on_stacked_tensors_decays_norms_and_layerscale() -> None:
    """Documented (docs/optim.md): `p.ndim <= 1` over `ens.named_parameters()` sees the member
    dim, so LayerNorm weights and LayerScale's `gamma` land in the decay group (biases and the
    names in `no_wd` are still caught by name); `p.ndim <= 2` on the stacked tensors, or the
    template's split, is the member's own."""
    ens = vmapens.Ensemble(ViT, n=N, seed=0)
    alone = {n for n, p in ViT().named_parameters() if no_decay(n, p)}
    stacked = {n for n, p in ens.named_parameters() if no_decay(n, p)}
    lost = alone - stacked
    assert lost and all(n.endswith((".weight", ".gamma")) for n in lost)
    assert {n.rsplit(".", 2)[-2] for n in lost} == {"norm1", "norm2", "ls1", "ls2", "norm"}
    fixed = {
        n for n, p in ens.named_parameters()
        if p.ndim <= 2 or n.endswith(".bias") or n in NO_WD
    }  # fmt: skip
    assert fixed == alone


def test_member_files_load_into_a_plain_vit(tmp_path: Any) -> None:
    torch.manual_seed(0)
    ens = vmapens.Ensemble(functools.partial(ViT, dp=0.3), n=N, seed=0, randomness="same")
    models, batches = ens.unstack(), data()
    rng = step_run(ens, batches)
    train_alone(models, batches, rng)
    paths = vmapens.save_members(ens, tmp_path / "members")
    x = torch.randn(2, 3, 8, 8)
    for i, path in enumerate(paths):
        plain = ViT(dp=0.3)
        plain.load_state_dict(torch.load(path))
        plain.eval(), models[i].eval()
        with torch.no_grad():
            torch.testing.assert_close(plain(x), models[i](x), **TOL)


def test_stochastic_depth_rate_sweep_is_refused_and_a_per_member_buffer_runs_as_alone() -> None:
    """A drop-path rate drawn per member is refused at build, naming the attribute; the way out
    it names, a buffer the forward reads, draws as alone with the `torch.rand(...) < keep`
    rewrite under "same", and `bernoulli_(buffer)` is refused under "same" (vmap cannot draw
    with per-member probabilities there) naming `backend="loop"`, where it runs as alone."""
    with pytest.raises(ValueError, match=r"blocks\.1\.drop_path1.*drop_prob.*0\.2 vs 0\.1"):
        vmapens.Ensemble.from_factories([functools.partial(ViT, dp=r) for r in (0.1, 0.2)])

    class Swept(nn.Module):
        def __init__(self, p: float, how: str) -> None:
            super().__init__()
            self.w, self.how = nn.Parameter(torch.ones(1)), how
            self.register_buffer("keep", torch.tensor(1 - p))

        def forward(self, x: Tensor) -> Tensor:
            x = x * self.w
            shape = (x.shape[0],) + (1,) * (x.ndim - 1)
            if self.how == "bernoulli":
                keep = x.new_empty(shape).bernoulli_(self.keep)
            else:
                keep = (torch.rand(shape) < self.keep).to(x.dtype)
            return x.div(self.keep) * keep

    x = torch.ones(50, 1)
    for how, options in (("rand", {}), ("bernoulli", {"backend": "loop"})):
        members = [Swept(p, how) for p in (0.1, 0.5, 0.9)]
        ens = vmapens.Ensemble.from_modules(members, randomness="same", **options)
        state = torch.get_rng_state()
        out = ens(x)
        for i, m in enumerate(members):
            torch.set_rng_state(state)
            torch.testing.assert_close(out[i], m(x), rtol=0, atol=0)
    ens = vmapens.Ensemble.from_modules(
        [Swept(p, "bernoulli") for p in (0.1, 0.5)], randomness="same"
    )
    with pytest.raises(RuntimeError, match="member's own parameters") as err:
        ens(x)
    assert "backend='loop'" in str(err.value)


def test_drop_path_rate_set_on_the_template_per_step_and_per_member_images() -> None:
    """timm-style schedule of the drop-path rate (set on `ens.template` before each step, as on
    the plain module) with each member's own augmented images (`in_dims=0`)."""
    torch.manual_seed(0)
    ens = vmapens.Ensemble(functools.partial(ViT, dp=0.3), n=N, seed=0, randomness="same")
    models = ens.unstack()
    g = torch.Generator().manual_seed(3)
    batches = [
        (torch.randn(N, B, 3, 8, 8, generator=g), torch.randint(3, (N, B), generator=g))
        for _ in range(STEPS)
    ]
    opt = stacked_adamw(ens)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warm_cosine)
    step = vmapens.make_step(ens, CRIT, opt, clip_grad_norm=CLIP, in_dims=0)
    rng = []
    for k, (x, y) in enumerate(batches):
        ens.template.blocks[1].drop_path1.drop_prob = 0.3 * (k + 1) / STEPS
        rng.append(torch.get_rng_state())
        step(x, y)
        sched.step()
    for i, m in enumerate(models):
        opt_i = torch.optim.AdamW(groups(list(m.named_parameters()), no_decay), lr=LRS[i])
        sched_i = torch.optim.lr_scheduler.LambdaLR(opt_i, warm_cosine)
        for k, (x, y) in enumerate(batches):
            m.blocks[1].drop_path1.drop_prob = 0.3 * (k + 1) / STEPS
            torch.set_rng_state(rng[k])
            opt_i.zero_grad()
            CRIT(m(x[i]), y[i]).backward()
            nn.utils.clip_grad_norm_(m.parameters(), CLIP)
            opt_i.step()
            sched_i.step()
    assert_members(ens, models)
