"""FedEmbModel on several hosts: real processes, one round plan, noise once.

`multi_host_worker.py` runs as two local processes that form one job
(JAX: `jax.distributed` over gloo with `DataParallel`; TensorFlow: two
`MultiWorkerMirroredStrategy` workers on localhost ports), and as a third,
single process, the reference on the same seeded rounds. The tests check:

- every host serves its slice (clients h, h + 2, ...) of the round plan
  that one process draws, and the same rounds in the same order, reading
  from the one `UserShards` directory only its own clients' examples;
- seeded, without noise and clipping, the two hosts give the single
  process's model round by round (clients summed over hosts once);
- with seeds from entropy, the hosts hold the chief's sampling seed and
  identical models, and each round adds N(0, (zC/M)²) once: a host
  adding its own noise would give √2 σ, and the hosts would differ (also
  with Python's `random` different on each host);
- a host whose round source runs ahead makes a round of mixed rounds:
  it trains nothing, counts nothing, and every host stops with
  `HostsDisagreeError`;
- a stopped job resumes on both hosts from the chief's backup and ledger,
  with the step count exact, and only the chief wrote files.
"""

import json
import os
import queue
import signal
import subprocess
import sys
import threading
from pathlib import Path

import keras
import numpy as np
import pytest

from benchmarks.scale import free_port
from kdpemb.datasets import synthetic_identities, write_user_shards
from tests.models.worker_results import once_per_run, round_changes

WORKER = Path(__file__).with_name("multi_host_worker.py")
SETUP = {
    "num_identities": 16,
    "images_per_identity": 4,
    "image_size": 8,
    "channels": 1,
    "seed": 3,
}
BACKEND = keras.backend.backend()
HOSTS = 2
ROUNDS = 2
MAX_CLIENTS = 8
NOISE_STD = 1.0 * 1.0 / 6  # z C / M of the worker's noise scenario.


def setup_data():
    """The worker's `make_data()` (16 users of 4 images of 8 x 8)."""
    return synthetic_identities(**SETUP)


def run_job(out_dir):
    """Two hosts and the one-process reference, concurrently."""
    env = dict(os.environ, KERAS_BACKEND=BACKEND, CUDA_VISIBLE_DEVICES="-1")
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join(
        [str(Path(__file__).parents[2]), env.get("PYTHONPATH", "")]
    )
    data_dir = out_dir / "users"
    write_user_shards(data_dir, setup_data())
    jobs = [(host, HOSTS, free_port(HOSTS)) for host in range(HOSTS)]
    jobs[1] = (1, HOSTS, jobs[0][2])
    reference_dir = out_dir / "reference"
    reference_dir.mkdir()
    runs = [(*job, out_dir) for job in jobs] + [(0, 1, 0, reference_dir)]
    commands = [
        [sys.executable, str(WORKER), *map(str, run), str(data_dir)] for run in runs
    ]
    outputs = run_all(commands, env)
    # The process that failed first, before those killed for it.
    for code, output in sorted(outputs, key=lambda o: o[0] == -signal.SIGKILL):
        assert code == 0, output[-6000:]
    reports = [json.loads((out_dir / f"host{h}.json").read_text()) for h in range(2)]
    reports.append(json.loads((reference_dir / "host0.json").read_text()))
    return reports


def run_all(commands, env):
    """`[(exit status, output)]` of `commands`, run concurrently.

    No timeout: the workers' work is bounded, and the first to fail (a host
    that dies leaves its peer waiting in a collective) gets the others
    killed, so every process ends.
    """
    processes = [
        subprocess.Popen(
            command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
        )
        for command in commands
    ]
    outputs = [None] * len(processes)
    ended = queue.Queue()

    def collect(index):
        try:
            output, _ = processes[index].communicate()
            outputs[index] = (
                processes[index].returncode,
                output.decode("utf-8", "replace"),
            )
        finally:
            if outputs[index] is None:
                outputs[index] = (None, "reading the output failed")
            ended.put(index)

    threads = [
        threading.Thread(target=collect, args=(i,), daemon=True)
        for i in range(len(processes))
    ]
    try:
        for thread in threads:
            thread.start()
        for _ in processes:
            if outputs[ended.get()][0] != 0:
                break
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
        for thread in threads:
            thread.join()
    return outputs


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    """`[host 0, host 1, reference]`, computed once per run (also with xdist)."""
    return once_per_run(
        tmp_path_factory,
        f"fedemb_multi_host_{BACKEND}",
        lambda: run_job(tmp_path_factory.mktemp("multi_host")),
    )


def scenario(report, name):
    result = report[name]
    if "error" in result:
        pytest.fail(f"{name} raised on host {report['host']}:\n{result['error']}")
    return result


def test_each_process_is_one_host_of_the_job(reports):
    assert [r["hosts"] for r in reports] == [[0, HOSTS], [1, HOSTS], [0, 1]]


