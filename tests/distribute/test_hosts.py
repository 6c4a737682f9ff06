"""`Hosts` and `VirtualClients.join_hosts`, with hosts simulated by threads.

Each thread is one host; their `all_gather` meets at a barrier, as the
engines' collectives do. `test_fedemb_multi_host.py` runs real processes.
"""

import threading

import numpy as np
import pytest

from kdpemb.data import VirtualClients
from kdpemb.datasets import synthetic_identities
from kdpemb.distribute import Hosts, current_hosts
from kdpemb.errors import HostsDisagreeError


def on_hosts(count, work):
    """`[work(hosts) for each host]`, run concurrently; exceptions returned.

    No clock: a host that leaves (returns or raises) while another waits in
    an `all_gather` it never joins, or before another enters one, breaks it
    (BrokenBarrierError on that host), so every thread ends.
    """
    barrier = threading.Barrier(count)
    lock = threading.Lock()
    rows = [None] * count
    entered = [0] * count  # all_gathers each host has entered ...
    completed = [0] * count  # ... and come out of.
    gone = [False] * count

    def make(index):
        def all_gather(words):
            with lock:
                entered[index] += 1
                if any(gone):
                    raise threading.BrokenBarrierError(
                        f"host {gone.index(True)} left before this all_gather"
                    )
            rows[index] = np.array(words, np.int32)
            barrier.wait()
            gathered = np.stack(rows)
            barrier.wait()
            with lock:
                completed[index] += 1
            return gathered

        return Hosts(index, count, all_gather, engine="threads")

    results = [None] * count

    def run(index):
        try:
            results[index] = work(make(index))
        except Exception as error:  # Returned to the test.
            results[index] = error
        finally:
            with lock:
                gone[index] = True
                if max(entered) > completed[index]:  # Someone waits for it.
                    barrier.abort()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


def test_a_host_that_leaves_breaks_the_others_all_gather():
    # What keeps `on_hosts` from waiting forever on a host that is gone.
    def work(hosts, leave):
        if hosts.index == 1:
            return leave()  # Never gathers: host 0 would wait forever.
        return hosts.gather_ints([1])

    def refuse():
        raise ValueError("refused")

    for leave, gone in ((lambda: "left", "left"), (refuse, ValueError)):
        host0, host1 = on_hosts(2, lambda hosts, leave=leave: work(hosts, leave))
        assert isinstance(host0, threading.BrokenBarrierError), host0
        assert host1 == gone or isinstance(host1, gone)


def test_one_process_is_one_chief_host():
    hosts = current_hosts()
    assert (hosts.index, hosts.count, hosts.is_chief) == (0, 1, True)


def test_ints_are_shared_exactly():
    big = 2**255 + 12345
    results = on_hosts(3, lambda h: h.gather_ints([h.index, big - h.index]))
    expected = [[h, big - h] for h in range(3)]
    assert results == [expected] * 3
    assert on_hosts(3, lambda h: h.broadcast_int(10 + h.index)) == [10] * 3
    assert on_hosts(3, lambda h: h.max_int(5 - h.index)) == [5] * 3


def test_shared_bits_are_the_chiefs_fresh_draw():
    first = on_hosts(2, lambda h: h.shared_bits(128))
    second = on_hosts(2, lambda h: h.shared_bits(128))
    assert first[0] == first[1] and second[0] == second[1]
    assert first[0] != second[0]  # Fresh entropy each time (2^-128 to fail).
    assert 0 <= first[0] < 2**128


def test_every_host_refuses_when_one_differs():
    results = on_hosts(
        3, lambda h: h.check_agree({"weights": b"w", "plan": b"p" + bytes([h.index])})
    )
    for result in results:
        assert isinstance(result, HostsDisagreeError)
        assert "plan" in str(result) and "host(s) [1, 2]" in str(result)
        assert "weights" not in str(result).split("(")[0]
    assert on_hosts(2, lambda h: h.check_agree({"weights": b"w"})) == [None, None]


def test_bad_values_are_refused():
    with pytest.raises(ValueError, match="2\\*\\*256"):
        Hosts.single().gather_ints([2**256])
    with pytest.raises(ValueError, match="all_gather"):
        Hosts(0, 2, None)
    with pytest.raises(ValueError, match="not in"):
        Hosts(2, 2, lambda w: w)


DATA = synthetic_identities(16, 3, image_size=8, channels=1, seed=0)


def make_clients(seed=None, data=DATA, max_clients=8):
    return VirtualClients(
        data,
        clients_per_round=6,
        users_per_client=2,
        num_clients=8,
        max_clients_per_round=max_clients,
        batch_size=2,
        seed=seed,
        workers=1,
    )


