"""Cross entropy of a target far below the row's best logit (more than 64 nats): the exact
-log softmax, as torch's (HF's) cross entropy and the compiled kernel give, on every path.

Paddle 3.3's CPU ``cross_entropy`` clips the shifted logits x - max at -64 before its softmax, so a
target more than 64 below the row's max got the loss 64 + log(sum): measured 64.0 where torch gives
100.0 (logits [0, -100, -70], target 1) and 64.0 for 112.0 ([88, 89, 200], target 0). That is the
fallback of ``ops.cross_entropy_sum`` (kernels off, no compiler) and, kernels or not, the trainer's
loss at tp 1 (``parallel_cross_entropy``, F.cross_entropy). The gradient was already right (the
clipped probabilities are within e^-64 of the exact ones). At tp 2 (Fleet's ParallelCrossEntropy, two
CPU ranks) the same rows gave the exact 100.313 and 112.0 (logits [0, -100, -70, -1] and
[88, 89, 200, 0]), so the trainer's loss depended on the layout; tp 1 now gives the same values.
"""

from __future__ import annotations

import numpy as np
import paddle
import pytest

from paddleformers_glm import ops
from paddleformers_glm.parallel.layers import parallel_cross_entropy

LOGITS = np.array(
    [[0.0, -100.0, -70.0], [88.0, 89.0, 200.0], [1.0, 2.0, 3.0], [0.0, -64.0, -1.0], [5.0, -1e30, 0.0]], np.float32
)
TARGET = np.array([1, 0, 0, 1, 1], np.int64)


def _exact() -> np.ndarray:
    """-log softmax(x)[t] in float64: logsumexp(x) - x[t]."""
    x = LOGITS.astype(np.float64)
    m = x.max(-1)
    lse = m + np.log(np.exp(x - m[:, None]).sum(-1))
    return lse - x[np.arange(len(x)), TARGET]


def _grad_exact() -> np.ndarray:
    x = LOGITS.astype(np.float64)
    p = np.exp(x - x.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    p[np.arange(len(x)), TARGET] -= 1.0
    return p


def _per_row(fn) -> tuple[np.ndarray, np.ndarray]:
    rows, grads = [], []
    for i in range(len(LOGITS)):
        x = paddle.to_tensor(LOGITS[i : i + 1], stop_gradient=False)
        loss = fn(x, paddle.to_tensor(TARGET[i : i + 1]))
        loss.backward()
        rows.append(float(loss))
        grads.append(x.grad.numpy()[0])
    return np.array(rows), np.array(grads)


@pytest.mark.parametrize(
    "path",
    ["kernel", "fallback", "trainer"],
)
def test_a_target_far_below_the_max_gets_its_exact_loss(path):
    if path == "trainer":
        fn = lambda x, t: parallel_cross_entropy(x, t, ignore_index=-100, reduction="sum")  # noqa: E731
    else:
        fn = lambda x, t: ops.cross_entropy_sum(x, t, -100)  # noqa: E731
    if path == "fallback":
        with ops.disabled():
            got, grad = _per_row(fn)
    else:
        got, grad = _per_row(fn)
    # before (fallback, trainer): 64.0 for 100.0 and 64.0 for 112.0; 1e30 became 64.0 too
    np.testing.assert_allclose(got, _exact(), rtol=1e-6)
    np.testing.assert_allclose(grad, _grad_exact(), rtol=1e-5, atol=1e-7)


def test_the_exact_loss_is_torchs():
    """The semantic pinned above is torch's (HF's loss) on the same rows."""
    torch = pytest.importorskip("torch")
    want = torch.nn.functional.cross_entropy(torch.tensor(LOGITS), torch.tensor(TARGET), reduction="none").numpy()
    np.testing.assert_allclose(want, _exact(), rtol=1e-6)
