"""How much memory does training from user shards on disk take?

`reader_memory(num_images, num_users)` writes a dataset of that size with
`kdpemb.datasets.write_user_shards` (from a `PyDataset` of chunks, so the
writer streams), then opens `VirtualClients(UserShards(directory), ...)`
and builds some rounds. Each step runs in a fresh Python process, so the
measures do not mix; each reports from `/proc/self/status`:

- `RssAnon`: anonymous memory (heap, arrays): what grows if something is
  held per example or per user;
- `RssFile`: file pages mapped in (the shards and the index): reclaimable
  page cache, shared between processes;
- `VmHWM`: the process's peak resident memory.

The reader's figures are given after the imports (baseline), after opening
the dataset and building `VirtualClients`, and after the rounds, with the
on-disk size of the per-user index and the time of each round (the
sampling hashes every user's key every round).

Usage:
    python -m benchmarks.reader_memory                  # the sizes below
    python -m benchmarks.reader_memory --quick          # small sizes
    python -m benchmarks.reader_memory 1000000 10000    # one size
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

SIZES = (
    (100_000, 10_000),
    (1_000_000, 10_000),
    (10_000_000, 10_000),
    (10_000_000, 10_000_000),  # The per-user index at 10M users.
)
QUICK_SIZES = ((20_000, 1_000), (20_000, 20_000))
_CHUNK = 2**16


def status():
    """RssAnon, RssFile and VmHWM of this process, in MiB."""
    values = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("RssAnon", "RssFile", "VmHWM"):
                values[key] = int(rest.split()[0]) / 1024  # kB to MiB.
    return values


class AnonPeak:
    """The largest RssAnon seen while the block runs (sampled every 2 ms).

    `/proc` keeps a peak of the whole resident set (VmHWM, file pages
    included) but none of anonymous memory alone, so a thread samples it.
    """

    def __enter__(self):
        import threading

        self.peak, self._stop = status()["RssAnon"], threading.Event()

        def sample():
            while not self._stop.wait(0.002):
                self.peak = max(self.peak, status()["RssAnon"])

        self._thread = threading.Thread(target=sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, status()["RssAnon"])
        return False


def _rss(values):
    return values["RssAnon"] + values["RssFile"]


def reset_peak():
    """Resets VmHWM to the current RSS (Linux: /proc/self/clear_refs)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def _write(directory, num_images, num_users, image_shape):
    import keras
    import numpy as np

    from kdpemb.datasets import write_user_shards

    class Chunks(keras.utils.PyDataset):
        """Image i belongs to user i % num_users, who holds one identity."""

        def __len__(self):
            return -(-num_images // _CHUNK)

        def __getitem__(self, index):
            rows = np.arange(index * _CHUNK, min((index + 1) * _CHUNK, num_images))
            images = np.empty((rows.size, *image_shape), np.uint8)
            images[...] = (rows % 251).astype(np.uint8).reshape(-1, 1, 1, 1)
            users = rows % num_users
            return images, users % 1000, users

    before = status()
    reset_peak()
    start = time.perf_counter()
    with AnonPeak() as anon:
        shards = write_user_shards(directory, Chunks())
    seconds = time.perf_counter() - start
    return {
        "write seconds": round(seconds, 1),
        "writer baseline [MiB]": before,
        "writer peak VmHWM [MiB]": status()["VmHWM"],
        "writer peak RssAnon above baseline [MiB]": anon.peak - before["RssAnon"],
        "num_shards": shards.num_shards,
        "index bytes on disk": shards.index_nbytes,
        "shard bytes on disk": sum(
            os.path.getsize(os.path.join(directory, name))
            for name in os.listdir(directory)
            if name.startswith("shard-")
        ),
    }


def _read(directory, rounds, users_per_client, clients_per_round):
    import warnings

    import numpy as np

    from kdpemb.data import VirtualClients
    from kdpemb.datasets import UserShards

    baseline = status()
    reset_peak()
    start = time.perf_counter()
    with AnonPeak() as opening, warnings.catch_warnings():
        shards = UserShards(directory)
        warnings.simplefilter("ignore")
        clients = VirtualClients(
            shards,
            clients_per_round=clients_per_round,
            users_per_client=users_per_client,
            local_steps=2,
            batch_size=8,
            seed=0,
        )
    open_seconds = time.perf_counter() - start
    opened = status()
    reset_peak()
    times = []
    with AnonPeak() as sampling:
        for r in range(rounds):
            start = time.perf_counter()
            element = clients.round(r)
            times.append(time.perf_counter() - start)
            assert element["client_mask"].any()
    after = status()
    return {
        "reader baseline (imports) [MiB]": baseline,
        "reader after opening [MiB]": opened,
        "reader after rounds [MiB]": after,
        "RssAnon growth, opening [MiB]": opened["RssAnon"] - baseline["RssAnon"],
        "RssAnon growth, opening + rounds [MiB]": after["RssAnon"]
        - baseline["RssAnon"],
        "peak RSS above baseline, opening [MiB]": opened["VmHWM"] - _rss(baseline),
        "peak RSS above baseline, rounds [MiB]": after["VmHWM"] - _rss(baseline),
        "peak RssAnon above baseline, opening [MiB]": opening.peak
        - baseline["RssAnon"],
        "peak RssAnon above baseline, rounds [MiB]": sampling.peak
        - baseline["RssAnon"],
        "open seconds": round(open_seconds, 2),
        "round seconds (median)": round(float(np.median(times)), 3),
        "round seconds (first)": round(times[0], 3),
        "num_users": clients.num_users,
        "num_examples": clients.num_examples,
    }


def _child(args):
    """Runs one step in this process: `write` or `read`."""
    step, directory = args[0], args[1]
    numbers = [int(a) for a in args[2:]]
    if step == "write":
        num_images, num_users, *shape = numbers
        result = _write(directory, num_images, num_users, tuple(shape))
    else:
        result = _read(directory, *numbers)
    print(json.dumps(result))


def _run_child(*args):
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.reader_memory", "--child", *map(str, args)],
        capture_output=True,
        text=True,
        check=False,
    )
    if out.returncode != 0:
        raise RuntimeError(f"benchmark step {args[0]} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def reader_memory(
    num_images,
    num_users,
    image_shape=(4, 4, 1),
    rounds=3,
    users_per_client=1,
    clients_per_round=64,
):
    """Writes, opens and samples a dataset of this size; returns the figures.

    The writing and the reading run in two fresh processes (see the
    module docstring); the dataset is written to a temporary directory,
    removed at the end.

    Args:
        num_images: int. Images (image i belongs to user i % num_users).
        num_users: int. Users, at most `num_images`.
        image_shape: tuple. `(H, W, C)` of the uint8 images.
        rounds: int. Rounds built after opening.
        users_per_client: int. k of `VirtualClients`.
        clients_per_round: float. M of `VirtualClients`.

    Returns:
        dict of figures: memory (MiB) from `/proc/self/status` of the
        writer and of the reader, bytes on disk, seconds.

    Example:

    >>> figures = reader_memory(2_000, 100, rounds=1)  # doctest: +SKIP
    >>> figures["index bytes on disk"] < 10_000  # doctest: +SKIP
    True
    """
    directory = tempfile.mkdtemp(prefix="kdpemb-reader-memory-")
    try:
        dataset = os.path.join(directory, "data")
        written = _run_child("write", dataset, num_images, num_users, *image_shape)
        read = _run_child("read", dataset, rounds, users_per_client, clients_per_round)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    return {
        "num_images": num_images,
        "num_users": num_users,
        "image_shape": list(image_shape),
        **written,
        **read,
    }


