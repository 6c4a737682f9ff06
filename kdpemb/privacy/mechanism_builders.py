"""Builders of the mechanisms of kdpemb's training schemes.

`dp_sgd`, `full_batch`, `virtual_clients`, `gaussian_releases`, `zcdp` and
`tree_aggregation` each return a `kdpemb.privacy.mechanisms.Mechanism`;
all are in `kdpemb.privacy`.

Example:

>>> from kdpemb import privacy
>>> m = privacy.dp_sgd(noise_multiplier=1.1, batch_size=256, num_examples=60_000)
>>> type(m).__name__, m.unit
('SampledGaussian', 'example')
"""

from kdpemb import _validation as validation
from kdpemb.privacy.gaussian_release import GaussianRelease
from kdpemb.privacy.mechanisms import (
    ZCDP,
    GaussianReleases,
    SampledGaussian,
    TreeAggregation,
)
from kdpemb.privacy.schedule import Schedule


def dp_sgd(
    noise_multiplier, batch_size, num_examples, *, sampling="poisson", clip_norm=None
):
    """Example-level DP-SGD: per-example clipping, Gaussian noise per step.

    Args:
        noise_multiplier: float. Noise std over the clip norm.
        batch_size: int or float. Expected batch size (Poisson) or exact
            batch size ("fixed").
        num_examples: int. Number of training examples N.
        sampling: str. "poisson" (default; q = batch_size / N) or "fixed".
            For one step on all the data use `full_batch`.
        clip_norm: float or None. The clip norm, for the statement.

    Example:

    >>> m = dp_sgd(noise_multiplier=1.1, batch_size=256, num_examples=60_000)
    >>> round(m.sampling_probability, 5), m.relation_name
    (0.00427, 'add_or_remove_one')
    """
    if sampling == "full_batch":
        raise ValueError("Use kdpemb.privacy.full_batch(...) for full-batch steps.")
    num_examples = validation.check_positive_int(num_examples, "num_examples")
    validation.check_sample_size(batch_size, num_examples, "batch_size", sampling)
    return SampledGaussian(
        noise_multiplier=noise_multiplier,
        sampling=sampling,
        sample_size=batch_size,
        pool_size=num_examples,
        population=num_examples,
        unit="example",
        clip_norm=clip_norm,
    )


def full_batch(
    noise_multiplier, num_examples, *, clip_norm=None, unit="example", setup=()
):
    """Every example in every step (q = 1): one Gaussian release per step.

    Example:

    >>> full_batch(noise_multiplier=5.0, num_examples=1000).sampling_probability
    1.0
    """
    num_examples = validation.check_positive_int(num_examples, "num_examples")
    return SampledGaussian(
        noise_multiplier=noise_multiplier,
        sampling="full_batch",
        sample_size=num_examples,
        pool_size=num_examples,
        population=num_examples,
        unit=unit,
        clip_norm=clip_norm,
        setup=setup,
    )


def virtual_clients(
    noise_multiplier,
    clients_per_round,
    num_users,
    *,
    users_per_client=1,
    sampling="poisson",
    clip_norm=None,
    num_clients=None,
):
    """User-level DP-FedEmb / DP-FedAvg rounds over virtual clients.

    Users are grouped into `ceil(num_users / users_per_client)` virtual
    clients; each round samples `clients_per_round` of them (in
    expectation, for Poisson), clips each client's update to C, sums, and
    adds N(0, (zC)²) once. With `users_per_client` > 1 the relation is
    replace-one on virtual clients (see `SampledGaussian`).

    Args:
        noise_multiplier: float. z = noise std / C.
        clients_per_round: float. Expected virtual clients per round M.
        num_users: int. Number of users.
        users_per_client: int. Users per virtual client k. Defaults to 1.
        sampling: str. "poisson" (default), "full_batch" or "fixed".
        clip_norm: float or None. C, for the statement.
        num_clients: int or None. P, the number of virtual clients, when it
            is fixed from a public count (k > 1). Defaults to
            `ceil(num_users / users_per_client)`.

    Example:

    >>> m = virtual_clients(1.0, clients_per_round=64, num_users=10_000,
    ...                     users_per_client=4)
    >>> m.pool_size, m.relation_name
    (2500, 'replace_one')
    """
    schedule = Schedule.virtual_clients(
        num_users,
        clients_per_round,
        users_per_client=users_per_client,
        num_clients=num_clients,
        sampling=sampling,
    )
    return schedule.privacy_mechanism(noise_multiplier, clip_norm)


def gaussian_releases(
    releases, num_examples, *, setup=(), clip_norm=None, unit="example"
):
    """Gaussian releases of full-data statistics at every step (DP-LS, DP-Newton).

    Args:
        releases: sequence of `GaussianRelease` or `(noise_std, sensitivity)`
            or `(noise_std, sensitivity, name)` tuples.
        num_examples: int. Number of examples.
        setup: one-off releases before the first step, same forms.
        clip_norm: float or None. Feature clip norm, for the statement.
        unit: str. "example" or "user".

    Example:

    >>> m = gaussian_releases([(2.0, 1.0, "gram"), (2.0, 1.0, "class sums")],
    ...                       num_examples=10_000)
    >>> round(m.noise_multiplier, 4)
    1.4142
    """
    return GaussianReleases(
        releases=_as_releases(releases),
        population=num_examples,
        unit=unit,
        clip_norm=clip_norm,
        setup=_as_releases(setup),
    )


def _as_releases(items):
    return tuple(
        item if isinstance(item, GaussianRelease) else GaussianRelease(*item)
        for item in items
    )


def zcdp(
    rho, population, *, xi=0.0, unit="example", neighboring_relation="add_or_remove_one"
):
    """Steps that each satisfy (ξ, ρ)-zCDP (RDP accountant only).

    Example:

    >>> zcdp(rho=0.01, population=1000).step_event()
    ZCDpEvent(rho=0.01, xi=0.0)
    """
    return ZCDP(
        rho=rho, population=population, xi=xi, unit=unit, relation=neighboring_relation
    )


def tree_aggregation(
    noise_multiplier,
    steps_per_epoch,
    num_examples,
    *,
    unit="example",
    users_per_client=1,
    leaves_per_tree=None,
    clip_norm=None,
):
    """DP-FTRL: tree-aggregated noise, each unit in one step per epoch.

    RDP accountant only (and `TreeAggregation.zcdp_rho` for zCDP). For user-level
    rounds over virtual clients, take the mechanism from
    `Schedule.virtual_clients(..., sampling="epochs")` instead.

    Args:
        noise_multiplier: float. z, noise std per tree node over C.
        steps_per_epoch: int. Steps per epoch.
        num_examples: int. Number of privacy units (examples, or users).
        unit: str. "example" (default) or "user".
        users_per_client: int. k, users per virtual client. Defaults to 1.
        leaves_per_tree: int or None. Steps before the tree restarts; None
            (default) restarts every epoch; 1 is independent noise.
        clip_norm: float or None. C, for the statement.

    Example:

    >>> m = tree_aggregation(10.0, steps_per_epoch=100, num_examples=6400)
    >>> two_epochs, partial_epoch = m.event(250).events
    >>> two_epochs.count, two_epochs.event.step_counts, partial_epoch.step_counts
    (2, [100], [50])
    """
    return TreeAggregation(
        noise_multiplier=noise_multiplier,
        steps_per_epoch=steps_per_epoch,
        population=num_examples,
        unit=unit,
        users_per_client=users_per_client,
        leaves_per_tree=leaves_per_tree,
        clip_norm=clip_norm,
    )
