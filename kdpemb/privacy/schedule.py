"""`Schedule`: who is sampled, and how often, in a private training run.

A schedule is the public half of a DP training run: the population of
privacy units, the pool that is sampled from (examples, or virtual
clients that group users), the expected sample per step, the sampling
scheme and the local steps per round. With a noise multiplier and a clip
norm it gives the run's `Mechanism`, and it is the only thing that does:
data pipelines (`kdpemb.data.VirtualClients`) build it, models take it
(from the data at their first `fit`, or from you) and save it with their
config, so no setting is typed twice.

Example:

>>> from kdpemb.privacy import Schedule
>>> schedule = Schedule.virtual_clients(num_users=10_000, clients_per_round=64,
...                                     users_per_client=4)
>>> schedule.pool_size, schedule.sampling_probability
(2500, 0.0256)
>>> schedule.privacy_mechanism(noise_multiplier=1.0).relation_name
'replace_one'
>>> Schedule.from_config(schedule.get_config()) == schedule
True
"""

import dataclasses
import math

from kdpemb import _validation as validation
from kdpemb.privacy import mechanisms
from kdpemb.privacy.config_dataclass import ConfigDataclass

SAMPLINGS = (*mechanisms.SAMPLINGS, "epochs")
NOISES = ("independent", "tree")


def rounds_per_epoch_for(pool_size, clients_per_round):
    """R = ceil(P / M): the rounds of an epoch without sampling, where
    M = P / R (a float) gives R back.

    >>> rounds_per_epoch_for(15, 15 / 13), rounds_per_epoch_for(20, 3)
    (13, 7)
    """
    ratio = pool_size / clients_per_round
    nearest = round(ratio)
    if abs(ratio - nearest) <= 1e-9 * ratio:
        return max(1, nearest)
    return math.ceil(ratio)


def epoch_rounds(pool_size, clients_per_round=None, rounds_per_epoch=None):
    """R, the public number of rounds of an epoch without sampling.

    `sampling="epochs"` takes `rounds_per_epoch` (R), or `clients_per_round`
    (M, for R = ceil(P / M)), or both when they agree. An epoch of more
    rounds than the P virtual clients is refused: some rounds would always
    be empty. M is checked (> 0, <= P) by the caller, which knows how to
    name P.

    >>> epoch_rounds(20, clients_per_round=3), epoch_rounds(20, None, 7)
    (7, 7)
    """
    if rounds_per_epoch is None:
        if clients_per_round is None:
            raise ValueError(
                "sampling='epochs' needs clients_per_round (M: an epoch is "
                "then R = ceil(P / M) rounds) or rounds_per_epoch (R, a "
                "public number). Pass one of them."
            )
        rounds = rounds_per_epoch_for(pool_size, clients_per_round)
    else:
        rounds = validation.check_positive_int(rounds_per_epoch, "rounds_per_epoch")
        if clients_per_round is not None:
            implied = rounds_per_epoch_for(pool_size, clients_per_round)
            if implied != rounds:
                raise ValueError(
                    f"clients_per_round={clients_per_round:g} and "
                    f"rounds_per_epoch={rounds} disagree: {pool_size} virtual "
                    f"clients in {rounds} rounds make {pool_size / rounds:.4g} "
                    f"per round, and clients_per_round={clients_per_round:g} "
                    f"makes ceil(P / M) = {implied} rounds. Pass only one "
                    "of them."
                )
    if rounds > pool_size:
        given = (
            f"rounds_per_epoch={rounds}"
            if rounds_per_epoch is not None
            else f"clients_per_round={clients_per_round:g} (R = {rounds} rounds)"
        )
        raise ValueError(
            f"{given}: an epoch of {rounds} rounds over {pool_size} virtual "
            f"clients would leave some rounds always empty. Use at most "
            f"rounds_per_epoch={pool_size} (clients_per_round >= 1)."
        )
    return rounds


