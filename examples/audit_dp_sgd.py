"""Audits each kdpemb mechanism, and broken copies of it, against its claim.

Runs every audit of `kdpemb.audit` on the real mechanism (its lower bound
must stay below the claimed ε) and on broken copies (noise divided by 10;
clipping removed, where the mechanism clips a gradient or an update),
whose bound must exceed it: the audit catches the bug. The mechanisms are
the Gaussian sum query, one DP-SGD step of `DPModel` (white-box) and its
final model after 4 steps (black-box), one `LastLayerDPClassifier` DP-SGD
step and DP-LS step, and one `FedEmbModel` round. Each audit is repeated
over `--seeds` seeds; the table shows the smallest real-to-claim margin
(largest real bound, smallest broken bound).

Run: python examples/audit_dp_sgd.py [--quick] [--seeds N] [--json]
(`--quick`: about 15 s on 2 CPU cores, either backend.)
"""

import argparse
import contextlib
import json
import time

import kdpemb  # noqa: F401  (before Keras: a quiet console)

# isort: split
import keras

from kdpemb import audit
from kdpemb.privacy import gaussian_sum, host_noise

DELTA = 1e-5
QUICK_NOTE = (
    "quick mode: half the trials and one seed, so the lower bounds are looser "
    "(the broken copies' still exceed the claim); run without --quick for the "
    "figures of docs/audit.md"
)


@contextlib.contextmanager
def patched(patches):
    """Sets `(module, name, make)` attributes to `make(real)`, then restores."""
    saved = [(module, name, getattr(module, name)) for module, name, _ in patches]
    for (module, name, make), (_, _, real) in zip(patches, saved, strict=True):
        setattr(module, name, make(real))
    try:
        yield
    finally:
        for module, name, real in saved:
            setattr(module, name, real)


def _tenth(real):
    return lambda *a, **k: real(*a, **k) / 10


def _unclipped(real):
    def factors(norms, clip_norm, mask=None):
        factor, finite = real(norms, clip_norm, mask)
        return keras.ops.cast(keras.ops.where(factor > 0, 1.0, 0.0), "float32"), finite

    return factors


BROKEN = {
    "noise / 10": [
        (gaussian_sum, "gaussian_noise", lambda real: lambda *a: [
            n / 10 for n in real(*a)]),
        (host_noise, "gaussian_noise", _tenth),
    ],
    "clipping removed": [(gaussian_sum, "clip_factors", _unclipped)],
}  # fmt: skip


def audits(quick):
    """name -> (run(seed), the broken variants that apply)."""
    n = 1 if quick else 2
    both = tuple(BROKEN)
    return {
        "Gaussian sum (DP-SGD step), z = 2": (
            lambda s: audit.audit_gaussian_sum(2.0, DELTA, trials=2000 * n, seed=s),
            both,
        ),
        "DPModel DP-SGD step, white-box, z = 2": (
            lambda s: audit.audit_dp_model(2.0, DELTA, trials=2000 * n, seed=s),
            both,
        ),
        "DPModel 4 DP-SGD steps, black-box, z = 4": (
            lambda s: audit.audit_dp_model(
                4.0, DELTA, mode="black-box", steps=4, trials=2000 * n, seed=s
            ),
            both,
        ),
        "LastLayerDPClassifier dp-sgd step, z = 2": (
            lambda s: audit.audit_last_layer_dp_sgd(
                2.0, DELTA, trials=2000 * n, seed=s
            ),
            both,
        ),
        "LastLayerDPClassifier dp-ls step, z = 2": (
            lambda s: audit.audit_last_layer_dp_ls(2.0, DELTA, trials=1200 * n, seed=s),
            ("noise / 10",),
        ),
        "FedEmbModel round, z = 2": (
            lambda s: audit.audit_fedemb_round(2.0, DELTA, trials=1000 * n, seed=s),
            both,
        ),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer trials")
    parser.add_argument("--seeds", type=int, default=None, help="default 1 / 3")
    parser.add_argument("--json", action="store_true", help="one JSON line per audit")
    args = parser.parse_args()
    seeds = range(args.seeds or (1 if args.quick else 3))
    if not args.json:
        print(
            f"auditing 6 mechanisms and their broken copies, {len(seeds)} "
            "seed(s) each: one line per mechanism as it finishes",
            flush=True,
        )
    for name, (run, broken) in audits(args.quick).items():
        start = time.perf_counter()
        real = [run(seed) for seed in seeds]
        row = {
            "mechanism": name,
            "backend": keras.backend.backend(),
            "claimed_epsilon": round(real[0].claimed_epsilon, 3),
            "lower_bound": round(max(r.epsilon_lower_bound for r in real), 3),
            "trials": real[0].trials,
            "confidence": real[0].confidence,
            "seeds": len(seeds),
        }
        for variant in broken:
            with patched(BROKEN[variant]):
                bounds = [run(seed).epsilon_lower_bound for seed in seeds]
            row[f"{variant} lower_bound"] = round(min(bounds), 3)
        row["seconds"] = round(time.perf_counter() - start, 1)
        if args.json:
            print(json.dumps(row), flush=True)
        else:
            broken_text = ", ".join(f"{v}: {row[f'{v} lower_bound']}" for v in broken)
            print(
                f"{name}: claimed ε = {row['claimed_epsilon']}, audited lower "
                f"bound {row['lower_bound']} ({broken_text}), {row['trials']} "
                f"trials, {row['confidence']:.0%} confidence, {len(seeds)} "
                f"seed(s), {row['seconds']} s",
                flush=True,
            )
    if args.quick and not args.json:
        print(QUICK_NOTE)


if __name__ == "__main__":
    main()
