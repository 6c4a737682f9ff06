"""`model.fit` with ε in the logs and a hard stop at a privacy budget.

kdpemb's DP models (`FedEmbModel`, `LastLayerDPClassifier`, `DPModel`)
implement the privacy protocol; to show the callback alone in seconds,
this uses `kdpemb.testing.ToyDPRegressor`, a linear regressor trained
with real Poisson-sampled DP-SGD (the guides show the callback on the
real models).

Run: python examples/privacy_budget_fit.py
"""

import kdpemb
from kdpemb.callbacks import PrivacyBudget


def main():
    model = kdpemb.testing.ToyDPRegressor(
        num_examples=512,
        num_features=8,
        noise_multiplier=1.2,
        sampling_probability=0.05,
        clip_norm=1.0,
    )
    model.compile(optimizer="sgd")
    data = kdpemb.testing.toy_regression_data(512, 8, steps_per_epoch=50)
    budget = PrivacyBudget(delta=1e-4, target_epsilon=2.0)
    history = model.fit(data, epochs=50, callbacks=[budget], verbose=2)
    print("ε per epoch:", [round(e, 3) for e in history.history["epsilon"]])
    print(budget.statement)


if __name__ == "__main__":
    main()
