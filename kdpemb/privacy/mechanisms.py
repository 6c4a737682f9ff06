"""Privacy mechanisms of kdpemb's training schemes, as dp-accounting events.

A `Mechanism` describes what one private training step releases (and any
one-off release before the first step), on which data, under which
neighbouring relation and for which unit of privacy (an example or a user).
`mechanism.event(steps)` builds the `dp_accounting.DpEvent` of a whole run.
Like a `DpEvent`, a mechanism only *describes*; `Accountant` interprets.

Build them with `kdpemb.privacy.mechanism_builders` (`dp_sgd`,
`full_batch`, `virtual_clients`, `gaussian_releases`, `zcdp`,
`tree_aggregation`, all in `kdpemb.privacy`) or from a `Schedule`. Every
mechanism is a frozen dataclass, validated when created.
"""

import abc
import dataclasses
import fractions
import math
import os
import sys
import warnings

import dp_accounting as dpa

from kdpemb import _validation as validation
from kdpemb._moved import moved_names
from kdpemb.errors import SmallPopulationWarning
from kdpemb.privacy import gaussian_release

Relation = dpa.NeighboringRelation

UNITS = ("example", "user")
INDEPENDENT_NOISE = "independent Gaussian noise each step"
SAMPLINGS = ("poisson", "full_batch", "fixed")

RELATION_NAMES = {
    Relation.ADD_OR_REMOVE_ONE: "add_or_remove_one",
    Relation.REPLACE_ONE: "replace_one",
    Relation.REPLACE_SPECIAL: "replace_special",
}


def relation_from_name(name):
    """Maps "add_or_remove_one" / "replace_one" / "replace_special" to a relation."""
    for relation, relation_name in RELATION_NAMES.items():
        if name in (relation_name, relation):
            return relation
    raise ValueError(
        f"Unknown neighbouring relation {name!r}; expected one of "
        f"{sorted(RELATION_NAMES.values())}."
    )


def num_virtual_clients(num_users, users_per_client):
    """The number of virtual clients: `ceil(num_users / users_per_client)`.

    Users are split into this many virtual clients of at most
    `users_per_client` users each. The count must be fixed before training
    (it is public, like the dataset size in DP-SGD): the sampling rate of a
    virtual client is `clients_per_round / num_virtual_clients`.
    """
    num_users = validation.check_positive_int(num_users, "num_users")
    users_per_client = validation.check_positive_int(
        users_per_client, "users_per_client"
    )
    if users_per_client > num_users:
        raise ValueError(
            f"users_per_client={users_per_client} is larger than the number of "
            f"users ({num_users}); use users_per_client <= {num_users}."
        )
    return math.ceil(num_users / users_per_client)


def _check_unit(unit):
    return validation.check_choice(unit, UNITS, "unit")


# The smallest population whose guarantee is about individuals: with one
# unit, its neighbouring dataset is the empty one.
MIN_POPULATION = 2


def _check_population(population, unit):
    """Checks a population (an int >= 1) and warns `SmallPopulationWarning`
    below `MIN_POPULATION`: every mechanism, hence every schedule, run and
    statement, gets its population here."""
    population = validation.check_positive_int(population, "population")
    unit = _check_unit(unit)
    if population < MIN_POPULATION:
        warnings.warn(
            f"The population is a single {unit}. Differential privacy bounds "
            f"what a run reveals about one {unit} against the same run without "
            f"it, which here is a run on no data at all: whatever the model "
            f"learns from its data is about this one {unit}, so it is either "
            f"useless (small ε) or discloses that {unit}'s data (large ε), and "
            "δ < 1/population rules out nothing (any δ < 1 passes). Check the "
            f"count of {unit}s (the distinct privacy units, not batches or "
            f"clients), or train on more {unit}s.",
            SmallPopulationWarning,
            stacklevel=_caller_stacklevel(),
        )
    return population


_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def _caller_stacklevel():
    """The `stacklevel` of the first frame outside kdpemb and dataclasses
    (whose `replace` and generated `__init__` build mechanisms), as seen
    from a `warnings.warn` in the caller: the user's line, once."""
    frame, level = sys._getframe(2), 2
    while frame is not None and (
        frame.f_code.co_filename.startswith(_PACKAGE_DIR)
        or frame.f_globals.get("__name__") == "dataclasses"
        or (  # A dataclass's generated __init__ runs in its module's globals.
            frame.f_code.co_filename == "<string>"
            and frame.f_globals.get("__name__", "").startswith("kdpemb.")
        )
    ):
        frame, level = frame.f_back, level + 1
    return level


