"""Clip norms suggested from public data: the norms are the ones training
would clip, measured by hand."""

import keras
import numpy as np
import pytest

from kdpemb.models import suggest_clip_norm, suggest_feature_clip_norm
from kdpemb.models.clip_suggestions import client_update_norms
from tests.models import fedemb_reference as ref
from tests.models.test_fedemb import make_model, tiny_clients

pytestmark = [
    pytest.mark.filterwarnings("ignore::kdpemb.errors.ReproducibleNoiseWarning"),
    pytest.mark.filterwarnings("ignore::kdpemb.errors.ReproducibleSamplingWarning"),
]


def test_the_feature_clip_norm_is_a_quantile_of_the_feature_norms():
    rng = np.random.default_rng(0)
    features = rng.normal(size=(101, 5)) * rng.uniform(0.1, 10, size=(101, 1))
    norms = np.sort(np.sqrt((features**2).sum(axis=1)))
    assert suggest_feature_clip_norm(features) == pytest.approx(norms[50])
    assert suggest_feature_clip_norm(features, quantile=0.9) == pytest.approx(norms[90])
    with pytest.raises(ValueError, match="quantile"):
        suggest_feature_clip_norm(features, quantile=1.5)
    with pytest.raises(ValueError, match=r"\[N, d\]"):
        suggest_feature_clip_norm(np.zeros(3))


def test_the_update_norms_are_those_of_hand_written_clients():
    backbone = ref.linear_backbone(seed=1)
    model = make_model(backbone, compile=False, reconstruction_steps=1)
    rounds = [ref.make_round(seed, classes=(3, 2, 2), steps=3) for seed in (5, 6)]
    kernel = ref.kernel_of(backbone).copy()
    expected = []
    for data in rounds:
        for client in ref.client_rows(data):
            head = np.zeros((3, client["num_local_classes"]))
            update, _ = ref.client_update(
                kernel.astype(np.float64), head, client, lr=0.2,
                head_lr_scale=5.0, reconstruction_steps=1,
            )  # fmt: skip
            expected.append(np.linalg.norm(update))
    norms = client_update_norms(model, rounds)
    np.testing.assert_allclose(norms, expected, rtol=1e-4)
    assert suggest_clip_norm(model, rounds) == pytest.approx(
        np.quantile(expected, 0.5), rel=1e-4
    )
    assert suggest_clip_norm(model, rounds, quantile=0.0) == pytest.approx(
        min(expected), rel=1e-4
    )
    np.testing.assert_array_equal(ref.kernel_of(backbone), kernel)  # Unchanged.


def test_virtual_clients_of_public_users_are_drawn_for_the_rounds_asked():
    clients = tiny_clients()
    model = make_model(ref.linear_backbone(), compile=False, local_steps=2)
    norms = client_update_norms(model, clients, rounds=3)
    sampled = sum(int(clients.round(i)["client_mask"].sum()) for i in range(3))
    assert len(norms) == sampled > 0
    assert np.all(norms > 0)
    assert suggest_clip_norm(model, clients, rounds=3) == pytest.approx(
        np.quantile(norms, 0.5)
    )
    with pytest.raises(TypeError, match="FedEmbModel"):
        suggest_clip_norm(keras.Sequential([keras.Input((2,))]), clients)


def test_rounds_where_the_backbone_cannot_move_are_refused():
    # One local step from a zero head: no gradient reaches the backbone.
    model = make_model(ref.linear_backbone(), compile=False, local_steps=1)
    rounds = [ref.make_round(3, classes=(3, 2), steps=1)]
    np.testing.assert_array_equal(client_update_norms(model, rounds), [0.0, 0.0])
    with pytest.raises(ValueError, match="local_steps"):
        suggest_clip_norm(model, rounds)
