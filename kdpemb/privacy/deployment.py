"""Simulated deployment: the ε a larger deployment of a run would have.

Utility depends on the noise of the *mean* update, std z·C/M (noise
multiplier z, clip norm C, M clients per round). A run with z and M has
the same mean-update noise as a deployment with s·z and s·M clients per
round, drawn from a population large enough that the sampling rate
q = s·M / P stays at most 1. Papers that train on public benchmarks with
small z (DP-FedEmb, Xu et al. 2023: "0.02×64") state the ε of such a
deployment. That ε is *not* the run's guarantee: the run itself, with
noise z, has a far larger ε (or none at all).

`simulated_deployment` states the deployment's guarantee as a
`DeploymentStatement`. It is not a `PrivacyStatement`: it *holds* one,
`.deployment` (the deployment's mechanism, built from
`Schedule.virtual_clients` and accounted like any other run), next to
`.run`, the run's own z, M, population and ε at the same δ
(`RunDescription`). Its summary, table and JSON (nested: `{"kind":
"simulated_deployment", "deployment": {"simulated": true, ...}, "run":
{...}}`) say "simulated deployment" everywhere, and so does `.deployment`
on its own (`simulated=True`: its summary, table and dict), so that
`PrivacyStatement.from_json` refuses the whole JSON and its "deployment"
entry alike. The extrapolation keeps the run's unit, users per
virtual client k (so its neighbouring relation: replace-one for k > 1),
sampling (Poisson only), local steps and number of rounds; the
deployment's pool is `ceil(deployment_users / k)` virtual clients, or
`deployment_clients`.

Example:

>>> from kdpemb import privacy
>>> run = privacy.Schedule.virtual_clients(num_users=200_000,
...                                        clients_per_round=100)
>>> statement = privacy.simulated_deployment(
...     run, noise_multiplier=0.1, steps=1_000, scale=10,
...     deployment_users=10_000_000, delta=1e-8)
>>> statement.deployment.noise_multiplier, statement.deployment_clients_per_round
(1.0, 1000.0)
>>> statement.run_epsilon > 100  # The run's own ε (RDP): no real guarantee.
True
>>> print(statement.summary())  # doctest: +ELLIPSIS
Simulated deployment (NOT this run's guarantee): scale s = 10, i.e. ...
"""

import dataclasses
import json
import math

from kdpemb import _validation as validation
from kdpemb.privacy import mechanisms
from kdpemb.privacy.accountant import Accountant
from kdpemb.privacy.mechanisms import Relation
from kdpemb.privacy.schedule import Schedule
from kdpemb.privacy.statement import (
    DEPLOYMENT_KIND,
    PrivacyStatement,
    rich_table,
    text_table,
)

KIND = DEPLOYMENT_KIND
RUN_LABEL = "this run's own guarantee"


def _count(value):
    """A count for display: an integer with separators, else 10 digits."""
    if float(value).is_integer():
        return f"{int(value):,}"
    return format(value, ".10g")


def _scale(value):
    return format(value, ".10g")


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunDescription:
    """The run a simulated deployment stands for, with its own ε.

    Attributes:
        noise_multiplier: float. The run's z.
        clients_per_round: float. The run's M.
        population: int. The run's users N.
        pool_size: int. The run's virtual clients P.
        users_per_client: int. k (the deployment's too).
        sampling_probability: float. The run's q = M / P.
        epsilon: float or None. The run's own ε at the deployment's δ
            (`math.inf`: no noise, no guarantee); None when not computed
            (see `epsilon_note`).
        epsilon_accountant: str or None. "rdp" or "pld"; None when not
            computed.
        epsilon_note: str. How `epsilon` was computed, or why it was not.

    Example:

    >>> from kdpemb import privacy
    >>> run = privacy.Schedule.virtual_clients(160_000, 2_048)
    >>> statement = privacy.simulated_deployment(
    ...     run, 0.02, 200, scale=64, deployment_users=10_000_000, delta=1e-8,
    ...     accountant="rdp")
    >>> statement.run.population, statement.run.clients_per_round
    (160000, 2048.0)
    >>> statement.run.epsilon > 1_000  # z = 0.02 alone protects nobody
    True
    """

    noise_multiplier: float
    clients_per_round: float
    population: int
    pool_size: int
    users_per_client: int
    sampling_probability: float
    epsilon: float | None
    epsilon_accountant: str | None
    epsilon_note: str

    def to_dict(self):
        data = dataclasses.asdict(self)
        if data["epsilon"] is not None and not math.isfinite(data["epsilon"]):
            data["epsilon"] = None  # Told apart by epsilon_accountant.
        return data

    @classmethod
    def from_dict(cls, data):
        data = dict(data)
        if data.get("epsilon") is None and data.get("epsilon_accountant"):
            data["epsilon"] = math.inf
        return cls(**data)

    def describe_epsilon(self, delta):
        """The run's own ε at `delta` in words, or why it was not computed."""
        if self.epsilon is None:
            return self.epsilon_note
        name = "PLD" if self.epsilon_accountant == "pld" else "RDP"
        if math.isinf(self.epsilon):
            return f"ε = ∞: NO guarantee (no noise; {name} accountant)"
        return f"ε = {self.epsilon:.4g} at δ = {delta:.3g} ({name} accountant)"


