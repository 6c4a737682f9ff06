"""The benchmarks stay runnable (quick sizes); their figures are for the note."""

import json
import math

from benchmarks import __main__ as runner


def test_accounting_benchmark_prints_figures_and_ratios_as_json(capsys):
    assert runner.main(["accounting", "--quick", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)["accounting"]
    for value in [*result["figures"].values(), *result["ratios"].values()]:
        assert math.isfinite(value) and value > 0
    ratios = result["ratios"]
    # Incremental RDP is a vector addition: far cheaper than a cold start.
    assert ratios["rdp warm/cold at 10,000 steps"] < 0.2
    assert ratios["rdp: callback time / epoch"] < ratios["pld: callback time / epoch"]
    assert any(key.startswith("epsilon() pld cold") for key in result["figures"])
