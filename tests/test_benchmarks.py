"""The benchmarks stay runnable (quick sizes); their figures are for the note."""

import dataclasses
import itertools
import json
import math

import numpy as np
import pytest

from benchmarks import __main__ as runner
from benchmarks.timing import gpu_available


def test_accounting_benchmark_prints_figures_and_ratios_as_json(capsys):
    assert runner.main(["accounting", "--quick", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)["accounting"]
    for value in [*result["figures"].values(), *result["ratios"].values()]:
        assert math.isfinite(value) and value > 0
    figures, ratios = result["figures"], result["ratios"]
    assert any(key.startswith("epsilon() pld cold") for key in figures)
    assert "rdp warm/cold at 10,000 steps" in ratios
    assert "pld: callback time / epoch" in ratios
    # Calibration: every documented schedule at every target, timed.
    timed = [k for k in figures if k.startswith("calibrate ") and k.endswith("[s]")]
    for target in ("0.1", "1", "10", "100", "1000"):
        assert sum(f", ε={target} [s]" in key for key in timed) == 4
    assert sum("/ one default-grid PLD ε" in key for key in ratios) == 8


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


def test_fedemb_benchmark_times_a_round_against_the_same_centralized_steps():
    from benchmarks import fedemb

    assert runner.BENCHMARKS["fedemb"] == "benchmarks.fedemb"
    result = fedemb.speed(quick=True)
    cpu = result["ratios"]["CPU: round time / centralized time (goal <= 1.2)"]
    gpu = result["ratios"]["GPU: round / centralized examples/s (goal >= 0.5)"]
    measured = gpu if gpu_available() else cpu
    assert math.isfinite(measured) and measured > 0
    if not gpu_available():
        assert gpu == "no GPU"
        assert result["figures"]["CPU: examples per round"] == 2 * 2 * 4  # M·S·B


@pytest.mark.slow
def test_fedemb_benchmark_reports_recall_of_each_method_and_epsilon():
    from benchmarks import fedemb

    result = fedemb.utility(quick=True)
    figures = result["figures"]
    for method in ("untrained", "centralized", "non-private FedEmb"):
        assert 0 <= figures[f"{method} recall@far=1e-3"] <= 1
    for method in ("DP-FedEmb", "DP-FedAvg"):
        assert 0 <= figures[f"{method} recall@far=1e-3 mean"] <= 1
        assert figures[f"{method} recall@far=1e-3 std"] >= 0
    # Same number of examples seen by centralized and federated training.
    assert (
        figures["centralized examples"]
        == figures["non-private FedEmb examples (expected)"]
    )
    assert math.isfinite(figures["DP epsilon"]) and figures["DP epsilon"] > 0
    assert figures["DP delta"] < 1 / figures["DP users"]


def test_last_layer_benchmark_times_a_dp_sgd_step_and_dp_ls():
    from benchmarks import last_layer

    assert runner.BENCHMARKS["last_layer"] == "benchmarks.last_layer"
    result = last_layer.speed(quick=True)
    device = "GPU" if gpu_available() else "CPU"
    assert set(result["ratios"]) == {
        f"{device}: DP-SGD step / non-private step, fit (goal <= 1.3)",
        f"{device}: DP-SGD step / non-private step, steady (goal <= 1.3)",
        f"{device}: DP-LS seconds / 10 s (goal < 1)",
    }
    numbers = {k: v for k, v in result["figures"].items() if k != "GPU"}
    for head in ("DP-SGD", "non-private Dense"):
        for measure in ("fit", "steady"):
            assert sum(f"{head} step ({measure})" in k for k in numbers) == 1
    assert any("DP-LS fit, 2,000 x 32, 10 classes" in k for k in numbers)
    assert numbers["DP-SGD sampling probability q"] == pytest.approx(256 / 2048)
    assert len(numbers) == 6
    for value in [*numbers.values(), *result["ratios"].values()]:
        assert math.isfinite(value) and value > 0
    if device == "CPU":
        assert result["figures"]["GPU"] == "no GPU"


def test_step_clock_times_steps_within_an_epoch_only(monkeypatch):
    # Steps 1 s apart, and a 100 s pause before the second epoch's first
    # step (an epoch's start): the pause is not a step.
    from benchmarks import timing

    now = iter([0.0, 1.0, 2.0, 102.0, 103.0, 104.0, 105.0])
    monkeypatch.setattr(timing.time, "perf_counter", lambda: next(now))
    clock = timing.StepClock()
    for epoch, steps in enumerate((3, 4)):
        clock.on_epoch_begin(epoch)
        for step in range(steps):
            clock.on_train_batch_end(step)
    assert clock.intervals == [1.0] * 5
    assert clock.step_seconds() == 1.0


@pytest.mark.slow
def test_last_layer_utility_tunes_on_public_data_and_writes_table_and_curves(
    tmp_path, capsys
):
    from benchmarks import last_layer
    from benchmarks import last_layer_regime as regime

    assert last_layer.main(["utility", "--quick", "--output", str(tmp_path)]) == 0
    assert "| DP-Newton |" in capsys.readouterr().out
    lines = (tmp_path / "records.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    config = regime.QUICK
    sizes = {p * config.num_classes for p in config.train_per_class}
    chosen = 0
    for record in records:
        if record["kind"] != "private":
            continue
        if math.isfinite(record["epsilon"]):
            assert 0.99 * record["epsilon"] < record["epsilon_spent"]
            assert record["epsilon_spent"] <= record["epsilon"]
        tuning = [
            r for r in records if r["kind"] == "tuning"
            and all(r[k] == record[k] for k in ("group", "method", "n", "epsilon"))
        ]  # fmt: skip
        assert all(r["task"] == "tuning" for r in tuning)  # Never the private task.
        if not tuning:  # A single candidate: nothing to choose.
            continue
        # The setting run privately is the best one on the public task.
        best = max(r["accuracy"] for r in tuning)
        (match,) = [r for r in tuning if r["setting"] == record["setting"]]
        assert match["accuracy"] == best
        chosen += 1
    assert chosen >= 10
    # ε = ∞: the logistic methods train on the l2 best on the public task.
    for n in sizes:
        public = max(
            (r for r in records if r["kind"] == "logistic" and r["n"] == n
             and r["task"] == "tuning"),
            key=lambda r: (r["accuracy"], -r["l2"]),
        )  # fmt: skip
        for method in ("dp-newton", "dp-fc"):
            (row,) = [
                r for r in records if r["kind"] == "private" and r["n"] == n
                and r["method"] == method and r["epsilon"] == math.inf
            ]  # fmt: skip
            assert row["setting"]["l2"] == public["l2"]
            assert row["ridge"] == pytest.approx(public["l2"] * n)
        assert (tmp_path / f"last_layer_n{n}.png").stat().st_size > 0
    table = (tmp_path / "table.md").read_text()
    for label in regime.LABELS.values():
        assert f"| {label} |" in table
    # A rerun measures nothing again.
    regime.main(["--quick", "--output", str(tmp_path)])
    assert (tmp_path / "records.jsonl").read_text().splitlines() == lines


def test_dp_sgd_benchmark_times_dp_model_against_the_same_network():
    import dataclasses

    from benchmarks import dp_sgd

    assert runner.BENCHMARKS["dp_sgd"] == "benchmarks.dp_sgd"
    # The CNN mirrors fast-dpsgd's CIFAR10Model: its parameter count, from
    # the PyTorch layer shapes (3x3 kernels, bias), is 605,226.
    widths = [3, 32, 32, 64, 64, 128, 128, 256, 10]
    expected = sum(9 * a * b + b for a, b in itertools.pairwise(widths))
    assert expected == 605_226
    assert dp_sgd.cnn(dp_sgd.Config()).count_params() == expected
    # One model and fixed-size sampling, in-process: JAX compiles each DP
    # step for seconds. (The CLI's --quick adds the CNN and a Poisson row.)
    config = dataclasses.replace(dp_sgd.QUICK, models=("vit",), poisson_batch_size=None)
    result = dp_sgd.run(config=config)
    device = result["device"]
    (row,) = result["rows"]
    assert (row["model"], row["batch_size"], row["sampling"]) == ("vit", 8, "fixed")
    key = f"{device}: vit B=8 DP fixed / non-private time (goal <= 2)"
    ratio = result["ratios"][key]
    assert math.isfinite(ratio) and ratio > 0
    assert row["non_private_s"] > 0 and row["dp_s"] > 0
    assert row["ratio"] == pytest.approx(row["dp_s"] / row["non_private_s"])
    plan = result["figures"]["vit gradient plan"]
    assert "ghost:" in plan and "vectorized: 1× PositionEmbedding" in plan
    assert len(result["peers"]) == 10
    assert "Opacus 1.6.0" in dp_sgd.table(result)


def test_scale_benchmark_pins_each_process_to_its_share_of_the_cores():
    # Pure helpers only: the benchmark itself starts processes (minutes).
    from benchmarks import scale

    assert runner.BENCHMARKS["scale"] == "benchmarks.scale"
    assert scale.core_layout([0, 1], 1) == ([[0, 1]], 2)
    assert scale.core_layout([1, 0], 2) == ([[0], [1]], 1)
    assert scale.core_layout([0, 1], 4) == ([[0], [1], [0], [1]], 1)
    assert scale.core_layout(range(16), 4) == (
        [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]],
        4,
    )
    # The one-process baseline first and last; on JAX also clients one by one.
    jobs = scale._jobs(scale.QUICK, "jax")
    assert [(n, p) for _, n, p in jobs] == [
        (1, "all"), (2, "all"), (4, "all"), (1, "all"), (1, 1),
    ]  # fmt: skip
    assert [n for _, n, _ in scale._jobs(scale.QUICK, "tensorflow")] == [1, 2, 4, 1]
    figures = scale.reader_figures("x", {"num_images": 5, "a [MiB]": 1.5, "b": "s"})
    assert figures == {"x: a [MiB]": 1.5}  # Every number when none is known.


def test_the_utility_study_pairs_each_seed_with_the_centralized_run():
    from benchmarks.fedemb_utility import paired_ratios, summarize

    runs = [
        {"method": "centralized", "seed": s, "recall@far=0.001": v}
        for s, v in ((0, 0.5), (1, 0.4), (2, 0.8), (4, 0.0))  # Seed 4: no ratio.
    ]
    runs += [
        {"method": "DP-FedEmb", "seed": s, "recall@far=0.001": v}
        for s, v in ((0, 0.45), (1, 0.4), (2, 0.4), (3, 0.9), (4, 0.2))  # 3: alone.
    ]
    (row,) = paired_ratios(runs)
    assert row["method"] == "DP-FedEmb"
    assert row["ratios"] == pytest.approx([0.9, 1.0, 0.5])
    assert row["mean"] == pytest.approx(0.8)
    # t(0.975, 2 df) = 4.303; the sample std of (0.9, 1.0, 0.5) is 0.2646.
    half = 4.303 * math.sqrt(0.07) / math.sqrt(3)
    low, high = row["interval95"]
    assert (low, high) == pytest.approx((0.8 - half, 0.8 + half), rel=1e-4)
    # Runs made apart list their settings in another order: one group.
    a = {"method": "A", "seed": 0, "k": 16, "lr": 0.1, "recall@far=0.001": 0.25}
    b = {"lr": 0.1, "recall@far=0.001": 0.2, "k": 16, "seed": 1, "method": "A"}
    (row,) = paired_ratios([*runs[:2], a, b])
    assert row["ratios"] == pytest.approx([0.5, 0.5])
    scores = {f"{p}recall@far={f:g}": 0.5 for p in ("", "val ") for f in (1e-3, 1e-2)}
    (summary,) = summarize([{**a, **scores}, {**b, **scores}])
    assert summary["seeds"] == [0, 1]


def test_the_utility_study_validates_on_identities_it_neither_trains_nor_reports():
    import numpy as np

    from benchmarks.fedemb_utility import QUICK, Study, StudyConfig

    # Identity k of a split is identity first_identity + k of the seed:
    # the three ranges must not meet, at the study's size and the quick one.
    for config in (StudyConfig(), QUICK):
        ranges = sorted(
            [
                (0, config.private_identities),
                (config.eval_first_identity, config.eval_identities),
                (config.val_first_identity, config.val_identities),
            ]
        )
        for (start, count), (next_start, _) in itertools.pairwise(ranges):
            assert start + count <= next_start, ranges
    study = Study(QUICK, seed=0)
    assert len(set(study.validation[1])) == QUICK.val_identities
    # Other identities, so other images (the labels restart at 0 in each).
    first = [split[0][split[1] == 0][0] for split in (
        study.validation, study.held_out, study.private[:2])]  # fmt: skip
    for a, b in itertools.combinations(first, 2):
        assert not np.array_equal(a, b)


def test_the_utility_study_places_each_curve_point_at_its_epoch(tmp_path):
    import keras
    import numpy as np

    from benchmarks.fedemb_utility import FARS, Study, plot_curves
    from kdpemb.callbacks import RecallAtFAR

    # The real callback, every 2nd of 4 epochs, on a tiny model.
    rng = np.random.default_rng(0)
    images = rng.normal(size=(60, 8)).astype("float32")
    labels = np.repeat(np.arange(12), 5)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4)])
    model.compile(loss="mse", optimizer="sgd")
    curve = [RecallAtFAR((images, labels), far=FARS, every_n_epochs=2)]
    history = model.fit(images, images[:, :4], epochs=4, verbose=0, callbacks=curve)
    info = Study.curve_of(history, curve, "rounds", per_epoch=5)
    # Epochs 2 and 4 of 5 rounds each: rounds 10 and 20.
    logged = [history.history[key] for key in curve[0].keys]
    assert info == {
        "curve": [[10, logged[0][0], logged[1][0]], [20, logged[0][1], logged[1][1]]],
        "curve unit": "rounds",
    }
    assert Study.curve_of(history, [], "rounds", 5) == {}
    records = [
        {"method": "DP-FedEmb", "seed": 0, **info},
        {"method": "DP-FedEmb", "seed": 0, "users_per_client": 16, **info},
        {"method": "centralized", "seed": 0, "curve": [[1, 0.2, 0.4]],
         "curve unit": "epochs"},
        {"method": "public-pretrained", "seed": 0},
    ]  # fmt: skip
    path = tmp_path / "curves.png"
    plot_curves(records, path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match="curve_points"):
        plot_curves(records[-1:], tmp_path / "none.png")


