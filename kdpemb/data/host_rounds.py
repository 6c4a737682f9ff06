"""Multi-host rounds: which rows of each round a host serves.

Every host plans the same rounds (`RoundPlanner` with the chief's seed, at
the same epoch); host h of H serves the clients h, h + H, ... of each round
(`HostSlice`), `max_clients_per_round // H` rows. Keras-free.

Example:

>>> hosts = HostSlice(index=1, count=2)
>>> hosts.rows(["a", "b", "c", "d", "e"]), hosts.rows_of(8)
(['b', 'd'], 4)
"""

from typing import NamedTuple

# On several hosts each row says its round, modulo this: small enough that
# the replicas' int32 sum of it cannot overflow.
ROUND_INDEX_MODULUS = 2**20


class HostSlice(NamedTuple):
    """Host `index` of `count`: the rows of a round it serves."""

    index: int = 0
    count: int = 1

    def rows(self, plans):
        """This host's share of a round's client plans (a list)."""
        return plans[self.index :: self.count]

    def rows_of(self, max_clients_per_round):
        """Client rows of a round that each host builds."""
        return max_clients_per_round // self.count


def check_split(settings, hosts):
    """Refuses hosts that the rows of rounds of `settings` (`RoundSettings`)
    do not split over (no collective)."""
    rows = settings.max_clients_per_round
    if rows % hosts.count:
        size = -(-rows // hosts.count) * hosts.count
        if settings.sampling == "fixed":
            fix = f"clients_per_round a multiple of {hosts.count}"
        elif settings.sampling == "epochs" and settings.users_per_client > 1:
            fix = (
                f"num_clients and rounds_per_epoch such that ceil(P / R) "
                f"is a multiple of {hosts.count}"
            )
        elif size <= settings.num_clients:
            fix = f"max_clients_per_round={size}"
        else:  # M_max is at most P.
            fix = (
                f"more virtual clients (num_clients >= {size}), or a number "
                f"of hosts that divides {rows}"
            )
        raise ValueError(
            f"The rounds hold max_clients_per_round={rows} client rows, which "
            f"do not split over {hosts.count} hosts; build the VirtualClients "
            f"with {fix}."
        )


def join_hosts(planner, hosts, extra=()):
    """Makes `planner` (`RoundPlanner`) plan the rounds every host plans.

    The seed becomes the chief's unless it was fixed, every host moves to
    one epoch (a new one where they were not at the same), and the plans'
    fingerprints (with `extra`) are compared: any difference raises
    `kdpemb.errors.HostsDisagreeError` on every host.

    Returns:
        `HostSlice` of this host.
    """
    check_split(planner.settings, hosts)
    if hosts.count > 1 and not planner.seed_is_fixed:
        planner.reseed(hosts.shared_bits(128))
    # The same current epoch everywhere: unchanged where the hosts agree
    # (fresh clients), else a new one that no host has served.
    epochs = hosts.gather_ints([planner.epoch, planner.epochs_claimed])
    if any(row != epochs[0] for row in epochs):
        planner.skip_epochs(max(row[1] for row in epochs))
    hosts.check_agree({"round plan": planner.fingerprint(extra)})
    return HostSlice(hosts.index, hosts.count)
