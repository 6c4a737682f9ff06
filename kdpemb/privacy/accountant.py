"""ε and δ of a mechanism run for some steps, computed with dp-accounting.

Two methods:
- "pld": privacy loss distributions (Koskela et al.; Doroshenko
  et al.), tight up to a discretisation that is rounded pessimistically,
  so the ε reported is an upper bound. Where no step is sampled (full
  batch, `GaussianReleases`) the whole run is one Gaussian mechanism,
  whose privacy loss distribution is known exactly: ε and δ come from
  Balle and Wang's analytic Gaussian mechanism (`analytic_gaussian`),
  with no discretisation at all.
- "rdp": Rényi DP (Mironov), fast and looser.

`accountant=None`, the default of every kdpemb function, is "pld" where
dp-accounting's PLD accountant models the mechanism and "rdp" where it
does not (fixed-size sampling without replacement).

The accountant caches what does not change between calls: the privacy
loss distribution (or RDP curve) of one step is built once, and ε for a
larger step count composes only the new steps onto the last result. This
is what keeps a per-epoch ε cheap in `kdpemb.callbacks.PrivacyBudget`.
"""

import collections
import contextlib
import functools
import math
import numbers
import re

import dp_accounting as dpa
from dp_accounting.pld import privacy_loss_distribution as pld_lib
from dp_accounting.pld import privacy_loss_mechanism as loss_lib
from dp_accounting.rdp import rdp_privacy_accountant as rdp_lib

from kdpemb import _validation as validation
from kdpemb.errors import AccountingError, UnsupportedMechanismError
from kdpemb.privacy import analytic_gaussian
from kdpemb.privacy.mechanisms import Mechanism, Relation

ACCOUNTANTS = ("pld", "rdp")
"""The accountants, for `accountant=`: "pld" (privacy loss distributions,
the tighter one, and the default where it models the mechanism) and "rdp"
(Rényi DP).

Example:

>>> from kdpemb import privacy
>>> m = privacy.dp_sgd(noise_multiplier=1.1, batch_size=256, num_examples=60_000)
>>> {a: round(privacy.epsilon(m, steps=1_000, delta=1e-5, accountant=a), 2)
...  for a in privacy.ACCOUNTANTS}
{'pld': 0.6, 'rdp': 0.89}
"""
MAX_SEARCH_STEPS = 2**31  # No training run takes two billion private steps.


def _for_rdp(event, relation):
    """The event as dp-accounting's RDP accountant must see it.

    A `GaussianDpEvent(z)` means noise std z·C where each unit contributes
    a vector of norm <= C. Under replace-one, a unit's contribution changes
    by up to 2C. The PLD accountant accounts for that itself (its REPLACE
    model doubles the sensitivity); the RDP accountant does not: it gives a
    Gaussian the same RDP under every relation, and its sampling-without-
    replacement bound takes noise std / (replace-one sensitivity). So under
    replace-one every Gaussian goes to RDP with multiplier z/2.
    """
    if relation != Relation.REPLACE_ONE:
        return event

    def rewrite(e):
        if isinstance(e, dpa.GaussianDpEvent):
            return dpa.GaussianDpEvent(e.noise_multiplier / 2)
        if isinstance(e, dpa.ComposedDpEvent):
            return dpa.ComposedDpEvent([rewrite(sub) for sub in e.events])
        if isinstance(e, dpa.SelfComposedDpEvent):
            return dpa.SelfComposedDpEvent(rewrite(e.event), e.count)
        if isinstance(e, dpa.PoissonSampledDpEvent):
            return dpa.PoissonSampledDpEvent(e.sampling_probability, rewrite(e.event))
        if isinstance(e, dpa.SampledWithoutReplacementDpEvent):
            return dpa.SampledWithoutReplacementDpEvent(
                e.source_dataset_size, e.sample_size, rewrite(e.event)
            )
        if isinstance(e, dpa.NoOpDpEvent | dpa.NonPrivateDpEvent | dpa.ZCDpEvent):
            return e  # zCDP is stated for its relation already.
        raise UnsupportedMechanismError(
            f"No rule for {type(e).__name__} under replace-one with RDP."
        )

    return rewrite(event)