def test_the_utility_study_builds_the_server_and_client_optimizers_it_is_set_to():
    from benchmarks.fedemb_utility import Study, StudyConfig

    def rates(optimizer, steps):
        rate = optimizer._learning_rate
        return [float(rate(step)) if callable(rate) else float(rate) for step in steps]

    base = StudyConfig(rounds=100, server_optimizer="sgd", server_lr=2.0)
    plain = Study._server(base)
    assert type(plain).__name__ == "SGD" and plain.momentum == 0.9
    assert rates(plain, (0, 99)) == [2.0, 2.0]
    # Warm-up over 10 rounds from lr / 20, then constant.
    warm = Study._server(dataclasses.replace(base, server_warmup=10))
    assert rates(warm, (0, 5, 10, 99)) == pytest.approx([0.1, 1.05, 2.0, 2.0])
    # Warm-up, then cosine decay to 0 at the last round.
    cosine = Study._server(
        dataclasses.replace(base, server_warmup=10, server_decay=1, server_momentum=0.5)
    )
    assert cosine.momentum == 0.5
    assert rates(cosine, (10, 55, 100)) == pytest.approx([2.0, 1.0, 0.0], abs=1e-6)
    adam = Study._server(dataclasses.replace(base, server_optimizer="adam"))
    assert type(adam).__name__ == "Adam" and rates(adam, (0,)) == [2.0]
    with pytest.raises(ValueError, match="'sgd' or 'adam'"):
        Study._server(dataclasses.replace(base, server_optimizer="adagrad"))
    client = Study._client(StudyConfig(client_lr=0.02, client_momentum=0.9))
    assert (float(client.learning_rate), client.momentum) == (pytest.approx(0.02), 0.9)


