"""``python -m vmapens demo``: the main job (the benchmarks are ``python -m bench`` in a checkout)."""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
from torch import Tensor, nn

import vmapens
from vmapens.callbacks import EarlyStopping


def mlp() -> nn.Sequential:
    """Workload A member (as in the benchmarks): ``Linear(2, 20) -> Linear(20, 1) -> sigmoid``."""
    return nn.Sequential(nn.Linear(2, 20), nn.Linear(20, 1), nn.Sigmoid())


def workload_a(n: int = 15, steps: int = 1000) -> None:
    """Workload A: n MLPs 2->20->1, BCELoss, Adam, one batch of 5, naive loop vs Ensemble."""
    torch.manual_seed(0)  # the batch too: the same figures at every run
    x, y = torch.randn(5, 2), torch.ones(5, 1)
    twins = [mlp() for _ in range(n)]
    eager = vmapens.Ensemble.from_modules(twins)
    compiled = vmapens.Ensemble.from_modules(twins)

    start = time.perf_counter()
    for model in twins:  # the naive code: one model, one Adam, one loop at a time
        opt = torch.optim.Adam(model.parameters())
        for _ in range(steps):
            opt.zero_grad()
            nn.functional.binary_cross_entropy(model(x), y).backward()
            opt.step()
    naive = time.perf_counter() - start

    times = {}
    for name, ens in (("eager", eager), ("compiled", compiled)):
        stacked = vmapens.StackedAdam(ens)
        step = vmapens.make_step(ens, nn.BCELoss(), stacked, compile=name == "compiled")
        start = time.perf_counter()
        step(x, y)  # the compiled step compiles on its first call
        first = time.perf_counter() - start
        for _ in range(steps - 1):
            step(x, y)
        times[name] = (time.perf_counter() - start - first, first)

    print(f"Workload A: {n} MLPs 2->20->1, BCELoss, Adam, batch of 5, {steps} steps")
    print(f"  naive loop over models       : {naive:7.2f} s")
    for name, (rest, first) in times.items():
        per_step = rest / max(steps - 1, 1)
        print(
            f"  vmapens {name:9s} make_step: {rest + first:7.2f} s  "
            f"({_than(naive, rest + first)} overall; first step {first:.2f} s, then "
            f"{per_step * 1e3:.3f} ms/step: {_than(naive / steps, per_step)} per step)"
        )
    for name, ens in (("eager", eager), ("compiled", compiled)):
        diff = max(
            (a - b).abs().max().item()
            for member, twin in zip(ens.unstack(), twins, strict=True)
            for a, b in zip(member.state_dict().values(), twin.state_dict().values(), strict=True)
        )
        print(f"  largest |{name} member - twin trained alone| over all parameters: {diff:.2e}")


def _than(naive_s: float, ours_s: float) -> str:
    """``"N x faster"`` or ``"N x slower"`` than the naive loop, whichever is true.

    Three digits below 10x, so that 3% slower reads "1.03x slower", not "1.0x slower".
    """
    if ours_s <= naive_s:
        ratio, word = naive_s / ours_s, "faster"
    else:
        ratio, word = ours_s / naive_s, "slower"
    digits = 2 if ratio < 10 else 1
    return f"{ratio:.{digits}f}x {word} than the naive loop"


