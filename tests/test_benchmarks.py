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


def test_data_pipeline_benchmark_reports_production_against_consumption(capsys):
    assert runner.main(["data", "--quick", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)["data"]
    for value in [*result["figures"].values(), *result["ratios"].values()]:
        assert math.isfinite(value) and value > 0
    assert set(result["ratios"]) == {
        "produced (1 thread) / consumed",
        "produced (workers) / consumed",
        "end to end / consumed",
    }


def test_verification_benchmark_reports_time_and_memory_ratios(capsys):
    assert runner.main(["verification", "--quick", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)["verification"]
    for value in [*result["figures"].values(), *result["ratios"].values()]:
        assert math.isfinite(value) and value > 0
    assert any("matmul-only" in key for key in result["ratios"])
