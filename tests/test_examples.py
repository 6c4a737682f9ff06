"""The example scripts run and print what their docstrings promise.

Most run in this process (`main()` with its command line, stdout
captured): the same code as `python examples/<name>.py ...`, without
starting Python and the backend again for each. The main job's first test
runs it as a user would, in its own process, to check its console output.
"""

import contextlib
import io
import json
import pathlib
import runpy
import subprocess
import sys

import pytest

EXAMPLES = pathlib.Path(__file__).resolve().parents[1] / "examples"


def call_example(name, *args):
    """Calls the `main()` of `examples/<name>` with command-line `args`."""
    path = EXAMPLES / name
    namespace = runpy.run_path(str(path), run_name=f"example_{path.stem}")
    argv = sys.argv
    sys.argv = [str(path), *args]
    try:
        return namespace["main"]()
    finally:
        sys.argv = argv


def run_example(name, *args):
    """Runs `examples/<name>` with command-line `args`; returns its stdout."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        call_example(name, *args)
    return out.getvalue()


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


def run_main_job(tmp_path, *args):
    """Runs the main job in --quick mode in its own process; returns
    (stdout, stderr, run dir)."""
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / "train_dp_fedemb.py"), "--quick",
         "--runs-dir", str(tmp_path), *args],
        capture_output=True, text=True,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    (run_dir,) = tmp_path.iterdir()
    return result.stdout, result.stderr, run_dir


def main_job_args(tmp_path, *args):
    return ("train_dp_fedemb.py", "--quick", "--runs-dir", str(tmp_path), *args)


@pytest.mark.slow
def test_the_main_job_writes_its_run_and_states_a_simulated_deployment(tmp_path):
    import keras

    out, err, run_dir = run_main_job(tmp_path, "--target-epsilon", "6")
    # A clean console (kdpemb holds the backends' lines back), and the job
    # leaves no iterator to finalise at exit.
    assert err == "", err[-2000:]
    for noise in ("GeneratorDataset", "cuInit", "absl", "oneDNN", "retracing"):
        assert noise not in out, noise
    # The quick figures say what they mean at that size.
    assert "quick mode: a tiny model and data" in out
    results = json.loads((run_dir / "results.json").read_text())
    assert set(results["files"]) == {path.name for path in run_dir.iterdir()} == {
        "results.json", "roc.png", "backbone.keras",
        "simulated_deployment.txt", "simulated_deployment.json",
    }  # fmt: skip
    released = results["recall_on_held_out_identities"]
    assert set(released) == {"untrained", "public-pretrained", "DP-FedEmb"}
    for row in released:
        assert row in out
    # No non-private reference unless asked (--reference): not trained, and
    # nothing of it on the console or in results.json.
    assert results["arguments"]["reference"] is False
    assert "outside_the_guarantee" not in results
    for shown in ("non-private", "reference", "OUTSIDE THE PRIVACY GUARANTEE"):
        assert shown not in out, shown
    assert "non-private" not in (run_dir / "results.json").read_text()
    assert "Simulated deployment (NOT this run's guarantee)" in out
    assert "This run's own guarantee: None meaningful" in out
    assert out.count("run's own guarantee") == 1  # Said once.
    assert results["privacy_statement"] is None  # Never the run's own claim.
    simulated = results["simulated_deployment"]
    deployment = simulated["deployment"]
    # Marked as a simulation, down to the statement it holds.
    assert simulated["kind"] == "simulated_deployment"
    assert deployment["simulated"] is True
    # The run's z was calibrated so that the stated deployment (10M users,
    # pools of 4, δ = 1e-8, 64× noise) spends the target, and no more.
    assert 0.99 * 6 <= deployment["epsilon"] <= 6
    assert deployment["population"] == 10_000_000
    assert deployment["delta"] == pytest.approx(1e-8)
    assert deployment["noise_multiplier"] == pytest.approx(
        64 * results["noise_multiplier"]
    )
    pools = -(-10_000_000 // results["sizes"]["users_per_client"])  # 2,500,000
    assert deployment["sampling_probability"] == pytest.approx(
        64 * results["sizes"]["clients_per_round"] / pools
    )
    assert results["private_steps"] == deployment["steps"] == results["sizes"]["rounds"]
    backbone = keras.saving.load_model(run_dir / "backbone.keras")
    assert backbone.output_shape == (None, results["sizes"]["embedding_dim"])


def test_the_main_job_refuses_a_bad_deployment_before_training(tmp_path, capsys):
    with pytest.raises(ValueError, match="deployment_users"):
        call_example(*main_job_args(tmp_path, "--deployment-users", "100"))
    out = capsys.readouterr().out
    assert "pretraining" not in out  # Refused before any training.


@pytest.mark.slow
def test_the_main_job_can_calibrate_for_the_runs_own_epsilon(tmp_path):
    # A given C: no public probe (the other test runs it), and the flag's
    # path; with the non-private reference, which only --reference trains.
    out = run_example(
        *main_job_args(
            tmp_path, "--own-epsilon", "5", "--reference", "--clip-norm", "0.5"
        )
    )
    (run_dir,) = tmp_path.iterdir()
    results = json.loads((run_dir / "results.json").read_text())
    assert results["clip_norm"] == 0.5
    assert results["clip_norm_source"] == "--clip-norm"
    assert "median update norm" not in out
    statement = results["privacy_statement"]
    assert statement["unit"] == "user" and 0.99 * 5 <= statement["epsilon"] <= 5
    assert (run_dir / "privacy_statement.txt").read_text().strip() in out
    # The reference is kept apart from the released figures: its own section
    # of results.json, saying it is outside the guarantee, and a labelled
    # console line after the table.
    released = results["recall_on_held_out_identities"]
    assert set(released) == {"untrained", "public-pretrained", "DP-FedEmb"}
    outside = results["outside_the_guarantee"]
    assert outside["covered_by_the_privacy_guarantee"] is False
    assert "NOT covered by the privacy guarantee" in outside["note"]
    assert "Do not publish" in outside["note"]
    reference = outside["non-private reference"]["recall_on_held_out_identities"]
    assert set(reference) == {"recall@far=0.001", "recall@far=0.01"}
    assert all(0 <= value <= 1 for value in reference.values())
    lines = out.splitlines()
    (row,) = [line for line in lines if line.startswith("non-private reference")]
    assert row.endswith("(outside the guarantee)")
    heading = lines[lines.index(row) - 1]
    assert heading.startswith("OUTSIDE THE PRIVACY GUARANTEE")
    assert "NOT covered by the privacy guarantee; do not publish" in heading
    table_end = lines.index(heading)
    assert not any("non-private reference" in line for line in lines[:table_end])


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


def test_dp_sgd_finetune_example_compares_full_and_last_layer_at_one_epsilon():
    # 4 training images of each of the 4 classes: N = 16 = the quick batch
    # size, so every Poisson batch (q = 1) pads to one shape, 2 physical
    # batches of 8, and JAX compiles one DP step rather than one per size.
    out = run_example(
        "dp_sgd_finetune.py", "--quick", "--epsilon", "3", "--train-images", "4"
    )
    lines = out.splitlines()
    # Progress while it runs (a line per method, one per DP-SGD epoch of
    # the full fine-tuning), then the table, then what quick figures mean.
    assert "seed 0, full fine-tuning: pretraining" in out
    assert sum(line.startswith("epoch ") for line in lines) == 2
    header = lines.index(next(line for line in lines if line.startswith("seed  ")))
    rows = [line.split() for line in lines[header + 1 : header + 3]]
    assert lines[header + 3].startswith("quick mode: ")
    methods = [" ".join(row[1:-3]) for row in rows]
    assert methods == ["last layer", "full fine-tuning"]
    for row in rows:
        accuracy, epsilon = float(row[-3]), float(row[-2])
        assert 0.0 <= accuracy <= 1.0
        assert 0.99 * 3 <= epsilon <= 3  # Each calibrated to the target.


def test_audit_example_bounds_the_real_mechanisms_and_catches_the_broken_ones():
    lines = [
        json.loads(line)
        for line in run_example("audit_dp_sgd.py", "--quick", "--json").splitlines()
        if line.startswith("{")
    ]
    assert len(lines) == 6
    for row in lines:
        broken = [row[k] for k in row if k.endswith(" lower_bound")]
        assert broken, row
        assert row["lower_bound"] <= row["claimed_epsilon"] < min(broken)