def sharded_demo(n: int = 8, epochs: int = 5) -> None:
    """n MLPs split over the processes torchrun started: fit per rank, gather on rank 0."""
    if "RANK" not in os.environ:
        raise SystemExit(
            "demo --sharded: start it with torchrun, e.g. "
            "torchrun --standalone --nproc-per-node 2 -m vmapens demo --sharded"
        )
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if cuda else "gloo")
    try:
        device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        g = torch.Generator().manual_seed(0)  # every rank sees the same data
        x = torch.randn(256, 2, generator=g)
        y = (x.sum(dim=1, keepdim=True) > 0).float()
        ens = vmapens.Ensemble(mlp, n, seed=0, shard=True).to(device)
        lrs = torch.logspace(-3, -1, n)  # one per member, for all n: each rank keeps its own
        history = vmapens.fit(ens, (x, y), nn.BCELoss(), epochs=epochs, batch_size=32, bootstrap=True,
                          lr=lrs, seed=0, progress=False)  # fmt: skip
        rank, world = dist.get_rank(), dist.get_world_size()
        print(f"rank {rank}/{world}: members {list(ens.member_ids)} of {ens.n_total}", flush=True)
        full = vmapens.gather(ens, dst=0)
        merged = vmapens.gather_history(history, dst=0)
        if rank == 0:
            assert full is not None and merged is not None  # rank 0 is `dst`
            print(f"gathered on rank 0: {len(full)} members, ids {list(full.member_ids)}")
            for i, loss in zip(merged.member_ids, merged.train_loss[-1].tolist()):
                print(f"  member {i}: lr {lrs[i].item():.4f}  final training loss {loss:.4f}")
    finally:
        dist.destroy_process_group()


def _digits(skipped: str) -> tuple[tuple[Tensor, Tensor], ...] | None:
    """scikit-learn's digits (bundled: no download), shuffled, as train/val/test (60/20/20)."""
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        print(f"{skipped}: it needs scikit-learn: pip install 'vmapens[examples]'")
        return None
    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16
    y = torch.tensor(digits.target)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    x, y = x[order], y[order]
    a, b = int(0.6 * len(x)), int(0.8 * len(x))
    return (x[:a], y[:a]), (x[a:b], y[a:b]), (x[b:], y[b:])


def member() -> nn.Module:
    """The digits member: an MLP 64 -> 32 -> 10."""
    return nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))


def digits(n: int = 32, plot: str = "vmapens-history.png") -> None:
    """Real data: n small MLPs on scikit-learn's digits, bagging and early stopping."""
    splits = _digits("Digits case skipped")
    if splits is None:
        return
    train, val, test = splits
    a = len(train[0])

    ens = vmapens.Ensemble(member, n=n, seed=0)
    start = time.perf_counter()
    history = vmapens.fit(
        ens,
        train,
        nn.CrossEntropyLoss(),
        epochs=60,
        batch_size=128,
        lr=1e-2,
        bootstrap=True,  # bagging: each member its own resample of the training split
        val_data=val,
        patience=5,  # each member stops on its own; best-epoch weights restored
        seed=0,
    )
    seconds = time.perf_counter() - start
    ens.eval()
    with torch.no_grad():
        logits = ens(test[0])  # [n, samples, 10]
    member_acc = (logits.argmax(-1) == test[1]).float().mean(1)
    averaged = (logits.softmax(-1).mean(0).argmax(-1) == test[1]).float().mean().item()
    stopped = history.stopped_epoch.masked_fill(history.stopped_epoch < 0, history.epochs - 1)
    print(f"\nDigits: {n} MLPs 64->32->10 on {a} bootstrap-resampled images, early stopping")
    print(
        f"  trained in {seconds:.1f} s; members stopped after epochs "
        f"{int(stopped.min()) + 1}..{int(stopped.max()) + 1}"
    )
    print(
        f"  test accuracy of single members: min {member_acc.min():.3f}, "
        f"median {member_acc.median():.3f}, max {member_acc.max():.3f}"
    )
    print(f"  test accuracy of the averaged ensemble: {averaged:.3f}")
    try:
        history.plot(plot, title=f"{n} MLPs on digits (bagging, early stopping)")
        print(f"  loss curves written to {os.path.abspath(plot)}")
    except ImportError as err:
        print(f"  no plot: {err}")


