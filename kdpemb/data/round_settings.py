"""`RoundSettings`: the checked numbers of DP-FedEmb training rounds.

How many virtual clients P there are, how many a round samples (M) and can
hold (M_max), with which sampling, local steps, batch size and rounds per
epoch, and the `kdpemb.privacy.Schedule` they make. Keras-free: the round
planner (`kdpemb.data.round_plan`) and `VirtualClients` read them.

Example:

>>> settings = RoundSettings(40, clients_per_round=4, users_per_client=2)
>>> settings.num_clients, settings.sampling_rate, settings.rounds_per_epoch
(20, 0.2, 5)
"""

import math
import warnings

from kdpemb import _validation as validation
from kdpemb.data import round_size
from kdpemb.errors import DataDependentScheduleWarning
from kdpemb.privacy import Schedule, mechanisms
from kdpemb.privacy.schedule import epoch_rounds

SAMPLINGS = ("poisson", "fixed", "epochs")
CLIENT_ORDERS = ("shuffled", "fixed")
# Largest overflow probability of a Poisson round's default bound M_max. For
# k > 1 the count of sampled slots depends on no one's data (P is public),
# so 1e-9 only makes a failed run rare. For k = 1 the count is the number of
# sampled users, so whether a round overflows depends on who is present and
# adds up to e^ε · rounds · p to δ: 1e-30 keeps that below 1e-10 for any
# ε <= 25 and up to 10^9 rounds.
TRUNCATION_TOLERANCE = {"independent of data": 1e-9, "data dependent": 1e-30}
# An epoch's length is a Python (and tf.data) integer: at most 2**53 rounds.
MAX_ROUNDS_PER_EPOCH = 2**53


