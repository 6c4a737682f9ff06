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
`DeploymentStatement`: a `PrivacyStatement` of the deployment's mechanism
(built from `Schedule.virtual_clients`, accounted like any other run)
that names itself "simulated deployment" everywhere it is shown, and
carries the run's own z, M and population. The extrapolation keeps the
run's unit, users per virtual client k (so its neighbouring relation:
replace-one for k > 1), sampling (Poisson only), local steps and number
of rounds; the deployment's pool is `ceil(deployment_users / k)` virtual
clients.

Example:

>>> from kdpemb import privacy
>>> run = privacy.Schedule.virtual_clients(num_users=200_000,
...                                        clients_per_round=100)
>>> deployment = privacy.simulated_deployment(
...     run, noise_multiplier=0.1, steps=1_000, scale=10,
...     deployment_users=10_000_000, delta=1e-8)
>>> deployment.noise_multiplier, deployment.clients_per_round
(1.0, 1000.0)
>>> print(deployment.summary())  # doctest: +ELLIPSIS
Simulated deployment (NOT this run's guarantee): scale s = 10, i.e. ...
"""

import dataclasses

from kdpemb import _validation as validation
from kdpemb.privacy import mechanisms
from kdpemb.privacy.schedule import Schedule
from kdpemb.privacy.statement import PrivacyStatement

KIND = "simulated_deployment"


@dataclasses.dataclass(frozen=True, kw_only=True)
class DeploymentStatement(PrivacyStatement):
    """The `PrivacyStatement` of a simulated deployment, marked as such.

    Its `PrivacyStatement` fields (`epsilon`, `noise_multiplier`,
    `sampling_probability`, `population`, ...) are the deployment's. Its
    `summary()`, table and JSON say "simulated deployment" and show the
    run's own values next to them. `PrivacyStatement.from_json` refuses
    its JSON (use `DeploymentStatement.from_json`), so it is not read
    back as the run's guarantee by mistake.

    Attributes (beyond `PrivacyStatement`'s):
        kind: str. Always "simulated_deployment".
        scale: float. s: the deployment has s times the run's noise
            multiplier and clients per round.
        clients_per_round: float. The deployment's s·M.
        run_noise_multiplier: float. The run's z.
        run_clients_per_round: float. The run's M.
        run_population: int. The run's users.
        run_sampling_probability: float. The run's q.
    """

    title = "Privacy statement of a SIMULATED DEPLOYMENT (not this run's guarantee)"

    kind: str = KIND
    scale: float
    clients_per_round: float
    run_noise_multiplier: float
    run_clients_per_round: float
    run_population: int
    run_sampling_probability: float

    def __post_init__(self):
        if self.kind != KIND:
            raise ValueError(f"kind must be {KIND!r}, got {self.kind!r}.")

    def summary(self):
        """One line, opening with "Simulated deployment", then the guarantee."""
        return (
            f"Simulated deployment (NOT this run's guarantee): scale s = "
            f"{self.scale:g}, i.e. noise multiplier {self.noise_multiplier:.4g} "
            f"and {self.clients_per_round:g} clients per round over "
            f"{self.population:,} {self.unit}s, where the run had noise "
            f"multiplier {self.run_noise_multiplier:.4g} and "
            f"{self.run_clients_per_round:g} clients per round over "
            f"{self.run_population:,} {self.unit}s (same mean-update noise "
            f"z·C/M). The deployment would satisfy: {super().summary()}"
        )

    def rows(self):
        run = (
            f"noise multiplier {self.run_noise_multiplier:.4g}, "
            f"{self.run_clients_per_round:g} clients per round, "
            f"{self.run_population:,} {self.unit}s, q = "
            f"{self.run_sampling_probability:.4g}"
        )
        return [
            ("statement of", f"simulated deployment, scale s = {self.scale:g}"),
            ("the run itself", run),
            ("clients per round (deployment)", f"{self.clients_per_round:g}"),
            *super().rows(),
        ]


def deployment_schedule(schedule, scale, deployment_users, deployment_clients=None):
    """The `Schedule` of a deployment with s times the run's clients per round.

    Args:
        schedule: `Schedule`. The run's (user level, Poisson sampling).
        scale: float. s >= 1.
        deployment_users: int. Users in the deployment, at least the run's.
        deployment_clients: int or None. The deployment's number of
            virtual clients P, if fixed from a public count. None derives
            `ceil(deployment_users / k)`, except that a deployment of the
            run's own users keeps the run's P.

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
    if deployment_clients is None and users == schedule.population:
        deployment_clients = schedule.num_clients
    if deployment_clients is None:
        pool = mechanisms.num_virtual_clients(users, k)
    else:
        pool = validation.check_positive_int(deployment_clients, "deployment_clients")
    clients = scale * schedule.sample_size
    if clients > pool:
        needed = clients * k
        raise ValueError(
            f"The deployment samples s·M = {scale:g} × "
            f"{schedule.sample_size:g} = {clients:g} virtual clients per round "
            f"from {pool} (deployment_users={users}, users_per_client={k}): "
            f"q = {clients / pool:.4g} > 1, more than the whole pool. Use "
            f"deployment_users >= {needed:.0f}, or scale <= "
            f"{pool / schedule.sample_size:.4g}."
        )
    return Schedule.virtual_clients(
        users,
        clients,
        users_per_client=k,
        num_clients=deployment_clients,
        sampling="poisson",
        local_steps=schedule.local_steps,
    )


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
    about that deployment, never about the run.

    Args:
        schedule: `Schedule`. The run's schedule (e.g. `model.schedule`).
        noise_multiplier: float. The run's z (e.g. `model.noise_multiplier`).
        steps: int. The run's private steps (rounds), kept as they are.
        scale: float. s >= 1; s = 1 with the run's own users is the run.
        deployment_users: int. Users in the deployment (>= the run's). The
            deployment's q = s·M / ceil(deployment_users / k) must be <= 1.
        delta: float. δ, below 1 / deployment_users.
        deployment_clients: int or None. See `deployment_schedule`.
        clip_norm: float or None. C, shown in the statement.
        accountant: str. "pld" (default) or "rdp" (add/remove only, k = 1).

    Returns:
        `DeploymentStatement`.
    """
    noise_multiplier = validation.check_noise_multiplier(noise_multiplier)
    deployed = deployment_schedule(
        schedule, scale, deployment_users, deployment_clients
    )
    scale = float(scale)
    mechanism = deployed.privacy_mechanism(scale * noise_multiplier, clip_norm)
    statement = PrivacyStatement.compute(mechanism, steps, delta, accountant)
    fields = {
        field.name: getattr(statement, field.name)
        for field in dataclasses.fields(PrivacyStatement)
    }
    return DeploymentStatement(
        **fields,
        scale=scale,
        clients_per_round=deployed.sample_size,
        run_noise_multiplier=noise_multiplier,
        run_clients_per_round=schedule.sample_size,
        run_population=schedule.population,
        run_sampling_probability=schedule.sampling_probability,
    )