@dataclasses.dataclass(frozen=True)
class Schedule(ConfigDataclass):
    """Population, pool, expected sample, sampling and steps per round.

    Frozen and validated when created. Build it with `Schedule.examples`
    (example-level DP-SGD), `Schedule.users` (user-level DP-SGD) or
    `Schedule.virtual_clients` (user-level DP-FedEmb and DP-FedAvg), or
    take it from `VirtualClients.schedule`.

    Args:
        population: int. Privacy units in the private data: examples, or
            users.
        sample_size: float. Expected units (examples, or virtual clients)
            per step; exact for `sampling="fixed"`; the whole pool for
            `"full_batch"`.
        sampling: str. "poisson" (each unit independently with probability
            `sample_size / pool_size`, the default), "fixed" (exactly
            `sample_size` without replacement; RDP accountant only),
            "full_batch" (every unit in every step) or "epochs" (no
            sampling: epochs of `steps_per_epoch` steps, each unit in at
            most one step of an epoch; for DP-FTRL's tree noise; RDP
            accountant only).
        unit: str. "example" or "user".
        users_per_client: int. k, users per virtual client (1 for
            examples, or one user per client). Defaults to 1.
        num_clients: int or None. P, the number of virtual clients, when
            it is fixed from a public count. None derives it from the
            private population as `ceil(population / users_per_client)`,
            which treats the population as public (as DP-SGD's q = B / N
            does).
        local_steps: int. Local batches per client per round (1 for
            DP-SGD). Defaults to 1.
        steps_per_epoch: int or None. For `sampling="epochs"` only: the
            public number of steps in an epoch (`sample_size` is then
            `pool_size / steps_per_epoch` units per step on average).
        examples_per_user: int or None. k, for user-level DP-SGD
            (`Schedule.users`): each step averages at most k of a sampled
            user's examples into one clipped contribution. A public cap,
            stated with the guarantee; the accounting does not depend on it.

    Example:

    >>> from kdpemb import privacy
    >>> schedule = privacy.Schedule.examples(60_000, 256)
    >>> round(schedule.sampling_probability, 5)
    0.00427
    >>> mechanism = schedule.privacy_mechanism(1.1)
    >>> mechanism == privacy.dp_sgd(
    ...     noise_multiplier=1.1, batch_size=256, num_examples=60_000)
    True
    """

    config_argument = "schedule"  # Saved with `get_config`, see `ConfigDataclass`.
    population: int
    sample_size: float
    sampling: str = "poisson"
    unit: str = "example"
    users_per_client: int = 1
    num_clients: int | None = None
    local_steps: int = 1
    steps_per_epoch: int | None = None
    examples_per_user: int | None = dataclasses.field(default=None, repr=False)

    def __post_init__(self):
        validation.check_positive_int(self.population, "population")
        validation.check_positive_int(self.local_steps, "local_steps")
        if self.sampling == "epochs":
            if self.steps_per_epoch is None:
                raise ValueError(
                    "sampling='epochs' needs steps_per_epoch, the public number "
                    "of steps in which every unit takes part at most once."
                )
            validation.check_positive_int(self.steps_per_epoch, "steps_per_epoch")
        elif self.steps_per_epoch is not None:
            raise ValueError(
                f"steps_per_epoch={self.steps_per_epoch} is for "
                f"sampling='epochs' only; sampling={self.sampling!r} sets the "
                "steps of an epoch from pool_size / sample_size."
            )
        if self.num_clients is not None:
            validation.check_positive_int(self.num_clients, "num_clients")
            if self.users_per_client == 1 and self.num_clients != self.population:
                raise ValueError(
                    f"num_clients={self.num_clients} groups users into virtual "
                    "clients: it needs users_per_client > 1 (with one unit per "
                    f"client the pool is the population, {self.population})."
                )
            fewest = mechanisms.num_virtual_clients(
                self.population, self.users_per_client
            )
            if not fewest <= self.num_clients <= self.population:
                raise ValueError(
                    f"num_clients={self.num_clients} is outside [{fewest}, "
                    f"{self.population}]: {self.population} users in virtual "
                    f"clients of users_per_client={self.users_per_client} make "
                    f"{fewest} to {self.population} clients."
                )
        if self.examples_per_user is not None and self.sampling == "epochs":
            raise ValueError(
                f"examples_per_user={self.examples_per_user!r} is for user-level "
                "DP-SGD with sampled users (Schedule.users), not sampling='epochs'."
            )
        self.privacy_mechanism(0.0)  # Validates the rest, once, in one place.

    # Builders ---------------------------------------------------------

    @classmethod
    def examples(cls, num_examples, batch_size=None, *, sampling="poisson"):
        """Example-level DP-SGD: batches of expected size `batch_size`.

        Args:
            num_examples: int. N.
            batch_size: float or None. Expected batch size B (q = B / N);
                None for one full batch of all N examples per step.
            sampling: str. "poisson" (default) or "fixed".

        Example:

        >>> Schedule.examples(60_000, 256).sampling_probability
        0.004266666666666667
        >>> Schedule.examples(1_000).sampling
        'full_batch'
        """
        num_examples = validation.check_positive_int(num_examples, "num_examples")
        if batch_size is None or sampling == "full_batch":
            return cls(num_examples, num_examples, "full_batch")
        validation.check_sample_size(batch_size, num_examples, "batch_size", sampling)
        return cls(num_examples, batch_size, sampling)

    @classmethod
    def users(
        cls,
        num_users,
        users_per_step=None,
        *,
        sampling="poisson",
        examples_per_user=None,
    ):
        """User-level DP-SGD: `users_per_step` users per step, each of them
        one contribution (their mean over at most `examples_per_user` of
        their examples, clipped); the privacy unit is the user.

        Args:
            num_users: int. U, the distinct users in the data.
            users_per_step: float or None. Expected users per step B_u
                (q = B_u / U); None: every user in every step.
            sampling: str. "poisson" (default) or "fixed" (exactly
                `users_per_step` users).
            examples_per_user: int or None. k, the public cap on a user's
                examples per step, for the statement.

        Example:

        >>> schedule = Schedule.users(10_000, 100, examples_per_user=4)
        >>> schedule.unit, schedule.pool_size, schedule.sampling_probability
        ('user', 10000, 0.01)
        >>> Schedule.users(500).sampling
        'full_batch'
        """
        num_users = validation.check_positive_int(num_users, "num_users")
        if users_per_step is None or sampling == "full_batch":
            users_per_step, sampling = num_users, "full_batch"
        else:
            validation.check_choice(sampling, ("poisson", "fixed"), "sampling")
            validation.check_sample_size(
                users_per_step, num_users, "users_per_step", sampling
            )
        return cls(
            population=num_users,
            sample_size=users_per_step,
            sampling=sampling,
            unit="user",
            examples_per_user=examples_per_user,
        )

    @classmethod
    def virtual_clients(
        cls,
        num_users,
        clients_per_round,
        *,
        users_per_client=1,
        num_clients=None,
        sampling="poisson",
        local_steps=1,
        rounds_per_epoch=None,
    ):
        """User-level rounds: `clients_per_round` virtual clients of k users.

        With `sampling="epochs"` (DP-FTRL) there is no sampling: an epoch
        is `rounds_per_epoch` rounds (default ceil(P / clients_per_round))
        and every virtual client takes part in exactly one of them.

        Example:

        >>> schedule = Schedule.virtual_clients(1_000, 10, users_per_client=4,
        ...                                     num_clients=300, local_steps=2)
        >>> schedule.pool_size, schedule.unit, schedule.local_steps
        (300, 'user', 2)
        """
        num_users = validation.check_positive_int(num_users, "num_users")
        users_per_client = validation.check_positive_int(
            users_per_client, "users_per_client"
        )
        if users_per_client == 1 and num_clients is not None:
            if num_clients != num_users:
                raise ValueError(
                    f"num_clients={num_clients} needs users_per_client > 1: with "
                    f"one user per virtual client there are {num_users} clients."
                )
            num_clients = None
        pool = (
            mechanisms.num_virtual_clients(num_users, users_per_client)
            if num_clients is None
            else validation.check_positive_int(num_clients, "num_clients")
        )
        if sampling == "full_batch" and clients_per_round is None:
            clients_per_round = pool
        if sampling != "epochs" or clients_per_round is not None:
            clients_per_round = validation.check_positive(
                clients_per_round, "clients_per_round"
            )
            if clients_per_round > pool:
                raise ValueError(
                    f"clients_per_round={clients_per_round:g} is more than the "
                    f"{pool} virtual clients that {num_users} users with "
                    f"users_per_client={users_per_client} make. Use at most "
                    f"{pool} clients per round, or fewer users per client."
                )
        steps_per_epoch = None
        if sampling == "epochs":
            steps_per_epoch = epoch_rounds(pool, clients_per_round, rounds_per_epoch)
            clients_per_round = pool / steps_per_epoch
        elif rounds_per_epoch is not None:
            raise ValueError(
                "rounds_per_epoch is for sampling='epochs' only (with sampling "
                f"{sampling!r} an epoch is P / M rounds)."
            )
        return cls(
            population=num_users,
            sample_size=clients_per_round,
            sampling=sampling,
            unit="user",
            users_per_client=users_per_client,
            num_clients=num_clients,
            local_steps=local_steps,
            steps_per_epoch=steps_per_epoch,
        )

    # Derived values ----------------------------------------------------

    @property
    def pool_size(self):
        """P: the number of units sampled from (examples or virtual clients)."""
        if self.num_clients is not None:
            return self.num_clients
        return mechanisms.num_virtual_clients(self.population, self.users_per_client)

    @property
    def pool_is_public(self):
        """Whether P was fixed from a public count rather than the population.

        With k > 1 users per client and P derived from the private user
        count, adding or removing a user can change P itself; pass
        `num_clients` from a public count to avoid relying on that count.
        """
        return self.users_per_client == 1 or self.num_clients is not None

    @property
    def sampling_probability(self):
        """q = sample_size / pool_size."""
        return self.sample_size / self.pool_size

    def steps_for_epochs(self, epochs):
        """Steps in `epochs` expected passes over the pool (rounded up)."""
        return self.privacy_mechanism(0.0).steps_for_epochs(epochs)

    # The one source of a mechanism ---------------------------------------

    def privacy_mechanism(
        self, noise_multiplier, clip_norm=None, *, setup=(), noise="independent"
    ):
        """The `Mechanism` of one step with noise multiplier z and clip norm C.

        Args:
            noise_multiplier: float. z, the noise std over the clip norm.
            clip_norm: float or None. C, for the statement.
            setup: tuple of `GaussianRelease`. One-off releases before the
                first step.
            noise: str. "independent" (default): a fresh Gaussian each step;
                "tree": DP-FTRL's tree aggregation, restarted every epoch
                (needs `sampling="epochs"`).

        Example:

        >>> Schedule.examples(60_000, 256).privacy_mechanism(1.1).unit
        'example'
        >>> epochs = Schedule.virtual_clients(1_000, 100, sampling="epochs")
        >>> epochs.privacy_mechanism(1.0, noise="tree").describe_noise()
        'tree aggregation (DP-FTRL), restarted every epoch'
        """
        if not isinstance(noise, str) or noise not in NOISES:
            raise ValueError(f"noise must be one of {NOISES}, got {noise!r}.")
        if self.sampling == "epochs":
            if setup:
                raise ValueError("sampling='epochs' takes no one-off setup releases.")
            return mechanisms.TreeAggregation(
                noise_multiplier=noise_multiplier,
                steps_per_epoch=self.steps_per_epoch,
                population=self.population,
                unit=self.unit,
                users_per_client=self.users_per_client,
                leaves_per_tree=None if noise == "tree" else 1,
                clip_norm=clip_norm,
            )
        if noise == "tree":
            raise ValueError(
                f"noise='tree' (DP-FTRL) needs rounds without sampling, in which "
                f"each unit takes part at most once per epoch; this schedule's "
                f"sampling is {self.sampling!r}. Use sampling='epochs' (e.g. "
                "VirtualClients(..., sampling='epochs')), or noise='independent'."
            )
        return mechanisms.SampledGaussian(
            noise_multiplier=noise_multiplier,
            sampling=self.sampling,
            sample_size=self.sample_size,
            pool_size=self.pool_size,
            population=self.population,
            unit=self.unit,
            users_per_client=self.users_per_client,
            clip_norm=clip_norm,
            setup=setup,
            examples_per_user=self.examples_per_user,
        )

    def describe(self):
        """One line in words.

        Example:

        >>> print(Schedule.examples(1_000).describe())
        1000 examples; full batch: every example in every step
        """
        mechanism = self.privacy_mechanism(0.0)
        group = (
            f" in {self.pool_size} virtual clients of ~{self.users_per_client}"
            if self.users_per_client > 1
            else ""
        )
        steps = f"; {self.local_steps} local steps" if self.local_steps > 1 else ""
        if self.examples_per_user is not None:
            steps += f"; at most {self.examples_per_user} examples per user per step"
        return (
            f"{self.population} {self.unit}s{group}; "
            f"{mechanism.describe_sampling()}{steps}"
        )
