"""Property-based fuzzing of the public API (issue 21, part 3).

Each test draws bad values for one argument of a public constructor or
function (NaN, ±inf, negative, zero, wrong type, wrong rank or dtype,
empty, extreme sizes, out-of-range labels) and checks that the call
raises `ValueError` or `TypeError` (kdpemb's error classes subclass them)
with a message that names the argument: never another exception, a hang
or a silent result. Valid values are drawn too, and must work.

Deterministic (`derandomize=True`, no example database, no shrinking) with
a fixed example budget, so CI sees the same examples every run.

No test reads a clock: a hang is work without a bound, so the tests check
the bounds instead, and a spy fails a call at once when it would go past
one. Every PLD that dp-accounting is asked to build is checked against
kdpemb's grid bound (`bounded_plds`), the accountant's searches against
their number of steps, and the data classes against the random draws of
one batch or round.
"""

import contextlib
import inspect
import io
import math
import warnings
from functools import cache

import keras
import numpy as np
import pytest
from dp_accounting.pld import privacy_loss_distribution as pld_lib
from dp_accounting.pld import privacy_loss_mechanism as loss_lib
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from kdpemb import privacy
from kdpemb.callbacks import PrivacyBudget, RecallAtFAR
from kdpemb.data import PoissonBatches, PoissonIndices, VirtualClients
from kdpemb.data.round_plan import RoundPlanner
from kdpemb.metrics import recall_at_far
from kdpemb.models import DPModel, FedEmbModel, LastLayerDPClassifier
from kdpemb.privacy import accountant as accountant_lib
from kdpemb.privacy import calibration


def fuzz(max_examples):
    return settings(
        max_examples=max_examples,
        derandomize=True,
        deadline=None,
        database=None,
        phases=(Phase.explicit, Phase.generate),
        suppress_health_check=list(HealthCheck),
    )


# The bound on an accountant's work: no PLD of one step (or of the plain
# Gaussian part) has more than MAX_PLD_POINTS grid steps of privacy loss,
# as kdpemb coarsens the grid (or refuses) beyond that. dp-accounting's
# connect-the-dots PLD has a point at each grid step of its loss range,
# the range rounded out to the grid at both ends: at most 2 more.
PLD_POINTS_BOUND = accountant_lib.MAX_PLD_POINTS + 2


def pld_points(
    standard_deviation,
    sensitivity=1,
    pessimistic_estimate=True,
    value_discretization_interval=1e-4,
    log_mass_truncation_bound=-50,
    sampling_prob=1.0,
    use_connect_dots=True,
    neighboring_relation=pld_lib.NeighborRel.ADD_OR_REMOVE_ONE,
):
    """Points a side of the PLD `pld_lib.from_gaussian_mechanism` builds from
    these arguments, from dp-accounting's own loss range (nothing built)."""
    sides = (
        (loss_lib.AdjacencyType.REPLACE,)
        if neighboring_relation == pld_lib.NeighborRel.REPLACE_ONE
        else (loss_lib.AdjacencyType.ADD, loss_lib.AdjacencyType.REMOVE)
    )
    points = 0
    for side in sides:
        bounds = loss_lib.GaussianPrivacyLoss(
            standard_deviation,
            sensitivity=sensitivity,
            pessimistic_estimate=pessimistic_estimate,
            log_mass_truncation_bound=log_mass_truncation_bound,
            sampling_prob=sampling_prob,
            adjacency_type=side,
        ).connect_dots_bounds()
        step = value_discretization_interval
        points = max(
            points,
            math.ceil(bounds.epsilon_upper / step)
            - math.floor(bounds.epsilon_lower / step)
            + 1,
        )
    return points


@pytest.fixture(autouse=True)
def bounded_plds(monkeypatch):
    """The points a side of every PLD built in the test, each checked
    against `PLD_POINTS_BOUND` before it is built: a PLD past the bound
    (1e8 points take hours) fails the test at once instead of hanging it."""
    build = pld_lib.from_gaussian_mechanism
    signature = inspect.signature(build)
    built = []

    def bounded(*args, **kwargs):
        call = signature.bind(*args, **kwargs)
        points = pld_points(**call.arguments)
        assert points <= PLD_POINTS_BOUND, (
            f"a PLD of {points} points a side, more than {PLD_POINTS_BOUND}: "
            f"the accountant would not answer ({call.arguments})"
        )
        pld = build(*args, **kwargs)
        for pmf in (pld._pmf_remove, pld._pmf_add):  # The count was right.
            assert pmf.size <= points, (pmf.size, points)
        built.append(points)
        return pld

    monkeypatch.setattr(pld_lib, "from_gaussian_mechanism", bounded)
    accountant_lib._gaussian_pld.cache_clear()  # Every PLD of the test is seen.
    return built