def _compose(events):
    """Composes events, dropping no-ops; returns a single event."""
    events = [e for e in events if not isinstance(e, dpa.NoOpDpEvent)]
    if not events:
        return dpa.NoOpDpEvent()
    return events[0] if len(events) == 1 else dpa.ComposedDpEvent(events)


class Mechanism(abc.ABC):
    """What a private training run releases, described for accounting.

    Subclasses are frozen dataclasses with these attributes: `unit`
    ("example" or "user"), `population` (number of units in the private
    data), `sampling` (a short name), `noise_multiplier` (None where there
    is no single one), `clip_norm` and `sampling_probability` (None where
    they do not apply), and `neighboring_relation` (a
    `dp_accounting.NeighboringRelation`).

    Example:

    >>> from kdpemb import privacy
    >>> m = privacy.dp_sgd(noise_multiplier=1.1, batch_size=256, num_examples=60_000)
    >>> isinstance(m, privacy.Mechanism)
    True
    >>> m.unit, m.population, m.sampling, m.noise_multiplier
    ('example', 60000, 'poisson', 1.1)
    """

    clip_norm = None
    sampling_probability = None

    @property
    @abc.abstractmethod
    def neighboring_relation(self):
        """The `dp_accounting.NeighboringRelation` the guarantee holds for."""

    def setup_event(self):
        """Event of one-off releases before the first step (default: none)."""
        return dpa.NoOpDpEvent()

    def step_event(self):
        """Event of one step, or None when steps are not independent."""
        return None

    def event(self, steps):
        """The `DpEvent` of the one-off releases followed by `steps` steps."""
        steps = validation.check_steps(steps, minimum=0)
        step = self.step_event()
        if step is None:
            raise NotImplementedError(f"{type(self).__name__} must override event().")
        repeated = dpa.SelfComposedDpEvent(step, steps) if steps else None
        return _compose([self.setup_event(), *([repeated] if repeated else [])])

    def with_noise_multiplier(self, noise_multiplier):
        """A copy whose per-step noise multiplier is `noise_multiplier`."""
        raise TypeError(
            f"{type(self).__name__} has no single noise multiplier to calibrate."
        )

    @property
    def relation_name(self):
        return RELATION_NAMES[self.neighboring_relation]

    def describe_relation(self):
        """The neighbouring relation in words, naming the unit."""
        relation = self.neighboring_relation
        if relation == Relation.ADD_OR_REMOVE_ONE:
            what = "all data of one user" if self.unit == "user" else "one example"
            return f"add or remove {what}"
        if relation == Relation.REPLACE_SPECIAL:
            return f"replace one {self.unit}'s data by a zero (null) record"
        return f"replace one {self.unit}'s data by any other data"

    def describe_sampling(self):
        return self.sampling

    def describe_noise(self):
        """How the noise is drawn, in words."""
        return INDEPENDENT_NOISE

    def zcdp_rho(self, steps):
        """zCDP ρ of `steps` steps where the mechanism has a closed form
        (no sampling), else None."""
        return None

    def parameters(self):
        """The mechanism's parameters as a JSON-friendly dict."""
        params = dataclasses.asdict(self)
        params["type"] = type(self).__name__
        return params


def _check_examples_per_user(value, unit, users_per_client):
    """None, or a cap k >= 1 of a mechanism on single users."""
    if value is None:
        return
    validation.check_positive_int(value, "examples_per_user", "It is k (e.g. 4).")
    if unit != "user" or users_per_client != 1:
        raise ValueError(
            f"examples_per_user={value} caps the examples of one sampled user "
            f"(user-level DP-SGD): it needs unit='user' with users_per_client=1, "
            f"got unit={unit!r}, users_per_client={users_per_client}. Use "
            "Schedule.users(...), or leave examples_per_user out."
        )