@dataclasses.dataclass(frozen=True, kw_only=True)
class DeploymentStatement:
    """A simulated deployment's guarantee, held apart from the run's.

    Not a `PrivacyStatement` (and not one by `isinstance`): it holds the
    deployment's `PrivacyStatement` as `deployment`, and the run as `run`.
    `PrivacyStatement.from_json` refuses its JSON, and the dict of its
    `deployment`; read it back with `DeploymentStatement.from_json`.

    Attributes:
        deployment: `PrivacyStatement`. The deployment's guarantee (s·z
            noise, s·M clients per round, its population and pool), marked
            `simulated=True` (marked here if it was not): its own summary
            opens with "SIMULATED DEPLOYMENT (NOT this run's guarantee)".
        scale: float. s: the deployment has s times the run's noise
            multiplier and clients per round.
        deployment_clients_per_round: float. The deployment's s·M.
        run: `RunDescription`. The run's own z, M, population and ε.

    Example:

    >>> from kdpemb import privacy
    >>> run = privacy.Schedule.virtual_clients(160_000, 2_048)
    >>> statement = privacy.simulated_deployment(
    ...     run, 0.02, 200, scale=64, deployment_users=10_000_000, delta=1e-8,
    ...     accountant="rdp")
    >>> isinstance(statement, privacy.DeploymentStatement)
    True
    >>> isinstance(statement, privacy.PrivacyStatement)  # never the run's own
    False
    >>> statement.deployment_clients_per_round, round(statement.deployment.epsilon, 2)
    (131072.0, 1.48)
    >>> print(statement.deployment.summary())  # doctest: +ELLIPSIS
    SIMULATED DEPLOYMENT (NOT this run's guarantee): (ε = 1.48, δ = 1e-08)-DP ...
    """

    title = "Privacy statement of a SIMULATED DEPLOYMENT (not this run's guarantee)"
    kind = KIND  # Not a field: written first in `to_dict`.

    deployment: PrivacyStatement
    scale: float
    deployment_clients_per_round: float
    run: RunDescription

    def __post_init__(self):
        if not isinstance(self.deployment, PrivacyStatement):
            raise TypeError(
                "deployment must be the deployment's PrivacyStatement, got "
                f"{type(self.deployment).__name__}."
            )
        if not self.deployment.simulated:  # Never shown as a run's on its own.
            marked = dataclasses.replace(self.deployment, simulated=True)
            object.__setattr__(self, "deployment", marked)
        if not isinstance(self.run, RunDescription):
            raise TypeError(
                f"run must be a RunDescription, got {type(self.run).__name__}."
            )

    @property
    def run_epsilon(self):
        """The run's own ε at the same δ (None: not computed; see `run`)."""
        return self.run.epsilon

    def summary(self, run_guarantee=True):
        """One line, opening with "Simulated deployment", then the guarantee;
        it ends with the run's own guarantee unless `run_guarantee=False`
        (for a report that states the run's guarantee once, elsewhere)."""
        deployment, run = self.deployment, self.run
        unit = deployment.unit
        line = (
            f"Simulated deployment (NOT this run's guarantee): scale s = "
            f"{_scale(self.scale)}, i.e. noise multiplier "
            f"{deployment.noise_multiplier:.4g} and "
            f"{_count(self.deployment_clients_per_round)} clients per round "
            f"over {deployment.population:,} {unit}s, where the run had noise "
            f"multiplier {run.noise_multiplier:.4g} and "
            f"{_count(run.clients_per_round)} clients per round over "
            f"{run.population:,} {unit}s (same mean-update noise z·C/M). The "
            f"deployment would satisfy: {deployment.guarantee_summary()}"
        )
        if not run_guarantee:
            return line
        own = run.describe_epsilon(deployment.delta)
        return f"{line} This run's own guarantee: {own}."

    def rows(self):
        """(field, value) pairs; each of the deployment's says "(deployment)"."""
        run = self.run
        return [
            (
                "statement of",
                f"SIMULATED DEPLOYMENT, scale s = {_scale(self.scale)} (not this run)",
            ),
            *[
                (f"{field} (deployment)", value)
                for field, value in self.deployment.guarantee_rows()
            ],
            (
                "clients per round (deployment)",
                _count(self.deployment_clients_per_round),
            ),
            (
                f"ε of the run ({RUN_LABEL})",
                run.describe_epsilon(self.deployment.delta),
            ),
            (
                "the run itself",
                f"noise multiplier {run.noise_multiplier:.4g}, "
                f"{_count(run.clients_per_round)} clients per round, "
                f"{run.population:,} {self.deployment.unit}s, q = "
                f"{run.sampling_probability:.4g}",
            ),
        ]

    def to_dict(self):
        """A JSON-ready, nested dict: kind, scale, deployment (`"simulated":
        true`), run."""
        return {
            "kind": KIND,
            "scale": self.scale,
            "deployment_clients_per_round": self.deployment_clients_per_round,
            "deployment": self.deployment.to_dict(),
            "run": self.run.to_dict(),
        }

    def to_json(self, indent=2):
        return json.dumps(self.to_dict(), indent=indent, allow_nan=False)

    @classmethod
    def from_dict(cls, data):
        """The statement `to_dict` wrote (its "deployment" with or without
        `"simulated": true`, as earlier versions wrote it)."""
        if data.get("kind") != KIND:
            raise ValueError(
                f"A DeploymentStatement dict has kind={KIND!r}, got "
                f"{data.get('kind')!r}. A run's own statement is read with "
                "PrivacyStatement.from_dict."
            )
        return cls(
            deployment=PrivacyStatement.from_fields(data["deployment"], simulated=True),
            scale=data["scale"],
            deployment_clients_per_round=data["deployment_clients_per_round"],
            run=RunDescription.from_dict(data["run"]),
        )

    @classmethod
    def from_json(cls, text):
        return cls.from_dict(json.loads(text))

    def __rich__(self):
        return rich_table(self.title, self.rows())

    def __str__(self):
        return text_table(self.title, self.rows())


