"""What the tests of worker processes share: their results computed once
per test run, and the backbone's change in every round."""

import contextlib
import fcntl
import itertools
import json
import os
from pathlib import Path

import numpy as np


def once_per_run(tmp_path_factory, name, compute):
    """`compute()` (JSON-serialisable), run once per test run: under
    pytest-xdist the first worker computes it and the others read its file."""
    if os.environ.get("PYTEST_XDIST_WORKER") is None:
        return compute()
    shared = tmp_path_factory.getbasetemp().parent / name
    with open(f"{shared}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        with contextlib.suppress(FileNotFoundError):
            return json.loads(Path(f"{shared}.json").read_text())
        data = compute()
        Path(f"{shared}.json").write_text(json.dumps(data))
        return data


def round_changes(report):
    """The backbone's change in every round (`report["before"]`, then
    `report["after_round"]`), one flat array each."""
    states = [np.asarray(report["before"])] + [
        np.asarray(w) for w in report["after_round"]
    ]
    return [after - before for before, after in itertools.pairwise(states)]
