"""Runs the longest tests first, so that `pytest -n 2` ends together.

pytest-xdist hands tests to its workers in collection order, and the
longest ones (example scripts, docs pages, benchmarks, fuzzing, the model
contract, crash safety: 10-90 s each) are collected last, under
tests/test_*.py. Left there, one worker runs the tail alone while the
other waits. Moved to the front, the short tests fill in around them.
Nothing else changes: every test still runs, each in its own state.
"""

# Modules whose tests take seconds to minutes each, longest first.
LONG_RUNNING = (
    "tests/test_examples.py",
    "tests/test_docs.py",
    "tests/test_benchmarks.py",
    "tests/test_private_model_contract.py",
    "tests/test_fuzz.py",
    "tests/test_crash_safety.py",
    "tests/models/test_fedemb_after_pretraining.py",
    "tests/models/test_fedemb_distributed.py",
    "tests/models/test_last_layer_distributed.py",
    "tests/models/test_dp_model_distributed.py",
    "tests/models/test_dp_model_multi_host.py",
    "tests/models/test_xla_train_steps.py",
    "tests/audit/test_model_audits.py",
    "tests/audit/test_audit.py",
)


def _rank(item):
    path = item.nodeid.split("::", 1)[0]
    if path in LONG_RUNNING:
        return LONG_RUNNING.index(path)
    if item.get_closest_marker("slow") is not None:
        return len(LONG_RUNNING)
    return len(LONG_RUNNING) + 1


def pytest_collection_modifyitems(items):
    items.sort(key=_rank)  # Stable: the order within each rank is kept.