@dataclasses.dataclass(frozen=True)
class SampledGaussian(Mechanism):
    """Clipped sum of a sample of units plus Gaussian noise, once per step.

    Covers example-level DP-SGD (units are examples) and DP-FedEmb /
    DP-FedAvg (units are virtual clients of `users_per_client` users; the
    privacy unit is the user).

    Sampling (`sampling`):
    - "poisson": each unit joins a step independently with probability
      `sample_size / pool_size` (what the accountant of DP-SGD assumes).
    - "full_batch": every unit in every step (q = 1).
    - "fixed": `sample_size` units drawn uniformly without replacement. The
      matching relation is replace-one (a fixed batch size reveals the
      dataset size, so add/remove does not apply); only the RDP accountant
      models it.

    Neighbouring relation. With one user per virtual client (or examples),
    removing a unit removes one clipped contribution of norm ≤ C:
    add/remove with sensitivity C. With `users_per_client` = k > 1,
    removing a user changes the *content* of one virtual client, whose
    clipped update can move anywhere in the C-ball: the sum moves by up to
    2C. That is the replace-one relation on virtual clients (one update of
    norm ≤ C replaced by another), accounted with the ordinary noise
    multiplier z = σ/C by the PLD accountant's REPLACE_ONE model, whose
    worst case puts the two versions at -C and +C. Treating it as
    add/remove with z would under-report ε; add/remove with z/2 is sound
    but far looser. The user-level guarantee follows because the assignment
    of a user to a virtual client never depends on other users. (The RDP
    accountant is given z/2 under replace-one: unlike PLD it does not
    double the sensitivity itself; see `kdpemb.privacy.accountant`.)

    Args:
        noise_multiplier: float. Noise std divided by the clip norm C.
        sampling: str. "poisson", "full_batch" or "fixed".
        sample_size: float. Expected units per step (exact for "fixed").
        pool_size: int. Number of units sampled from.
        population: int. Number of privacy units (examples or users).
        unit: str. "example" or "user".
        users_per_client: int. Users per virtual client (1 for examples).
        clip_norm: float or None. C, for the statement only.
        setup: tuple of `GaussianRelease`. One-off releases before step 1
            (e.g. the feature covariance of DP-FC).
        examples_per_user: int or None. k, with unit "user" and one user
            per sampled unit: each step averages at most k of a sampled
            user's examples into the user's one clipped contribution
            (user-level DP-SGD). A public cap, for the statement only: the
            accounting does not depend on it.

    Example:

    >>> from kdpemb import privacy
    >>> m = privacy.dp_sgd(noise_multiplier=1.1, batch_size=256, num_examples=60_000)
    >>> isinstance(m, privacy.SampledGaussian), round(m.sampling_probability, 5)
    (True, 0.00427)
    """

    noise_multiplier: float
    sampling: str
    sample_size: float
    pool_size: int
    population: int
    unit: str = "example"
    users_per_client: int = 1
    clip_norm: float | None = None
    setup: tuple = ()
    examples_per_user: int | None = dataclasses.field(default=None, repr=False)

    def __post_init__(self):
        validation.check_noise_multiplier(self.noise_multiplier)
        validation.check_choice(self.sampling, SAMPLINGS, "sampling")
        _check_unit(self.unit)
        validation.check_positive_int(self.pool_size, "pool_size")
        _check_population(self.population, self.unit)
        validation.check_positive_int(self.users_per_client, "users_per_client")
        validation.check_clip_norm(self.clip_norm)
        validation.check_positive(self.sample_size, "sample_size")
        if self.sample_size > self.pool_size:
            raise ValueError(
                f"The sample size ({self.sample_size}) is larger than the "
                f"number of units it is drawn from ({self.pool_size}). Use at "
                f"most {self.pool_size} per step."
            )
        if self.sampling == "full_batch" and self.sample_size != self.pool_size:
            raise ValueError(
                "Full-batch sampling uses every unit: sample_size must equal "
                f"pool_size ({self.pool_size}), got {self.sample_size}."
            )
        if self.sampling == "fixed" and self.sample_size != int(self.sample_size):
            raise ValueError(
                f"Fixed-size batches need an integer size, got {self.sample_size}."
            )
        if self.users_per_client > 1 and self.unit != "user":
            raise ValueError(
                "users_per_client > 1 groups users into virtual clients; the "
                f"unit must be 'user', got {self.unit!r}."
            )
        if self.users_per_client == 1 and self.pool_size != self.population:
            raise ValueError(
                f"With one unit per sampled element, pool_size ({self.pool_size}) "
                f"must equal population ({self.population}); group users with "
                "users_per_client > 1 (see kdpemb.privacy.virtual_clients)."
            )
        min_pool = num_virtual_clients(self.population, self.users_per_client)
        if not min_pool <= self.pool_size <= self.population:
            raise ValueError(
                f"{self.population} users in virtual clients of "
                f"users_per_client={self.users_per_client} make {min_pool} to "
                f"{self.population} virtual clients; got pool_size={self.pool_size}."
            )
        object.__setattr__(
            self, "setup", gaussian_release.check_releases(self.setup, "setup")
        )
        _check_examples_per_user(
            self.examples_per_user, self.unit, self.users_per_client
        )

    @property
    def sampling_probability(self):
        return self.sample_size / self.pool_size

    def parameters(self):
        """`examples_per_user` only when set: older ledgers still match."""
        params = super().parameters()
        if params["examples_per_user"] is None:
            del params["examples_per_user"]
        return params

    @property
    def neighboring_relation(self):
        if self.sampling == "fixed" or self.users_per_client > 1:
            return Relation.REPLACE_ONE
        return Relation.ADD_OR_REMOVE_ONE

    def setup_event(self):
        return _compose([r.event() for r in self.setup])

    def step_event(self):
        gaussian = dpa.GaussianDpEvent(self.noise_multiplier)
        if self.sampling == "full_batch":
            return gaussian
        if self.sampling == "poisson":
            return dpa.PoissonSampledDpEvent(self.sampling_probability, gaussian)
        return dpa.SampledWithoutReplacementDpEvent(
            self.pool_size, int(self.sample_size), gaussian
        )

    def with_noise_multiplier(self, noise_multiplier):
        return dataclasses.replace(self, noise_multiplier=noise_multiplier)

    def steps_for_epochs(self, epochs):
        """Steps in `epochs` passes: ceil(epochs · pool_size / sample_size).

        An epoch is one expected visit of every unit (example or virtual
        client). Rounding up never under-counts steps.
        """
        epochs = validation.check_positive(epochs, "epochs")
        exact = (
            fractions.Fraction(epochs)
            * self.pool_size
            / fractions.Fraction(self.sample_size)
        )
        return validation.check_steps(math.ceil(exact))

    def describe_relation(self):
        if self.users_per_client > 1:
            return (
                "add or remove all data of one user; with "
                f"{self.users_per_client} users per virtual client that changes "
                "one virtual client's clipped update, accounted as replace-one "
                "on virtual clients (the sum moves by up to 2C)"
            )
        if self.examples_per_user is not None:
            return (
                f"{super().describe_relation()} (each step averages at most "
                f"{self.examples_per_user} of the user's examples into one "
                "contribution clipped to C)"
            )
        return super().describe_relation()

    def describe_sampling(self):
        what = "virtual client" if self.unit == "user" else "example"
        if self.examples_per_user is not None:
            what = "user"
        if self.sampling == "full_batch":
            return f"full batch: every {what} in every step"
        if self.sampling == "fixed":
            return (
                f"fixed-size batches of {int(self.sample_size)} {what}s drawn "
                f"without replacement from {self.pool_size}"
            )
        return (
            f"Poisson: each {what} joins a step independently with "
            f"probability {self.sampling_probability:.4g}"
        )


