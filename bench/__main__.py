"""``python -m bench``: time vmapens against the naive loop and hand-merged models.

Run from a checkout of the repository (the benchmark suite is not in the installed wheel).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from . import DEFAULT_SIZES, QUICK_REAL_N, QUICK_SIZES, REAL_N, WORKLOADS, format_table, run
from .memory import BUILD_N, TRAIN_N
from .run import OptionError


def _positive_int(text: str) -> int:
    """argparse type: an int >= 1 (a size or a thread count of 0 or less means nothing)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _json_path(text: str) -> Path:
    """argparse type: a file whose folder exists, checked before a run that can take minutes."""
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"expected a file name, got the folder {text!r}")
    folder = path.parent
    if not folder.is_dir() or not os.access(folder, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(
            f"the folder {str(folder)!r} of {text!r} does not exist or is not writable"
        )
    return path


def _write_json(path: Path, results: dict) -> None:
    """Write `results` to `path` whole or not at all: a temporary file beside it (opened as any
    file is, so the umask sets its mode), then renamed, so a failure (a value json cannot encode,
    a full disk) leaves no half-written file."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w") as f:
            json.dump(results, f, indent=2)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    parser.add_argument(
        "--device", default="cpu", choices=["cpu", "cuda"], help="cuda needs a GPU torch can see"
    )
    sizes = " ".join(map(str, DEFAULT_SIZES))
    parser.add_argument(
        "--sizes",
        type=_positive_int,
        nargs="+",
        default=None,
        help=f"N for workload A (default {sizes}; not with --quick, which uses "
        f"{' '.join(map(str, QUICK_SIZES))})",
    )
    parser.add_argument(
        "--workloads",
        nargs="+",
        default=None,
        choices=WORKLOADS,
        help="what to time (default: all, or a quick subset with --quick); A: tiny MLPs; B: "
        "128 heads; optim: the optimizer step alone; cnn/transformer/gru/lstm: real models; "
        "result: time to result of workload A in fresh processes; compile: first compiled "
        "step, cold and warm caches; optimizers: every stacked optimizer's step vs torch.optim; "
        "widths: 4 widths x 8 seeds in one padded ensemble vs the loop and 4 ensembles",
    )
    parser.add_argument(
        "--real-n",
        type=_positive_int,
        default=None,
        help=f"N for cnn/transformer/gru/lstm (default {REAL_N}; not with --quick, which uses "
        f"{QUICK_REAL_N})",
    )
    parser.add_argument(
        "--json", type=_json_path, default=None, help="also write the results to this file"
    )
    parser.add_argument("--quick", action="store_true", help="tiny sizes, a CI smoke test")
    parser.add_argument("--threads", type=_positive_int, default=None, help="torch.set_num_threads")
    parser.add_argument(
        "--memory",
        action="store_true",
        help="also measure the memory of building 64 members of a 1M-param MLP and of training "
        f"{TRAIN_N} CNN members (subprocesses), and the time to build workload A's MLP "
        f"{BUILD_N} times",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    # Quick mode times its own sizes: refuse what it would silently ignore.
    for flag, value in (("--sizes", args.sizes), ("--real-n", args.real_n)):
        if args.quick and value is not None:
            parser.error(f"argument {flag}: not allowed with --quick (it times its own sizes)")
    options: dict = {
        "device": args.device,
        "quick": args.quick,
        "threads": args.threads,
        "memory": args.memory,
        # A full run takes minutes: say what is being timed, on stderr (stdout is the table).
        "log": lambda line: print(line, file=sys.stderr, flush=True),
    }
    if args.sizes is not None:
        options["sizes"] = tuple(dict.fromkeys(args.sizes))
    if args.workloads is not None:
        options["workloads"] = tuple(dict.fromkeys(args.workloads))
    if args.real_n is not None:
        options["real_n"] = args.real_n
    try:
        results = run(**options)
    except OptionError as err:  # refused before anything ran: a usage error, not a crash
        parser.error(str(err))
    print(format_table(results))
    if args.json is not None:
        _write_json(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
