"""`Hosts`: the processes of one training job, and what they must share.

A DP-FedEmb round spans every host: each builds its slice of the round's
client rows, the engine sums the clipped updates over all of them, and
the noise is added once. That is only private if the hosts agree on what
no single host may choose alone:

- the sampling seed of `VirtualClients` and the noise seeds of the model
  are drawn once, from OS entropy on the chief (host 0), and sent to the
  others (`shared_bits`), never derived from a fixed number;
- the round plan, the model's weights and its step count are compared
  across hosts before the first round (`check_agree`), and a difference
  stops every host with the same error, before any round.

The transport is the engine's own collective (`jax.experimental.
multihost_utils` on JAX, the `tf.distribute` strategy's all-reduce on
TensorFlow), in `kdpemb.distribute._jax_backend` and `_tensorflow_backend`.
Every host must make the same calls in the same order, which the same
training script on every host does.

Example:

>>> from kdpemb.distribute import Hosts
>>> hosts = Hosts.single()  # One process: nothing to share.
>>> hosts.count, hosts.index, hosts.is_chief
(1, 0, True)
>>> 0 <= hosts.shared_bits(128) < 2**128
True
>>> hosts.check_agree({"seed": b"same everywhere"})
"""

import contextlib
import hashlib
import secrets

import numpy as np

from kdpemb.errors import HostsDisagreeError

# Collectives carry int32 words of 16 bits: exact on every engine and
# device (JAX keeps int32 without x64; sums of one-hot rows never carry).
_WORD_BITS = 16


class Hosts:
    """The hosts of a training job: how many, which one this is, and the
    collectives that share values between them.

    Build it with `kdpemb.distribute.current_hosts(model)`; a single
    process is `Hosts.single()`.

    Args:
        index: int. This host's index, 0 for the chief.
        count: int. The number of hosts.
        all_gather: callable or None. `all_gather(words)` takes an int32
            array `[n]` of this host's words and returns `[count, n]`, row
            h from host h, on every host; None for a single host.
        engine: str. What carries the collectives, for messages.

    Example:

    >>> hosts = Hosts(index=0, count=1, all_gather=None)
    >>> hosts.broadcast_int(7)
    7
    """

    def __init__(self, index, count, all_gather, engine="one process"):
        if not 0 <= index < count:
            raise ValueError(f"Host index {index} is not in [0, {count}).")
        if count > 1 and all_gather is None:
            raise ValueError(f"{count} hosts need an all_gather collective.")
        self.index = int(index)
        self.count = int(count)
        self.engine = engine
        self._all_gather = all_gather

    @classmethod
    def single(cls):
        """One process, no collective."""
        return cls(0, 1, None)

    @property
    def is_chief(self):
        """True on host 0, which draws shared entropy and writes files."""
        return self.index == 0

    def __repr__(self):
        return f"Hosts(index={self.index}, count={self.count}, engine={self.engine!r})"

    # -------------------------------------------------------- sharing --

    def gather_ints(self, values):
        """`[count, len(values)]` Python ints: every host's `values`.

        Each value is a non-negative int below 2**256.

        Example:

        >>> Hosts.single().gather_ints([3, 2**70])
        [[3, 1180591620717411303424]]
        """
        values = [int(v) for v in values]
        for value in values:
            if not 0 <= value < 2**256:
                raise ValueError(f"Can only share ints in [0, 2**256), got {value}.")
        if self.count == 1:
            return [values]
        words_per_value = 256 // _WORD_BITS
        words = np.array(
            [
                (value >> (_WORD_BITS * i)) & (2**_WORD_BITS - 1)
                for value in values
                for i in range(words_per_value)
            ],
            dtype=np.int32,
        )
        gathered = np.asarray(self._all_gather(words)).astype(np.int64)
        if gathered.shape != (self.count, words.size):
            raise RuntimeError(
                f"The {self.engine} collective returned shape {gathered.shape}, "
                f"expected {(self.count, words.size)}."
            )
        rows = []
        for row in gathered:
            chunks = row.reshape(len(values), words_per_value)
            rows.append(
                [
                    sum(int(w) << (_WORD_BITS * i) for i, w in enumerate(chunk))
                    for chunk in chunks
                ]
            )
        return rows

    def broadcast_int(self, value):
        """The chief's `value` on every host (a non-negative int < 2**256)."""
        return self.gather_ints([value])[0][0]

    def shared_bits(self, bits):
        """`bits` random bits drawn from OS entropy on the chief, the same
        on every host (on one host, a fresh `secrets.randbits`)."""
        if not 0 < bits <= 256:
            raise ValueError(f"bits must be in (0, 256], got {bits}.")
        draw = secrets.randbits(bits) if self.is_chief else 0
        return self.broadcast_int(draw)

    def max_int(self, value):
        """The largest of every host's `value` (non-negative), on every host."""
        return max(row[0] for row in self.gather_ints([value]))

    @contextlib.contextmanager
    def together(self, what):
        """Runs the block on every host, then has the hosts tell each other
        whether it raised anywhere: a host that raised re-raises its error,
        and the others raise `HostsDisagreeError` naming it, so that no host
        goes on to wait in a collective for one that stopped. The block
        must not use collectives itself.

        Example:

        >>> with Hosts.single().together("the checks"):
        ...     pass
        """
        if self.count == 1:
            yield
            return
        try:
            yield
        except BaseException:
            self.gather_ints([1])  # This host refused: tell the others.
            raise
        failed = [h for h, row in enumerate(self.gather_ints([0])) if row[0]]
        if failed:
            raise HostsDisagreeError(
                f"Host(s) {failed} refused {what} (their error says why); "
                f"this host stops with them. Nothing was trained."
            )

    def check_agree(self, items):
        """Raises `HostsDisagreeError` on every host unless every host holds
        the same `items` (`{name: bytes or str}`); returns None.

        Only a digest of each item crosses hosts.
        """
        names = sorted(items)
        digests = [_digest(items[name]) for name in names]
        rows = self.gather_ints(digests)
        differing = [
            name
            for position, name in enumerate(names)
            if len({row[position] for row in rows}) > 1
        ]
        if differing:
            hosts = {
                name: [
                    h
                    for h, row in enumerate(rows)
                    if row[names.index(name)] != rows[0][names.index(name)]
                ]
                for name in differing
            }
            details = "; ".join(
                f"{name}: host(s) {hosts[name]} differ from the chief"
                for name in differing
            )
            raise HostsDisagreeError(
                f"The {self.count} hosts do not agree on {', '.join(differing)} "
                f"({details}). Every host must run the same script on the same "
                "data and weights: the same x, y (and users) for DPModel; for "
                "FedEmbModel, VirtualClients with seed=None (the chief's seed "
                "is shared) from the same UserShards directory; and the same "
                "weights (or the same backup restored) on every host. Nothing "
                "was trained."
            )


def _digest(item):
    if isinstance(item, str):
        item = item.encode()
    return int.from_bytes(hashlib.blake2b(bytes(item), digest_size=32).digest(), "big")