def _unsupported_message(mechanism, method, detail):
    relation = mechanism.relation_name
    other = "rdp" if method == "pld" else "pld"
    if method == "rdp" and mechanism.neighboring_relation == Relation.REPLACE_ONE:
        reason = (
            "dp-accounting's RDP accountant has no model of Poisson sampling "
            "under the replace-one relation"
        )
        if getattr(mechanism, "users_per_client", 1) > 1:
            reason += (
                f", which virtual clients of {mechanism.users_per_client} "
                "users need (removing one user replaces one clipped update, so "
                "the sum moves by up to 2C). Reporting the add/remove ε instead "
                "would under-state the privacy loss"
            )
    elif method == "pld":
        reason = (
            f"dp-accounting's PLD accountant has no model of "
            f"{type(mechanism).__name__} (sampling: {mechanism.sampling}, "
            f"relation: {relation})"
        )
    else:
        reason = f"dp-accounting's RDP accountant cannot express {relation}"
    return (
        f"The {method.upper()} accountant cannot account for this mechanism: "
        f"{reason}. Use the {other.upper()} accountant (accountant={other!r}; "
        f"on the command line --accountant {other}). (dp-accounting: {detail})"
    )


def dp_accounting_cause(error):
    """dp-accounting's reason for `error` in one line, without its dump of
    the events (their reprs run to kilobytes for composed schedules).

    Example:

    >>> dp_accounting_cause(ValueError(
    ...     "Unsupported event: SelfComposedDpEvent(event=ZCDpEvent(rho=0.1), "
    ...     "count=1). Error: [Unsupported event.] caused by subevent "
    ...     "ZCDpEvent(rho=0.1)."))
    'Unsupported event (ZCDpEvent).'
    """
    text = " ".join(str(error).split())
    reasons = re.findall(r"\[([^\[\]]+)\]", text)
    if reasons:
        reason = reasons[-1].strip().rstrip(".")
        subevent = re.search(r"caused by subevent (\w+)", text)
        text = reason + (f" ({subevent.group(1)})" if subevent else "") + "."
    if len(text) > 200:
        text = text[:197] + "..."
    text = text or type(error).__name__
    return text if text.endswith((".", "...")) else text + "."


def _raised_by_dp_accounting(error):
    """Whether dp-accounting's code is on `error`'s traceback."""
    tb = error.__traceback__
    while tb is not None:
        if tb.tb_frame.f_globals.get("__name__", "").startswith("dp_accounting"):
            return True
        tb = tb.tb_next
    return False


def _check_rdp_orders(orders):
    """`orders` as a list of finite floats > 1 (None: dp-accounting's).

    An empty list, or only infinite orders, would let dp-accounting report
    ε = 0; an order of 1 gives ε = ∞ with a warning of division by zero.
    """
    if orders is None:
        return None
    if isinstance(orders, str) or not hasattr(orders, "__iter__"):
        raise TypeError(
            f"rdp_orders must be a sequence of numbers > 1, got {orders!r}."
        )
    orders = list(orders)
    bad = [
        o
        for o in orders
        if not isinstance(o, numbers.Real)
        or isinstance(o, bool)
        or not math.isfinite(o)
        or o <= 1
    ]
    if not orders or bad:
        raise ValueError(
            "rdp_orders must be a non-empty sequence of finite numbers > 1 "
            f"(e.g. [1.5, 2, 4, 8, 16, 32, 64]), got {orders!r}"
            + (f": {bad[0]!r} is not one." if bad else ".")
            + " Or pass None for dp-accounting's orders."
        )
    return [float(o) for o in orders]


def _check_accountant(name):
    return validation.check_choice(name, ACCOUNTANTS, "accountant")


def default_accountant(mechanism):
    """ "pld" (tight) where dp-accounting's PLD accountant models `mechanism`,
    else "rdp" (fixed-size sampling): what `accountant=None` means in every
    kdpemb function.

    >>> from kdpemb import privacy
    >>> default_accountant(privacy.dp_sgd(1.0, batch_size=10, num_examples=100))
    'pld'
    """
    reference = dpa.pld.PLDAccountant(mechanism.neighboring_relation)
    return "pld" if reference.supports(mechanism.event(1)) else "rdp"