def test_tuning_keeps_each_stages_best_validation_value_for_the_later_stages(
    monkeypatch,
):
    from benchmarks import fedemb_utility as utility

    # A stand-in study whose validation score is known per setting; the
    # test identities score the opposite, so a choice made on them shows.
    calls = []

    def run(self, method, **overrides):
        calls.append((method, overrides))
        score = {"sgd": 0.3, "adam": 0.1}.get(overrides.get("server_optimizer"), 0.0)
        score += overrides.get("users_per_client", 0) / 100
        score += 0.2 * (overrides.get("clip_norm") == 3.0)
        score += overrides.get("centralized_lr", 0)
        scores = {"val recall@far=0.001": score, "recall@far=0.001": 1 - score}
        return {"method": method, "seed": 0, **overrides, **scores}

    monkeypatch.setattr(utility.Study, "__init__", lambda self, *a, **k: None)
    monkeypatch.setattr(utility.Study, "run", run)
    grid = (
        ("centralized", "centralized_lr", (0.1, 0.2)),
        ("fedemb", "server", ("adam:0.003", "sgd:1")),
        ("fedemb", "users_per_client", (16, 8)),
        ("DP-FedAvg", "clip_norm", (1.0, 3.0)),
        # The default: DP-FedEmb's settings unchanged, its last run reused.
        ("fedemb", "client_momentum", (0.0,)),
    )
    chosen, runs = utility.tune(utility.QUICK, grid)
    assert len(runs) == 9 and len(calls) == 8
    assert runs[-1]["val recall@far=0.001"] == runs[4]["val recall@far=0.001"]
    assert chosen["centralized"] == {"centralized_lr": 0.2}
    shared = {"server_optimizer": "sgd", "server_lr": 1.0, "users_per_client": 16,
              "client_momentum": 0.0}  # fmt: skip
    for method in ("FedEmb (non-private)", "DP-FedEmb", "DP-FTRL-FedEmb"):
        assert chosen[method] == shared
    assert chosen["DP-FedAvg"] == {**shared, "clip_norm": 3.0}
    del shared["client_momentum"]  # Chosen last.
    # "fedemb" stages are scored on DP-FedEmb, and each later stage starts
    # from the choices so far.
    assert [m for m, _ in calls[2:6]] == ["DP-FedEmb"] * 4
    assert calls[4][1] == {"server_optimizer": "sgd", "server_lr": 1.0,
                           "users_per_client": 16}  # fmt: skip
    assert calls[6] == ("DP-FedAvg", {**shared, "clip_norm": 1.0})
    shared["client_momentum"] = 0.0
    # A cut-off walk resumed: its finished runs are reused, not run again.
    calls.clear()
    longer = (*grid, ("DP-FedEmb", "clip_norm", (0.5,)))
    again, _ = utility.tune(utility.QUICK, longer, done=runs[:5])
    before = {k: v for k, v in shared.items() if k != "client_momentum"}
    assert calls == [
        ("DP-FedEmb", {**before, "users_per_client": 8}),
        ("DP-FedAvg", {**before, "clip_norm": 1.0}),
        ("DP-FedAvg", {**before, "clip_norm": 3.0}),
        ("DP-FedEmb", {**shared, "clip_norm": 0.5}),
    ]
    assert again["DP-FedAvg"] == chosen["DP-FedAvg"]
    assert again["DP-FedEmb"] == {**shared, "clip_norm": 0.5}
    assert utility.setting("server_schedule", "warmup-cosine") == {
        "server_warmup": -1, "server_decay": 1}  # fmt: skip
    with pytest.raises(ValueError, match="warmup-cosine"):
        utility.setting("server_schedule", "linear")


