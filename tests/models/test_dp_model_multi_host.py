"""DPModel on several hosts: real processes, one sample per step, noise once.

`dp_model_multi_host_worker.py` runs as two local processes that form one
job (JAX: `keras.distribution.initialize` with
`DataParallel(auto_shard_dataset=False)`; TensorFlow: two
`MultiWorkerMirroredStrategy` workers on localhost ports), and as a third,
single process, the reference of the seeded fits. The tests check:

- every host serves its half of the rows of every sample (at user level,
  whole users), the hosts the same samples, the one process's;
- seeded, without noise, the two hosts give the single process's weights
  step by step, at example and at user level (clipped sums added over
  the hosts once, divided by B once);
- with seeds from entropy, the hosts hold the chief's sampling and noise
  seeds (the same samples, identical weights), and each step with zero
  gradients adds N(0, (zC/B)²) once: noise from each host would give
  2 σ (one seed) or √2 σ (a seed each);
- a host whose sampler runs one sample ahead makes a step of mixed
  samples: it trains nothing, counts nothing, and every host raises
  `HostsDisagreeError`;
- hosts that differ in the data's length or in `clip_norm` are refused
  with `HostsDisagreeError` on every host before any step.
"""

import json
import os
import signal
import sys
from pathlib import Path

import keras
import numpy as np
import pytest

from benchmarks.scale import free_port
from tests.models.test_fedemb_multi_host import run_all
from tests.models.worker_results import once_per_run, round_changes

WORKER = Path(__file__).with_name("dp_model_multi_host_worker.py")
BACKEND = keras.backend.backend()
HOSTS = 2
STEPS = 3  # The worker's fits: one epoch of 3 steps.
EXAMPLES_PER_USER, K = 3, 2  # Users of 3 examples, at most k = 2 a step.
NOISE_STD = 1.0 * 1.0 / 16  # z C / B of the worker's noise scenario.
SEEDED = ("examples", "users")


def run_job(out_dir):
    """Two hosts and the one-process reference, concurrently."""
    env = dict(os.environ, KERAS_BACKEND=BACKEND, CUDA_VISIBLE_DEVICES="-1")
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join(
        [str(Path(__file__).parents[2]), env.get("PYTHONPATH", "")]
    )
    port = free_port(HOSTS)
    reference_dir = out_dir / "reference"
    reference_dir.mkdir()
    runs = [(host, HOSTS, port, out_dir) for host in range(HOSTS)]
    runs.append((0, 1, 0, reference_dir))
    commands = [[sys.executable, str(WORKER), *map(str, run)] for run in runs]
    outputs = run_all(commands, env)
    # The process that failed first, before those killed for it.
    for code, output in sorted(outputs, key=lambda o: o[0] == -signal.SIGKILL):
        assert code == 0, output[-6000:]
    reports = [json.loads((out_dir / f"host{h}.json").read_text()) for h in range(2)]
    reports.append(json.loads((reference_dir / "host0.json").read_text()))
    return reports


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    """`[host 0, host 1, reference]`, computed once per run (also with xdist)."""
    return once_per_run(
        tmp_path_factory,
        f"dp_model_multi_host_{BACKEND}",
        lambda: run_job(tmp_path_factory.mktemp("dp_multi_host")),
    )


def scenario(report, name):
    result = report[name]
    if "error" in result:
        pytest.fail(f"{name} raised on host {report['host']}:\n{result['error']}")
    return result


def samples(result):
    """`{index: (indices, mask)}` of the samples a fit drew; a seeded
    sample is a function of its index, however often Keras read it."""
    drawn = {}
    for index, indices, mask in result["drawn"]:
        assert drawn.setdefault(index, (indices, mask)) == (indices, mask)
    assert set(range(STEPS)) <= set(drawn)
    return drawn


def real(indices, mask):
    return [i for i, m in zip(indices, mask, strict=True) if m]


def test_each_process_is_one_host_of_the_job(reports):
    assert [r["hosts"] for r in reports] == [[0, HOSTS], [1, HOSTS], [0, 1]]


