"""Is the virtual-client pipeline fast enough to feed training?

Rounds of M = 64 expected clients, 8 local steps of batch 32, 32×32×3 uint8
images, from 10,000 users in P = 2,500 virtual clients of 4 (M_max = 117
client slots, about 90 MiB per round). Measured in one run:

- produced: rounds/s that `VirtualClients` builds, on 1 thread and on its
  default 2 prefetch workers;
- consumed: rounds/s of `fit` with a trivial model (cast to float, masked
  mean, one weight) fed an already-built round through the same prefetching
  PyDataset machinery, so only the step and the host-to-device copy count;
- end to end: rounds/s of the same `fit` fed by `VirtualClients`.

The pipeline is not the bottleneck when produced / consumed >= 1 and end to
end / consumed is close to 1.
"""

import concurrent.futures
import time
import warnings

import keras
import numpy as np

from kdpemb.data import VirtualClients
from kdpemb.datasets import synthetic_identities
from kdpemb.testing import RoundConsumer


class _SameRound(keras.utils.PyDataset):
    def __init__(self, element, rounds, **kwargs):
        super().__init__(**kwargs)
        self.element, self.rounds = element, rounds

    def __len__(self):
        return self.rounds

    def __getitem__(self, index):
        return self.element


def _fit_rate(data, rounds):
    model = RoundConsumer(scale=1 / 255)
    model.compile(optimizer=keras.optimizers.SGD(0.1))
    model.fit(data, epochs=1, steps_per_epoch=2, verbose=0)  # Compile.
    start = time.perf_counter()
    model.fit(data, epochs=1, steps_per_epoch=rounds, verbose=0)
    return rounds / (time.perf_counter() - start)


def _produce_rate(clients, rounds, threads):
    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        for _ in pool.map(clients.round, range(1000, 1000 + rounds)):
            pass
    return rounds / (time.perf_counter() - start)


def run(quick=False):
    identities, per_identity, rounds = (400, 2, 3) if quick else (10_000, 4, 30)
    data = synthetic_identities(identities, per_identity, image_size=32, seed=0)
    start = time.perf_counter()
    images = np.asarray(data.images)
    render_seconds = time.perf_counter() - start
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # A seed, for a benchmark.
        clients = VirtualClients(
            images, data.labels, data.user_ids,
            clients_per_round=64, users_per_client=4, local_steps=8, batch_size=32,
            rounds_per_epoch=rounds, seed=0,
        )  # fmt: skip
    produced_1 = _produce_rate(clients, rounds, threads=1)
    produced_2 = _produce_rate(clients, rounds, threads=clients.workers)
    same_round = _SameRound(
        clients.round(0), rounds,
        workers=clients.workers, max_queue_size=clients.max_queue_size,
    )  # fmt: skip
    consumed = _fit_rate(same_round, rounds)
    end_to_end = _fit_rate(clients, rounds)
    return {
        "figures": {
            "images rendered per s": round(len(images) / render_seconds),
            "client slots per round (M_max)": clients.max_clients_per_round,
            "MiB per round": round(clients.round_nbytes / 2**20, 1),
            "produced rounds/s, 1 thread": produced_1,
            f"produced rounds/s, {clients.workers} workers": produced_2,
            "consumed rounds/s (trivial step)": consumed,
            "end-to-end rounds/s (fit on VirtualClients)": end_to_end,
        },
        "ratios": {
            "produced (1 thread) / consumed": produced_1 / consumed,
            "produced (workers) / consumed": produced_2 / consumed,
            "end to end / consumed": end_to_end / consumed,
        },
    }
