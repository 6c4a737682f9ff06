import json
import math
import os
import re
import subprocess
import sys

import dp_accounting as dpa
import pytest

from kdpemb import cli, privacy

MNIST = ["--num-examples", "60000", "--batch-size", "256", "--delta", "1e-5"]


def run_cli(capsys, *args):
    status = cli.main(list(args))
    out = capsys.readouterr().out
    return status, out


def test_epsilon_json_has_the_documented_fields_and_matches_the_library(capsys):
    status, out = run_cli(
        capsys,
        "privacy",
        "epsilon",
        *MNIST,
        "--epochs",
        "60",
        "--noise-multiplier",
        "1.1",
        "--json",
    )
    assert status == 0
    data = json.loads(out)
    for key in ("epsilon", "delta", "noise_multiplier", "steps", "accountant", "unit"):
        assert key in data
    assert (
        data["steps"] == 14_063
        and data["unit"] == "example"
        and data["accountant"] == "pld"
    )
    mechanism = privacy.dp_sgd(1.1, 256, 60_000)
    assert data["epsilon"] == pytest.approx(privacy.epsilon(mechanism, 14_063, 1e-5))


def test_user_level_virtual_clients_use_the_replace_one_relation(capsys):
    status, out = run_cli(
        capsys,
        "privacy",
        "epsilon",
        "--num-users",
        "20000",
        "--clients-per-round",
        "50",
        "--users-per-client",
        "4",
        "--steps",
        "500",
        "--noise-multiplier",
        "1.0",
        "--delta",
        "1e-6",
        "--json",
    )
    data = json.loads(out)
    assert status == 0 and data["unit"] == "user"
    assert data["neighboring_relation"] == "replace_one"
    assert data["sampling_probability"] == pytest.approx(50 / 5000)


def test_calibrate_round_trips(capsys):
    status, out = run_cli(
        capsys,
        "privacy",
        "calibrate",
        *MNIST,
        "--steps",
        "3000",
        "--target-epsilon",
        "2",
        "--accountant",
        "rdp",
        "--json",
    )
    data = json.loads(out)
    assert status == 0 and data["target_epsilon"] == 2.0
    assert 0.99 * 2 <= data["epsilon"] <= 2
    mechanism = privacy.dp_sgd(data["noise_multiplier"], 256, 60_000)
    assert privacy.epsilon(mechanism, 3000, 1e-5, accountant="rdp") == pytest.approx(
        data["epsilon"]
    )


def test_full_batch_and_fixed_sampling(capsys):
    status, out = run_cli(
        capsys,
        "privacy",
        "epsilon",
        "--num-examples",
        "1000",
        "--sampling",
        "full-batch",
        "--epochs",
        "5",
        "--noise-multiplier",
        "10",
        "--delta",
        "1e-5",
        "--json",
    )
    assert status == 0 and json.loads(out)["steps"] == 5
    status, out = run_cli(
        capsys,
        "privacy",
        "epsilon",
        *MNIST,
        "--sampling",
        "fixed",
        "--steps",
        "100",
        "--noise-multiplier",
        "1",
        "--accountant",
        "rdp",
        "--json",
    )
    assert status == 0 and json.loads(out)["neighboring_relation"] == "replace_one"


def test_table_output_is_readable(capsys):
    status, out = run_cli(
        capsys,
        "privacy",
        "epsilon",
        *MNIST,
        "--epochs",
        "1",
        "--noise-multiplier",
        "1.1",
    )
    assert status == 0
    assert "Privacy statement" in out and "ε (epsilon)" in out and "235" in out


def epsilon_argv(*extra, noise="1", steps="9", delta="1e-5"):
    """`privacy epsilon` for 60,000 examples in batches of 256, plus `extra`."""
    return [
        *("privacy", "epsilon", "--num-examples", "60000", "--batch-size", "256"),
        *("--steps", steps, "--noise-multiplier", noise, "--delta", delta),
        *extra,
    ]


USERS = ("--num-users", "100", "--clients-per-round", "30", "--users-per-client", "5")


