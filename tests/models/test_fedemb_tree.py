"""FedEmbModel(noise="tree"): DP-FTRL rounds, their state and accounting.

Rounds come from hand-built round dicts (`fedemb_reference`). A round
with no sampled client has a zero clipped sum, so with the server
optimizer SGD(1.0) the backbone moves by exactly the round's noise over
M: the kernel's displacement is the tree's noisy prefix sum.
"""

import math
import warnings

import dp_accounting as dpa
import keras
import numpy as np
import pytest

from kdpemb import privacy
from kdpemb.errors import PrivacyBudgetExhaustedError
from kdpemb.models import FedEmbModel
from kdpemb.privacy import AdaptiveClipping, Schedule, protocol
from tests.models import fedemb_reference as ref

pytestmark = [
    pytest.mark.filterwarnings("ignore::kdpemb.errors.ReproducibleNoiseWarning"),
    pytest.mark.filterwarnings("ignore::kdpemb.errors.ReproducibleSamplingWarning"),
]

ROUNDS_PER_EPOCH = 4
DELTA = 1e-3


def epochs_schedule(rounds_per_epoch=ROUNDS_PER_EPOCH, users_per_client=2):
    return Schedule.virtual_clients(
        20,
        None,
        users_per_client=users_per_client,
        num_clients=10 if users_per_client > 1 else None,
        local_steps=3,
        sampling="epochs",
        rounds_per_epoch=rounds_per_epoch,
    )


def tree_model(noise_multiplier=1.0, clip_norm=1.0, momentum=0.0, **overrides):
    settings = {
        "client_optimizer": 0.2,
        "head_lr_scale": 5.0,
        "clip_norm": clip_norm,
        "noise_multiplier": noise_multiplier,
        "schedule": epochs_schedule(),
        "noise": "tree",
        "seed": 0,
        "delta": DELTA,
        **overrides,
    }
    model = FedEmbModel(ref.linear_backbone(seed=1), **settings)
    model.compile(optimizer=keras.optimizers.SGD(1.0, momentum=momentum))
    return model


def positioned(data, index, rounds_per_epoch=ROUNDS_PER_EPOCH):
    """Round `index` of a run: the epoch layout and position that
    `VirtualClients(sampling="epochs")` puts on every row."""
    epoch, position = divmod(index, rounds_per_epoch)
    rows = data["client_mask"].shape[0]
    return dict(
        data,
        epoch_id=np.full(rows, epoch, "int32"),
        round_in_epoch=np.full(rows, position, "int32"),
    )


def empty_round(index=0):
    return positioned(ref.make_round(index, classes=(), steps=3), index)


def data_rounds(count, rounds_per_epoch=ROUNDS_PER_EPOCH):
    return [
        positioned(
            ref.make_round(seed, classes=(3, 2), steps=3), seed, rounds_per_epoch
        )
        for seed in range(count)
    ]


def open_noise(model):
    return keras.ops.convert_to_numpy(model.tree_open_noise[0]).astype(np.float64)


def test_the_model_moves_by_the_noisy_prefix_sum_and_restarts_every_epoch():
    model = tree_model()
    sample_size = model.schedule.sample_size  # M = P / R = 2.5.
    previous = ref.kernel_of(model.backbone).astype(np.float64)
    for round_index in range(ROUNDS_PER_EPOCH + 3):
        model.train_on_batch(empty_round(round_index))
        j = round_index % ROUNDS_PER_EPOCH + 1  # Position in the tree.
        if j == 1:
            epoch_start = previous
        moved = (ref.kernel_of(model.backbone) - epoch_start) * sample_size
        # The prefix noise of this epoch's tree is the sum of its open nodes:
        # one per set bit of j (levels 0, 1, 2 for R = 4).
        nodes = open_noise(model)
        expected = sum(nodes[level] for level in range(3) if j >> level & 1)
        np.testing.assert_allclose(moved, expected, atol=1e-4)
        previous = ref.kernel_of(model.backbone).astype(np.float64)