def test_hosts_take_the_chiefs_sampling_seed_and_serve_their_slices():
    def work(hosts):
        clients = make_clients()
        own = clients.plan_fingerprint()
        clients.join_hosts(hosts)
        return own, clients

    (own0, chief), (own1, other) = on_hosts(2, work)
    assert own0 != own1  # Each host drew its own seed first.
    assert chief.plan_fingerprint() == other.plan_fingerprint()
    assert (chief.host_index, other.host_index) == (0, 1)
    assert chief.rows_per_host == 4
    for index in range(3):
        whole = chief.round(index)
        np.testing.assert_array_equal(whole["images"], other.round(index)["images"])
        sampled = np.flatnonzero(whole["client_mask"])
        assert sampled.size >= 2
        for host, clients in enumerate((chief, other)):
            part = clients.host_round(index)
            mine = sampled[host::2]
            assert part["images"].shape[0] == 4
            assert part["client_mask"].tolist() == [True] * mine.size + [False] * (
                4 - mine.size
            )
            for key in ("images", "global_labels", "example_mask", "labels"):
                np.testing.assert_array_equal(part[key][: mine.size], whole[key][mine])
                assert not part[key][mine.size :].any()
    # Keras reads the host's slice.
    assert chief[0]["images"].shape[0] == 4


def test_hosts_with_other_seeds_or_data_refuse_before_any_round():
    results = on_hosts(2, lambda h: make_clients(seed=1 + h.index).join_hosts(h))
    assert all(isinstance(r, HostsDisagreeError) for r in results), results
    assert "round plan" in str(results[0])
    # Another user index (more examples per user). Pixels are not compared.
    other_data = synthetic_identities(16, 4, image_size=8, channels=1, seed=0)

    def join(hosts):
        make_clients(data=other_data if hosts.index else DATA).join_hosts(hosts)

    results = on_hosts(2, join)
    assert all(isinstance(r, HostsDisagreeError) for r in results), results


def test_rows_that_do_not_split_over_the_hosts_are_refused():
    with pytest.warns(UserWarning, match="max_clients_per_round=7"):
        clients = make_clients(max_clients=7)
    with pytest.raises(ValueError, match="max_clients_per_round=8"):
        clients.join_hosts(Hosts(0, 2, lambda w: np.stack([w] * 2)))
    # 9 rows would be more than the P = 8 virtual clients a round can hold.
    with pytest.raises(ValueError, match="num_clients >= 9"):
        clients.join_hosts(Hosts(0, 3, lambda w: np.stack([w] * 3)))


def test_a_host_that_refuses_stops_every_host_before_any_collective():
    def work(hosts):
        with hosts.together("the checks"):
            if hosts.index == 1:
                raise ValueError("bad flag on host 1")
        return "passed"

    chief, other = on_hosts(2, work)
    assert isinstance(other, ValueError) and "bad flag" in str(other)
    assert isinstance(chief, HostsDisagreeError)
    assert "Host(s) [1] refused the checks" in str(chief)


def fedemb_model(clients, **settings):
    import keras

    from kdpemb.models import FedEmbModel

    keras.utils.set_random_seed(0)
    backbone = keras.Sequential(
        [keras.Input((8, 8, 1)), keras.layers.Flatten(), keras.layers.Dense(4)]
    )
    return FedEmbModel(backbone, schedule=clients.schedule, **settings)


@pytest.mark.parametrize(
    "change",
    [{"noise_multiplier": 1.5}, {"clip_norm": 2.0}, {"log_local_loss": True}],
    ids=lambda c: next(iter(c)),
)
def test_hosts_with_other_privacy_settings_are_refused(change):
    from kdpemb.models.fedemb import fedemb_multi_host as multi_host

    clients = make_clients(seed=0)
    base = {"clip_norm": 1.0, "noise_multiplier": 1.0}
    models = [
        fedemb_model(clients, **base),
        fedemb_model(clients, **{**base, **change}),
    ]
    for mine, chiefs in zip(models[1].variables, models[0].variables, strict=True):
        mine.assign(chiefs)  # The same variables (seeds too): only settings differ.

    def begin(hosts):
        guard = multi_host.HostsGuard(hosts)
        guard.set_model(models[hosts.index])
        guard.on_train_begin()

    results = on_hosts(2, begin)
    assert all(isinstance(r, HostsDisagreeError) for r in results), results
    assert "privacy settings" in str(results[0])
    assert "model variables" not in str(results[0]).split("(")[0]
    models[1] = models[0]
    assert on_hosts(2, begin) == [None, None]  # The same model passes.


def test_every_host_takes_the_chiefs_fresh_noise_seeds_at_each_fit():
    import keras

    clients = make_clients(seed=0)
    models = [fedemb_model(clients, clip_norm=1.0, noise_multiplier=1.0) for _ in "ab"]

    def state(model):
        return keras.ops.convert_to_numpy(model.noise_seed.state.value).tolist()

    def reseed(hosts):
        models[hosts.index]._reseed(hosts)
        return state(models[hosts.index])

    first = on_hosts(2, reseed)
    second = on_hosts(2, reseed)
    assert first[0] == first[1] and second[0] == second[1]
    assert first[0] != second[0]