def _round_down(value, digits=4):
    """`value` rounded down to `digits` significant digits (> 0 values)."""
    exponent = math.floor(math.log10(value))
    factor = 10.0 ** (digits - 1 - exponent)
    rounded = math.floor(value * factor) / factor
    while rounded > value:  # Guards against float error in the product.
        rounded -= 1 / factor
    return rounded


def deployment_schedule(schedule, scale, deployment_users, deployment_clients=None):
    """The `Schedule` of a deployment with s times the run's clients per round.

    Args:
        schedule: `Schedule`. The run's (user level, Poisson sampling).
        scale: float. s >= 1.
        deployment_users: int. Users N' in the deployment, at least the
            run's N.
        deployment_clients: int or None. The deployment's number of
            virtual clients P', if fixed from a public count: in
            [ceil(N'/k), N'] (exactly N' for k = 1). None derives
            `ceil(N'/k)`, except: a deployment of the run's own users
            keeps the run's P; and a run whose P is a public count
            (`num_clients`) needs an explicit P' for any other N' (the
            deployment's public count is not the run's to guess).

    Example:

    >>> run = Schedule.virtual_clients(20_000, 50, users_per_client=4)
    >>> deployed = deployment_schedule(run, 8, 1_000_000)
    >>> deployed.sample_size, deployed.pool_size, deployed.users_per_client
    (400.0, 250000, 4)
    """
    if not isinstance(schedule, Schedule):
        raise TypeError(
            "schedule must be a kdpemb.privacy.Schedule (e.g. model.schedule or "
            "Schedule.virtual_clients(...)), got "
            f"{type(schedule).__name__}."
        )
    if schedule.unit != "user":
        raise ValueError(
            "A simulated deployment scales the clients per round of a "
            f"user-level schedule; this one's unit is {schedule.unit!r}. Build "
            "it with Schedule.virtual_clients."
        )
    if schedule.sampling != "poisson":
        raise ValueError(
            "A simulated deployment keeps the run's Poisson sampling at a new "
            f"rate; this schedule samples {schedule.sampling!r}. Use a "
            "schedule with sampling='poisson'."
        )
    scale = validation.check_deployment_scale(scale)
    users = validation.check_positive_int(deployment_users, "deployment_users")
    if users < schedule.population:
        raise ValueError(
            f"deployment_users={users} is fewer than the run's "
            f"{schedule.population} users. A simulated deployment is at "
            f"least as large as the run: use deployment_users >= "
            f"{schedule.population}."
        )
    k = schedule.users_per_client
    given = deployment_clients is not None
    if given:
        deployment_clients = validation.check_deployment_clients(
            deployment_clients, users, k
        )
    elif users == schedule.population:
        deployment_clients = schedule.num_clients
    elif schedule.num_clients is not None:
        low = mechanisms.num_virtual_clients(users, k)
        same_ratio = -(-schedule.num_clients * users // schedule.population)
        raise ValueError(
            f"The run's pool of {schedule.num_clients} virtual clients is a "
            f"public count (num_clients); a deployment of {users} users (not "
            f"the run's {schedule.population}) needs its own: pass "
            f"deployment_clients in [{low}, {users}] (e.g. "
            f"{min(max(same_ratio, low), users)} for the run's ratio of "
            "clients to users)."
        )
    pool = (
        mechanisms.num_virtual_clients(users, k)
        if deployment_clients is None
        else deployment_clients
    )
    clients = scale * schedule.sample_size
    if clients > pool:
        needed = math.ceil(clients)
        fix = (
            f"deployment_clients >= {needed}"
            if given
            else f"deployment_users >= {needed * k}"
        )
        raise ValueError(
            f"The deployment samples s·M = {_scale(scale)} × "
            f"{_count(schedule.sample_size)} = {_count(clients)} virtual clients "
            f"per round from {pool} (deployment_users={users}, "
            f"users_per_client={k}): q = {clients / pool:.4g} > 1, more than "
            f"the whole pool. Use {fix}, or scale <= "
            f"{_round_down(pool / schedule.sample_size):.10g}."
        )
    return Schedule.virtual_clients(
        users,
        clients,
        users_per_client=k,
        num_clients=deployment_clients,
        sampling="poisson",
        local_steps=schedule.local_steps,
    )


def run_epsilon(schedule, noise_multiplier, steps, delta, *, scale, accountant):
    """The run's own ε at `delta`, where it can be computed safely.

    PLD at the small z of such runs can take very long (or exhaust
    memory), so: with s = 1 the run has the deployment's z and is accounted
    like it (`accountant`); otherwise with RDP, which is fast at any z,
    where the run's relation allows (add/remove, k = 1). Replace-one runs
    (k > 1) with s > 1 are not computed: RDP has no model of them and no
    bound is invented.

    Returns:
        (epsilon or None, accountant name or None, note).
    """
    mechanism = schedule.privacy_mechanism(noise_multiplier)
    if scale == 1:
        method = accountant
    elif mechanism.neighboring_relation == Relation.ADD_OR_REMOVE_ONE:
        method = "rdp"
    else:
        return (
            None,
            None,
            "not computed: the run's relation is replace-one (users_per_client "
            f"{schedule.users_per_client}), which the RDP accountant does not "
            f"model, and PLD at the run's noise multiplier {noise_multiplier:.4g} "
            "can take very long; compute it with PrivacyStatement.compute("
            "schedule.privacy_mechanism(z), steps, delta) if you need it",
        )
    epsilon = Accountant(mechanism, method).epsilon(steps, delta)
    note = f"{RUN_LABEL}, at the deployment's δ, {method.upper()} accountant"
    return epsilon, method, note


def simulated_deployment(
    schedule,
    noise_multiplier,
    steps,
    *,
    scale,
    deployment_users,
    delta,
    deployment_clients=None,
    clip_norm=None,
    accountant="pld",
):
    """The guarantee of a deployment with s·z noise and s·M clients per round.

    The deployment has the run's mean-update noise z·C/M, the run's
    number of rounds, unit, users per virtual client (hence relation) and
    local steps; only its noise, clients per round and population differ.
    Its ε is computed like any run's (`PrivacyStatement.compute` on
    `deployment_schedule(...).privacy_mechanism(s·z)`); it is a statement
    about that deployment, never about the run. The run's own ε at the
    same δ comes with it (`run_epsilon`; see the function of that name).

    Args:
        schedule: `Schedule`. The run's schedule (e.g. `model.schedule`).
        noise_multiplier: float. The run's z (e.g. `model.noise_multiplier`).
        steps: int. The run's private steps (rounds), kept as they are.
        scale: float. s >= 1; s = 1 with the run's own users is the run.
        deployment_users: int. Users N' in the deployment (>= the run's).
            The deployment's q = s·M / P' must be <= 1.
        delta: float. δ, below 1 / deployment_users.
        deployment_clients: int or None. P'; see `deployment_schedule`.
        clip_norm: float or None. C, shown in the statement.
        accountant: str. "pld" (default) or "rdp" (add/remove only, k = 1)
            for the deployment.

    Returns:
        `DeploymentStatement`.

    Example:

    >>> from kdpemb import privacy
    >>> run = privacy.Schedule.virtual_clients(160_000, 2_048)
    >>> statement = privacy.simulated_deployment(
    ...     run, 0.02, 200, scale=64, deployment_users=10_000_000, delta=1e-8,
    ...     accountant="rdp")
    >>> statement.deployment.noise_multiplier, statement.deployment.population
    (1.28, 10000000)
    >>> round(statement.deployment.epsilon, 2)
    1.48
    """
    noise_multiplier = validation.check_noise_multiplier(noise_multiplier)
    deployed = deployment_schedule(
        schedule, scale, deployment_users, deployment_clients
    )
    scale = float(scale)
    mechanism = deployed.privacy_mechanism(scale * noise_multiplier, clip_norm)
    statement = PrivacyStatement.compute(mechanism, steps, delta, accountant)
    epsilon, method, note = run_epsilon(
        schedule,
        noise_multiplier,
        statement.steps,
        statement.delta,
        scale=scale,
        accountant=statement.accountant,
    )
    return DeploymentStatement(
        deployment=statement,
        scale=scale,
        deployment_clients_per_round=deployed.sample_size,
        run=RunDescription(
            noise_multiplier=noise_multiplier,
            clients_per_round=schedule.sample_size,
            population=schedule.population,
            pool_size=schedule.pool_size,
            users_per_client=schedule.users_per_client,
            sampling_probability=schedule.sampling_probability,
            epsilon=epsilon,
            epsilon_accountant=method,
            epsilon_note=note,
        ),
    )


def calibrate_run_noise(
    schedule,
    steps,
    delta,
    *,
    target_epsilon,
    scale,
    deployment_users,
    deployment_clients=None,
    accountant="pld",
):
    """The run's z whose *simulated deployment* spends `target_epsilon`.

    Calibrates the deployment's noise multiplier z' (s·M clients per
    round over `deployment_users`, `steps` rounds, δ) for the target, and
    returns z = z' / s for the run, so that the run has the deployment's
    noise in the mean update. The target holds for the simulated
    deployment only; the run's own ε, over its own users, is far larger.

    Args:
        schedule: the run's `Schedule` (user-level, Poisson).
        steps: int. Rounds of the run (and of the deployment).
        delta: float. δ of the deployment, below 1 / deployment_users.
        target_epsilon: float. ε of the simulated deployment.
        scale, deployment_users, deployment_clients: as for
            `simulated_deployment`.
        accountant: "pld" (default) or "rdp".

    Returns:
        float: the run's noise multiplier.

    Example:

    >>> from kdpemb.privacy import Schedule, calibrate_run_noise
    >>> run = Schedule.virtual_clients(40_000, clients_per_round=16,
    ...                                users_per_client=4)
    >>> z = calibrate_run_noise(run, 100, 1e-8, target_epsilon=8.0, scale=64,
    ...                         deployment_users=10_000_000)
    >>> 0 < z < 0.05
    True
    """
    from kdpemb.privacy.calibration import calibrate_noise_multiplier

    deployed = deployment_schedule(
        schedule, scale, deployment_users, deployment_clients
    )
    deployed_z = calibrate_noise_multiplier(
        deployed.privacy_mechanism(1.0),
        steps,
        delta,
        target_epsilon=target_epsilon,
        accountant=accountant,
    )
    # Rounded up, so that s·z is never below the calibrated z'.
    run_z = deployed_z / float(scale)
    while run_z * float(scale) < deployed_z:
        run_z = math.nextafter(run_z, math.inf)
    return run_z