@dataclasses.dataclass(frozen=True)
class GaussianReleases(Mechanism):
    """Independent Gaussian releases of full-data statistics at every step.

    For the last-layer methods: DP least squares (one step releasing the
    Gram matrix and the per-class sums), DP-Newton (per step, a noisy
    gradient and Hessian). Each release has its own noise and sensitivity
    (under add/remove of one example); the noise of every release is drawn
    independently. Their composition is exactly one Gaussian mechanism
    with noise multiplier (Σ z_i⁻²)^(-1/2), reported as `noise_multiplier`.

    Args:
        releases: tuple of `GaussianRelease`, released at every step.
        population: int. Number of examples.
        unit: str. "example" or "user".
        clip_norm: float or None. Feature clip norm, for the statement.
        setup: tuple of `GaussianRelease`. One-off releases before step 1.

    Example:

    >>> from kdpemb import privacy
    >>> m = privacy.gaussian_releases(
    ...     [(2.0, 1.0, "gram"), (2.0, 1.0, "class sums")], num_examples=10_000)
    >>> isinstance(m, privacy.GaussianReleases), [r.name for r in m.releases]
    (True, ['gram', 'class sums'])
    >>> round(privacy.epsilon(m, steps=1, delta=1e-5), 2)
    2.94
    """

    releases: tuple
    population: int
    unit: str = "example"
    clip_norm: float | None = None
    setup: tuple = ()

    def __post_init__(self):
        releases = tuple(self.releases)
        if not releases or not all(
            isinstance(r, gaussian_release.GaussianRelease) for r in releases
        ):
            raise ValueError(
                "releases must be a non-empty sequence of GaussianRelease, got "
                f"{self.releases!r}."
            )
        object.__setattr__(self, "releases", releases)
        object.__setattr__(self, "setup", tuple(self.setup))
        _check_population(self.population, self.unit)
        validation.check_clip_norm(self.clip_norm)
        _check_unit(self.unit)

    neighboring_relation = Relation.ADD_OR_REMOVE_ONE
    sampling = "full_batch"
    sampling_probability = 1.0

    @property
    def noise_multiplier(self):
        return gaussian_release.effective_noise_multiplier(self.releases)

    def setup_event(self):
        return _compose([r.event() for r in self.setup])

    def step_event(self):
        return _compose([r.event() for r in self.releases])

    def with_noise_multiplier(self, noise_multiplier):
        """Scales every per-step release so the composition has this multiplier.

        The split of the budget between the releases is kept; one-off
        `setup` releases keep their noise.
        """
        noise_multiplier = validation.check_noise_multiplier(noise_multiplier)
        current = self.noise_multiplier
        if current == 0:
            raise ValueError("Cannot rescale releases that have zero noise.")
        scale = noise_multiplier / current
        releases = tuple(
            dataclasses.replace(r, noise_std=r.noise_std * scale) for r in self.releases
        )
        return dataclasses.replace(self, releases=releases)

    def describe_sampling(self):
        names = ", ".join(r.name or "statistic" for r in self.releases)
        return f"full data each step; releases: {names}"


