"""Exact all-pairs Recall@FAR: pairs per second and peak memory.

For N = 10,000 and 50,000 embeddings of dimension 128 (1,000 identities
and 5,000, ten images each), measured in one run:

- `recall_at_far(far=(1e-3, 1e-2))` and `verification_roc(max_far=1e-2)`:
  seconds, pairs per second, and peak traced memory (`tracemalloc`, which
  sees NumPy's buffers);
- baseline: the float64 matrix products alone, in the same row blocks
  (what the exact method must at least do: scores are float64 products
  rounded to float32, so that duplicated embeddings tie exactly);
- ratios: time / baseline time, and peak memory / the N × N float32
  matrix that the blocked computation never holds.
"""

import time
import tracemalloc

import numpy as np

from kdpemb.metrics import recall_at_far, verification, verification_roc


def _embeddings(n, dim=128, per_identity=10, seed=0):
    rng = np.random.default_rng(seed)
    labels = np.repeat(np.arange(n // per_identity), per_identity)
    centres = rng.normal(size=(n // per_identity, dim)).astype(np.float32)
    noise = rng.normal(size=(n, dim)).astype(np.float32)
    return centres[labels] + 1.2 * noise, labels


def _matmul_only(unit):
    n = unit.shape[0]
    rows = max(1, verification._BLOCK_ELEMENTS // n)
    for start in range(0, n, rows):
        unit[start : start + rows] @ unit[start:].T


def _measure(function):
    tracemalloc.start()
    start = time.perf_counter()
    result = function()
    seconds = time.perf_counter() - start
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return result, seconds, peak


def run(quick=False):
    sizes = (2_000,) if quick else (10_000, 50_000)
    figures, ratios = {}, {}
    for n in sizes:
        x, labels = _embeddings(n)
        pairs = n * (n - 1) // 2
        unit = x.astype(np.float64)
        unit /= np.linalg.norm(unit, axis=1, keepdims=True)
        _, base_seconds, _ = _measure(lambda unit=unit: _matmul_only(unit))
        values, seconds, peak = _measure(
            lambda x=x, labels=labels: recall_at_far(x, labels, far=[1e-3, 1e-2])
        )
        _, roc_seconds, roc_peak = _measure(
            lambda x=x, labels=labels: verification_roc(x, labels, max_far=1e-2)
        )
        matrix = n * n * 4
        figures[f"N={n}: recall@far=1e-3"] = float(values[0])
        figures[f"N={n}: recall_at_far seconds"] = seconds
        figures[f"N={n}: pairs per second (millions)"] = pairs / seconds / 1e6
        figures[f"N={n}: peak MiB"] = peak / 2**20
        figures[f"N={n}: verification_roc seconds"] = roc_seconds
        figures[f"N={n}: verification_roc peak MiB"] = roc_peak / 2**20
        figures[f"N={n}: matmul-only seconds"] = base_seconds
        ratios[f"N={n}: recall_at_far time / matmul-only"] = seconds / base_seconds
        ratios[f"N={n}: peak memory / N×N float32 matrix"] = peak / matrix
    return {"figures": figures, "ratios": ratios}
