"""Training scenarios for the distributed tests: run alone, or on each rank under torchrun.

``python -m torch.distributed.run --nproc-per-node 2 tests/dist_worker.py SCENARIO OUT``
runs ``SCENARIO`` sharded over the launched ranks and writes its results under ``OUT``;
the test process imports the same functions to run them in one process and compares.
"""

from __future__ import annotations

import io
import json
import os
import signal
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import vmapens  # noqa: E402

SEED = 100
STEPS = 6
EPOCHS, BATCH = 4, 4
D_IN, D_OUT, ROWS = 4, 2, 16


def factory() -> nn.Module:
    return nn.Sequential(nn.Linear(D_IN, 8), nn.Tanh(), nn.Linear(8, D_OUT)).double()


def learning_rates(n: int) -> list[float]:
    return [1e-3 * (i + 1) for i in range(n)]


def data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return (
        torch.randn(ROWS, D_IN, generator=g, dtype=torch.float64),
        torch.randn(ROWS, D_OUT, generator=g, dtype=torch.float64),
    )


def validation() -> tuple[torch.Tensor, torch.Tensor]:
    """Shared validation rows: History's val_loss and metrics must match to the bit too."""
    g = torch.Generator().manual_seed(1)
    return (
        torch.randn(ROWS, D_IN, generator=g, dtype=torch.float64),
        torch.randn(ROWS, D_OUT, generator=g, dtype=torch.float64),
    )


def mae(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (out - target).abs().mean()


def bootstrap(ids: range) -> torch.Tensor:
    """Member i's resample of the rows, keyed by its global id: [len(ids), ROWS]."""
    return torch.stack(
        [
            torch.randint(0, ROWS, (ROWS,), generator=torch.Generator().manual_seed(SEED + i))
            for i in ids
        ]
    )


def train_steps(n: int, shard: bool) -> vmapens.Ensemble:
    """make_step with per-member bootstrap rows and per-member learning rates."""
    ens = vmapens.Ensemble(factory, n, seed=SEED, shard=shard)
    # Per-member values for all n members: StackedAdam keeps this rank's block of them.
    opt = vmapens.StackedAdam(ens, lr=learning_rates(n), eps=torch.full((n,), 1e-8))
    step = vmapens.make_step(ens, nn.MSELoss(), opt, in_dims=0)
    x, y = data()
    rows = bootstrap(ens.member_ids)
    for _ in range(STEPS):
        step(x[rows], y[rows])
    return ens


def fit(
    n: int,
    shard: bool,
    checkpoint: Path | None = None,
    loss_fn=None,
    callbacks=(),
    progress=False,
    epochs: int = EPOCHS,
):
    """ens.fit with bagging, per-member learning rates, shuffled mini-batches, validation."""
    ens = vmapens.Ensemble(factory, n, seed=SEED, shard=shard)
    history = vmapens.fit(
        ens,
        data(),
        loss_fn or nn.MSELoss(),
        epochs=epochs,
        batch_size=BATCH,
        bootstrap=True,
        lr=learning_rates(n),
        seed=SEED,
        val_data=validation(),
        metrics={"mae": mae},
        progress=progress,
        checkpoint=checkpoint,
        callbacks=callbacks,
        check=False,  # the first step's self-check would call FailOnce's counted loss too
    )
    return ens, history


class FailOnce:
    """MSELoss that makes this process die mid-way through epoch 2, on the first attempt only.

    ``kill``: die by SIGKILL (no exception handler, no cleanup) instead of raising.
    """

    def __init__(self, kill: bool = False) -> None:
        self.calls, self.kill = 0, kill

    def __call__(self, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        # One call per step (traced once under vmap); validation calls it without grad.
        self.calls += torch.is_grad_enabled()
        if self.calls == ROWS // BATCH + 2:
            if self.kill:
                os.kill(os.getpid(), signal.SIGKILL)
            raise RuntimeError("dist_worker: injected failure in epoch 2")
        return nn.functional.mse_loss(out, target)


def main(scenario: str, out: Path) -> None:
    dist.init_process_group("gloo")
    me = dist.get_rank()
    if scenario == "main":
        report = {}
        for n in (8, 7):
            ens = train_steps(n, shard=True)
            report[n] = [ens.member_ids.start, ens.member_ids.stop, ens.n_total]
            full = vmapens.gather(ens, dst=0)
            if me == 0:
                assert full is not None and list(full.member_ids) == list(range(n))
                torch.save(full.state_dict(), out / f"steps{n}.pt")
            else:
                assert full is None
        try:
            vmapens.Ensemble(factory, 1, seed=SEED, shard=True)
        except ValueError as err:
            report["too_many_ranks"] = str(err)
        (out / f"rank{me}.json").write_text(json.dumps(report))
        bar = io.StringIO()  # only rank 0 draws; it shows totals over both ranks
        ens, history = fit(8, shard=True, progress=bar)
        (out / f"progress.rank{me}.txt").write_text(bar.getvalue())
        vmapens.save_members(ens, out / "members")
        write_fit(ens, history, out / "fit.pt")
    elif scenario == "fault":
        fail = os.environ.get("VMAPENS_TEST_FAIL_RANK") == str(me)
        first_attempt = os.environ["TORCHELASTIC_RESTART_COUNT"] == "0"
        loss_fn = FailOnce() if fail and first_attempt else None
        epochs_run: list[int] = []
        ens, history = fit(
            8,
            shard=True,
            checkpoint=out / "ckpt.pt",
            loss_fn=loss_fn,
            callbacks=[lambda h: epochs_run.append(h.epochs)],
        )
        attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
        (out / f"attempt{attempt}.rank{me}.json").write_text(json.dumps(epochs_run))
        write_fit(ens, history, out / "fit.pt")
    elif scenario == "killed":  # rank 1 is killed in epoch 2; no restart
        loss_fn = FailOnce(kill=True) if me == 1 else None
        fit(8, shard=True, checkpoint=out / "ckpt.pt", loss_fn=loss_fn)
    elif scenario == "partial":  # the first epochs only, then stop
        fit(8, shard=True, checkpoint=out / "ckpt.pt", epochs=2)
    elif scenario == "resume":  # each checkpoint named in the environment, to the end
        for ckpt in os.environ["VMAPENS_TEST_CKPTS"].split(os.pathsep):
            epochs_run: list[int] = []
            callbacks = [lambda h, run=epochs_run: run.append(h.epochs)]
            ens, history = fit(8, shard=True, checkpoint=Path(ckpt), callbacks=callbacks)
            Path(f"{ckpt}.epochs.rank{me}.json").write_text(json.dumps(epochs_run))
            write_fit(ens, history, Path(ckpt + ".fit.pt"))
    else:
        raise SystemExit(f"dist_worker: unknown scenario {scenario!r}")
    dist.barrier()
    dist.destroy_process_group()


def write_fit(ens: vmapens.Ensemble, history, path: Path) -> None:
    """Gather the ensemble and its history onto rank 0 and save them there."""
    full = vmapens.gather(ens, dst=0)
    merged = vmapens.gather_history(history, dst=0)
    if dist.get_rank() == 0:
        torch.save({"state": full.state_dict(), "history": merged.state_dict()}, path)


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(sys.argv[1], Path(sys.argv[2]))
    # The work is done and the group destroyed. Skip interpreter finalization: gloo's C++
    # threads can still release tensors then and abort the process ("terminate called without
    # an active exception", SIGABRT; pytorch/pytorch#179291), seen once in ~10 suite runs.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