@dataclasses.dataclass(frozen=True)
class ZCDP(Mechanism):
    """A step known only to satisfy (ξ, ρ)-zCDP, e.g. from another library.

    Each step satisfies (α, ξ + ρα)-RDP for all α > 1 under
    `neighboring_relation`. Only the RDP accountant can use this.

    Args:
        rho: float. ρ of each step.
        population: int. Number of privacy units.
        xi: float. ξ of each step. Defaults to 0.
        unit: str. "example" or "user".
        relation: str. The relation the zCDP guarantee holds for.

    Example:

    >>> from kdpemb import privacy
    >>> step = privacy.ZCDP(rho=0.01, population=1_000)
    >>> step == privacy.zcdp(rho=0.01, population=1_000)  # the builder
    True
    >>> round(privacy.epsilon(step, steps=100, delta=1e-5, accountant="rdp"), 2)
    7.08
    """

    rho: float
    population: int
    xi: float = 0.0
    unit: str = "example"
    relation: str = "add_or_remove_one"

    def __post_init__(self):
        validation.check_positive(self.rho, "rho")
        if validation.check_finite_real(self.xi, "xi") < 0:
            raise ValueError(f"xi must be >= 0, got {self.xi!r}.")
        _check_population(self.population, self.unit)
        _check_unit(self.unit)
        relation_from_name(self.relation)

    sampling = "as stated by the zCDP guarantee"
    noise_multiplier = None

    @property
    def neighboring_relation(self):
        return relation_from_name(self.relation)

    def step_event(self):
        return dpa.ZCDpEvent(self.rho, self.xi)

    def zcdp_rho(self, steps):
        return steps * self.rho if self.xi == 0 else None