def test_the_gpu_slot_runs_the_chosen_settings_at_gpu_sizes_with_curves():
    from benchmarks import fedemb_utility as utility

    config, methods, seeds, chosen = utility.gpu_slot()
    gpu_sizes = utility.StudyConfig()
    assert (config.image_size, config.private_identities) == (
        gpu_sizes.image_size, gpu_sizes.private_identities)  # fmt: skip
    assert config.curve_points > 0 and config.deployment_epsilon > 0
    # The CPU study's choice, for every trained method.
    assert seeds == (0,) and chosen is utility.CHOSEN
    assert {"centralized", *utility.FEDERATED} <= set(chosen)
    assert set(methods) == {"public-pretrained", "centralized",
                            "FedEmb (non-private)", "DP-FedEmb"}  # fmt: skip
    quick = utility.gpu_slot(quick=True)[0]
    assert quick.private_identities == utility.QUICK.private_identities


def test_the_utility_study_combines_runs_made_apart(tmp_path, capsys):
    from benchmarks import fedemb_utility as utility

    def run(method, seed, value):
        return {"method": method, "seed": seed, "recall@far=0.001": value,
                "recall@far=0.01": 2 * value, "val recall@far=0.001": value,
                "val recall@far=0.01": 2 * value}  # fmt: skip

    parts = [
        [run("centralized", 0, 0.5), run("centralized", 1, 0.4)],
        [run("DP-FedEmb", 0, 0.25), run("DP-FedEmb", 1, 0.3)],
    ]
    paths = []
    for index, runs in enumerate(parts):
        paths.append(tmp_path / f"part{index}.json")
        paths[-1].write_text(json.dumps({"runs": runs}))
    output = tmp_path / "all.json"
    utility.main(["--quick", "--combine", *map(str, paths), "--output", str(output)])
    combined = json.loads(output.read_text())
    assert len(combined["runs"]) == 4
    (row, _) = combined["ratios to centralized"]  # One per FAR.
    assert row["method"] == "DP-FedEmb"
    assert row["ratios"] == pytest.approx([0.5, 0.75])
    # Nothing trained: the only records printed are the summaries.
    lines = capsys.readouterr().out.splitlines()
    assert not [line for line in lines if line.startswith('{"method"')]