def sweep_demo(n: int = 16, epochs: int = 24, k: int = 5) -> None:
    """A learning-rate sweep with population-based training on digits, then the top k."""
    splits = _digits("The sweep demo is skipped")
    if splits is None:
        return
    train, val, test = splits

    def accuracy(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return (out.argmax(-1) == target).float().mean()

    ens = vmapens.Ensemble(member, n=n, seed=0)
    lrs = torch.logspace(-4, -0.5, n)
    opt = vmapens.StackedAdam(ens, lr=lrs)
    pbt = vmapens.pbt.PBT(interval=4, fraction=0.25, monitor="val_acc", mode="max", seed=0)
    stopper = EarlyStopping("val_acc", "max")  # restores each member's best epoch at the end
    start = time.perf_counter()
    vmapens.fit(ens, train, nn.CrossEntropyLoss(), epochs=epochs, batch_size=128,
                optimizer=opt, val_data=val, metrics={"acc": accuracy}, seed=0,
                progress=False, callbacks=[stopper, pbt])  # fmt: skip
    seconds = time.perf_counter() - start
    final = opt.param_groups[0]["lr"]
    # Ranked by the stopper's best values (lower is better: -accuracy here), which follow PBT's
    # copies as the restored members do; a copied member's history column keeps its own past.
    best = int(stopper.best_val.argmin())
    best_acc = -float(stopper.best_val[best])
    print(f"\nSweep: {n} MLPs on digits, lr {lrs[0]:.1e}..{lrs[-1]:.1e}, PBT every 4 epochs")
    print(f"  trained {epochs} epochs in {seconds:.1f} s; {len(pbt.log)} exploit/explore rounds")
    print(f"  best member: {best} (lr now {final[best]:.2e}), val accuracy {best_acc:.3f}")
    top = vmapens.selection.best_k(ens, stopper.best_val, k)
    probs = vmapens.predict(top, test[0], reduce="mean", softmax=True)
    member_acc = vmapens.predict(top, test[0]).argmax(-1).eq(test[1]).float().mean(1)
    print(f"  test accuracy of the top {k} members: {member_acc.min():.3f}..{member_acc.max():.3f}")
    print(f"  test accuracy of their averaged ensemble: {accuracy(probs, test[1]):.3f}")


def _steps(text: str) -> int:
    """argparse type for ``--steps``: an int >= 2, as workload A times its first step (the
    compile) apart from the rest and divides by their number."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 2, got {text!r}") from None
    if value < 2:
        raise argparse.ArgumentTypeError(
            f"expected an integer >= 2 (the first step is timed apart), got {value}"
        )
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vmapens", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="workload A (naive loop vs Ensemble) and a real-data case")
    demo.add_argument(
        "--steps",
        type=_steps,
        default=None,
        help="training steps of workload A (default 1000; not with --sharded or --sweep)",
    )
    # One demo per run: with both flags, one of them would be dropped without a word.
    which = demo.add_mutually_exclusive_group()
    which.add_argument(
        "--sharded",
        action="store_true",
        help="split the members over torchrun's processes (docs/distributed.md)",
    )
    which.add_argument(
        "--sweep",
        action="store_true",
        help="an lr sweep with population-based training on digits, then the top-k ensemble",
    )
    # The benchmark suite is not part of the installed package (0.3.0): say where it went.
    # No -h of its own: `bench --help` gets the message below, not an empty usage line.
    sub.add_parser(
        "bench",
        help="moved: run `python -m bench` in a checkout of the repository",
        add_help=False,
    )
    args, _ = parser.parse_known_args(argv)
    if args.command == "bench":
        print(
            "python -m vmapens bench: the benchmark suite moved out of the installed package in "
            "0.3.0; from a checkout of the repository run `python -m bench` with the same options",
            file=sys.stderr,
        )
        return 2
    args = parser.parse_args(argv)
    if args.steps is not None and (args.sharded or args.sweep):
        flag = "--sharded" if args.sharded else "--sweep"
        demo.error(f"argument --steps: not allowed with {flag} (only workload A takes steps)")

    if args.command == "demo" and args.sharded:
        sharded_demo()
        return 0
    if args.command == "demo" and args.sweep:
        sweep_demo()
        return 0
    workload_a(steps=1000 if args.steps is None else args.steps)
    digits()
    return 0


if __name__ == "__main__":
    sys.exit(main())