def resolve_accountant(mechanism, accountant):
    """`accountant` checked, or the mechanism's default when None."""
    if accountant is None:
        return default_accountant(mechanism)
    return _check_accountant(accountant)


class Accountant:
    """ε(δ) and δ(ε) of `mechanism` after a number of private steps.

    Args:
        mechanism: `kdpemb.privacy.Mechanism`. What each step releases.
        accountant: str or None. "pld" (tight) or "rdp" (fast), as the
            `accountant=` argument of every other kdpemb function. None
            (default): "pld" where it models the mechanism, else "rdp"
            (fixed-size sampling).
        value_discretization_interval: float in (0, 1]. PLD resolution;
            smaller is tighter and slower. Defaults to 1e-4. Unused where
            the run is one Gaussian (no sampled step), whose ε is exact.
            Where one step's privacy loss spans more than `MAX_PLD_POINTS`
            steps of it (at 1e-4: noise multipliers below about 0.2-0.3,
            where one step's ε is above about 10) the grid is coarsened to
            span / MAX_PLD_POINTS, so that the accountant answers in
            seconds, not hours; ε stays an upper bound
            (`value_discretization_interval_used`). A span too wide for a
            grid of 1 (z around 1e-3 and below) raises ValueError.
        rdp_orders: sequence of float or None. RDP orders, each finite and
            above 1; defaults to dp-accounting's.

    Raises:
        UnsupportedMechanismError: if the method cannot model the mechanism
            under its neighbouring relation (e.g. RDP for virtual clients of
            several users, PLD for fixed-size sampling).
        AccountingError: if dp-accounting fails on the mechanism's values
            (its reason in one line; its whole message in `detail`).

    Example:

    >>> from kdpemb import privacy
    >>> m = privacy.dp_sgd(noise_multiplier=1.1, batch_size=256,
    ...                    num_examples=60_000)
    >>> accountant = privacy.Accountant(m, "pld")
    >>> round(accountant.epsilon(delta=1e-5, steps=14_063), 2)
    2.38
    >>> accountant.delta(epsilon=2.38, steps=14_063) < 1.1e-5
    True
    """

    def __init__(
        self,
        mechanism,
        accountant=None,
        *,
        value_discretization_interval=1e-4,
        rdp_orders=None,
    ):
        if not isinstance(mechanism, Mechanism):
            raise TypeError(
                "mechanism must be a kdpemb.privacy.Mechanism (see "
                f"kdpemb.privacy.dp_sgd and friends), got {type(mechanism)}."
            )
        self.mechanism = mechanism
        self.name = resolve_accountant(mechanism, accountant)
        validation.check_value_discretization_interval(value_discretization_interval)
        rdp_orders = _check_rdp_orders(rdp_orders)
        self._check_supported(rdp_orders, value_discretization_interval)
        with self._dp_accounting_errors(1):
            if self.name == "pld":
                self._impl = _PldComposer(mechanism, value_discretization_interval)
            else:
                self._impl = _RdpComposer(mechanism, rdp_orders)
        self._epsilons = {}

    def _check_supported(self, rdp_orders, value_discretization_interval):
        relation = self.mechanism.neighboring_relation
        event = self.mechanism.event(1)
        if self.name == "pld":
            reference = dpa.pld.PLDAccountant(relation, value_discretization_interval)
        else:
            reference = dpa.rdp.RdpAccountant(rdp_orders, relation)
            event = _for_rdp(event, relation)
        if reference.supports(event):  # Checks without building anything.
            return
        try:
            reference.compose(event)  # Fails, with dp-accounting's reason.
            detail = "unsupported event"
        except dpa.UnsupportedEventError as error:
            detail = dp_accounting_cause(error)
        raise UnsupportedMechanismError(
            _unsupported_message(self.mechanism, self.name, detail)
        )

    @property
    def value_discretization_interval_used(self):
        """The PLD grid step of the last answer (None for RDP or exact ε)."""
        if isinstance(self._impl, _PldComposer) and not self._impl.exact:
            return self._impl.interval
        return None

    @property
    def exact(self):
        """True where ε and δ are exact: PLD of a run that is one Gaussian."""
        return isinstance(self._impl, _PldComposer) and self._impl.exact

    def epsilon(self, steps, delta):
        """The ε of (ε, δ)-DP after `steps` private steps (an upper bound).

        `steps` may be 0: the ε of the one-off releases alone (0 if none).
        Results are memoised, so the same query always gets the same answer.
        """
        delta = validation.check_delta(
            delta, self.mechanism.population, self.mechanism.unit
        )
        return self._epsilon(delta, validation.check_steps(steps, minimum=0))

    def delta(self, steps, epsilon):
        """The δ of (ε, δ)-DP after `steps` private steps (an upper bound).

        Example:

        >>> from kdpemb import privacy
        >>> m = privacy.dp_sgd(
        ...     noise_multiplier=1.1, batch_size=256, num_examples=60_000)
        >>> privacy.Accountant(m, "pld").delta(1_000, epsilon=1.0) < 1e-8
        True
        """
        epsilon = validation.check_finite_real(epsilon, "epsilon")
        if epsilon < 0:
            raise ValueError(f"epsilon must be >= 0, got {epsilon!r}.")
        steps = validation.check_steps(steps, minimum=0)
        with self._dp_accounting_errors(steps):
            return min(1.0, self._impl.delta(epsilon, steps))

    def _epsilon(self, delta, steps):
        key = (delta, steps)
        if key not in self._epsilons:
            with self._dp_accounting_errors(steps):
                self._epsilons[key] = self._impl.epsilon(delta, steps)
        return self._epsilons[key]

    @contextlib.contextmanager
    def _dp_accounting_errors(self, steps):
        """A privacy loss distribution too large to build: a ValueError; any
        other failure inside dp-accounting: an `AccountingError`."""
        noise = getattr(self.mechanism, "noise_multiplier", None)
        try:
            yield
        except MemoryError as error:
            raise ValueError(
                f"The {self.name.upper()} accountant cannot hold the privacy "
                f"loss distribution of {steps} steps at noise_multiplier="
                f"{noise!r} ({error}). "
                "Use fewer steps, a larger noise multiplier, or "
                "accountant='rdp'."
            ) from error
        except (ArithmeticError, TypeError, ValueError) as error:
            if isinstance(error, AccountingError) or not _raised_by_dp_accounting(
                error
            ):
                raise
            other = "rdp" if self.name == "pld" else "pld"
            raise AccountingError(
                f"The {self.name.upper()} accountant (dp-accounting) failed on "
                f"{type(self.mechanism).__name__} with noise_multiplier="
                f"{noise!r} after {steps} step{'' if steps == 1 else 's'}: "
                f"{dp_accounting_cause(error)} "
                f"Check the mechanism's values, or try accountant={other!r}.",
                detail=str(error),
            ) from None

    def max_steps(self, delta, *, target_epsilon, limit=None):
        """The largest step count whose ε is at most `target_epsilon`.

        Args:
            delta: float. The δ.
            target_epsilon: float. The budget (keyword only).
            limit: int or None. Do not look beyond this many steps (the
                planned length of training). None searches upward until ε
                exceeds the target, up to `MAX_SEARCH_STEPS`.

        Returns:
            int: 0 when even one step (or the one-off releases alone) would
            exceed the target; `limit` (or `MAX_SEARCH_STEPS`) when the whole
            range stays within it.
        """
        target_epsilon = validation.check_target_epsilon(target_epsilon)
        delta = validation.check_delta(
            delta, self.mechanism.population, self.mechanism.unit
        )

        def within(steps):
            return self._epsilon(delta, steps) <= target_epsilon

        if not within(0):
            return 0
        if limit is None:
            low, high = 0, 1
            while within(high):
                if high >= MAX_SEARCH_STEPS:
                    return MAX_SEARCH_STEPS
                low, high = high, min(2 * high, MAX_SEARCH_STEPS)
        else:
            limit = validation.check_steps(limit, "limit", minimum=0)
            if within(limit):
                return limit
            low, high = 0, limit
        while high - low > 1:  # Invariant: within(low) and not within(high).
            middle = (low + high) // 2
            if within(middle):
                low = middle
            else:
                high = middle
        return low