def test_user_level_benchmark_compares_at_the_same_user_level_epsilon(capsys):
    from benchmarks import user_level

    assert runner.BENCHMARKS["user_level"] == "benchmarks.user_level"
    assert runner.main(["user_level", "--quick", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)["user_level"]
    figures, config = result["figures"], user_level.QUICK
    for name in config.datasets:
        for method in user_level.METHODS:
            for key in ("test mean", "non-private test"):
                assert 0 <= figures[f"{name}: {method} {key}"] <= 1
            assert figures[f"{name}: {method} step seconds"] > 0
        # Group privacy over the most examples one user keeps (at most k).
        group = figures[f"{name}: group size"]
        assert 1 <= group <= config.examples_per_user
        epsilon, delta = (
            figures[f"{name}: example epsilon"],
            figures[f"{name}: example delta"],
        )
        assert math.isclose(group * epsilon, config.epsilon)
        assert math.isclose(
            group * math.exp((group - 1) * epsilon) * delta, config.delta
        )
        # More noise for the example-level run at ε_u / k.
        assert (
            figures[f"{name}: example-level + group privacy noise multiplier"]
            > figures[f"{name}: user-level noise multiplier"]
        )
    assert "| identities | user-level |" in result["table"]


def test_the_user_level_benchmark_caps_each_user_at_k_seeded_examples():
    from benchmarks.user_level import cap_per_user

    users = np.repeat([3, 1, 2], [10, 2, 5])
    keep = cap_per_user(users, 4, seed=0)
    kept, counts = np.unique(users[keep], return_counts=True)
    assert kept.tolist() == [1, 2, 3] and counts.tolist() == [2, 4, 4]
    assert not np.array_equal(keep, cap_per_user(users, 4, seed=1))


@pytest.mark.slow
def test_scale_benchmark_times_dp_model_on_one_device_then_two_then_one():
    # Three fresh processes of the current backend (quick sizes); the
    # two-device job must really split each batch over two devices.
    import os

    from benchmarks import scale
    from benchmarks import scale_dp_model as part

    result = scale.dp_model(quick=True)
    config, reports = part.QUICK, result["reports"]
    labels = ["1 device", "2 devices", "1 device (again, last)"]
    assert [label for label in reports if not label.startswith("GPU")] == labels
    assert [reports[label]["devices"] for label in labels] == [1, 2, 1]
    figures, ratios = result["figures"], result["ratios"]
    for label in labels:
        report = reports[label]
        assert report["device_kinds"] in (["CPU"], ["cpu"])
        assert report["steps"] == config.steps
        assert report["private_steps"] == config.warmup_steps + config.steps
        numbers = [figures[f"DPModel CPU {label}: {m}"] for m in (
            "steps/s", "examples/s", "steps/s, every timed step",
            "first step incl. compile (s)")]  # fmt: skip
        assert all(math.isfinite(n) and n > 0 for n in numbers)
        assert numbers[1] == pytest.approx(config.batch_size * numbers[0])
    first, again = (reports[label]["steps_per_second"] for label in labels[::2])
    assert ratios["DPModel CPU 1 device: last / first steps/s (load drift)"] == (
        pytest.approx(again / first)
    )
    two = ratios["DPModel CPU steps/s, 2 devices / 1 device"]
    assert two == pytest.approx(
        reports["2 devices"]["steps_per_second"] / ((first + again) / 2)
    )
    assert "Poisson B=16" in figures["DPModel setting"]
    gpus = part.gpu_count(os.environ.get("KERAS_BACKEND", "tensorflow"))
    if gpus < 2:
        says = "no GPU" if gpus == 0 else "one GPU"
        assert figures["DPModel GPU"] == ratios[
            "DPModel GPU steps/s, all GPUs / 1 GPU"] == says  # fmt: skip
    # The XLA flags of the jobs: two host devices for two, none for one.
    flags = "--o=1 --xla_force_host_platform_device_count=8"
    assert part._xla_flags(flags, 1) == "--o=1"
    assert part._xla_flags(None, 2) == "--xla_force_host_platform_device_count=2"


def test_scale_benchmark_runs_the_dp_model_part_with_the_others(monkeypatch):
    from benchmarks import scale

    def part(name):
        return lambda *args, **kwargs: {
            "figures": {name: 1.0}, "ratios": {f"{name} ratio": 2.0},
            "config": {"part": name}}  # fmt: skip

    for name in ("throughput", "reader", "gpu", "dp_model"):
        monkeypatch.setattr(scale, name, part(name))
    result = scale.run(quick=True)
    assert list(result["figures"]) == ["throughput", "reader", "dp_model", "gpu"]
    assert result["ratios"]["dp_model ratio"] == 2.0
    assert result["dp_model_config"] == {"part": "dp_model"}
