"""Property-based fuzzing of the public API (issue 21, part 3).

Each test draws bad values for one argument of a public constructor or
function (NaN, ±inf, negative, zero, wrong type, wrong rank or dtype,
empty, extreme sizes, out-of-range labels) and checks that the call
raises `ValueError` or `TypeError` (kdpemb's error classes subclass them)
with a message that names the argument: never another exception, a hang
or a silent result. Valid values are drawn too, and must work.

Deterministic (`derandomize=True`, no example database, no shrinking) with
a fixed example budget, so CI sees the same examples every run.
"""

import contextlib
import io
import math
import signal

import numpy as np
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from kdpemb import privacy
from kdpemb.metrics import recall_at_far


def fuzz(max_examples):
    return settings(
        max_examples=max_examples,
        derandomize=True,
        deadline=None,
        database=None,
        phases=(Phase.explicit, Phase.generate),
        suppress_health_check=list(HealthCheck),
    )


@contextlib.contextmanager
def time_limit(seconds=10):
    """Fails a call that takes longer than `seconds` (a hang)."""

    def hang(*_):
        raise AssertionError(f"no answer within {seconds} s (a hang)")

    previous = signal.signal(signal.SIGALRM, hang)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def rejects(call, *names):
    """`call()` raises ValueError/TypeError naming one of `names`."""
    with time_limit():
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
    with time_limit():
        eps = privacy.epsilon(mechanism, steps, 1e-6)
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
    """Huge or tiny multipliers: an answer, or an error naming the multiplier."""
    z = data.draw(st.one_of(st.floats(1e-300, 1e-6), st.floats(1e12, 1e308)), label="z")
    accountant = data.draw(st.sampled_from(["pld", "rdp"]))
    mechanism = MECHANISMS[kind]
    with time_limit():
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
    with time_limit():
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
    with time_limit():
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
def test_cli_bad_flag_values(flag, value):
    if cli_is_valid(flag, value):
        return
    argv = ["privacy", "epsilon"]
    for name, default in {**CLI_BASE, flag: value}.items():
        argv += [f"{name}={default}"]
    with time_limit(20):
        status, output = run_cli(argv)
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