class _RdpComposer:
    """RDP curve of one step, built once; T steps are T times that curve."""

    def __init__(self, mechanism, orders):
        self._mechanism = mechanism
        self._relation = mechanism.neighboring_relation
        self._orders_arg = orders
        fresh = self._fresh()
        self.orders = fresh.orders
        step = mechanism.step_event()
        if step is None:
            self._setup_rdp = self._step_rdp = None
        else:
            self._setup_rdp = self._compose(mechanism.setup_event())
            self._step_rdp = self._compose(step)

    def _fresh(self):
        return dpa.rdp.RdpAccountant(self._orders_arg, self._relation)

    def _compose(self, event):
        return self._fresh().compose(_for_rdp(event, self._relation)).rdp

    def _rdp(self, steps):
        if self._step_rdp is None:
            return self._compose(self._mechanism.event(steps))
        if steps == 0:
            return self._setup_rdp
        return self._setup_rdp + steps * self._step_rdp

    def epsilon(self, delta, steps):
        rdp = self._rdp(steps)
        if not rdp.any():
            return 0.0
        return float(rdp_lib.compute_epsilon(self.orders, rdp, delta)[0])

    def delta(self, epsilon, steps):
        rdp = self._rdp(steps)
        if not rdp.any():
            return 0.0
        return float(rdp_lib.compute_delta(self.orders, rdp, epsilon)[0])


