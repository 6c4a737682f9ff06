"""The example scripts run and print what their docstrings promise."""

import json
import pathlib
import subprocess
import sys

import pytest

EXAMPLES = pathlib.Path(__file__).resolve().parents[1] / "examples"


def run_example(name, *args):
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / name), *args],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def test_privacy_calculator_states_each_documented_schedule():
    lines = [
        json.loads(line)
        for line in run_example("privacy_calculator.py", "--json").splitlines()
        if line.startswith("{")
    ]
    by_name = {line["schedule"]: line for line in lines}
    mnist = by_name["DP-SGD, MNIST tutorial"]
    assert mnist["steps"] == 14_063 and mnist["epsilon"] == pytest.approx(
        2.38, abs=0.01
    )
    assert mnist["rdp_epsilon"] <= 3.01  # The tutorial's published RDP value.
    four = by_name["DP-FedEmb, 4 user(s) per virtual client"]
    assert four["neighboring_relation"] == "replace_one" and four["unit"] == "user"
    calibrated = by_name["calibrated for ε = 4"]
    assert 0.99 * 4 <= calibrated["epsilon"] <= 4


def test_privacy_budget_example_stops_within_its_target():
    out = run_example("privacy_budget_fit.py")
    assert "PrivacyBudget: stopping after" in out
    assert "Privacy statement" in out


def test_virtual_clients_example_prints_a_round_and_its_privacy():
    out = run_example("virtual_clients.py")
    assert "images: [" in out and "local classes" in out
    assert "per user" in out and "replace-one" in out


@pytest.mark.slow
def test_train_dp_fedemb_example_reports_epsilon_recall_and_saves_the_backbone(
    tmp_path,
):
    import keras

    output = tmp_path / "backbone.keras"
    out = run_example("train_dp_fedemb.py", "--quick", "--output", str(output))
    assert "-DP per user" in out and "replace-one" in out
    assert "Recall@FAR=1e-3 on 20 held-out identities" in out
    assert "epoch 4/4" in out  # RichProgress's plain line per epoch.
    backbone = keras.saving.load_model(output)
    assert backbone.output_shape == (None, 32)


@pytest.mark.slow
def test_last_layer_dp_example_prints_accuracy_per_method_and_epsilon(tmp_path):
    import keras

    import kdpemb.models  # noqa: F401  (registers ClipFeatures for loading)
    from kdpemb.datasets import DatasetNotFoundError, load_fashion_mnist

    try:
        load_fashion_mnist(download=False)
    except DatasetNotFoundError:
        pytest.skip(
            "Fashion-MNIST is not installed: apt-get install dataset-fashion-mnist"
        )
    output = tmp_path / "classifier.keras"
    out = run_example(
        "last_layer_dp.py", "--quick", "--epsilons", "1",
        "--cache", str(tmp_path / "cache"), "--output", str(output),
    )  # fmt: skip
    header = next(line for line in out.splitlines() if line.startswith("method"))
    assert header.split()[1:] == ["ε", "=", "1", "no", "noise"]
    rows = {
        line.split()[0]: [float(v) for v in line.split()[1:]]
        for line in out.splitlines()
        if line.startswith("DP-")
    }
    assert set(rows) == {"DP-SGD", "DP-LS", "DP-Newton", "DP-FC"}
    assert all(len(v) == 2 and all(0 <= a <= 1 for a in v) for v in rows.values())
    assert "-DP per example" in out and "Gram matrix" in out
    classifier = keras.saving.load_model(output)
    assert classifier.input_shape == (None, 28, 28, 1)
    assert classifier.output_shape == (None, 10)