class RoundSettings:
    """The checked settings of the rounds of `num_users` users.

    Takes the arguments of `VirtualClients` of the same names (see there)
    and checks them in the same order; `workers` (threads that read the
    rounds) must be 1 with `sampling="epochs"`. Warnings point at the
    caller of the caller (`VirtualClients(...)`).

    Attributes:
        num_users, users_per_client, sampling, client_order, num_clients,
        clients_per_round, sampling_rate, local_steps, batch_size,
        max_examples_per_client, max_clients_per_round,
        truncation_probability, rounds_per_epoch: as in `VirtualClients`.
        schedule: `kdpemb.privacy.Schedule` of the rounds.

    Example:

    >>> epochs = RoundSettings(40, users_per_client=2, num_clients=20,
    ...                        sampling="epochs", rounds_per_epoch=6)
    >>> epochs.max_clients_per_round, epochs.client_order
    (4, 'shuffled')
    """

    def __init__(
        self,
        num_users,
        *,
        clients_per_round=None,
        users_per_client=1,
        sampling="poisson",
        client_order=None,
        local_steps=1,
        batch_size=32,
        max_examples_per_client=None,
        max_clients_per_round=None,
        rounds_per_epoch=None,
        num_clients=None,
        workers=1,
    ):
        self.num_users = num_users
        self.users_per_client = validation.check_positive_int(
            users_per_client, "users_per_client"
        )
        if self.users_per_client > self.num_users:
            raise ValueError(
                f"users_per_client={users_per_client} is more than the "
                f"{self.num_users} users in the data. Use at most "
                f"{self.num_users}, or add users."
            )
        if not isinstance(sampling, str) or sampling not in SAMPLINGS:
            raise ValueError(f"sampling must be one of {SAMPLINGS}, got {sampling!r}.")
        self.sampling = sampling
        self.client_order = self._check_client_order(client_order)
        if sampling == "epochs" and workers > 1:
            raise ValueError(
                f"workers={workers}: with sampling='epochs' Keras must read "
                "the rounds in order, one whole epoch per Keras epoch. Keras' "
                "multi-worker loader carries rounds it prefetched over into the "
                "next Keras epoch, which would then mix two epochs of rounds (a "
                "user could take part twice in one DP-FTRL tree). Use workers=1 "
                "(the default), or `to_tf_dataset()` for rounds prepared ahead."
            )
        self.num_clients = self._check_num_clients(num_clients)
        if self.sampling == "epochs":
            self.local_steps = validation.check_positive_int(local_steps, "local_steps")
            self.rounds_per_epoch = self._check_epoch_rounds(
                clients_per_round, rounds_per_epoch
            )
            # P enters the schedule only when given: a P derived from the
            # user count is not public (`Schedule.pool_is_public`).
            self.schedule = Schedule.virtual_clients(
                self.num_users,
                clients_per_round,
                users_per_client=self.users_per_client,
                num_clients=None if num_clients is None else self.num_clients,
                sampling=self.sampling,
                local_steps=self.local_steps,
                rounds_per_epoch=self.rounds_per_epoch,
            )
            self.clients_per_round = self.schedule.sample_size
            self.sampling_rate = self.schedule.sampling_probability
        else:
            self.clients_per_round = self._check_clients_per_round(clients_per_round)
            self.sampling_rate = self.clients_per_round / self.num_clients
            self.local_steps = validation.check_positive_int(local_steps, "local_steps")
            self.schedule = Schedule.virtual_clients(
                self.num_users,
                self.clients_per_round,
                users_per_client=self.users_per_client,
                num_clients=None if num_clients is None else self.num_clients,
                sampling=self.sampling,
                local_steps=self.local_steps,
            )
        self.batch_size = validation.check_positive_int(batch_size, "batch_size")
        self.max_examples_per_client = self._check_cap(max_examples_per_client)
        self.max_clients_per_round, self.truncation_probability = self._round_bound(
            max_clients_per_round
        )
        if self.sampling != "epochs":
            self.rounds_per_epoch = self._sampled_epoch_rounds(rounds_per_epoch)

    def _sampled_epoch_rounds(self, rounds_per_epoch):
        """`len()` of Poisson or fixed-size rounds: floor(P / M) unless given."""
        given = rounds_per_epoch is not None
        if not given:
            rounds_per_epoch = max(
                1, math.floor(self.num_clients / self.clients_per_round)
            )
        rounds = validation.check_positive_int(rounds_per_epoch, "rounds_per_epoch")
        if rounds > MAX_ROUNDS_PER_EPOCH:
            what = (
                f"rounds_per_epoch={rounds}"
                if given
                else f"clients_per_round={self.clients_per_round:g} makes "
                f"an epoch of floor(P / M) = {rounds:.3g} "
                "rounds, which"
            )
            raise ValueError(
                f"{what} is more than the {MAX_ROUNDS_PER_EPOCH} rounds an "
                "epoch (len() of this dataset) can hold. Pass a smaller "
                "rounds_per_epoch (and fit with epochs)."
            )
        return rounds

    def _check_num_clients(self, value):
        k = self.users_per_client
        if value is None:
            return mechanisms.num_virtual_clients(self.num_users, k)
        value = validation.check_positive_int(value, "num_clients")
        if k == 1 and value != self.num_users:
            raise ValueError(
                f"num_clients={value}: with users_per_client=1 every user is "
                f"their own virtual client, so num_clients is the number of "
                f"users ({self.num_users}). Leave it None."
            )
        low = mechanisms.num_virtual_clients(self.num_users, k)
        if not low <= value <= self.num_users:
            raise ValueError(
                f"num_clients={value} must be between ceil(N / k) = {low} and "
                f"N = {self.num_users} for {self.num_users} users with "
                f"users_per_client={k}."
            )
        return value

    def _check_client_order(self, order):
        if self.sampling != "epochs":
            if order is not None:
                raise ValueError(
                    f"client_order={order!r} is for sampling='epochs' only (rounds "
                    f"without sampling); sampling={self.sampling!r} draws new "
                    "clients every round. Leave client_order None, or use "
                    "sampling='epochs'."
                )
            return None
        if order is None:
            return "shuffled"
        if not isinstance(order, str) or order not in CLIENT_ORDERS:
            raise ValueError(
                f"client_order must be one of {CLIENT_ORDERS}, got {order!r}."
            )
        return order

    def _check_epoch_rounds(self, clients_per_round, rounds_per_epoch):
        """R, the public number of rounds per epoch, for sampling='epochs'."""
        if clients_per_round is not None:
            clients_per_round = self._check_clients_per_round(clients_per_round)
        rounds = epoch_rounds(self.num_clients, clients_per_round, rounds_per_epoch)
        if rounds_per_epoch is None and self.users_per_client == 1:
            warnings.warn(
                f"sampling='epochs' with one user per virtual client: the "
                f"epoch's R = ceil(N / M) = {rounds} rounds derives from "
                f"the private user count N = {self.num_clients}, and every "
                "user's round depends on R, so one user more or less can move "
                "everyone. Pass rounds_per_epoch from a public count.",
                DataDependentScheduleWarning,
                stacklevel=5,
            )
        return rounds

    def _check_clients_per_round(self, value):
        if value is None:
            raise ValueError(
                f"sampling={self.sampling!r} needs clients_per_round, M: the "
                "expected number of virtual clients per round."
            )
        value = validation.check_positive(value, "clients_per_round")
        if value > self.num_clients:
            raise ValueError(
                f"clients_per_round={value:g} is more than the "
                f"{self.num_clients} virtual clients that {self.num_users} "
                f"users make with users_per_client={self.users_per_client}. "
                f"Use at most {self.num_clients} (q = M / P must be <= 1)."
            )
        if self.sampling == "fixed":
            if value != int(value):
                raise ValueError(
                    f"sampling='fixed' takes exactly clients_per_round clients, "
                    f"which must be a whole number; got {value:g}."
                )
            value = int(value)
        return value

    def _check_cap(self, cap):
        slots = self.local_steps * self.batch_size
        if cap is None:
            return slots
        cap = validation.check_positive_int(cap, "max_examples_per_client")
        if cap > slots:
            raise ValueError(
                f"max_examples_per_client={cap} is more than the "
                f"local_steps * batch_size = {slots} examples a client can "
                f"use in a round. Use at most {slots}, or more local steps."
            )
        return cap

    @property
    def truncation_tolerance(self):
        """Overflow probability per round of the default M_max."""
        if self.users_per_client == 1:
            return TRUNCATION_TOLERANCE["data dependent"]
        return TRUNCATION_TOLERANCE["independent of data"]

    def _round_bound(self, bound):
        if self.sampling == "fixed":
            if bound is not None and bound != self.clients_per_round:
                raise ValueError(
                    f"max_clients_per_round={bound}: sampling='fixed' takes "
                    f"exactly clients_per_round={self.clients_per_round} slots. "
                    "Leave it None."
                )
            return self.clients_per_round, 0.0
        rate = self.sampling_rate
        if self.sampling == "epochs":
            # k > 1: a round holds a public number of slots. k = 1: each
            # user's round is uniform over R, so a round holds
            # Binomial(N, 1 / R) users.
            if self.users_per_client > 1:
                return self._epoch_slots_bound(bound), 0.0
            rate = 1.0 / self.rounds_per_epoch
        tolerance = self.truncation_tolerance
        if bound is None:
            bound = round_size.max_clients_per_round(self.num_clients, rate, tolerance)
        bound = validation.check_positive_int(bound, "max_clients_per_round")
        probability = round_size.overflow_probability(self.num_clients, rate, bound)
        if probability > tolerance:
            extra = (
                " With users_per_client=1 whether a round overflows depends on "
                "who is present: it adds up to e^ε · rounds · "
                f"{probability:.2g} to δ."
                if self.users_per_client == 1
                else ""
            )
            warnings.warn(
                f"max_clients_per_round={bound}: a round draws more clients "
                f"with probability {probability:.2g}, and then training stops "
                "with RoundTruncationError. Leave it as None for a bound "
                f"with probability <= {tolerance:g}." + extra,
                UserWarning,
                stacklevel=4,
            )
        return min(bound, self.num_clients), probability

    def _epoch_slots_bound(self, bound):
        slots = math.ceil(self.num_clients / self.rounds_per_epoch)
        if bound is not None:
            bound = validation.check_positive_int(bound, "max_clients_per_round")
            if bound != slots:
                raise ValueError(
                    f"max_clients_per_round={bound}: with sampling='epochs' and "
                    f"users_per_client={self.users_per_client} every round "
                    f"holds ceil(P / R) = ceil({self.num_clients} / "
                    f"{self.rounds_per_epoch}) = {slots} client slots (or one "
                    "fewer). Leave it None."
                )
        return slots

    def describe(self):
        """Two lines on the virtual clients, their sampling and M_max."""
        if self.sampling == "epochs":
            how = (
                f"no sampling: each in one of {self.rounds_per_epoch} rounds "
                f"per epoch ({self.client_order} order), "
                f"{self.clients_per_round:.4g} per round"
            )
        else:
            how = (
                f"{self.sampling} sampling, M = {self.clients_per_round:g} "
                f"per round (q = {self.sampling_rate:.4g})"
            )
        return [
            f"{self.num_clients} virtual clients of ~{self.users_per_client} "
            f"user(s); {how}",
            f"M_max = {self.max_clients_per_round} client slots "
            f"(overflow probability {self.truncation_probability:.2g} per round)",
        ]

    def arguments(self):
        """The main settings as `name=value, ...` (for `repr`)."""
        return (
            f"num_users={self.num_users}, "
            f"num_clients={self.num_clients}, "
            f"clients_per_round={self.clients_per_round:g}, "
            f"sampling={self.sampling!r}"
            + (
                f", rounds_per_epoch={self.rounds_per_epoch}, "
                f"client_order={self.client_order!r}"
                if self.sampling == "epochs"
                else ""
            )
        )
