"""Audits the noisy clipped sum that every DP-SGD step releases, and DP-LS.

A white-box audit: the noisy sum of one DP-SGD step (kdpemb's
`clip_and_sum` + `add_gaussian_noise`) is released many times with and
without a canary gradient, each release is scored by its projection on the
canary's direction, and the counts give an ε lower bound at 95%
confidence. The same is done for one DP-LS step of `LastLayerDPClassifier`.
Each audit runs twice: on the real mechanism (its bound must stay below
the claimed ε) and on a broken copy whose noise is divided by 10 (its
bound must exceed it: the audit catches the bug).

Run: python examples/audit_dp_sgd.py [--quick] [--json]
"""

import argparse
import contextlib
import json
import time

from kdpemb import audit
from kdpemb.privacy import gaussian_sum, host_noise

DELTA = 1e-5


@contextlib.contextmanager
def noise_divided_by_10():
    """Patches kdpemb's noise functions to draw a tenth of the noise."""
    saved = [
        (module, name, getattr(module, name))
        for module, name in (
            (gaussian_sum, "gaussian_noise"),
            (host_noise, "gaussian_noise"),
            (host_noise, "symmetric_noise"),
        )
    ]
    weak = {
        (gaussian_sum, "gaussian_noise"): lambda real: (
            lambda *a: [n / 10 for n in real(*a)]
        ),
    }
    for module, name, real in saved:
        patch = weak.get((module, name), lambda real: lambda *a: real(*a) / 10)
        setattr(module, name, patch(real))
    try:
        yield
    finally:
        for module, name, real in saved:
            setattr(module, name, real)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer trials")
    parser.add_argument("--json", action="store_true", help="one JSON line per audit")
    args = parser.parse_args()
    scale = 1 if args.quick else 5
    audits = {
        "Gaussian sum (DP-SGD step), z = 2": lambda: audit.audit_gaussian_sum(
            2.0, DELTA, trials=2000 * scale
        ),
        "LastLayerDPClassifier dp-ls, z = 2": lambda: audit.audit_last_layer_dp_ls(
            2.0, DELTA, trials=1200 * scale
        ),
    }
    for name, run in audits.items():
        start = time.perf_counter()
        real = run()
        with noise_divided_by_10():
            broken = run()
        row = {
            "mechanism": name,
            "claimed_epsilon": round(real.claimed_epsilon, 3),
            "lower_bound": round(real.epsilon_lower_bound, 3),
            "broken_lower_bound": round(broken.epsilon_lower_bound, 3),
            "trials": real.trials,
            "confidence": real.confidence,
            "seconds": round(time.perf_counter() - start, 1),
        }
        if args.json:
            print(json.dumps(row))
        else:
            print(
                f"{name}: claimed ε = {row['claimed_epsilon']}, audited lower "
                f"bound {row['lower_bound']} (noise / 10: "
                f"{row['broken_lower_bound']}), {real.trials} trials, "
                f"{real.confidence:.0%} confidence"
            )


if __name__ == "__main__":
    main()