class _PldTerms:
    """An event flattened into what its privacy loss distribution needs.

    Plain Gaussian releases compose exactly into one Gaussian (their
    1/z² add up), which is tighter and faster than composing discretised
    distributions; Poisson-sampled Gaussians are counted by (q, z).
    """

    def __init__(self):
        self.gaussian_inverse_square = 0.0
        self.sampled = collections.Counter()  # (q, z) -> count
        self.non_private = False

    @classmethod
    def of(cls, event, count=1):
        terms = cls()
        terms._add(event, count)
        return terms

    def _add(self, event, count):
        if isinstance(event, dpa.NoOpDpEvent) or count == 0:
            return
        if isinstance(event, dpa.NonPrivateDpEvent):
            self.non_private = True
        elif isinstance(event, dpa.SelfComposedDpEvent):
            self._add(event.event, count * event.count)
        elif isinstance(event, dpa.ComposedDpEvent):
            for sub in event.events:
                self._add(sub, count)
        elif isinstance(event, dpa.GaussianDpEvent):
            if event.noise_multiplier == 0:
                self.non_private = True
            else:
                self.gaussian_inverse_square += count / event.noise_multiplier**2
        elif isinstance(event, dpa.PoissonSampledDpEvent) and isinstance(
            event.event, dpa.GaussianDpEvent
        ):
            q, z = event.sampling_probability, event.event.noise_multiplier
            if q == 1:
                self._add(event.event, count)
            elif q > 0 and z == 0:
                self.non_private = True
            elif q > 0:
                self.sampled[(q, z)] += count
        else:
            raise UnsupportedMechanismError(f"PLD cannot model {event}.")


# Sensitivity of a Gaussian term per unit of clip norm, as dp-accounting's
# PLD models it: replacing a unit moves the sum from -C to +C.
_GAUSSIAN_SENSITIVITY = {
    Relation.ADD_OR_REMOVE_ONE: 1.0,
    Relation.REPLACE_ONE: 2.0,
}


# The largest grid of one step's privacy loss that a PLD is built on:
# dp-accounting takes about 2 µs a point and side (add, remove), so 2**19
# points cost about two seconds. At the default grid of 1e-4 a step of
# noise multiplier 0.3 and sampling rate 0.01 spans 3.3e5 points, one of
# 0.1 1.4e6, and one of 0.01 about 1e8 (hours).
MAX_PLD_POINTS = 2**19


