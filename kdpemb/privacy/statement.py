"""PrivacyStatement: the guarantee a trained model ships with."""

import dataclasses
import importlib.metadata
import json
import math

from kdpemb import _validation as validation
from kdpemb.privacy.accountant import ACCOUNTANTS, Accountant
from kdpemb.privacy.mechanisms import INDEPENDENT_NOISE
from kdpemb.version import __version__

# The "kind" of a `DeploymentStatement`'s dict (kdpemb.privacy.deployment).
DEPLOYMENT_KIND = "simulated_deployment"
# What a simulated deployment's statement (`simulated=True`) says first.
SIMULATED_LABEL = "SIMULATED DEPLOYMENT (NOT this run's guarantee)"

_ACCOUNTANT_NAMES = {
    "pld": "PLD (privacy loss distributions, dp-accounting)",
    "rdp": "RDP (Rényi DP, dp-accounting)",
}


def _dp_accounting_version():
    try:
        return importlib.metadata.version("dp-accounting")
    except importlib.metadata.PackageNotFoundError:  # pragma: no cover
        return "unknown"


@dataclasses.dataclass(frozen=True)
class PrivacyStatement:
    """An (ε, δ)-DP guarantee with everything needed to read it correctly.

    Attributes:
        epsilon: float. ε; `math.inf` means no guarantee (no noise).
        delta: float. δ.
        unit: str. "example" or "user": whose data the guarantee protects.
        neighboring_relation: str. "add_or_remove_one", "replace_one" or
            "replace_special".
        relation_description: str. The relation in words.
        sampling: str. "poisson", "full_batch", "fixed", "tree", ...
        sampling_description: str. The sampling assumption in words.
        accountant: str. "pld" or "rdp".
        steps: int. Private steps (rounds) accounted for.
        noise_multiplier: float or None. Noise std over sensitivity.
        clip_norm: float or None. The clip norm C.
        sampling_probability: float or None. q per step.
        population: int. Number of units (examples or users).
        noise_description: str. How the noise is drawn ("independent
            Gaussian noise each step", or DP-FTRL's tree aggregation).
        rho: float or None. The zCDP ρ of the run where it has a closed
            form (no sampling: tree aggregation), else None.
        mechanism: dict. The mechanism's parameters.
        kdpemb_version, dp_accounting_version: str. Software that computed it.
        simulated: bool. True for the guarantee of a *simulated deployment*
            (the `deployment` a `DeploymentStatement` holds), never a run's
            own: its summary, table and dict say so, and `from_dict` /
            `from_json` refuse its dict (read the whole
            `DeploymentStatement` instead). False (default): a run's.

    Example:

    >>> from kdpemb import privacy
    >>> m = privacy.dp_sgd(1.1, batch_size=256, num_examples=60_000,
    ...                    clip_norm=1.0)
    >>> statement = privacy.PrivacyStatement.compute(m, steps=14_063, delta=1e-5)
    >>> print(statement.summary())  # doctest: +ELLIPSIS
    (ε = 2.38, δ = 1e-05)-DP per example (add or remove one example); ...
    >>> privacy.PrivacyStatement.from_json(statement.to_json()) == statement
    True
    """

    title = "Privacy statement"  # Not a field: the heading of the table.

    epsilon: float
    delta: float
    unit: str
    neighboring_relation: str
    relation_description: str
    sampling: str
    sampling_description: str
    accountant: str
    steps: int
    noise_multiplier: float | None
    clip_norm: float | None
    sampling_probability: float | None
    population: int
    noise_description: str = INDEPENDENT_NOISE
    rho: float | None = None
    mechanism: dict = dataclasses.field(default_factory=dict, compare=False)
    kdpemb_version: str = __version__
    dp_accounting_version: str = dataclasses.field(
        default_factory=_dp_accounting_version
    )
    simulated: bool = False

    @classmethod
    def compute(cls, mechanism, steps, delta, accountant=None):
        """Accounts `steps` steps of `mechanism` and states the result.

        Args:
            mechanism: `kdpemb.privacy.Mechanism`.
            steps: int. Private steps taken (0 is allowed: nothing released
                yet, or only one-off releases).
            delta: float. The δ to state ε at.
            accountant: str, `Accountant` or None. "pld", "rdp", or an
                existing accountant of this mechanism (reuses its caches).
                None (default): "pld" where it models the mechanism, else
                "rdp".
        """
        if isinstance(accountant, Accountant):
            if accountant.mechanism != mechanism:
                raise ValueError("The accountant was built for another mechanism.")
        else:
            accountant = Accountant(mechanism, accountant)
        steps = validation.check_steps(steps, minimum=0)
        return cls.from_epsilon(
            mechanism, steps, delta, accountant.epsilon(steps, delta), accountant.name
        )

    @classmethod
    def from_epsilon(cls, mechanism, steps, delta, epsilon, accountant):
        """States an ε already accounted: `compute` without the accounting.

        For an upper bound on what `accountant` gives for `mechanism` after
        `steps` at `delta`, such as `kdpemb.privacy.calibration.calibrate`'s
        (never a smaller ε: the statement would claim more privacy than
        the accountant allows).

        Example:

        >>> from kdpemb import privacy
        >>> m = privacy.dp_sgd(1.1, batch_size=256, num_examples=60_000)
        >>> PrivacyStatement.from_epsilon(m, 10, 1e-5, 0.5, "pld").epsilon
        0.5
        """
        steps = validation.check_steps(steps, minimum=0)
        accountant = validation.check_choice(accountant, ACCOUNTANTS, "accountant")
        if not (validation.is_real(epsilon) and epsilon >= 0):
            raise ValueError(f"epsilon must be >= 0 (or inf), got {epsilon!r}.")
        if not (validation.is_real(delta) and 0 <= delta < 1):
            raise ValueError(f"delta must be in [0, 1), got {delta!r}.")
        return cls(
            epsilon=float(epsilon),
            delta=float(delta),
            unit=mechanism.unit,
            neighboring_relation=mechanism.relation_name,
            relation_description=mechanism.describe_relation(),
            sampling=mechanism.sampling,
            sampling_description=mechanism.describe_sampling(),
            accountant=accountant,
            steps=steps,
            noise_multiplier=mechanism.noise_multiplier,
            clip_norm=mechanism.clip_norm,
            sampling_probability=mechanism.sampling_probability,
            population=mechanism.population,
            noise_description=mechanism.describe_noise(),
            rho=mechanism.zcdp_rho(steps),
            mechanism=mechanism.parameters(),
        )

    @property
    def is_private(self):
        """False when ε is infinite (no noise): no privacy guarantee."""
        return math.isfinite(self.epsilon)

    def summary(self):
        """One line: the guarantee, its unit, relation and schedule (opening
        with "SIMULATED DEPLOYMENT (NOT this run's guarantee)" when
        `simulated`)."""
        if self.simulated:
            return f"{SIMULATED_LABEL}: {self.guarantee_summary()}"
        return self.guarantee_summary()

    def guarantee_summary(self):
        """`summary` without the simulated-deployment label (for a
        `DeploymentStatement`, which labels it itself)."""
        if self.is_private:
            head = f"(ε = {self.epsilon:.3g}, δ = {self.delta:.3g})-DP"
        else:
            head = "NO differential privacy guarantee (ε = ∞: no noise)"
        parts = [
            f"{head} per {self.unit} ({self.relation_description})",
            f"{self.steps} step{'' if self.steps == 1 else 's'}",
            f"sampling: {self.sampling_description}",
        ]
        if self.noise_description != INDEPENDENT_NOISE:
            parts.append(f"noise: {self.noise_description}")
        if self.rho is not None and self.is_private:
            parts.insert(1, f"ρ = {self.rho:.4g} zCDP")
        if self.noise_multiplier is not None:
            parts.append(f"noise multiplier {self.noise_multiplier:.4g}")
        if self.clip_norm is not None:
            parts.append(f"clip norm {self.clip_norm:g}")
        parts.append(f"{self.accountant.upper()} accountant")
        return "; ".join(parts) + "."

    def to_dict(self):
        """A JSON-ready dict; an infinite ε is written as null. A simulated
        deployment's opens with `"simulated": true`; a run's has no
        "simulated" entry."""
        data = dataclasses.asdict(self)
        del data["simulated"]
        if not self.is_private:
            data["epsilon"] = None
        if self.simulated:
            return {"simulated": True, **data}
        return data

    def to_json(self, indent=2):
        return json.dumps(self.to_dict(), indent=indent, allow_nan=False)

    @classmethod
    def from_dict(cls, data):
        """The statement `to_dict` wrote; refuses a simulated deployment's
        (a `DeploymentStatement`'s dict, or the statement it holds)."""
        if data.get("simulated"):
            raise ValueError(
                'This dict has "simulated": true: it is the guarantee of a '
                "SIMULATED DEPLOYMENT (the 'deployment' entry of a "
                "DeploymentStatement), not of a run. Read the whole statement "
                "with DeploymentStatement.from_dict / from_json."
            )
        if "kind" in data or "deployment" in data:
            kind = data.get("kind")
            if kind == DEPLOYMENT_KIND or "deployment" in data:
                raise ValueError(
                    f"This dict has kind={kind!r}: it is a DeploymentStatement, "
                    "the guarantee of a SIMULATED DEPLOYMENT, not of the run. "
                    "Read it with DeploymentStatement.from_dict / from_json; "
                    "its 'deployment' entry is not the run's guarantee."
                )
            raise ValueError(
                f"This dict has kind={kind!r}; a PrivacyStatement dict has no "
                "'kind' (it comes from PrivacyStatement.to_dict)."
            )
        return cls.from_fields(data, simulated=False)

    @classmethod
    def from_fields(cls, data, *, simulated):
        """The statement of `data` (a `to_dict`, with or without its
        "simulated" entry) marked `simulated` as given: `from_dict` reads a
        run's; `DeploymentStatement.from_dict` reads its deployment's."""
        data = dict(data)
        data.pop("simulated", None)
        if data.get("epsilon") is None:
            data["epsilon"] = math.inf
        return cls(**data, simulated=simulated)

    @classmethod
    def from_json(cls, text):
        return cls.from_dict(json.loads(text))

    @property
    def _heading(self):
        """The title of its table: `title`, or the simulated deployment's."""
        if self.simulated:
            return f"Privacy statement of a {SIMULATED_LABEL}"
        return self.title

    def rows(self):
        """(field, value) pairs for display; a simulated deployment's open
        with ("statement of", "SIMULATED DEPLOYMENT ...")."""
        marker = [("statement of", SIMULATED_LABEL)] if self.simulated else []
        return marker + self.guarantee_rows()

    def guarantee_rows(self):
        """`rows` without the simulated-deployment row (for a
        `DeploymentStatement`, which labels its rows itself)."""
        epsilon = f"{self.epsilon:.4g}" if self.is_private else "∞ (no privacy)"

        def optional(value, fmt):
            return "-" if value is None else format(value, fmt)

        return [
            ("ε (epsilon)", epsilon),
            ("δ (delta)", f"{self.delta:.3g}"),
            *([("ρ (zCDP)", f"{self.rho:.4g}")] if self.rho is not None else []),
            ("unit of privacy", self.unit),
            (
                "neighbouring relation",
                f"{self.neighboring_relation}: {self.relation_description}",
            ),
            ("sampling", self.sampling_description),
            ("noise", self.noise_description),
            ("sampling probability q", optional(self.sampling_probability, ".4g")),
            ("population", f"{self.population:,} {self.unit}s"),
            ("steps", f"{self.steps:,}"),
            ("noise multiplier", optional(self.noise_multiplier, ".4g")),
            ("clip norm", optional(self.clip_norm, "g")),
            ("accountant", _ACCOUNTANT_NAMES.get(self.accountant, self.accountant)),
            (
                "software",
                f"kdpemb {self.kdpemb_version}, dp-accounting "
                f"{self.dp_accounting_version}",
            ),
        ]

    def __rich__(self):
        return rich_table(self._heading, self.rows())

    def __str__(self):
        return text_table(self._heading, self.rows())


def rich_table(title, rows):
    """A `rich` table of (field, value) rows under `title`."""
    from rich.table import Table

    table = Table(title=title, show_header=False, title_justify="left")
    table.add_column("field", style="bold")
    table.add_column("value")
    for field, value in rows:
        table.add_row(field, value)
    return table


def text_table(title, rows):
    """The plain-text table of (field, value) rows under `title`."""
    width = max(len(field) for field, _ in rows)
    lines = [title]
    lines += [f"  {field:<{width}}  {value}" for field, value in rows]
    return "\n".join(lines)