@pytest.mark.parametrize("name", SEEDED)
def test_every_host_serves_its_half_of_every_sample(reports, name):
    results = [scenario(r, name) for r in reports]
    drawn = [samples(result) for result in results]
    for index in range(STEPS):
        sample = real(*drawn[HOSTS][index])  # The one process's.
        hosts_rows = []
        for host in range(HOSTS):
            indices, mask = drawn[host][index]
            assert real(indices, mask) == sample  # One sample everywhere.
            unit = K if name == "users" else 1  # A user slot: k rows.
            units = len(indices) // unit
            # Units (rows; slots of k rows at user level) dealt in turn:
            # units h, h + 2, ..., padding included.
            mine = [
                u * unit + r for u in range(host, units, HOSTS) for r in range(unit)
            ]
            served = [e for e in results[host]["served"] if e[0] == index]
            assert served  # Keras may read a batch more than once.
            for _, rows, served_mask, _ in served:
                assert rows == [indices[i] for i in mine]
                assert served_mask == [mask[i] for i in mine]
            hosts_rows.append(real(rows, served_mask))
            # Every host trains examples of the step, about half of them.
            assert len(hosts_rows[-1]) >= len(sample) // 2 - unit
        # Every sampled row is served by exactly one host.
        assert sorted(hosts_rows[0] + hosts_rows[1]) == sorted(sample)
        if name == "users":  # Whole users: no user on both hosts.
            users = [{row // EXAMPLES_PER_USER for row in rows} for rows in hosts_rows]
            assert not users[0] & users[1]
        digests = {
            e[3] for host in range(HOSTS) for e in results[host]["served"]
            if e[0] == index
        }  # fmt: skip
        assert len(digests) == 1  # The step's rows carry one batch digest.


@pytest.mark.parametrize("name", SEEDED)
def test_seeded_hosts_train_the_single_process_model(reports, name):
    single = scenario(reports[HOSTS], name)
    reference = round_changes({**single, "after_round": single["after_step"]})
    assert len(reference) == STEPS
    for change in reference:
        # Each step moves the weights well beyond the tolerance: sums
        # counted on one host only, or twice, would not pass.
        assert np.abs(change).max() > 1e-3
    results = [scenario(r, name) for r in reports[:HOSTS]]
    np.testing.assert_array_equal(results[0]["after_step"], results[1]["after_step"])
    for result in results:
        np.testing.assert_array_equal(result["before"], single["before"])
        for ours, theirs in zip(
            result["after_step"], single["after_step"], strict=True
        ):
            np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-6)
        assert result["private_steps"] == single["private_steps"] == [float(STEPS)]


def test_hosts_share_the_chiefs_seeds_and_add_the_noise_once(reports):
    results = [scenario(r, "noise") for r in reports[:HOSTS]]
    # The noise seeds drawn at fit (fresh: not those of the model's
    # construction) are the chief's on every host.
    assert results[0]["seed_at_start"] == results[1]["seed_at_start"]
    assert results[0]["seed_at_start"] != results[0]["seed_before"]
    # The chief's sampling seed: the same samples, drawn from entropy,
    # in the same order (a prefix: a host may have read one ahead).
    served = [[(e[0], e[3]) for e in r["served"]] for r in results]
    common = min(map(len, served))
    assert common >= STEPS and served[0][:common] == served[1][:common]
    digests = [digest for _, digest in served[0]]
    assert len(set(digests)) == len(digests)  # A fresh sample each time.
    # One model: the same noise on every host.
    np.testing.assert_array_equal(results[0]["after_step"], results[1]["after_step"])
    changes = round_changes({**results[0], "after_round": results[0]["after_step"]})
    assert len(changes) == STEPS and results[0]["private_steps"] == STEPS
    for change in changes:
        n = change.size
        assert n > 4000
        # Within 6 % of σ (the std of n draws is within 1/sqrt(2n) of it);
        # noise from each host would give 2 σ (√2 σ from seeds of their
        # own), none 0.
        assert np.std(change) == pytest.approx(NOISE_STD, rel=0.06)
        assert abs(np.mean(change)) < 5 * NOISE_STD / np.sqrt(n)
    correlation = np.corrcoef(changes[0], changes[1])[0, 1]
    assert abs(correlation) < 6 / np.sqrt(changes[0].size)  # Fresh each step.


def test_a_host_out_of_step_trains_nothing_and_stops_every_host(reports):
    results = [scenario(r, "drift") for r in reports[:HOSTS]]
    # Host 1 serves the sample after the chief's: one seed, one ahead.
    chief, ahead = ([e[3] for e in r["served"]] for r in results)
    common = min(len(chief) - 1, len(ahead))
    assert common >= 1 and ahead[:common] == chief[1 : common + 1]
    for result in results:
        assert result["refused"] is not None
        assert "different samples on different hosts" in result["refused"]
        assert result["private_steps"] == 0
        assert result["unchanged"]  # The mixed step released nothing.


@pytest.mark.parametrize("name", ["fewer_examples", "clip_norm"])
def test_hosts_that_differ_are_refused_before_any_step(reports, name):
    for report in reports[:HOSTS]:
        result = scenario(report, "refusals")[name]
        assert result["refused"] is not None
        assert "do not agree on privacy settings" in result["refused"]
        assert "host(s) [1] differ from the chief" in result["refused"]
        assert result["private_steps"] == 0
        assert result["unchanged"]


def test_hosts_with_other_rows_of_the_same_shape_are_refused(reports):
    for report in reports[:HOSTS]:
        result = scenario(report, "refusals")["other_rows"]
        assert result["refused"] is not None
        assert "do not agree on privacy settings" in result["refused"]
        assert result["private_steps"] == 0
        assert result["unchanged"]


def test_a_host_that_refuses_its_input_stops_every_host_before_any_step(reports):
    chief, other = (scenario(r, "refusals")["one_host_refuses"] for r in reports[:2])
    assert other["refused"].startswith("NonFiniteInputError")
    assert chief["refused"].startswith("HostsDisagreeError")
    assert "Host(s) [1] refused DPModel.fit" in chief["refused"]
    for result in (chief, other):
        assert result["private_steps"] == 0
        assert result["unchanged"]


def test_jax_processes_without_a_distribution_are_refused(reports):
    for report in reports[:HOSTS]:
        result = scenario(report, "refusals").get("no_distribution")
        if BACKEND == "tensorflow":
            # A TensorFlow model outside the strategy's scope is one host.
            assert result is None
            continue
        assert "no keras.distribution set" in result["refused"]
        assert "auto_shard_dataset=False" in result["refused"]
        assert result["private_steps"] == 0
        assert result["unchanged"]


def test_the_hosts_data_digest_reads_user_ids_by_value():
    from kdpemb.models.dp_sgd.distributed_fit import data_digest

    x = np.arange(12, dtype="float32").reshape(6, 2)
    y = np.arange(6)
    ids = ["ann", "bob", "ann", "cy", "bob", "cy"]

    def digest(users, x=x):
        return data_digest(x, y, np.asarray(users, dtype=object))

    # Two object arrays of the same ids (their addresses differ) agree;
    assert digest(list(ids)) == digest([str(i) for i in ids])
    # other ids, or other rows of x, do not.
    assert digest(ids) != digest(ids[::-1])
    assert digest(ids) != digest(ids, x=x[::-1].copy())