@pytest.mark.parametrize(
    "argv, message",
    [
        (epsilon_argv(delta="1e-3"), "1/population"),
        (epsilon_argv(steps="0"), "at least 1"),
        (
            epsilon_argv("--sampling", "fixed", "--accountant", "pld"),
            "--accountant rdp",
        ),
        (epsilon_argv("--clients-per-round", "5"), "--clients-per-round is for user"),
        (epsilon_argv(noise="-1"), "--noise-multiplier must be a finite number >= 0"),
        (
            [
                "privacy",
                "epsilon",
                *USERS,
                "--steps",
                "9",
                "--noise-multiplier",
                "1",
                "--delta",
                "1e-5",
            ],
            "more than the 20 virtual clients",
        ),
    ],
)
def test_bad_input_exits_2_with_a_message(capsys, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


DEPLOYMENT_RUN = (
    *("privacy", "epsilon", "--num-users", "160000", "--clients-per-round", "2048"),
    *("--steps", "300", "--noise-multiplier", "0.02", "--delta", "1e-8"),
)


def test_deployment_flags_state_the_simulated_deployment(capsys):
    status, out = run_cli(
        capsys,
        *DEPLOYMENT_RUN,
        *("--deployment-scale", "64", "--deployment-users", "10000000"),
        *("--accountant", "rdp", "--json"),
    )
    assert status == 0
    data = json.loads(out)
    assert data["kind"] == "simulated_deployment" and data["scale"] == 64
    assert "epsilon" not in data  # Nested: never read as the run's own ε.
    deployment, run = data["deployment"], data["run"]
    assert deployment["noise_multiplier"] == 64 * 0.02
    assert run["noise_multiplier"] == 0.02
    assert deployment["population"] == 10_000_000 and run["population"] == 160_000
    step = dpa.PoissonSampledDpEvent(2048 * 64 / 1e7, dpa.GaussianDpEvent(64 * 0.02))
    reference = dpa.rdp.RdpAccountant().compose(dpa.SelfComposedDpEvent(step, 300))
    assert deployment["epsilon"] == pytest.approx(reference.get_epsilon(1e-8), rel=1e-9)
    own = dpa.PoissonSampledDpEvent(2048 / 160_000, dpa.GaussianDpEvent(0.02))
    own_reference = dpa.rdp.RdpAccountant().compose(dpa.SelfComposedDpEvent(own, 300))
    assert run["epsilon"] == pytest.approx(own_reference.get_epsilon(1e-8), rel=1e-9)
    assert "this run's own guarantee" in run["epsilon_note"]
    with pytest.raises(ValueError, match="DeploymentStatement"):
        privacy.PrivacyStatement.from_json(out)
    status, out = run_cli(
        capsys,
        *DEPLOYMENT_RUN,
        *("--deployment-scale", "64", "--deployment-users", "10000000"),
        *("--accountant", "rdp"),
    )
    assert status == 0 and "SIMULATED DEPLOYMENT" in out
    assert "Simulated deployment (NOT this run's guarantee)" in out
    assert "ε (epsilon) (deployment)" in out
    assert "This run's own guarantee: ε = " in out


def test_deployment_clients_flag_sets_the_deployment_pool(capsys):
    status, out = run_cli(
        capsys,
        *DEPLOYMENT_RUN,
        *("--users-per-client", "4", "--deployment-scale", "64"),
        *("--deployment-users", "10000000", "--deployment-clients", "3000000"),
        "--json",
    )
    assert status == 0
    data = json.loads(out)
    deployment = data["deployment"]
    assert deployment["mechanism"]["pool_size"] == 3_000_000
    assert deployment["neighboring_relation"] == "replace_one"
    step = dpa.PoissonSampledDpEvent(2048 * 64 / 3e6, dpa.GaussianDpEvent(64 * 0.02))
    reference = dpa.pld.PLDAccountant(dpa.NeighboringRelation.REPLACE_ONE).compose(
        dpa.SelfComposedDpEvent(step, 300)
    )
    assert deployment["epsilon"] == pytest.approx(reference.get_epsilon(1e-8), rel=1e-9)
    assert data["run"]["epsilon"] is None  # Replace-one at z = 0.02: not computed.
    assert data["run"]["epsilon_note"].startswith("not computed")


def test_deployment_with_epochs_keeps_the_run_rounds(capsys):
    argv = [arg if arg != "--steps" else "--epochs" for arg in DEPLOYMENT_RUN]
    argv[argv.index("--epochs") + 1] = "2"
    status, out = run_cli(
        capsys,
        *argv,
        *("--deployment-scale", "64", "--deployment-users", "10000000"),
        *("--accountant", "rdp", "--json"),
    )
    assert status == 0
    # Two epochs of the run: ceil(2 / q) rounds at the run's q = 2048 / 160000,
    # not two epochs of the deployment (ceil(2 / 0.0131) = 153 rounds).
    assert json.loads(out)["deployment"]["steps"] == math.ceil(2 * 160_000 / 2048)


def test_deployment_with_non_integer_clients_per_round(capsys):
    argv = list(DEPLOYMENT_RUN)
    argv[argv.index("--clients-per-round") + 1] = "33"
    status, out = run_cli(
        capsys,
        *argv,
        *("--deployment-scale", "1.5", "--deployment-users", "200000"),
        *("--accountant", "rdp", "--json"),
    )
    assert status == 0
    data = json.loads(out)
    assert data["deployment_clients_per_round"] == 49.5
    assert data["deployment"]["sampling_probability"] == 49.5 / 200_000


@pytest.mark.parametrize(
    "extra, message",
    [
        (("--deployment-scale", "64"), "needs both --deployment-scale"),
        (("--deployment-users", "10000000"), "needs both --deployment-scale"),
        (
            ("--deployment-scale", "128", "--deployment-users", "200000"),
            "Use --deployment-users >= 262144",
        ),
        (
            ("--deployment-scale", "0.5", "--deployment-users", "200000"),
            "--deployment-scale must be a finite number >= 1",
        ),
        (
            (
                *("--deployment-scale", "2", "--deployment-users", "200000"),
                *("--deployment-clients", "199999"),
            ),
            "exactly 200000 clients",
        ),
        (
            (
                *("--users-per-client", "4", "--deployment-scale", "2"),
                *("--deployment-users", "200000", "--deployment-clients", "100"),
            ),
            "--deployment-clients=100 is outside [50000, 200000]",
        ),
        (
            (
                *("--users-per-client", "4", "--deployment-scale", "64"),
                *("--deployment-users", "200000", "--deployment-clients", "60000"),
            ),
            "Use --deployment-clients >= 131072, or --deployment-scale <= 29.29.",
        ),
    ],
)
def test_bad_deployment_flags_exit_2(capsys, extra, message):
    with pytest.raises(SystemExit) as exit_info:
        cli.main([*DEPLOYMENT_RUN, *extra])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_deployment_flags_need_a_user_level_run(capsys):
    argv = epsilon_argv("--deployment-scale", "2", "--deployment-users", "70000")
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == 2
    assert "--num-users" in capsys.readouterr().err


def test_an_unreachable_target_is_reported(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(
            [
                "privacy",
                "calibrate",
                "--num-examples",
                "1000",
                "--sampling",
                "full-batch",
                "--steps",
                "100000",
                "--target-epsilon",
                "0.001",
                "--delta",
                "1e-5",
                "--accountant",
                "rdp",
            ]
        )
    assert exit_info.value.code == 2
    assert "cannot be met" in capsys.readouterr().err


def test_the_installed_console_script_and_module_entry_point_work():
    env = {k: v for k, v in os.environ.items() if k != "KERAS_BACKEND"}
    args = [
        "privacy",
        "epsilon",
        *MNIST,
        "--steps",
        "10",
        "--noise-multiplier",
        "2",
        "--json",
    ]
    result = subprocess.run(
        [sys.executable, "-m", "kdpemb", *args],
        capture_output=True,
        text=True,
        env=env,
    )  # No timeout: ε of 10 steps, printed; the child waits on nothing.
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["steps"] == 10


def test_fixed_size_sampling_is_accounted_with_rdp_by_default(capsys):
    status, out = run_cli(capsys, *epsilon_argv("--sampling", "fixed", "--json"))
    assert status == 0
    data = json.loads(out)
    assert data["accountant"] == "rdp"
    assert data["neighboring_relation"] == "replace_one"
    mechanism = privacy.Schedule.examples(60_000, 256, sampling="fixed")
    expected = privacy.epsilon(
        mechanism.privacy_mechanism(1.0), 9, 1e-5, accountant="rdp"
    )
    assert data["epsilon"] == pytest.approx(expected, rel=1e-9)


EXAMPLES = ("--num-examples", "1000", "--batch-size", "10")
RUN = ("--steps", "9", "--noise-multiplier", "1", "--delta", "1e-5")
USER_RUN = (
    *("--num-users", "1000", "--clients-per-round", "10", "--steps", "9"),
    *("--noise-multiplier", "1", "--delta", "1e-5"),
)


def replace_flag(argv, flag, value):
    """`argv` with `flag`'s value set to `value` (added if absent)."""
    argv = list(argv)
    if flag in argv:
        argv[argv.index(flag) + 1] = value
    else:
        argv += [flag, value]
    return argv


# Every numeric flag, a run it belongs to, and values it refuses.
NUMERIC_FLAGS = {
    "--num-examples": ("epsilon", (*EXAMPLES, *RUN), ("-3", "0")),
    "--num-users": ("epsilon", USER_RUN, ("-3", "0")),
    "--batch-size": ("epsilon", (*EXAMPLES, *RUN), ("-3", "0", "nan", "inf")),
    "--clients-per-round": ("epsilon", USER_RUN, ("-3", "0", "nan")),
    "--users-per-client": ("epsilon", USER_RUN, ("-3", "0")),
    "--steps": ("epsilon", (*EXAMPLES, *RUN), ("-3", "0")),
    "--epochs": (
        "epsilon",
        (*EXAMPLES, "--epochs", "1", "--noise-multiplier", "1", "--delta", "1e-5"),
        ("-3", "0", "nan", "inf"),
    ),
    "--noise-multiplier": ("epsilon", (*EXAMPLES, *RUN), ("-3", "nan", "inf")),
    "--delta": ("epsilon", (*EXAMPLES, *RUN), ("-3", "0", "1", "2", "nan")),
    "--target-epsilon": (
        "calibrate",
        (*EXAMPLES, "--steps", "9", "--target-epsilon", "1", "--delta", "1e-5"),
        ("-3", "0", "nan", "inf"),
    ),
    "--clip-norm": ("epsilon", (*EXAMPLES, *RUN), ("-3", "0", "nan", "inf")),
    "--steps-per-epoch": (
        "epsilon",
        (*EXAMPLES, *RUN, "--sampling", "epochs"),
        ("-3", "0"),
    ),
    "--deployment-scale": (
        "epsilon",
        (*USER_RUN, "--deployment-scale", "2", "--deployment-users", "2000"),
        ("-3", "0", "0.5", "nan"),
    ),
    "--deployment-users": (
        "epsilon",
        (*USER_RUN, "--deployment-scale", "2", "--deployment-users", "2000"),
        ("-3", "0", "10"),
    ),
    "--deployment-clients": (
        "epsilon",
        (*USER_RUN, "--deployment-scale", "2", "--deployment-users", "2000"),
        ("-3", "0", "10"),
    ),
}
INTERNAL_NAMES = (
    *("sample_size", "num_examples", "num_users", "clients_per_round"),
    *("users_per_client", "steps_per_epoch", "rounds_per_epoch", "noise_multiplier"),
    *("target_epsilon", "clip_norm", "deployment_", "delta=", "population must"),
)


def internal_names_in(error):
    """The library's argument names in `error` (not as part of a flag)."""
    return [name for name in INTERNAL_NAMES if re.search(rf"(?<![-\w]){name}", error)]


@pytest.mark.parametrize("flag", sorted(NUMERIC_FLAGS))
def test_every_numeric_flag_is_named_in_its_error(capsys, flag):
    # Review finding: `--batch-size -3` was refused as "sample_size must be > 0".
    action, argv, values = NUMERIC_FLAGS[flag]
    good = ["privacy", action, *argv]
    assert cli.main(good) == 0  # The run is fine but for the flag.
    capsys.readouterr()
    for value in values:
        with pytest.raises(SystemExit) as exit_info:
            cli.main(replace_flag(good, flag, value))
        assert exit_info.value.code == 2, value
        error = capsys.readouterr().err
        assert f"kdpemb: error: {flag}" in error, (value, error)
        assert internal_names_in(error) == [], (value, error)


@pytest.mark.parametrize(
    ("argv", "flags"),
    [
        ((*EXAMPLES, *RUN, "--batch-size", "2000"), ("--batch-size", "--num-examples")),
        (
            (*EXAMPLES, *RUN, "--sampling", "fixed", "--batch-size", "2.5"),
            ("--batch-size", "--sampling fixed"),
        ),
        ((*USER_RUN, "--clients-per-round", "2000"), ("--clients-per-round",)),
        ((*USER_RUN, "--users-per-client", "5000"), ("--users-per-client",)),
        (
            (*USER_RUN, "--sampling", "epochs", "--steps-per-epoch", "7"),
            ("--clients-per-round", "--steps-per-epoch"),
        ),
        (
            (*USER_RUN, "--sampling", "epochs", "--steps-per-epoch", "5000"),
            ("--steps-per-epoch",),
        ),
        ((*EXAMPLES, *RUN, "--delta", "0.01"), ("--delta", "--num-examples")),
        (
            (*USER_RUN, "--deployment-scale", "300", "--deployment-users", "2000"),
            ("--deployment-users", "--deployment-scale"),
        ),
        (
            (*USER_RUN, "--deployment-scale", "2", "--deployment-users", "10000000"),
            ("--delta",),
        ),
    ],
    ids=[
        "batch>examples", "fixed-fraction", "clients>pool", "k>users",
        "clients-vs-steps-per-epoch", "steps-per-epoch>pool", "delta>=1/N",
        "deployment-pool", "deployment-delta",
    ],
)  # fmt: skip
def test_bad_combinations_of_flags_name_the_flags(capsys, argv, flags):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["privacy", "epsilon", *argv])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert all(flag in error for flag in flags), error
    assert internal_names_in(error) == []


def test_epochs_sampling_takes_a_fractional_batch_size(capsys):
    # ceil(N / B) steps per epoch, as the help says (B = 0.5 crashed).
    status, out = run_cli(
        capsys, "privacy", "epsilon", *EXAMPLES, *RUN,
        "--sampling", "epochs", "--batch-size", "2.5", "--json",
    )  # fmt: skip
    expected = privacy.tree_aggregation(1.0, 400, 1000, leaves_per_tree=1)
    assert status == 0
    assert json.loads(out)["epsilon"] == pytest.approx(
        privacy.epsilon(expected, 9, 1e-5, accountant="rdp")
    )


def test_calibrate_states_the_bound_it_met_without_accounting_again(
    capsys, monkeypatch
):
    # The MNIST DP-SGD schedule at ε = 200: the accountant's own grid at the
    # calibrated z ≈ 0.29 takes seconds; the search's coarser grids do not.
    from kdpemb.privacy import accountant

    built = []
    build = accountant.pld_lib.from_gaussian_mechanism

    def spy(**kwargs):
        built.append(
            (kwargs["standard_deviation"], kwargs["value_discretization_interval"])
        )
        return build(**kwargs)

    monkeypatch.setattr(accountant.pld_lib, "from_gaussian_mechanism", spy)
    accountant._gaussian_pld.cache_clear()  # Count every build.
    status, out = run_cli(
        capsys, "privacy", "calibrate", *MNIST, "--epochs", "60",
        "--target-epsilon", "200", "--json",
    )  # fmt: skip
    data = json.loads(out)
    assert status == 0 and data["steps"] == 14_063
    assert (1 - 0.005) * 200 <= data["epsilon"] <= 200
    assert data["noise_multiplier"] < 0.3
    # Small multipliers were only ever accounted on coarse grids.
    assert built and all(interval > 1e-4 for z, interval in built if z < 10)