def test_every_host_serves_its_slice_of_the_same_round_plan(reports):
    rows = MAX_CLIENTS // HOSTS
    served = [scenario(r, "equivalence")["served"] for r in reports[:HOSTS]]
    full = scenario(reports[0], "equivalence")["full_rounds"]
    # The rounds trained come first (TensorFlow's input pipeline may have
    # prepared a few more ahead, which no step took).
    indices = [[entry["index"] for entry in host][:ROUNDS] for host in served]
    assert indices[0] == indices[1] and len(indices[0]) == ROUNDS
    for position, whole in enumerate(full[:ROUNDS]):
        sampled = [i for i, kept in enumerate(whole["mask"]) if kept]
        assert len(sampled) >= HOSTS  # Both hosts train clients.
        for host in range(HOSTS):
            entry = served[host][position]
            mine = sampled[host::HOSTS]
            assert len(entry["mask"]) == rows
            assert entry["mask"] == [True] * len(mine) + [False] * (rows - len(mine))
            # The clients h, h + H, ... of the plan, with their examples.
            for row, client in enumerate(mine):
                assert entry["labels"][row] == whole["labels"][client]
        # Every sampled client is served by exactly one host.
        assert sum(sum(served[h][position]["mask"]) for h in range(HOSTS)) == len(
            sampled
        )


def test_each_host_reads_only_the_examples_of_its_own_rows(reports):
    for report in reports[:HOSTS]:
        result = scenario(report, "equivalence")
        assert result["rows_of_my_clients"] > 0
        assert result["read_rows"] == result["rows_of_my_clients"]
        assert result["read_outside_my_clients"] == 0
        # The other host's clients hold examples this host never read.
        assert result["rows_of_my_clients"] < result["rows_of_all_clients"]
    single = scenario(reports[HOSTS], "equivalence")  # One host reads them all.
    assert single["read_rows"] == single["rows_of_all_clients"]


def test_seeded_hosts_train_the_single_process_model(reports):
    single = scenario(reports[HOSTS], "equivalence")
    reference = round_changes(single)
    assert len(reference) == ROUNDS
    for change in reference:
        # Each round moves the backbone well beyond the tolerance: clients
        # counted twice, or divided by M twice, would not pass.
        assert np.abs(change).max() > 1e-3
    for report in reports[:HOSTS]:
        result = scenario(report, "equivalence")
        np.testing.assert_array_equal(result["before"], single["before"])
        for ours, theirs in zip(
            result["after_round"], single["after_round"], strict=True
        ):
            np.testing.assert_allclose(ours, theirs, rtol=0, atol=2e-6)
        assert result["private_steps"] == [float(ROUNDS)]


def test_hosts_share_the_chiefs_seeds_and_add_the_noise_once(reports):
    results = [scenario(r, "noise") for r in reports[:HOSTS]]
    # Each host drew its own sampling seed, then took the chief's.
    assert results[0]["seed_before"] != results[1]["seed_before"]
    assert results[0]["seed_after"] == results[1]["seed_after"]
    assert results[0]["plan"] == results[1]["plan"]
    # One model: the same noise on every host.
    np.testing.assert_array_equal(results[0]["after_round"], results[1]["after_round"])
    changes = round_changes(results[0])
    assert len(changes) == ROUNDS
    for change in changes:
        n = change.size
        assert n > 2000
        # Within 6 % of σ (the std of n draws is within 1/sqrt(2n) of it);
        # noise from each host would give √2 σ, none 0.
        assert np.std(change) == pytest.approx(NOISE_STD, rel=0.06)
        assert abs(np.mean(change)) < 5 * NOISE_STD / np.sqrt(n)
    correlation = np.corrcoef(changes[0], changes[1])[0, 1]
    assert abs(correlation) < 6 / np.sqrt(changes[0].size)  # Fresh each round.


def test_a_host_out_of_step_trains_nothing_and_stops_every_host(reports):
    for report in reports[:HOSTS]:
        result = scenario(report, "drift")
        assert result["refused"] is not None
        assert "different rounds on different hosts" in result["refused"]
        assert result["private_steps"] == 0
        assert result["unchanged"]  # The mixed round released nothing.


def test_a_stopped_job_resumes_on_every_host_from_the_chiefs_files(reports):
    results = [scenario(r, "resume") for r in reports[:HOSTS]]
    for result in results:
        # Stopped at the start of epoch 2 (of 3): one epoch of rounds ran.
        assert result["steps_at_stop"] == ROUNDS
        assert result["ledger_at_stop"] == ROUNDS
        # The new job restored the chief's backup and ran epochs 2 and 3.
        assert result["epochs_after_resume"] == [1, 2]
        assert result["private_steps"] == 3 * ROUNDS
        assert result["history_steps"] == [2.0 * ROUNDS, 3.0 * ROUNDS]
        assert result["ledger_after"] == 3 * ROUNDS
    assert results[0]["saved"] == results[1]["saved"]
    assert results[0]["after"] == results[1]["after"]
    assert results[0]["files_written"] > 0
    assert results[1]["files_written"] == 0


def test_set_ups_that_cannot_span_the_hosts_are_refused_before_any_round(reports):
    for report in reports[:HOSTS]:
        result = scenario(report, "refusals")
        assert "RecallAtFAR evaluates in one process" in result["recall_at_far"]
        assert "kdpemb.data.VirtualClients" in result["other_round_source"]
        assert "steps_per_execution=2" in result["steps_per_execution"]
        assert result["private_steps"] == 0
    # A backup that one host cannot read stops both, neither left waiting.
    chief, other = (scenario(r, "refusals")["restore"] for r in reports[:HOSTS])
    assert other == "OSError: unreadable backup on host 1"
    assert chief.startswith("HostsDisagreeError: Host(s) [1] refused restoring")