@contextlib.contextmanager
def at_most(calls, owner, name):
    """Counts the calls of `owner.name` (yields the count, a list of one);
    the call past `calls` fails the test at once rather than run on."""
    real = getattr(owner, name)
    count = [0]

    def counted(*args, **kwargs):
        count[0] += 1
        assert count[0] <= calls, f"{name} called more than {calls} times"
        return real(*args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(owner, name, counted)
        yield count


def rejects(call, *names):
    """`call()` raises ValueError/TypeError naming one of `names`."""
    try:
        result = call()
    except (ValueError, TypeError) as error:
        message = str(error)
        assert any(name in message for name in names), (
            f"error does not name {names}: {type(error).__name__}: {message}"
        )
        return error
    raise AssertionError(f"accepted silently, returned {result!r}")


NAN, INF = math.nan, math.inf
# Values that are never a number of anything.
NOT_NUMBERS = st.sampled_from(
    [None, "1", b"1", [1.0], (1,), {}, np.array([1.0, 2.0]), object(), 1j]
)
NON_FINITE = st.sampled_from(
    [NAN, INF, -INF, np.float32(NAN), np.float64(INF), np.float32(-INF)]
)
BOOLS = st.sampled_from([True, False, np.bool_(True)])


def bad_positive_real():
    """Not a finite real > 0."""
    return st.one_of(
        NOT_NUMBERS,
        NON_FINITE,
        BOOLS,
        st.floats(max_value=0.0, allow_nan=False, allow_infinity=False),
        st.integers(max_value=0),
    )


def bad_non_negative_real():
    return st.one_of(
        NOT_NUMBERS,
        NON_FINITE,
        BOOLS,
        st.floats(max_value=-1e-300, allow_nan=False, allow_infinity=False),
        st.integers(max_value=-1),
    )


def bad_positive_int():
    """Not an integer >= 1."""
    return st.one_of(
        NOT_NUMBERS,
        NON_FINITE,
        BOOLS,
        st.integers(max_value=0),
        st.floats(allow_nan=False, allow_infinity=False),  # 3.0 is not an int.
    )


def bad_choice():
    """Not one of a set of names (None is a valid default for some)."""
    return st.one_of(
        NOT_NUMBERS.filter(lambda v: v is not None), st.text(max_size=8), st.integers()
    )


# Constructors: privacy builders and Schedule -------------------------------


@st.composite
def good_dp_sgd(draw):
    n = draw(st.integers(1, 10**9))
    sampling = draw(st.sampled_from(["poisson", "fixed"]))
    if sampling == "fixed":
        batch = draw(st.integers(1, n))
    else:
        batch = draw(st.floats(1e-6, 1.0)) * n
    return {
        "noise_multiplier": draw(st.just(0.0) | st.floats(1e-6, 1e6)),
        "batch_size": batch,
        "num_examples": n,
        "sampling": sampling,
        "clip_norm": draw(st.none() | st.floats(1e-6, 1e6)),
    }


DP_SGD_BAD = {
    "noise_multiplier": bad_non_negative_real(),
    "batch_size": bad_positive_real(),
    "num_examples": bad_positive_int(),
    "sampling": bad_choice(),
    "clip_norm": bad_positive_real().filter(lambda v: v is not None),
}


@fuzz(40)
@given(good_dp_sgd(), st.data())
def test_dp_sgd(kwargs, data):
    mechanism = privacy.dp_sgd(**kwargs)
    assert mechanism.population == kwargs["num_examples"]
    name = data.draw(st.sampled_from(sorted(DP_SGD_BAD)))
    bad = {**kwargs, name: data.draw(DP_SGD_BAD[name])}
    rejects(lambda: privacy.dp_sgd(**bad), name)


@fuzz(30)
@given(st.integers(1, 1000), st.integers(1001, 10**7))
def test_dp_sgd_batch_above_population(n, batch):
    rejects(lambda: privacy.dp_sgd(1.0, batch, n), "batch_size")
    rejects(lambda: privacy.Schedule.examples(n, batch), "batch_size")


@fuzz(40)
@given(st.data())
def test_full_batch(data):
    n = data.draw(st.integers(1, 10**9))
    assert privacy.full_batch(1.0, n).sampling_probability == 1.0
    bad = {
        "noise_multiplier": bad_non_negative_real(),
        "num_examples": bad_positive_int(),
        "unit": bad_choice(),
        "clip_norm": bad_positive_real().filter(lambda v: v is not None),
        "setup": st.sampled_from([[1], ["a"], [(1.0,)], [None], [(NAN, 1.0)]]),
    }
    name = data.draw(st.sampled_from(sorted(bad)))
    kwargs = {"noise_multiplier": 1.0, "num_examples": n}
    kwargs[name] = data.draw(bad[name])
    names = (name, "noise_std") if name == "setup" else (name,)
    rejects(lambda: privacy.full_batch(**kwargs), *names)


@st.composite
def good_virtual_clients(draw):
    users = draw(st.integers(1, 10**7))
    k = draw(st.integers(1, min(16, users)))
    pool = -(-users // k)
    sampling = draw(st.sampled_from(["poisson", "fixed", "full_batch", "epochs"]))
    if sampling == "fixed":
        clients = draw(st.integers(1, pool))
    elif sampling == "full_batch":
        clients = pool
    elif sampling == "epochs":  # At least one virtual client per round.
        clients = draw(st.floats(1.0, pool)) if pool > 1 else 1.0
    else:
        clients = draw(st.floats(1e-3, 1.0)) * pool
    return {
        "noise_multiplier": draw(st.just(0.0) | st.floats(1e-6, 1e6)),
        "clients_per_round": clients,
        "num_users": users,
        "users_per_client": k,
        "sampling": sampling,
    }


VC_BAD = {
    "noise_multiplier": bad_non_negative_real(),
    "clients_per_round": bad_positive_real(),
    "num_users": bad_positive_int(),
    "users_per_client": bad_positive_int(),
    "sampling": bad_choice(),
}


@fuzz(40)
@given(good_virtual_clients(), st.data())
def test_virtual_clients(kwargs, data):
    mechanism = privacy.virtual_clients(**kwargs)
    assert mechanism.population == kwargs["num_users"]
    name = data.draw(st.sampled_from(sorted(VC_BAD)))
    value = data.draw(VC_BAD[name])
    if (
        value is None
        and name == "clients_per_round"
        and kwargs["sampling"]
        in (
            "full_batch",
            "epochs",
        )
    ):
        value = -1.0  # None: the whole pool (full batch), valid.
    bad = {**kwargs, name: value}
    rejects(lambda: privacy.virtual_clients(**bad), name)


@fuzz(40)
@given(st.data())
def test_schedule_virtual_clients(data):
    users = data.draw(st.integers(2, 10**6))
    k = data.draw(st.integers(2, min(8, users)))
    pool = -(-users // k)
    rounds = data.draw(st.integers(1, pool))
    schedule = privacy.Schedule.virtual_clients(
        users, None, users_per_client=k, sampling="epochs", rounds_per_epoch=rounds
    )
    assert schedule.steps_per_epoch == rounds
    bad = {
        "rounds_per_epoch": st.one_of(
            bad_positive_int(), st.integers(pool + 1, 10**12)
        ),
        "local_steps": bad_positive_int(),
        "num_clients": st.one_of(
            bad_positive_int().filter(lambda v: v is not None),
            st.integers(pool + users, 10**12),
        ),
    }
    name = data.draw(st.sampled_from(sorted(bad)))
    kwargs = {"users_per_client": k, "sampling": "epochs", "rounds_per_epoch": rounds}
    kwargs[name] = data.draw(bad[name])
    names = {
        "num_clients": (name, "pool_size"),
        "rounds_per_epoch": (name, "clients_per_round"),  # None: needs one.
    }.get(name, (name,))
    rejects(lambda: privacy.Schedule.virtual_clients(users, None, **kwargs), *names)


@fuzz(40)
@given(st.data())
def test_tree_aggregation(data):
    n = data.draw(st.integers(1, 10**6))
    steps = data.draw(st.integers(1, n))
    assert privacy.tree_aggregation(1.0, steps, n).population == n
    bad = {
        "noise_multiplier": bad_non_negative_real(),
        "steps_per_epoch": bad_positive_int(),
        "num_examples": bad_positive_int(),
        "leaves_per_tree": bad_positive_int().filter(lambda v: v is not None),
        "users_per_client": bad_positive_int(),
    }
    name = data.draw(st.sampled_from(sorted(bad)))
    kwargs = {"noise_multiplier": 1.0, "steps_per_epoch": steps, "num_examples": n}
    kwargs[name] = data.draw(bad[name])
    names = {"num_examples": ("population",)}.get(name, (name,))
    rejects(lambda: privacy.tree_aggregation(**kwargs), *names)


# The accountant -------------------------------------------------------------

MECHANISMS = {
    "dp_sgd": privacy.dp_sgd(1.1, batch_size=100, num_examples=10_000),
    "full_batch": privacy.full_batch(5.0, num_examples=1_000),
    "virtual_clients": privacy.virtual_clients(
        1.0, clients_per_round=10, num_users=1_000, users_per_client=4
    ),
    "tree": privacy.tree_aggregation(5.0, steps_per_epoch=10, num_examples=1_000),
}


def bad_steps():
    return st.one_of(bad_positive_int(), st.integers(-(10**30), 0))


def bad_delta():
    return st.one_of(
        bad_positive_real(),
        st.floats(min_value=1.0, allow_nan=False),
        st.floats(1e-3, 1.0),  # Not below 1/population.
    )


@fuzz(25)
@given(st.sampled_from(sorted(MECHANISMS)), st.data())
def test_epsilon_and_delta(kind, data):
    mechanism = MECHANISMS[kind]
    steps = data.draw(st.integers(1, 100))
    eps = privacy.epsilon(mechanism, steps, 1e-6)  # PLDs: `bounded_plds`.
    assert 0 < eps < INF
    assert 0 <= privacy.delta(mechanism, steps, eps) <= 1
    rejects(lambda: privacy.epsilon(mechanism, data.draw(bad_steps()), 1e-6), "steps")
    rejects(lambda: privacy.epsilon(mechanism, steps, data.draw(bad_delta())), "delta")
    rejects(lambda: privacy.delta(mechanism, data.draw(bad_steps()), eps), "steps")
    bad_epsilon = st.one_of(bad_non_negative_real())
    rejects(lambda: privacy.delta(mechanism, steps, data.draw(bad_epsilon)), "epsilon")
    rejects(
        lambda: privacy.epsilon(
            mechanism, steps, 1e-6, accountant=data.draw(bad_choice())
        ),
        "accountant",
    )
    not_a_mechanism = data.draw(st.one_of(NOT_NUMBERS, st.integers()))
    rejects(lambda: privacy.epsilon(not_a_mechanism, steps, 1e-6), "mechanism")


@fuzz(25)
@given(st.sampled_from(["dp_sgd", "full_batch"]), st.data())
def test_extreme_noise_multipliers(kind, data):
    """Huge or tiny multipliers: an answer, or an error naming the multiplier.

    PLD: no grid past the bound (`bounded_plds`). RDP: dp-accounting's
    fixed orders, each a bounded series."""
    z = data.draw(st.one_of(st.floats(1e-300, 1e-6), st.floats(1e12, 1e308)), label="z")
    accountant = data.draw(st.sampled_from(["pld", "rdp"]))
    mechanism = MECHANISMS[kind]
    try:
        mechanism = mechanism.with_noise_multiplier(z)
        eps = privacy.epsilon(mechanism, 10, 1e-6, accountant=accountant)
    except (ValueError, TypeError) as error:
        assert "noise_multiplier" in str(error), error
    else:
        assert eps >= 0


@fuzz(15)
@given(st.data())
def test_max_steps(data):
    accountant = privacy.Accountant(MECHANISMS["dp_sgd"])
    target = data.draw(st.floats(0.1, 5.0))
    # The search composes for 0 and 300 steps, then bisects [0, 300]: at
    # most 2 + ceil(log2 300) = 11 step counts, each of <= 300 steps.
    with at_most(2 + math.ceil(math.log2(300)), accountant._impl, "epsilon"):
        steps = accountant.max_steps(1e-6, target_epsilon=target, limit=300)
    assert 0 <= steps <= 300
    if 0 < steps < 300:
        assert accountant.epsilon(steps, 1e-6) <= target
        assert accountant.epsilon(steps + 1, 1e-6) > target
    rejects(
        lambda: accountant.max_steps(
            1e-6, target_epsilon=data.draw(bad_positive_real())
        ),
        "target_epsilon",
    )
    rejects(
        lambda: accountant.max_steps(data.draw(bad_delta()), target_epsilon=1.0),
        "delta",
    )
    bad_limit = st.one_of(bad_positive_int(), st.integers(max_value=-1)).filter(
        lambda v: v is not None and not (type(v) is int and v == 0)  # Both valid.
    )
    rejects(
        lambda: accountant.max_steps(
            1e-6, target_epsilon=1.0, limit=data.draw(bad_limit)
        ),
        "limit",
    )


@fuzz(30)
@given(st.data())
def test_calibrate_noise_multiplier(data):
    mechanism = MECHANISMS["full_batch"]  # Exact ε: calibration is instant.
    steps = data.draw(st.integers(1, 100))
    target = data.draw(st.floats(0.5, 10.0))
    # One accountant at max_noise_multiplier, then one for each step of the
    # search, which stops after 200 steps (calibration._search).
    with at_most(1 + 200, calibration, "Accountant"):
        z = privacy.calibrate_noise_multiplier(
            mechanism, steps, 1e-6, target_epsilon=target
        )
    assert privacy.epsilon(mechanism.with_noise_multiplier(z), steps, 1e-6) <= target
    bad = {
        "steps": bad_steps(),
        "delta": bad_delta(),
        "target_epsilon": bad_positive_real(),
        "max_noise_multiplier": bad_positive_real(),
        "min_noise_multiplier": bad_positive_real(),
        "rtol": st.one_of(
            NOT_NUMBERS, NON_FINITE, st.floats(max_value=0.0), st.floats(min_value=0.5)
        ),
        "accountant": bad_choice(),
        "mechanism": st.one_of(NOT_NUMBERS, st.integers()),
    }
    name = data.draw(st.sampled_from(sorted(bad)))
    kwargs = {
        "mechanism": mechanism,
        "steps": steps,
        "delta": 1e-6,
        "target_epsilon": target,
    }
    kwargs[name] = data.draw(bad[name])
    rejects(lambda: privacy.calibrate_noise_multiplier(**kwargs), name)


# recall_at_far --------------------------------------------------------------


@st.composite
def good_embeddings(draw):
    identities = draw(st.integers(2, 6))
    per_identity = draw(st.integers(2, 4))
    dim = draw(st.integers(1, 8))
    labels = np.repeat(np.arange(identities), per_identity)
    seed = draw(st.integers(0, 2**16))
    embeddings = np.random.default_rng(seed).normal(size=(labels.size, dim))
    return embeddings, labels


@fuzz(40)
@given(good_embeddings(), st.data())
def test_recall_at_far_good(good, data):
    embeddings, labels = good
    far = data.draw(st.floats(0.25, 1.0))  # At least 4 impostor pairs.
    scale = data.draw(st.sampled_from([1.0, 1e-30, 1e30, 1e300]))
    label_dtype = data.draw(st.sampled_from(["int8", "int64", "uint16", "float32"]))
    recall = recall_at_far(embeddings * scale, labels.astype(label_dtype), far=far)
    reference = recall_at_far(embeddings, labels, far=far)
    assert 0.0 <= recall <= 1.0
    assert recall == reference


@fuzz(40)
@given(good_embeddings(), st.data())
def test_recall_at_far_bad(good, data):
    embeddings, labels = good
    n, dim = embeddings.shape
    kind = data.draw(
        st.sampled_from(
            [
                "non_finite",
                "rank",
                "dtype",
                "length",
                "empty",
                "one_identity",
                "far",
                "label_fractions",
                "label_dtype",
                "zero_dim",
                "pairs",
                "batch_size",
            ]
        )
    )
    far = 0.5
    names = ("embeddings",)
    if kind == "non_finite":
        embeddings = embeddings.copy()
        embeddings[data.draw(st.integers(0, n - 1)), 0] = data.draw(NON_FINITE)
    elif kind == "rank":
        shape = data.draw(st.sampled_from([(n,), (n, dim, 1), (), (1, n, dim)]))
        embeddings = np.zeros(shape)
    elif kind == "dtype":
        embeddings = embeddings.astype(
            data.draw(st.sampled_from([bool, complex, object, "U3", "S2"]))
        )
    elif kind == "length":
        labels = labels[: data.draw(st.integers(0, n - 1))]
        names = ("labels",)
    elif kind == "empty":
        embeddings, labels = np.zeros((0, dim)), np.zeros(0, int)
        names = ("embeddings", "identit")
    elif kind == "one_identity":
        labels = np.zeros(n, int)
        names = ("identit",)
    elif kind == "far":
        far = data.draw(
            st.one_of(
                NOT_NUMBERS,
                NON_FINITE,
                st.floats(max_value=0.0),
                st.floats(min_value=1.0, exclude_min=True),
                st.just([]),
                st.just([[0.1]]),
                st.just("0.1"),
            )
        )
        names = ("far",)
    elif kind == "label_fractions":
        labels = labels + data.draw(st.sampled_from([0.5, NAN, INF]))
        names = ("labels",)
    elif kind == "label_dtype":
        labels = np.array(
            data.draw(st.sampled_from([[None] * n, [1.0j] * n, [{}] * n, [1, "a"] * n]))
        )[:n]
        names = ("labels",)
    elif kind == "zero_dim":
        embeddings = np.zeros((n, 0))
    elif kind == "pairs":
        with_pairs = data.draw(bad_choice())
        rejects(
            lambda: recall_at_far(embeddings, labels, far=far, pairs=with_pairs),
            "pairs",
        )
        return
    elif kind == "batch_size":
        size = data.draw(st.one_of(bad_positive_int(), st.just(1)))
        rejects(
            lambda: recall_at_far(
                embeddings, labels, far=far, pairs="in_batch", batch_size=size
            ),
            "batch_size",
        )
        return
    rejects(lambda: recall_at_far(embeddings, labels, far=far), *names)


# The CLI --------------------------------------------------------------------

CLI_BASE = {
    "--num-examples": "60000",
    "--batch-size": "256",
    "--epochs": "1",
    "--delta": "1e-6",
    "--noise-multiplier": "1.1",
}
CLI_BAD = st.sampled_from(
    ["nan", "inf", "-inf", "-3", "0", "abc", "", "1e400", "-1e-300", "1.5"]
)


def run_cli(argv):
    from kdpemb.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            status = main(argv)
        except SystemExit as exit:
            status = exit.code
    return status, out.getvalue() + err.getvalue()


CLI_FLAGS = {  # flag -> values it takes (None: any finite number in range).
    "--num-examples": ("int", 1),
    "--batch-size": ("float", 1),
    "--epochs": ("float", 1),
    "--delta": ("prob", 0),
    "--noise-multiplier": ("float", 0),
}


def cli_is_valid(flag, value):
    kind, minimum = CLI_FLAGS[flag]
    try:
        number = int(value) if kind == "int" else float(value)
    except ValueError:
        return False
    if not math.isfinite(number):
        return False
    if kind == "prob":
        return 0 < number < 1 / 60000
    if flag == "--batch-size":
        return 0 < number <= 60000
    return number > 0 if minimum else number >= 0


@fuzz(30)
@given(st.sampled_from(sorted(CLI_FLAGS)), CLI_BAD)
def test_cli_bad_flag_values(bounded_plds, flag, value):
    if cli_is_valid(flag, value):
        return
    argv = ["privacy", "epsilon"]
    for name, default in {**CLI_BASE, flag: value}.items():
        argv += [f"{name}={default}"]
    status, output = run_cli(argv)
    assert bounded_plds == []  # Refused before any accounting.
    assert status == 2, (argv, status, output)
    assert flag in output, (argv, output)
    assert "Traceback" not in output


def test_cli_good_values():
    argv = ["privacy", "epsilon", "--json"]
    for name, value in CLI_BASE.items():
        argv += [name, value]
    status, output = run_cli(argv)
    assert status in (0, None), output
    assert "epsilon" in output


# Data: VirtualClients, PoissonIndices, PoissonBatches -----------------------

USERS, PER_USER, IDENTITIES = 8, 3, 4
VC_IMAGES = np.random.default_rng(0).normal(size=(USERS * PER_USER, 4, 4, 1))
VC_LABELS = np.arange(USERS * PER_USER) % IDENTITIES
VC_USERS = np.repeat(np.arange(USERS), PER_USER)
VC_GOOD = {"clients_per_round": 2, "users_per_client": 2, "batch_size": 2}


def virtual_clients(images=VC_IMAGES, labels=VC_LABELS, user_ids=VC_USERS, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # A fixed seed, a derived P.
        return VirtualClients(images, labels, user_ids, **{**VC_GOOD, **kwargs})


VC_ARG_BAD = {
    "clients_per_round": st.one_of(bad_positive_real(), st.floats(4.01, 1e300)),
    "users_per_client": st.one_of(bad_positive_int(), st.integers(USERS + 1)),
    "sampling": bad_choice(),
    "local_steps": bad_positive_int(),
    "batch_size": bad_positive_int(),
    "max_examples_per_client": st.one_of(
        bad_positive_int().filter(lambda v: v is not None), st.integers(3, 10**9)
    ),
    "max_clients_per_round": bad_positive_int().filter(lambda v: v is not None),
    "rounds_per_epoch": bad_positive_int().filter(lambda v: v is not None),
    "num_clients": st.one_of(
        bad_positive_int().filter(lambda v: v is not None),
        st.integers(USERS + 1, 10**12),
    ),
    "num_classes": st.one_of(
        bad_positive_int().filter(lambda v: v is not None),
        st.integers(-5, IDENTITIES - 1),
    ),
    "seed": st.one_of(
        NOT_NUMBERS.filter(lambda v: v is not None),
        NON_FINITE,
        BOOLS,
        st.integers(max_value=-1),
        st.integers(min_value=2**128),
        st.floats(0, 10),
    ),
    "workers": bad_positive_int().filter(lambda v: v is not None),
    "max_queue_size": bad_positive_int(),
    "client_order": bad_choice(),
}


@fuzz(25)
@given(st.data())
def test_virtual_clients_good(data):
    k = data.draw(st.integers(1, USERS))
    pool = -(-USERS // k)
    sampling = data.draw(st.sampled_from(["poisson", "fixed", "epochs"]))
    clients = (
        data.draw(st.integers(1, pool))
        if sampling == "fixed"
        else data.draw(st.floats(1e-300, 1.0)) * pool
    )
    if sampling == "epochs":
        clients = max(clients, 1.0)
    kwargs = {
        "users_per_client": k,
        "clients_per_round": clients,
        "sampling": sampling,
        "local_steps": data.draw(st.integers(1, 4)),
        "batch_size": data.draw(st.integers(1, 8)),
        "seed": data.draw(st.integers(0, 2**128 - 1)),
    }
    if k == 1 and sampling == "epochs":
        kwargs["rounds_per_epoch"] = math.ceil(pool / clients)
        kwargs["clients_per_round"] = None
    if sampling == "epochs":
        kwargs["workers"] = 1
    else:  # The default floor(P / M) may be 1e300 rounds: refused (FOUND).
        kwargs["rounds_per_epoch"] = data.draw(st.integers(1, 10**12))
    clients = virtual_clients(**kwargs)
    index = data.draw(st.integers(0, len(clients) - 1))  # Up to 1e12.
    # A round is drawn from its own random streams, whatever its index (not
    # by replaying the rounds before it): its sample's (or its epoch's layout
    # and the epoch's identity: two), and one for each client it holds.
    with at_most(2 + clients.max_clients_per_round, RoundPlanner, "rng") as drawn:
        element = clients.round(index)
    assert drawn[0] >= 1  # The spy sees the streams the round draws from.
    assert element["images"].shape[1:3] == (kwargs["local_steps"], kwargs["batch_size"])
    assert element["client_mask"].sum() <= clients.max_clients_per_round


@fuzz(60)
@given(st.data())
def test_virtual_clients_arguments(data):
    name = data.draw(st.sampled_from(sorted(VC_ARG_BAD)))
    value = data.draw(VC_ARG_BAD[name])
    rejects(lambda: virtual_clients(seed=0, **{name: value}), name)


def bad_images(data, n=USERS * PER_USER):
    """Images that are not finite numbers of shape (N, H, W, C)."""
    kind = data.draw(st.sampled_from(["non_finite", "rank", "dtype", "empty"]))
    images = VC_IMAGES.copy()
    if kind == "non_finite":
        images[data.draw(st.integers(0, n - 1)), 0, 0, 0] = data.draw(NON_FINITE)
    elif kind == "rank":
        shape = data.draw(st.sampled_from([(n,), (n, 4, 4, 1, 1), (n, 16), ()]))
        images = np.zeros(shape)
    elif kind == "dtype":
        images = images.astype(data.draw(st.sampled_from([complex, object, "U3"])))
    else:
        images = images[:0]
    return images


def bad_labels(data, n, num_classes=None):
    """Labels that are not n whole numbers in [0, num_classes)."""
    kind = data.draw(
        st.sampled_from(
            ["negative", "fraction", "non_finite", "dtype", "length"]
            + (["range"] if num_classes else [])
        )
    )
    labels = np.arange(n) % 2
    i = data.draw(st.integers(0, n - 1))
    if kind == "negative":
        labels[i] = data.draw(st.integers(max_value=-1).filter(lambda v: v > -(2**62)))
    elif kind == "fraction":
        labels = labels + data.draw(st.sampled_from([0.5, 1e-9, -0.25]))
    elif kind == "non_finite":
        labels = labels.astype(float)
        labels[i] = data.draw(NON_FINITE)
    elif kind == "dtype":
        labels = np.array(
            data.draw(st.sampled_from([[None] * n, [1j] * n, ["a"] * n, [{}] * n]))
        )
    elif kind == "length":
        labels = labels[: data.draw(st.integers(0, n - 1))]
    else:
        labels[i] = data.draw(st.integers(num_classes, 2**62))
    return labels


@fuzz(40)
@given(st.data())
def test_virtual_clients_data(data):
    n = USERS * PER_USER
    field = data.draw(st.sampled_from(["images", "labels", "user_ids"]))
    if field == "images":
        images = bad_images(data)
        rejects(lambda: virtual_clients(images, seed=0), "images")
    elif field == "labels":
        labels = bad_labels(data, n, num_classes=IDENTITIES)
        rejects(
            lambda: virtual_clients(labels=labels, num_classes=IDENTITIES, seed=0),
            "labels",
            "num_classes",
        )
    else:
        user_ids = data.draw(
            st.sampled_from(
                [
                    VC_USERS[:-1],
                    VC_USERS + 0.5,
                    np.full(n, NAN),
                    np.full(n, 1j),
                    np.full(n, None),
                    VC_USERS.reshape(-1, 1),
                    np.zeros(0),
                ]
            )
        )
        rejects(lambda: virtual_clients(user_ids=user_ids, seed=0), "user_ids")


@st.composite
def good_poisson_indices(draw):
    n = draw(st.integers(1, 10**6))
    sampling = draw(st.sampled_from(["poisson", "fixed"]))
    batch = draw(st.none() | st.integers(1, min(n, 10**4)))
    if batch is not None and sampling == "poisson":
        batch = draw(st.just(batch) | st.floats(1e-3, 1.0).map(lambda f: f * batch))
    return {
        "num_examples": n,
        "batch_size": batch,
        "steps": draw(st.integers(1, 10**6)),
        "seed": draw(st.none() | st.integers(0, 2**64)),
        "padding": draw(st.sampled_from(["bound", "multiple", "none"])),
        "sampling": sampling,
        "multiple_of": draw(st.integers(1, 64)),
    }


class CountedDraws:
    """A NumPy generator that counts the random values it hands out."""

    def __init__(self, rng):
        self._rng, self.values = rng, 0

    def __getattr__(self, name):
        method = getattr(self._rng, name)

        def draw(*args, **kwargs):
            result = method(*args, **kwargs)
            self.values += np.size(result)
            return result

        return draw


@fuzz(60)
@given(good_poisson_indices(), st.data())
def test_poisson_indices(kwargs, data):
    batches = PoissonIndices(**kwargs)
    batches._rng = draws = CountedDraws(batches._rng)
    indices, mask = batches[data.draw(st.integers(0, kwargs["steps"] - 1))]
    n, chosen = kwargs["num_examples"], indices[mask == 1]
    # A batch costs O(B) random values whatever its index, not O(N): the
    # size of a Poisson sample, then its examples.
    assert draws.values <= 1 + chosen.size
    assert len(batches) == kwargs["steps"] and indices.shape == mask.shape
    assert np.all(np.diff(chosen) > 0) and (chosen.size == 0 or chosen[-1] < n)
    bad = {
        "num_examples": bad_positive_int(),
        "batch_size": st.one_of(
            bad_positive_real().filter(lambda v: v is not None),
            st.floats(n * (1 + 1e-9) + 1, 1e300),
        ),
        "steps": bad_positive_int(),
        "seed": st.one_of(
            NOT_NUMBERS.filter(lambda v: v is not None),
            NON_FINITE,
            BOOLS,
            st.integers(max_value=-1),
            st.floats(0, 10),
        ),
        "padding": bad_choice(),
        "sampling": bad_choice(),
        "multiple_of": bad_positive_int(),
    }
    name = data.draw(st.sampled_from(sorted(bad)))
    value = data.draw(bad[name])
    if name == "num_examples" and kwargs["batch_size"] is not None:
        value = value if value is not None else 0
    names = (name, "batch_size") if name == "num_examples" else (name,)
    rejects(lambda: PoissonIndices(**{**kwargs, name: value}), *names)


@fuzz(20)
@given(st.data())
def test_poisson_indices_fixed_fraction(data):
    batch = data.draw(st.floats(1.0, 99.0).filter(lambda v: v != int(v)))
    rejects(lambda: PoissonIndices(100, batch, 1, sampling="fixed"), "batch_size")


@fuzz(20)
@given(st.data())
def test_poisson_batches(data):
    features, labels = np.zeros((10, 3)), np.zeros(10, int)
    batches = PoissonBatches(features, labels, 5, 2, seed=0)
    assert batches[1][0].shape[1:] == (3,)
    kind = data.draw(st.sampled_from(["length", "not_array", "empty"]))
    if kind == "length":
        labels = labels[: data.draw(st.integers(0, 9))]
    elif kind == "not_array":
        features = data.draw(st.sampled_from([None, 3, 1.5, object()]))
    else:
        features, labels = features[:0], labels[:0]
    rejects(
        lambda: PoissonBatches(features, labels, 5, 2, seed=0),
        "features",
        "labels",
    )


# Model constructors ----------------------------------------------------------


def quietly(call):
    """`call()` with kdpemb's warnings (a fixed seed, ...) muted."""

    def wrapped():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return call()

    return wrapped


@cache
def tiny_network(classes=3, dim=4):
    return keras.Sequential([keras.Input((dim,)), keras.layers.Dense(classes)])


def bad_seed():
    return st.one_of(
        NOT_NUMBERS.filter(lambda v: v is not None),
        NON_FINITE,
        BOOLS,
        st.integers(max_value=-1),
        st.integers(min_value=2**31),
        st.floats(0, 10),
    )


def bad_bool():
    return st.one_of(NOT_NUMBERS, st.integers(), st.text(max_size=3))


def bad_delta_arg():
    return st.one_of(bad_positive_real(), st.floats(min_value=1.0, allow_nan=False))


def bad_noise_multiplier():
    return st.one_of(
        bad_non_negative_real().filter(lambda v: v is not None),
        st.floats(1e-300, 9.9e-7),
        st.floats(1.01e12, 1e308),
    )


MODEL_COMMON_BAD = {
    "clip_norm": bad_positive_real().filter(lambda v: v is not None),
    "noise_multiplier": bad_noise_multiplier(),
    "delta": bad_delta_arg().filter(lambda v: v is not None),
    "seed": bad_seed(),
}

DP_MODEL_BAD = {
    **MODEL_COMMON_BAD,
    "target_epsilon": bad_positive_real().filter(lambda v: v is not None),
    "physical_batch_size": bad_positive_int().filter(lambda v: v is not None),
    "sampling": bad_choice(),
    "per_layer_clipping": bad_bool(),
    "gradient_method": bad_choice(),
    "network": st.one_of(NOT_NUMBERS, st.integers()),
}


@fuzz(40)
@given(st.data())
def test_dp_model_arguments(data):
    name = data.draw(st.sampled_from(sorted(DP_MODEL_BAD)))
    kwargs = {"clip_norm": 1.0, "noise_multiplier": 1.0, "delta": 1e-5}
    if name == "target_epsilon":
        kwargs.pop("noise_multiplier")
    kwargs[name] = data.draw(DP_MODEL_BAD[name])
    network = kwargs.pop("network", tiny_network())
    rejects(quietly(lambda: DPModel(network, **kwargs)), name)


LAST_LAYER_BAD = {
    **MODEL_COMMON_BAD,
    "num_classes": bad_positive_int(),
    "method": bad_choice(),
    "feature_clip_norm": bad_positive_real().filter(lambda v: v is not None),
    "target_epsilon": bad_positive_real().filter(lambda v: v is not None),
    "head_init": bad_choice(),
    "l2": st.one_of(
        NOT_NUMBERS.filter(lambda v: v is not None),
        NON_FINITE,
        BOOLS,
        st.floats(max_value=-1e-300, allow_infinity=False),
    ),
    "budget_split": st.one_of(
        NOT_NUMBERS,
        NON_FINITE,
        BOOLS,
        st.floats(max_value=0.0),
        st.floats(min_value=1.0),
    ),
}


@fuzz(40)
@given(st.data())
def test_last_layer_arguments(data):
    name = data.draw(st.sampled_from(sorted(LAST_LAYER_BAD)))
    kwargs = {"num_classes": 3, "noise_multiplier": 1.0, "delta": 1e-5}
    if name == "target_epsilon":
        kwargs.pop("noise_multiplier")
    if name in ("feature_clip_norm", "l2", "budget_split"):
        kwargs["method"] = "dp-ls"
        kwargs["feature_clip_norm"] = 1.0
    kwargs[name] = data.draw(LAST_LAYER_BAD[name])
    rejects(quietly(lambda: LastLayerDPClassifier(**kwargs)), name)


FEDEMB_BAD = {
    **MODEL_COMMON_BAD,
    "embedding_dim": st.one_of(
        bad_positive_int().filter(lambda v: v is not None), st.just(2.5)
    ),
    "num_classes": bad_positive_int().filter(lambda v: v is not None),
    "aggregation": bad_choice(),
    "client_optimizer": st.one_of(
        bad_positive_real().filter(lambda v: v is not None), st.just("sgdd")
    ),
    "head_lr_scale": bad_positive_real(),
    "head": bad_choice(),
    "head_scale": bad_positive_real(),
    "head_margin": st.one_of(
        NOT_NUMBERS, NON_FINITE, st.floats(max_value=-1e-9), st.floats(min_value=1.0)
    ),
    "head_init": bad_choice().filter(lambda v: v is not None),
    "reconstruction_steps": st.one_of(
        NOT_NUMBERS, NON_FINITE, BOOLS, st.integers(max_value=-1), st.just(1.5)
    ),
    "client_parallelism": bad_positive_int().filter(lambda v: v is not None),
    "noise": bad_choice(),
    "tree_estimator": bad_choice(),
    "log_local_loss": bad_bool(),
    "log_nonfinite_updates": bad_bool(),
    "backbone": st.one_of(NOT_NUMBERS, st.integers()),
}


@fuzz(40)
@given(st.data())
def test_fedemb_arguments(data):
    name = data.draw(st.sampled_from(sorted(FEDEMB_BAD)))
    kwargs = {"noise_multiplier": 1.0, "delta": 1e-5}
    if name == "num_classes":
        kwargs["aggregation"] = data.draw(st.sampled_from(["full", "partial"]))
    if name in ("head_margin", "head_init"):
        kwargs["head"] = "cosine"
    kwargs[name] = data.draw(FEDEMB_BAD[name])
    backbone = kwargs.pop("backbone") if name == "backbone" else cached_backbone()
    rejects(quietly(lambda: FedEmbModel(backbone, **kwargs)), name)


@cache
def cached_backbone():
    from tests.models import fedemb_reference as ref

    return ref.linear_backbone()


# fit inputs ------------------------------------------------------------------

FIT_N, FIT_DIM, FIT_CLASSES = 12, 4, 3
FIT_X = np.random.default_rng(1).normal(size=(FIT_N, FIT_DIM)).astype("float32")
FIT_Y = np.arange(FIT_N) % FIT_CLASSES


def bad_features(data, n=FIT_N, dim=FIT_DIM, finite=True):
    """Rows that are not (finite, with `finite`) real vectors of length `dim`."""
    kinds = ["rank", "dtype", "width"] + (["non_finite"] if finite else [])
    kind = data.draw(st.sampled_from(kinds))
    x = FIT_X.copy()
    if kind == "non_finite":
        x[data.draw(st.integers(0, n - 1)), data.draw(st.integers(0, dim - 1))] = (
            data.draw(NON_FINITE)
        )
    elif kind == "rank":
        x = np.zeros(data.draw(st.sampled_from([(n,), (n, dim, 1), (n, 1, dim)])))
    elif kind == "dtype":
        x = x.astype(data.draw(st.sampled_from([complex, object, "U3", "S2"])))
    else:
        x = np.zeros((n, data.draw(st.sampled_from([1, dim + 1, 0]))))
    return x


@cache
def dp_model():
    model = quietly(
        lambda: DPModel(tiny_network(), noise_multiplier=1.0, delta=1e-3, seed=0)
    )()
    model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


@cache
def last_layer_model():
    model = quietly(
        lambda: LastLayerDPClassifier(
            FIT_CLASSES, noise_multiplier=1.0, delta=1e-3, seed=0
        )
    )()
    model.build((None, FIT_DIM))  # Features of another width are refused.
    return model


def bad_fit_arguments(data, finite=True):
    """(x, y, kwargs, names): one bad input of a classifier's `fit`; a
    non-finite `x` only with `finite` (refused by every trainer)."""
    x, y, kwargs = FIT_X, FIT_Y, {"batch_size": 4, "epochs": 1, "verbose": 0}
    part = data.draw(st.sampled_from(["x", "y", "empty", "batch_size", "epochs"]))
    if part == "x":
        names = ("x", "features", "network", "input")
        return bad_features(data, finite=finite), y, kwargs, names
    if part == "y":
        return x, bad_labels(data, FIT_N, FIT_CLASSES), kwargs, ("y", "labels")
    if part == "empty":
        return x[:0], y[:0], kwargs, ("x", "features", "empty")
    value = data.draw(
        st.one_of(bad_positive_int(), st.integers(FIT_N + 1, 10**12))
        if part == "batch_size"
        else bad_positive_int()
    )
    if part == "batch_size" and value is None:
        value = 0  # None: full batches, valid.
    return x, y, {**kwargs, part: value}, (part,)


@fuzz(25)
@given(st.data())
def test_dp_model_fit_inputs(data):
    x, y, kwargs, names = bad_fit_arguments(data)
    model = dp_model()
    before = int(model.private_steps.value)
    rejects(quietly(lambda: model.fit(x, y, **kwargs)), *names)
    assert int(model.private_steps.value) == before


@fuzz(25)
@given(st.data())
def test_last_layer_fit_inputs(data):
    x, y, kwargs, names = bad_fit_arguments(data)
    model = last_layer_model()
    before = int(model.private_steps.value)
    rejects(quietly(lambda: model.fit(x, y, **kwargs)), *names)
    assert int(model.private_steps.value) == before


@fuzz(15)
@given(st.data())
def test_fedemb_fit_inputs(data):
    model = quietly(lambda: FedEmbModel(cached_backbone(), noise_multiplier=1.0))()
    x = data.draw(
        st.sampled_from(
            [None, FIT_X, (FIT_X, FIT_Y), {"images": VC_IMAGES}, [VC_IMAGES], 3]
        )
    )
    rejects(lambda: model.fit(x, verbose=0), "VirtualClients", "schedule")


def test_fitted_models_stay_usable():
    """The cached models took no step; good inputs still train."""
    for model in (dp_model(), last_layer_model()):
        before = int(model.private_steps.value)
        quietly(lambda m=model: m.fit(FIT_X, FIT_Y, batch_size=4, verbose=0))()
        assert int(model.private_steps.value) == before + 3


# Callbacks -------------------------------------------------------------------


@fuzz(40)
@given(st.data())
def test_privacy_budget_arguments(data):
    bad = {
        "delta": bad_delta_arg().filter(lambda v: v is not None),
        "target_epsilon": bad_positive_real().filter(lambda v: v is not None),
        "accountant": bad_choice(),
        "value_discretization_interval": st.one_of(
            bad_positive_real(), st.floats(1.01, 1e308)
        ),
    }
    name = data.draw(st.sampled_from(sorted(bad)))
    rejects(lambda: PrivacyBudget(**{name: data.draw(bad[name])}), name)


@fuzz(40)
@given(good_embeddings(), st.data())
def test_recall_at_far_callback_arguments(good, data):
    images, labels = good
    bad = {
        "far": st.one_of(
            NOT_NUMBERS,
            NON_FINITE,
            st.floats(max_value=0.0),
            st.floats(min_value=1.0, exclude_min=True),
            st.just([]),
        ),
        "every_n_epochs": bad_positive_int(),
        "batch_size": bad_positive_int(),
        "pairs": bad_choice(),
        "in_batch_size": st.one_of(bad_positive_int(), st.just(1)),
        "data": st.sampled_from(
            [None, 3, "x", images, (images,), (images, labels[:-1])]
        ),
    }
    name = data.draw(st.sampled_from(sorted(bad)))
    kwargs = {"data": (images, labels), "far": 0.5}
    if name == "in_batch_size":
        kwargs["pairs"] = "in_batch"
    kwargs[name] = data.draw(bad[name])
    names = ("data", "labels", "images") if name == "data" else (name,)
    rejects(lambda: RecallAtFAR(**kwargs), *names)


# What the fuzzing found: each input once, with the argument it must name ----


def _dp_model_fit(x=FIT_X, y=FIT_Y):
    return lambda: dp_model().fit(x, y, batch_size=4, verbose=0)


def _fedemb(**kwargs):
    return lambda: FedEmbModel(cached_backbone(), noise_multiplier=1.0, **kwargs)


def _last_layer(**kwargs):
    settings = {"feature_clip_norm": 1.0, "noise_multiplier": 1.0, **kwargs}
    return lambda: LastLayerDPClassifier(3, "dp-ls", **settings)


def _poisson(*args, **kwargs):
    return lambda: PoissonIndices(*args, **kwargs)


FOUND = {  # id: (call, the name its error must hold); the old behaviour.
    # Accepted; Keras' loader then misbehaves.
    "vc_workers": (lambda: virtual_clients(workers=-3), "workers"),
    "vc_queue": (lambda: virtual_clients(max_queue_size=0), "max_queue_size"),
    # OverflowError: cannot fit 'int' into an index-sized integer (len()).
    "vc_default_rounds": (
        lambda: virtual_clients(clients_per_round=1e-300),
        "clients_per_round",
    ),
    "vc_rounds": (lambda: virtual_clients(rounds_per_epoch=2**70), "rounds_per_epoch"),
    # TypeError: unsupported operand type(s) for /: 'str' and 'int'.
    "pi_batch_str": (_poisson(1, "1", 1), "batch_size"),
    # Accepted; the first batch failed in NumPy.
    "pi_fixed_fraction": (_poisson(100, 58.9, 1, sampling="fixed"), "batch_size"),
    # ValueError: math domain error.
    "pi_batch_above_n": (_poisson(100, 500, 1), "batch_size"),
    # Accepted (no batches, or 2 of "2.5").
    "pi_steps": (_poisson(100, 5, -1), "steps"),
    "pi_steps_float": (_poisson(100, 5, 2.5), "steps"),
    # Accepted; batches of one masked-out row.
    "pi_no_examples": (_poisson(0, None, 1), "num_examples"),
    # ZeroDivisionError.
    "pi_multiple_of": (_poisson(100, 5, 1, multiple_of=0), "multiple_of"),
    # ValueError from NumPy: expected non-negative integer.
    "pi_seed": (_poisson(100, 5, 1, seed=-1), "seed"),
    # Accepted; a gather past the labels at the first batch.
    "pb_lengths": (
        lambda: PoissonBatches(np.zeros((10, 3)), np.zeros(0), 5, 2),
        "labels",
    ),
    # TypeError: only 0-dimensional arrays can be converted to Python scalars.
    "model_seed_array": (_fedemb(seed=np.array([1.0, 2.0])), "seed"),
    # Accepted, truncated to 2.
    "model_seed_float": (_fedemb(seed=2.7), "seed"),
    # JAX: OverflowError (out of bounds for uint32).
    "model_seed_big": (_fedemb(seed=2**32), "seed"),
    # Accepted; refused only by a fit.
    "dp_model_delta": (
        lambda: DPModel(tiny_network(), noise_multiplier=1.0, delta=NAN),
        "delta",
    ),
    "last_layer_delta": (_last_layer(delta=2.0), "delta"),
    # TypeError: '<' not supported between instances of 'int' and 'NoneType'.
    "last_layer_budget_split": (_last_layer(budget_split=None), "budget_split"),
    # Accepted.
    "last_layer_l2_inf": (_last_layer(l2=INF), "l2"),
    "last_layer_l2_bool": (_last_layer(l2=True), "l2"),
    # Accepted as False.
    "fedemb_log_bool": (_fedemb(log_nonfinite_updates=None), "log_nonfinite_updates"),
    # ValueError: The truth value of an array ... is ambiguous.
    "fedemb_head_array": (_fedemb(head=np.array([1.0, 2.0])), "head"),
    # Accepted, truncated to 2.
    "fedemb_embedding_dim_float": (_fedemb(embedding_dim=2.5), "embedding_dim"),
    # Keras: invalid value for `units`.
    "fedemb_embedding_dim_negative": (_fedemb(embedding_dim=-3), "embedding_dim"),
    # Accepted.
    "fedemb_num_classes": (_fedemb(num_classes=-5), "num_classes"),
    # The message named batch_size.
    "recall_callback_in_batch_size": (
        lambda: RecallAtFAR(
            (np.zeros((6, 2)), np.arange(6) % 2),
            far=0.5,
            pairs="in_batch",
            in_batch_size=1,
        ),
        "in_batch_size",
    ),
    # OverflowError: math range error.
    "accountant_interval_huge": (
        lambda: privacy.Accountant(
            MECHANISMS["dp_sgd"], "pld", value_discretization_interval=1e300
        ),
        "value_discretization_interval",
    ),
    # Accepted: ε = 599 where the default grid gives 0.7.
    "accountant_interval_coarse": (
        lambda: privacy.Accountant(
            MECHANISMS["dp_sgd"], "pld", value_discretization_interval=100.0
        ),
        "value_discretization_interval",
    ),
    # Never answered (a grid of about 1e12 points).
    "accountant_tiny_noise": (
        lambda: privacy.Accountant(
            MECHANISMS["dp_sgd"].with_noise_multiplier(1e-6), "pld"
        ),
        "noise_multiplier",
    ),
    # TensorFlow: InvalidArgumentError in the graph; JAX: trained silently.
    "dp_model_fit_label_range": (_dp_model_fit(y=np.full(FIT_N, 7)), "num_classes"),
    "dp_model_fit_label_negative": (_dp_model_fit(y=-FIT_Y - 1), "labels"),
    # TensorFlow: Invalid dtype: str32; JAX: TypeError from jit.
    "dp_model_fit_str_y": (_dp_model_fit(y=np.array(["a"] * FIT_N)), "y"),
    # Backend traceback (MatMul / dot_general shapes).
    "last_layer_fit_width": (
        lambda: last_layer_model().fit(np.ones((FIT_N, 1)), FIT_Y, verbose=0),
        "features",
    ),
}


@pytest.mark.parametrize("case", sorted(FOUND))
def test_found_by_fuzzing(case):
    call, name = FOUND[case]
    models = (dp_model(), last_layer_model())
    before = [int(model.private_steps.value) for model in models]
    rejects(quietly(call), name)
    assert [int(model.private_steps.value) for model in models] == before


def test_tiny_noise_multiplier_answers(bounded_plds):
    """One sampled step of z = 0.01 used to build a PLD of ~1e8 points (hours
    of work); the grid is coarsened to at most `MAX_PLD_POINTS` steps."""
    mechanism = privacy.dp_sgd(0.01, batch_size=100, num_examples=10_000)
    q = mechanism.sampling_probability
    assert pld_points(0.01, value_discretization_interval=1e-4, sampling_prob=q) > (
        100 * PLD_POINTS_BOUND
    )  # What the default grid would take.
    accountant = privacy.Accountant(mechanism, "pld")
    eps = accountant.epsilon(3, 1e-6)
    assert 1e3 < eps < INF
    assert accountant.value_discretization_interval_used > 1e-4
    # The sampled step was built, within the bound (checked before building).
    assert bounded_plds and max(bounded_plds) <= PLD_POINTS_BOUND
