"""``python -m bench``: time vmapens against the naive loop and hand-merged models.

Run from a checkout of the repository (the benchmark suite is not in the installed wheel).
"""

from __future__ import annotations

import argparse
import json
import sys

from . import WORKLOADS, format_table, run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--sizes", type=int, nargs="+", default=None, help="N for workload A")
    parser.add_argument(
        "--workloads",
        nargs="+",
        default=None,
        choices=WORKLOADS,
        help="what to time (default: all, or a quick subset with --quick); optim: the optimizer "
        "step alone; cnn/transformer/gru/lstm: real models; result: time to result of "
        "workload A in fresh processes; compile: first compiled step, cold and warm caches; "
        "widths: 4 widths x 8 seeds in one padded ensemble vs the loop and 4 ensembles",
    )
    parser.add_argument(
        "--real-n", type=int, default=None, help="N for cnn/transformer/gru/lstm (default 16)"
    )
    parser.add_argument("--json", default=None, help="also write the results to this file")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, a CI smoke test")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    parser.add_argument(
        "--memory", action="store_true", help="also measure building 64 members of a 1M-param MLP"
    )
    args = parser.parse_args(argv)
    options: dict = {
        "device": args.device,
        "quick": args.quick,
        "threads": args.threads,
        "memory": args.memory,
    }
    if args.sizes:
        options["sizes"] = tuple(args.sizes)
    if args.workloads:
        options["workloads"] = tuple(dict.fromkeys(args.workloads))
    if args.real_n:
        options["real_n"] = args.real_n
    results = run(**options)
    print(format_table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