def run(quick=False):
    """Every size of `SIZES` (`QUICK_SIZES` with `quick`), as figures."""
    figures = {}
    for num_images, num_users in QUICK_SIZES if quick else SIZES:
        result = reader_memory(num_images, num_users)
        name = f"{num_images:,} images, {num_users:,} users"
        figures[f"{name}: index on disk [MiB]"] = result["index bytes on disk"] / 2**20
        figures[f"{name}: reader RssAnon growth [MiB]"] = result[
            "RssAnon growth, opening + rounds [MiB]"
        ]
        figures[f"{name}: round [s]"] = result["round seconds (median)"]
    return {"figures": figures, "ratios": {}}


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        _child(argv[1:])
        return 0
    parser = argparse.ArgumentParser(prog="python -m benchmarks.reader_memory")
    parser.add_argument("sizes", nargs="*", type=int, help="num_images num_users")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--users-per-client", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    if args.sizes:
        sizes = [tuple(args.sizes[i : i + 2]) for i in range(0, len(args.sizes), 2)]
    else:
        sizes = QUICK_SIZES if args.quick else SIZES
    for num_images, num_users in sizes:
        result = reader_memory(
            num_images,
            num_users,
            rounds=args.rounds,
            users_per_client=args.users_per_client,
        )
        print(json.dumps(result, indent=1), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