def test_zero_noise_tree_rounds_equal_independent_noise_rounds():
    rounds = data_rounds(5)
    models = [
        tree_model(noise_multiplier=0.0, clip_norm=0.05, momentum=0.9, noise=noise)
        for noise in ("tree", "independent")
    ]
    for model in models:
        for data in rounds:
            model.train_on_batch(data)
    tree, independent = (ref.kernel_of(m.backbone) for m in models)
    assert not np.allclose(tree, ref.kernel_of(ref.linear_backbone(seed=1)))
    np.testing.assert_allclose(tree, independent, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("estimator", ["standard", "efficient"])
def test_a_resumed_model_adds_the_noise_of_an_uninterrupted_run(tmp_path, estimator):
    # Seeded (tests only): 3 rounds, save, load, 2 more rounds, mid-tree,
    # against 5 rounds in one go. The open nodes drawn before the save are
    # subtracted after it, so they must come back exactly.
    rounds = data_rounds(5, rounds_per_epoch=8)
    settings = {"schedule": epochs_schedule(8), "tree_estimator": estimator}
    uninterrupted = tree_model(**settings)
    for data in rounds:
        uninterrupted.train_on_batch(data)

    first = tree_model(**settings)
    for data in rounds[:3]:
        first.train_on_batch(data)
    path = tmp_path / "model.keras"
    first.save(path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        resumed = keras.saving.load_model(path)
    assert resumed.noise == "tree" and resumed.tree_estimator == estimator
    np.testing.assert_array_equal(open_noise(resumed), open_noise(first))
    # A loaded model draws its new nodes from fresh OS entropy (the seed is
    # never saved). To compare noise, give it the generator state the
    # uninterrupted run had at round 3: then only the restored open nodes
    # can make the two runs differ.
    resumed.noise_seed.state.assign(first.noise_seed.state)
    for data in rounds[3:]:
        resumed.train_on_batch(data)

    assert protocol.read_private_steps(resumed) == 5
    np.testing.assert_allclose(
        ref.kernel_of(resumed.backbone),
        ref.kernel_of(uninterrupted.backbone),
        atol=1e-5,
    )
    np.testing.assert_allclose(
        open_noise(resumed), open_noise(uninterrupted), atol=1e-6
    )


def test_the_statement_names_the_tree_and_states_rho_and_rdp_epsilon():
    model = tree_model(noise_multiplier=3.0)
    for data in [empty_round(i) for i in range(ROUNDS_PER_EPOCH + 2)]:
        model.train_on_batch(data)
    statement = model.privacy_statement()
    assert statement.accountant == "rdp" and statement.unit == "user"
    assert "tree aggregation" in statement.noise_description
    assert "at most one" in statement.sampling_description
    # k = 2 users per client: one user moves one leaf by up to 2C, so every
    # node above it by 2C; depth(4) = 3 nodes in the full epoch, depth(2) =
    # 2 in the partial one.
    assert statement.rho == pytest.approx((3 + 2) * 2.0**2 / (2 * 3.0**2))
    accountant = dpa.rdp.RdpAccountant(
        neighboring_relation=dpa.NeighboringRelation.REPLACE_SPECIAL
    )
    accountant.compose(dpa.SingleEpochTreeAggregationDpEvent(1.5, [4]))
    accountant.compose(dpa.SingleEpochTreeAggregationDpEvent(1.5, [2]))
    assert statement.epsilon == pytest.approx(accountant.get_epsilon(DELTA), rel=1e-9)
    assert f"ρ = {statement.rho:.4g} zCDP" in statement.summary()


def test_target_epsilon_calibrates_the_tree_noise():
    model = tree_model(noise_multiplier=None, target_epsilon=8.0)
    model.fit(ref.Rounds([empty_round(i) for i in range(4)]), epochs=2, verbose=0)
    z = model.noise_multiplier
    assert model.planned_steps == 8
    spent = privacy.epsilon(model.privacy_mechanism(), 8, DELTA)
    assert spent <= 8.0 and spent == pytest.approx(8.0, rel=1e-2)
    # Direct: two epochs of a 4-round tree at z/2 (k = 2).
    accountant = dpa.rdp.RdpAccountant(
        neighboring_relation=dpa.NeighboringRelation.REPLACE_SPECIAL
    )
    accountant.compose(dpa.SingleEpochTreeAggregationDpEvent(z / 2, [4]), 2)
    assert accountant.get_epsilon(DELTA) == pytest.approx(spent, rel=1e-9)
    with pytest.raises(PrivacyBudgetExhaustedError):
        model.fit(ref.Rounds([empty_round(i) for i in range(4)]), epochs=1, verbose=0)


def test_a_fit_must_start_at_an_epoch_and_run_whole_epochs():
    model = tree_model()
    model.train_on_batch(empty_round())
    with pytest.raises(ValueError, match="not a whole number of epochs"):
        model.fit(ref.Rounds([empty_round(i) for i in range(4)]), verbose=0)
    fresh = tree_model()
    with pytest.raises(ValueError, match="steps_per_epoch=2"):
        fresh.fit(
            ref.Rounds([empty_round(i) for i in range(4)]),
            steps_per_epoch=2,
            verbose=0,
        )
    assert protocol.read_private_steps(fresh) == 0


def test_bad_combinations_are_refused_at_construction():
    poisson = Schedule.virtual_clients(20, 2.5, users_per_client=2, num_clients=10)
    with pytest.raises(ValueError, match="sampling='epochs'"):
        tree_model(schedule=poisson)
    with pytest.raises(ValueError, match="adaptive clipping"):
        tree_model(adaptive_clipping=AdaptiveClipping())
    with pytest.raises(ValueError, match="noise='tree' only"):
        tree_model(noise="independent", tree_estimator="efficient")
    with pytest.raises(ValueError, match="noise must be one of"):
        tree_model(noise="banded")


def test_independent_noise_without_sampling_is_one_gaussian_per_epoch():
    model = tree_model(noise="independent", noise_multiplier=2.0)
    mechanism = model.privacy_mechanism()
    # A user is in one round per epoch: 3 epochs are 3 Gaussians of
    # sensitivity 2C (k = 2), whatever the number of rounds per epoch.
    assert mechanism.zcdp_rho(3 * ROUNDS_PER_EPOCH) == pytest.approx(3 * 4 / (2 * 4.0))
    assert mechanism.describe_noise() == "independent Gaussian noise each step"
    assert math.isfinite(privacy.epsilon(mechanism, 12, DELTA))


def epochs_clients(**overrides):
    from kdpemb.data import VirtualClients

    rng = np.random.default_rng(0)
    images = rng.normal(size=(40, *ref.IMAGE_SHAPE)).astype("float32")
    settings = {
        "clients_per_round": 3,
        "users_per_client": 2,
        "num_clients": 10,
        "local_steps": 3,
        "batch_size": 2,
        "sampling": "epochs",
        "seed": 0,
        **overrides,
    }
    return VirtualClients(images, np.arange(40) % 20, np.arange(40) % 20, **settings)


def test_a_fit_on_the_clients_trains_whole_epochs_of_one_tree_each():
    clients = epochs_clients()
    rounds = clients.rounds_per_epoch
    model = tree_model(schedule=clients.schedule)
    model.fit(clients, epochs=2, verbose=0)
    assert protocol.read_private_steps(model) == 2 * rounds
    assert int(keras.ops.convert_to_numpy(model.misaligned_rounds)) == 0
    # The second epoch's tree took the rounds of a data epoch served after
    # the first one's.
    assert int(keras.ops.convert_to_numpy(model.data_epoch)) >= 1


@pytest.mark.parametrize("order", ["repeated", "mixed_epochs"])
def test_rounds_out_of_their_epoch_are_not_trained_and_the_fit_raises(order):
    from kdpemb.errors import RoundsOutOfEpochError

    clients = epochs_clients()
    rounds = clients.rounds_per_epoch  # 4 rounds of 3 of the 10 slots.
    if order == "repeated":  # A round twice: its users twice in one tree.
        served = [clients.round(i) for i in (2, 0, 2, 0)]
    else:  # Epoch 0's first rounds, then the rest of epoch 1: a user twice.
        served = [clients.round(i) for i in (1, 0, rounds + 2, rounds + 3)]
    model = tree_model(schedule=clients.schedule)
    start = ref.kernel_of(model.backbone).copy()
    with pytest.raises(RoundsOutOfEpochError, match="1 round"):
        model.fit(ref.Rounds(served), epochs=1, verbose=0, shuffle=False)
    # The first two (distinct rounds of one data epoch, in any order) were
    # trained; training stopped at the third, which released nothing and
    # is not counted.
    assert protocol.read_private_steps(model) == 2
    after_two = tree_model(schedule=clients.schedule)
    after_two.fit(ref.Rounds(served[:2]), epochs=1, verbose=0, shuffle=False)
    np.testing.assert_allclose(
        ref.kernel_of(model.backbone), ref.kernel_of(after_two.backbone), atol=1e-6
    )
    assert not np.allclose(ref.kernel_of(model.backbone), start)


def test_rounds_of_another_layout_are_refused():
    # A restarted job draws a new sampling seed, hence a new layout: its
    # epoch-0 rounds must not fill the rest of an epoch begun with the old.
    from kdpemb.errors import RoundsOutOfEpochError

    first, second = epochs_clients(seed=0), epochs_clients(seed=1)
    served = [first.round(0), first.round(1), second.round(2), second.round(3)]
    model = tree_model(schedule=first.schedule)
    with pytest.raises(RoundsOutOfEpochError, match="1 round"):
        model.fit(ref.Rounds(served), epochs=1, verbose=0, shuffle=False)
    assert protocol.read_private_steps(model) == 2  # Stopped at the first.


def test_a_mid_epoch_restore_by_a_callback_is_refused_before_any_round():
    class RestoresMidEpoch(keras.callbacks.Callback):  # As BackupAndRestore
        def on_train_begin(self, logs=None):  # with save_freq=<int> would.
            self.model.private_steps.assign(1)

    clients = epochs_clients()
    model = tree_model(schedule=clients.schedule)
    start = ref.kernel_of(model.backbone).copy()
    with pytest.raises(ValueError, match="not a whole number of epochs"):
        model.fit(clients, epochs=1, verbose=0, callbacks=[RestoresMidEpoch()])
    assert protocol.read_private_steps(model) == 1
    np.testing.assert_array_equal(ref.kernel_of(model.backbone), start)


def test_rounds_without_their_position_are_refused():
    clients = epochs_clients()
    model = tree_model(schedule=clients.schedule)
    data = clients.round(0)
    del data["epoch_id"]
    with pytest.raises(ValueError, match="epoch_id"):
        model.train_on_batch(data)
    assert protocol.read_private_steps(model) == 0


def test_a_round_past_the_plan_moves_no_tree_node():
    snapshots = []

    class JumpsToThePlan(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 0:  # A callback moves the counter to the plan's end.
                self.model.private_steps.assign(self.model.planned_steps)
                snapshots.append(open_noise(self.model))

    model = tree_model(noise_multiplier=None, target_epsilon=8.0, planned_steps=4)
    model.fit(
        ref.Rounds([empty_round(i) for i in range(4)]),
        verbose=0,
        callbacks=[JumpsToThePlan()],
    )
    assert protocol.read_private_steps(model) == 4
    np.testing.assert_array_equal(open_noise(model), snapshots[0])


def test_a_model_that_took_its_schedule_from_the_clients_saves_and_resumes(
    tmp_path,
):
    clients = epochs_clients()
    model = tree_model(schedule=None)
    model.fit(clients, epochs=1, verbose=0)
    path = tmp_path / "model.keras"
    model.save(path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        loaded = keras.saving.load_model(path)
    assert loaded.schedule == clients.schedule
    np.testing.assert_array_equal(open_noise(loaded), open_noise(model))
    loaded.fit(clients, epochs=1, verbose=0)
    assert protocol.read_private_steps(loaded) == 2 * clients.rounds_per_epoch


def test_a_ledger_resumes_a_killed_epoch_as_a_whole_one(tmp_path):
    # A run killed 2 rounds into its second epoch: its backup (saved at the
    # first epoch's end) restores R rounds, its ledger counts R + 2 begun.
    # The killed rounds released part of a tree over users who take part
    # again in the resumed epoch, so the model resumes at 2R: a whole epoch
    # for them, where R + 2 would be refused as a cut-short epoch.
    import dp_accounting as dpa

    from kdpemb.callbacks import PrivacyLedger
    from kdpemb.privacy import ledger

    clients = epochs_clients(seed=None)
    rounds = clients.rounds_per_epoch
    model = tree_model(schedule=clients.schedule)
    path = tmp_path / "ledger.json"
    model.fit(clients, epochs=1, verbose=0, callbacks=[PrivacyLedger(path)])
    mechanism = model.privacy_mechanism()
    ledger.write_ledger(path, mechanism, rounds + 2, model="FedEmbModel")
    resumed = PrivacyLedger(path, verbose=0)
    model.fit(clients, epochs=1, verbose=0, callbacks=[resumed])
    assert resumed.restored_steps == rounds
    steps = protocol.read_private_steps(model)
    assert steps == ledger.read_ledger(path)["steps"] == 3 * rounds
    assert int(keras.ops.convert_to_numpy(model.misaligned_rounds)) == 0

    # ε counts three whole trees (dp-accounting directly), at least what
    # ran: the trees of R, 2 and R rounds. k = 2 users per client: a tree
    # node moves by up to 2C, so its noise is z / 2 per unit of sensitivity.
    def tree_epsilon(*trees):
        relation = dpa.NeighboringRelation.REPLACE_SPECIAL  # As trees need.
        accountant = dpa.rdp.RdpAccountant(neighboring_relation=relation)
        for leaves in trees:
            z = model.noise_multiplier / 2
            accountant.compose(dpa.SingleEpochTreeAggregationDpEvent(z, [leaves]))
        return accountant.get_epsilon(DELTA)

    epsilon = model.privacy_statement().epsilon
    assert epsilon == pytest.approx(tree_epsilon(rounds, rounds, rounds), rel=1e-6)
    assert epsilon > tree_epsilon(rounds, 2, rounds)