@dataclasses.dataclass(frozen=True)
class TreeAggregation(Mechanism):
    """DP-FTRL: each unit in at most one step per epoch, tree-aggregated noise.

    There is no sampling: an epoch is `steps_per_epoch` steps, and every
    privacy unit contributes to at most one of them (a virtual client takes
    part in at most one round). The clipped sums are released as noisy
    prefix sums through a binary tree over the steps: every node of the tree
    (the sum of a dyadic block of consecutive steps) gets its own noise
    N(0, (z·C)²), and the tree restarts every `leaves_per_tree` steps.

    Sensitivity, per tree. A unit's contribution sits in one leaf, and a
    leaf of a tree over n steps lies in at most `depth(n) = floor(log2 n) + 1`
    completed nodes (the nodes the online algorithm ever releases). Each of
    those nodes moves by at most Δ: C when the unit's contribution is
    replaced by a zero record (examples, or one user per virtual client),
    2C when it is replaced by another vector of norm <= C (k > 1 users per
    virtual client: removing one user changes the content of one client).
    The release of the whole tree is then one Gaussian mechanism of L2
    sensitivity Δ·sqrt(depth) and noise z·C per coordinate, so it is
    ρ = depth·(Δ/C)²/(2z²)-zCDP (RDP ε(α) = αρ). Trees in which no unit
    takes part twice compose by adding ρ; epochs compose by adding ρ. So

        ρ = (Δ/C)² / (2 z²) · Σ_epochs max_trees depth(steps of the tree)

    (within one epoch a unit is in one tree only, so an epoch costs the
    depth of its deepest tree, which is dp-accounting's
    `SingleEpochTreeAggregationDpEvent`). The RDP accountant composes
    exactly those events, with the noise multiplier z·C/Δ.

    Independent noise on the same schedule is the tree of one step
    (`leaves_per_tree=1`): depth 1, one Gaussian per epoch.

    Args:
        noise_multiplier: float. z: noise std per tree node over C.
        steps_per_epoch: int. Steps per epoch, a public number.
        population: int. Number of privacy units.
        unit: str. "example" or "user".
        users_per_client: int. k, users per virtual client. Defaults to 1.
        leaves_per_tree: int or None. Steps per tree before it restarts;
            None (default) restarts at every epoch. At most
            `steps_per_epoch`.
        clip_norm: float or None. C, for the statement.

    References:
        Kairouz et al., "Practical and Private (Deep) Learning without
        Sampling or Shuffling", ICML 2021.

    Example:

    >>> from kdpemb import privacy
    >>> m = privacy.tree_aggregation(10.0, steps_per_epoch=100, num_examples=6_400)
    >>> isinstance(m, privacy.TreeAggregation), m.sampling
    (True, 'tree')
    >>> round(privacy.epsilon(m, steps=200, delta=1e-5), 3)  # two epochs
    1.574
    """

    noise_multiplier: float
    steps_per_epoch: int
    population: int
    unit: str = "example"
    users_per_client: int = 1
    leaves_per_tree: int | None = None
    clip_norm: float | None = None

    def __post_init__(self):
        validation.check_noise_multiplier(self.noise_multiplier)
        validation.check_positive_int(self.steps_per_epoch, "steps_per_epoch")
        _check_population(self.population, self.unit)
        validation.check_positive_int(self.users_per_client, "users_per_client")
        validation.check_clip_norm(self.clip_norm)
        _check_unit(self.unit)
        if self.users_per_client > 1 and self.unit != "user":
            raise ValueError(
                "users_per_client > 1 groups users into virtual clients; the "
                f"unit must be 'user', got {self.unit!r}."
            )
        if self.leaves_per_tree is None:
            object.__setattr__(self, "leaves_per_tree", self.steps_per_epoch)
        leaves = validation.check_positive_int(self.leaves_per_tree, "leaves_per_tree")
        if leaves > self.steps_per_epoch:
            raise ValueError(
                f"leaves_per_tree={leaves} is more than the {self.steps_per_epoch} "
                "steps of an epoch: a tree spanning two epochs could hold one "
                "unit twice, which this accounting does not cover. Restart "
                f"the tree at least every epoch (leaves_per_tree <= "
                f"{self.steps_per_epoch})."
            )

    # The RDP accountant models tree events only under replace-by-zero; a
    # unit's placement never depends on other units, so adding or removing
    # a unit is exactly that (see `describe_relation`).
    neighboring_relation = Relation.REPLACE_SPECIAL

    @property
    def sampling(self):
        return "tree" if self.leaves_per_tree > 1 else "epochs"

    @property
    def node_sensitivity(self):
        """Δ/C: how far one unit moves a tree node, in clip norms."""
        return 2.0 if self.users_per_client > 1 else 1.0

    @property
    def unit_noise_multiplier(self):
        """z·C/Δ: the noise multiplier per unit of sensitivity."""
        return self.noise_multiplier / self.node_sensitivity

    def _epoch_trees(self, steps):
        """Steps per tree in an epoch (or its first `steps` steps)."""
        full, rest = divmod(steps, self.leaves_per_tree)
        return [self.leaves_per_tree] * full + ([rest] if rest else [])

    def _epochs(self, steps):
        """`(full epochs, steps of a partial last epoch)`."""
        steps = validation.check_steps(steps, minimum=0)
        return divmod(steps, self.steps_per_epoch)

    def event(self, steps):
        full_epochs, rest = self._epochs(steps)
        z = self.unit_noise_multiplier
        events = []
        if full_epochs:
            epoch = dpa.SingleEpochTreeAggregationDpEvent(
                z, self._epoch_trees(self.steps_per_epoch)
            )
            events.append(dpa.SelfComposedDpEvent(epoch, full_epochs))
        if rest:
            events.append(
                dpa.SingleEpochTreeAggregationDpEvent(z, self._epoch_trees(rest))
            )
        return _compose(events)

    def zcdp_rho(self, steps):
        """ρ of `steps` steps, in closed form (zCDP; None without noise).

        Example:

        >>> from kdpemb import privacy
        >>> m = privacy.tree_aggregation(4.0, steps_per_epoch=100, num_examples=6_400)
        >>> m.zcdp_rho(250) == (2 * 7 + 6) / (2 * 4.0**2)  # depths 7, 7 and 6
        True
        """
        full_epochs, rest = self._epochs(steps)
        if self.noise_multiplier == 0:
            return None if steps else 0.0

        def depth(epoch_steps):  # The deepest tree of the epoch.
            return max(tree_depth(n) for n in self._epoch_trees(epoch_steps))

        depths = full_epochs * depth(self.steps_per_epoch)
        if rest:
            depths += depth(rest)
        return depths / (2 * self.unit_noise_multiplier**2)

    def with_noise_multiplier(self, noise_multiplier):
        return dataclasses.replace(self, noise_multiplier=noise_multiplier)

    def steps_for_epochs(self, epochs):
        """Steps in `epochs` epochs: ceil(epochs · steps_per_epoch)."""
        epochs = validation.check_positive(epochs, "epochs")
        exact = fractions.Fraction(epochs) * self.steps_per_epoch
        return validation.check_steps(math.ceil(exact))

    def describe_relation(self):
        if self.unit == "example":
            return (
                "replace one example by a zero (null) record (that is add or "
                "remove one example only where an example's step does not "
                "depend on the other examples)"
            )
        text = (
            "add or remove all data of one user (VirtualClients places a user "
            "by keyed hashes of the user's own id, never by the other users, "
            "so the other users' contributions stay where they were)"
        )
        if self.users_per_client > 1:
            return text + (
                f"; with {self.users_per_client} users per virtual client that "
                "changes one client's clipped update, by up to 2C"
            )
        return text + ": one clipped update (norm <= C) is replaced by zero"

    def describe_sampling(self):
        what = "virtual client" if self.unit == "user" else self.unit
        return (
            f"no sampling: each {what} in at most one of the "
            f"{self.steps_per_epoch} steps of an epoch"
        )

    def describe_noise(self):
        if self.leaves_per_tree == 1:
            return INDEPENDENT_NOISE
        restart = (
            "restarted every epoch"
            if self.leaves_per_tree == self.steps_per_epoch
            else f"restarted every {self.leaves_per_tree} steps"
        )
        return f"tree aggregation (DP-FTRL), {restart}"


def tree_depth(steps):
    """Completed tree nodes one leaf lies in: floor(log2 steps) + 1.

    >>> [tree_depth(n) for n in (1, 2, 3, 4, 7, 8)]
    [1, 2, 2, 3, 3, 4]
    """
    steps = validation.check_positive_int(steps, "steps")
    return steps.bit_length()


# Moved in 0.x (issue 32): the builders to `kdpemb.privacy.mechanism_builders`
# and `GaussianRelease` to `kdpemb.privacy.gaussian_release`; their old paths
# here work, with a DeprecationWarning, for one release.
__getattr__ = moved_names(
    __name__,
    {
        "GaussianRelease": "kdpemb.privacy.gaussian_release",
        "effective_noise_multiplier": "kdpemb.privacy.gaussian_release",
        "dp_sgd": "kdpemb.privacy.mechanism_builders",
        "full_batch": "kdpemb.privacy.mechanism_builders",
        "virtual_clients": "kdpemb.privacy.mechanism_builders",
        "gaussian_releases": "kdpemb.privacy.mechanism_builders",
        "zcdp": "kdpemb.privacy.mechanism_builders",
        "tree_aggregation": "kdpemb.privacy.mechanism_builders",
    },
)
