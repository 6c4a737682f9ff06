"""Runs kdpemb benchmarks and prints their figures and ratios.

Usage:
    python -m benchmarks accounting          # a table
    python -m benchmarks accounting --json   # one JSON object
    python -m benchmarks all --quick         # every benchmark, smaller sizes
    python -m benchmarks fedemb --quick      # DP-FedEmb utility and speed, smoke
    python -m benchmarks dp_sgd --quick      # DPModel against non-private steps
    python -m benchmarks scale --quick       # a round on 1, 2, 4 processes,
                                             # DPModel on 1 and 2 devices
    python -m benchmarks user_level --quick  # user-level DP against group privacy
"""

import argparse
import importlib
import json
import platform
import sys
import time

BENCHMARKS = {
    "accounting": "benchmarks.accounting",
    "data": "benchmarks.data_pipeline",
    "dp_sgd": "benchmarks.dp_sgd",
    "fedemb": "benchmarks.fedemb",
    "last_layer": "benchmarks.last_layer",
    "scale": "benchmarks.scale",
    "user_level": "benchmarks.user_level",
    "verification": "benchmarks.verification",
}


def machine():
    import os

    return {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "keras_backend": os.environ.get("KERAS_BACKEND", "tensorflow"),
    }


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m benchmarks")
    parser.add_argument("name", choices=[*BENCHMARKS, "all"])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument(
        "--quick", action="store_true", help="smaller sizes (smoke test)"
    )
    args = parser.parse_args(argv)
    names = list(BENCHMARKS) if args.name == "all" else [args.name]
    results = {"machine": machine()}
    for name in names:
        start = time.perf_counter()
        module = importlib.import_module(BENCHMARKS[name])
        results[name] = module.run(quick=args.quick)
        results[name]["seconds"] = round(time.perf_counter() - start, 1)
    if args.json:
        print(json.dumps(results, indent=2))
        return 0
    from rich.console import Console
    from rich.table import Table

    console = Console()
    console.print(f"machine: {results['machine']}")
    for name in names:
        for section in ("figures", "ratios"):
            table = Table(title=f"{name}: {section}", title_justify="left")
            table.add_column("measure")
            table.add_column("value", justify="right")
            for key, value in results[name][section].items():
                table.add_row(
                    key, f"{value:.4g}" if isinstance(value, float) else str(value)
                )
            console.print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