@functools.lru_cache(maxsize=32)
def _gaussian_pld(noise_multiplier, sampling_prob, interval, relation):
    """dp-accounting's PLD of one (Poisson-sampled) Gaussian step.

    Cached for the process: a `PrivacyBudget`, a calibration search and a
    statement of one run ask for the same steps, and building one takes
    about 0.2-0.5 s. PLDs are never changed in place (composing makes a new
    one), so sharing them is safe.
    """
    return pld_lib.from_gaussian_mechanism(
        standard_deviation=noise_multiplier,
        sampling_prob=sampling_prob,
        value_discretization_interval=interval,
        neighboring_relation=relation,
    )


def _loss_span(noise_multiplier, sampling_prob, relation):
    """Width of the privacy loss range of one (sampled) Gaussian step, as
    dp-accounting's connect-the-dots PLD covers it (both adjacency sides)."""
    sides = (
        (loss_lib.AdjacencyType.REPLACE,)
        if relation == Relation.REPLACE_ONE
        else (loss_lib.AdjacencyType.ADD, loss_lib.AdjacencyType.REMOVE)
    )
    span = 0.0
    for side in sides:
        bounds = loss_lib.GaussianPrivacyLoss(
            noise_multiplier, sampling_prob=sampling_prob, adjacency_type=side
        ).connect_dots_bounds()
        span = max(span, bounds.epsilon_upper - bounds.epsilon_lower)
    return span


