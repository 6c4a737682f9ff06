"""Noisy sufficient statistics and solvers of the closed-form last-layer methods.

NumPy, float64, on the host: the statistics are sums over all examples
(`X̃ᵀX̃`, per-class sums, the logistic gradient and per-class Hessians),
each released once with its own Gaussian noise.
Features are first clipped to norm `C_x`; the sensitivities below are for
adding or removing one example:

| statistic | shape | sensitivity |
|---|---|---|
| Gram matrix `X̃ᵀX̃` | d × d | C_x² |
| per-class sums `X̃ᵀY` (Y one-hot) | d × K | C_x |
| logistic gradient `X̃ᵀ(P − Y)` | d × K | √2 · C_x |
| per-class Hessians `X̃ᵀ diag(p_c(1 − p_c)) X̃` | K × d × d | C_x² / 2 |

The gradient bound: one example adds `x (p − y)ᵀ`, whose Frobenius norm is
`‖x‖ · ‖p − y‖ ≤ C_x √2`. The Hessians: one example adds
`p_c(1 − p_c) x xᵀ` to class c, so the stack moves by
`‖x‖² (Σ_c p_c²(1 − p_c)²)^½`, and `Σ_c p_c²(1 − p_c)² ≤ ¼ Σ_c p_c(1 − p_c)
≤ ¼`. A symmetric matrix gets noise on its upper triangle (diagonal
included), mirrored: the upper triangle of `x xᵀ` has norm at most
`‖x xᵀ‖_F = ‖x‖²`, so the sensitivity of the matrix carries over.

At user level (`LastLayerDPClassifier(unit="user")`) each example of a
user's chosen n_u ≤ k has weight 1 / n_u (`row_weights`): a user's share
of a statistic is a convex combination of per-example terms, so its norm
is bounded as one example's is, and the sensitivities above hold for
adding or removing one user.

The noise is added by the solvers (`last_layer_solvers`) with
`kdpemb.privacy.host_noise`, from each statistic's `GaussianRelease`.
"""

import numpy as np

GRAM_SENSITIVITY = 1.0  # × C_x²
CLASS_SUMS_SENSITIVITY = 1.0  # × C_x
GRADIENT_SENSITIVITY = float(np.sqrt(2.0))  # × C_x
HESSIANS_SENSITIVITY = 0.5  # × C_x²

_BLOCK = 8192  # Rows per block: bounds the float64 copies of the features.


def clip_rows(features, clip_norm):
    """Rows scaled to L2 norm at most `clip_norm` (float64); None: unchanged.

    >>> clip_rows(np.array([[3.0, 4.0], [0.3, 0.4]]), 1.0).round(2).tolist()
    [[0.6, 0.8], [0.3, 0.4]]
    """
    features = np.asarray(features, dtype=np.float64)
    if clip_norm is None:
        return features
    norms = np.linalg.norm(features, axis=1, keepdims=True)
    return features * np.minimum(1.0, clip_norm / np.maximum(norms, 1e-300))


def _blocks(features, clip_norm, row_weights=None):
    """`(start, clipped rows, their weights or None)` of float64 blocks."""
    for start in range(0, len(features), _BLOCK):
        block = clip_rows(features[start : start + _BLOCK], clip_norm)
        rows = None if row_weights is None else row_weights[start : start + _BLOCK]
        yield start, block, None if rows is None else rows[:, None]


def gram(features, clip_norm, row_weights=None):
    """`X̃ᵀX̃` of the clipped features, accumulated in float64 blocks.

    `row_weights` [N] (e.g. 1 / n_u for the examples of a user's mean):
    `X̃ᵀ diag(w) X̃`. Likewise for the statistics below.
    """
    d = features.shape[1]
    total = np.zeros((d, d))
    for _, block, w in _blocks(features, clip_norm, row_weights):
        total += (block if w is None else block * w).T @ block
    return total


def class_sums(features, labels, num_classes, clip_norm, row_weights=None):
    """`X̃ᵀY`: column c is the sum of the clipped features of class c."""
    total = np.zeros((features.shape[1], num_classes))
    for start, block, w in _blocks(features, clip_norm, row_weights):
        rows = block if w is None else block * w
        np.add.at(total.T, labels[start : start + len(block)], rows)
    return total


def logistic_statistics(
    features, labels, weights, clip_norm, hessians=True, row_weights=None
):
    """Gradient `X̃ᵀ(P − Y)` [d, K] and per-class Hessians [K, d, d] at `weights`.

    P = softmax(X̃ W). The Hessians are the diagonal blocks of the
    multinomial logistic Hessian, `X̃ᵀ diag(p_c (1 − p_c)) X̃` per class.
    """
    d, num_classes = weights.shape
    gradient = np.zeros((d, num_classes))
    blocks = np.zeros((num_classes, d, d)) if hessians else None
    for start, block, w in _blocks(features, clip_norm, row_weights):
        logits = block @ weights
        logits -= logits.max(axis=1, keepdims=True)
        probs = np.exp(logits)
        probs /= probs.sum(axis=1, keepdims=True)
        residual = probs.copy()
        residual[np.arange(len(block)), labels[start : start + len(block)]] -= 1.0
        gradient += block.T @ (residual if w is None else residual * w)
        if hessians:
            curvature = probs * (1.0 - probs) * (1.0 if w is None else w)
            for c in range(num_classes):
                blocks[c] += (block * curvature[:, c : c + 1]).T @ block
    return gradient, blocks


def make_psd(matrix, floor=0.0):
    """The symmetric matrix with eigenvalues below `floor` raised to it.

    Noise can make a released Gram matrix or Hessian indefinite; solving
    with it would then amplify noise without bound. Post-processing, so
    it costs no privacy.

    >>> make_psd(np.array([[1.0, 0.0], [0.0, -2.0]])).tolist()
    [[1.0, 0.0], [0.0, 0.0]]
    """
    matrix = (matrix + np.swapaxes(matrix, -1, -2)) / 2
    values, vectors = np.linalg.eigh(matrix)
    values = np.maximum(values, floor)
    return (vectors * values[..., None, :]) @ np.swapaxes(vectors, -1, -2)


def solve_ridge(matrix, right_hand_side, ridge):
    """`(matrix + ridge · I)⁻¹ right_hand_side`; a least-squares solve if singular."""
    system = matrix + ridge * np.eye(matrix.shape[-1])
    try:
        return np.linalg.solve(system, right_hand_side)
    except np.linalg.LinAlgError:
        return np.linalg.lstsq(system, right_hand_side, rcond=None)[0]