class _PldComposer:
    """Composes PLDs incrementally: ε at T steps reuses the result at T' < T.

    A schedule without sampled terms is one Gaussian of noise multiplier
    (Σ 1/z²)^(-1/2): its ε and δ are exact (`analytic_gaussian`), with the
    sensitivity doubled under replace-one as in dp-accounting's PLD.
    """

    def __init__(self, mechanism, value_discretization_interval):
        self._relation = mechanism.neighboring_relation
        self._requested = value_discretization_interval
        self._mechanism = mechanism
        self._setup = _PldTerms.of(mechanism.setup_event())
        self._step = _PldTerms.of(mechanism.step_event())
        self.exact = (
            not self._setup.sampled
            and not self._step.sampled
            and self._relation in _GAUSSIAN_SENSITIVITY
        )
        self.interval = None
        self._sampled_interval = None  # What the sampled terms need.
        if not self.exact:
            spans = [
                _loss_span(z, q, self._relation)
                for q, z in {**self._setup.sampled, **self._step.sampled}
            ]
            self._sampled_interval = max(
                [self._requested] + [span / MAX_PLD_POINTS for span in spans]
            )
            self._check_grid(self._sampled_interval, mechanism)
            self._use_interval(self._sampled_interval)

    @staticmethod
    def _check_grid(interval, mechanism, steps=None):
        """Refuses a loss range too wide for a grid of at most 1: ε would be
        above about 1e5 and dp-accounting's arithmetic overflows."""
        if interval <= validation.MAX_VALUE_DISCRETIZATION_INTERVAL:
            return
        after = "" if steps is None else f" after {steps} steps"
        raise ValueError(
            f"The PLD accountant cannot hold the privacy loss{after} at "
            f"noise_multiplier={getattr(mechanism, 'noise_multiplier', None)!r}: "
            f"it spans more than {MAX_PLD_POINTS} grid steps of 1 (ε is above "
            "about 1e5, no privacy to speak of). Use a noise multiplier of at "
            "least 0.01, or accountant='rdp'."
        )

    def _use_interval(self, interval):
        """Builds every later PLD on the grid `interval` (coarser only)."""
        if interval == self.interval:
            return
        self.interval = interval
        self._single_step = {}  # (q, z) -> PLD of one step
        self._powers = {}  # (q, z, count) -> PLD of `count` steps
        self._last_steps = None  # the sampled part composed for this many steps
        self._last_sampled = None

    def _gaussian(self, noise_multiplier, sampling_prob=1.0):
        return _gaussian_pld(
            float(noise_multiplier), float(sampling_prob), self.interval, self._relation
        )

    def _power(self, q, z, count):
        key = (q, z, count)
        if key not in self._powers:
            if (q, z) not in self._single_step:
                self._single_step[(q, z)] = self._gaussian(z, q)
            if len(self._powers) > 8:  # Epoch-sized powers repeat; keep a few.
                self._powers.pop(next(iter(self._powers)))
            self._powers[key] = self._single_step[(q, z)].self_compose(count)
        return self._powers[key]

    def _sampled_part(self, steps):
        """PLD of the Poisson-sampled terms after `steps` steps (or None)."""
        step_keys = list(self._step.sampled)
        can_extend = (
            self._last_sampled is not None
            and steps >= self._last_steps
            and len(step_keys) == 1
        )
        if can_extend and steps == self._last_steps:
            return self._last_sampled
        if can_extend:
            ((q, z),) = step_keys
            extra = (steps - self._last_steps) * self._step.sampled[(q, z)]
            result = self._last_sampled.compose(self._power(q, z, extra))
        else:
            counts = collections.Counter(self._setup.sampled)
            for key, count in self._step.sampled.items():
                counts[key] += steps * count
            result = None
            for (q, z), count in counts.items():
                if count:
                    power = self._power(q, z, count)
                    result = power if result is None else result.compose(power)
        self._last_steps, self._last_sampled = steps, result
        return result

    def _pld(self, steps):
        """The PLD after `steps` steps, or None if nothing was released."""
        inverse_square = (
            self._setup.gaussian_inverse_square
            + steps * self._step.gaussian_inverse_square
        )
        if inverse_square:  # The Gaussian part's grid grows with the steps.
            span = _loss_span(inverse_square**-0.5, 1.0, self._relation)
            needed = max(self._sampled_interval, span / MAX_PLD_POINTS)
            self._check_grid(needed, self._mechanism, steps)
            self._use_interval(max(self.interval, needed))
        sampled = self._sampled_part(steps)
        if inverse_square == 0:
            return sampled
        gaussian = self._gaussian(inverse_square**-0.5)
        return gaussian if sampled is None else gaussian.compose(sampled)

    def _non_private(self, steps):
        return self._setup.non_private or (steps > 0 and self._step.non_private)

    def _exact_noise(self, steps):
        """σ/Δ of the single Gaussian the run amounts to (inf: no release)."""
        inverse_square = (
            self._setup.gaussian_inverse_square
            + steps * self._step.gaussian_inverse_square
        )
        if inverse_square == 0:
            return math.inf
        return inverse_square**-0.5 / _GAUSSIAN_SENSITIVITY[self._relation]

    def epsilon(self, delta, steps):
        if self._non_private(steps):
            return math.inf
        if self.exact:
            return analytic_gaussian.epsilon_for_delta(self._exact_noise(steps), delta)
        pld = self._pld(steps)
        return 0.0 if pld is None else float(pld.get_epsilon_for_delta(delta))

    def delta(self, epsilon, steps):
        if self._non_private(steps):
            return 1.0
        if self.exact:
            return analytic_gaussian.delta_for_epsilon(
                self._exact_noise(steps), epsilon
            )
        pld = self._pld(steps)
        return 0.0 if pld is None else float(pld.get_delta_for_epsilon(epsilon))


def epsilon(mechanism, steps, delta, *, accountant=None):
    """ε after `steps` steps of `mechanism` at `delta` (one-shot helper).

    Example:

    >>> from kdpemb import privacy
    >>> m = privacy.dp_sgd(1.1, batch_size=256, num_examples=60_000)
    >>> round(privacy.epsilon(m, steps=14_063, delta=1e-5, accountant="rdp"), 2)
    2.6
    """
    steps = validation.check_steps(steps)
    return Accountant(mechanism, accountant).epsilon(steps, delta)


def delta(mechanism, steps, epsilon, *, accountant=None):
    """δ after `steps` steps of `mechanism` at `epsilon` (one-shot helper).

    Example:

    >>> from kdpemb import privacy
    >>> m = privacy.dp_sgd(noise_multiplier=1.1, batch_size=256, num_examples=60_000)
    >>> privacy.delta(m, steps=1_000, epsilon=1.0) < 1e-8
    True
    """
    steps = validation.check_steps(steps)
    return Accountant(mechanism, accountant).delta(steps, epsilon)
