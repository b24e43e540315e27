"""The compiled CPU kernels (paddleformers_glm/ops) against Paddle's own ops and numpy.

Each kernel has a Paddle-op fallback with the same maths; here both run on the same inputs, and
the loader's switches (environment, `disabled()`, a failed build) are exercised. The whole-model
parity tests run with the kernels on (the default), tests/test_perf_paths.py holds the RMSNorm and
the MoE to their fallbacks.
"""

import contextlib
import json
import os
import subprocess
import sys
import threading
import warnings

import numpy as np
import paddle
import pytest

from paddleformers_glm import ops as glm_ops
from paddleformers_glm.modeling import attention_forms as attn
from paddleformers_glm.ops import kernels as cpu_kernels


@pytest.fixture(scope="module")
def ops():
    built = cpu_kernels.cpu_ops()
    if built is None:  # a build failure is a failure here, never a skip
        pytest.fail(f"the CPU kernels did not build: {cpu_kernels._state['error']}")
    return built


def _mask(rng, shape, p_keep=0.5):
    m = np.where(rng.random(shape) < p_keep, 0.0, -np.inf).astype("float32")
    m[..., 0] = 0.0  # every row keeps a key
    return m


def _paddle_masked_softmax(s, m):
    with cpu_kernels.disabled():
        return glm_ops.masked_softmax_(s.clone(), m)


@pytest.mark.parametrize("shape", [(7, 4, 33), (3, 16, 513), (2, 3, 5, 40)])
def test_masked_softmax_matches_paddle_ops(ops, shape):
    """3-D s [G, H, T] with mask [G, T] (latent chunks) and 4-D s [B, H, S, T] with mask [B, S, T]
    (per-head dense): the mask is shared over the head axis; values to a few fp32 ulps."""
    rng = np.random.default_rng(0)
    s = paddle.to_tensor((4 * rng.standard_normal(shape)).astype("float32"))
    mshape = (shape[0],) + tuple(shape[2:])
    m = paddle.to_tensor(_mask(rng, mshape))
    want = _paddle_masked_softmax(s, m).numpy()
    got = s.clone()
    out = glm_ops.masked_softmax_(got, m)
    np.testing.assert_allclose(out.numpy(), want, rtol=2e-6, atol=1e-7)
    np.testing.assert_array_equal(got.numpy(), out.numpy())  # in place
    assert np.all(got.numpy()[np.broadcast_to(np.isinf(m.numpy())[:, None], shape)] == 0.0)


def test_masked_softmax_reads_a_row_slice_of_the_mask(ops):
    """The latent chunks pass mask rows r0:r1 of a larger table (a view at an offset)."""
    rng = np.random.default_rng(1)
    table = paddle.to_tensor(_mask(rng, (50, 64)))
    s = paddle.to_tensor(rng.standard_normal((10, 4, 64)).astype("float32"))
    m = table[20:30]
    want = _paddle_masked_softmax(s, m.contiguous()).numpy()
    np.testing.assert_allclose(glm_ops.masked_softmax_(s.clone(), m).numpy(), want, rtol=2e-6, atol=1e-7)


def test_masked_softmax_extreme_scores(ops):
    """Scores far apart (exp underflows to 0 for all but the largest) and large magnitudes."""
    s = paddle.to_tensor(np.array([[[1000.0, 0.0, -1000.0, 999.0], [-50.0, -50.0, -50.0, -50.0]]], "float32"))
    m = paddle.zeros([1, 4])
    got = glm_ops.masked_softmax_(s.clone(), m).numpy()
    e = np.exp(np.float64(1.0) * np.array([0.0, -1000.0, -2000.0, -1.0]))
    np.testing.assert_allclose(got[0, 0], e / e.sum(), rtol=1e-6, atol=1e-30)
    np.testing.assert_allclose(got[0, 1], np.full(4, 0.25), rtol=1e-7)


@pytest.mark.parametrize("shape", [(5, 4, 37), (64, 300)])
def test_softmax_backward_matches_paddle(ops, shape):
    rng = np.random.default_rng(2)
    p = paddle.nn.functional.softmax(paddle.to_tensor(rng.standard_normal(shape).astype("float32")), axis=-1)
    dp = paddle.to_tensor(rng.standard_normal(shape).astype("float32"))
    with cpu_kernels.disabled():
        want = glm_ops.softmax_backward(p, dp.clone()).numpy()
    pn, dpn = p.numpy().astype(np.float64), dp.numpy().astype(np.float64)
    exact = pn * (dpn - (pn * dpn).sum(-1, keepdims=True))
    got = glm_ops.softmax_backward(p, dp.clone()).numpy()
    np.testing.assert_allclose(got, exact, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(want, exact, rtol=1e-5, atol=1e-7)


def test_rms_norm_kernel_against_fp64(ops):
    """The fused RMSNorm forward is within 2 ulps of the exact (fp64) result; its gradients match
    the fp64 gradients to fp32 rounding."""
    rng = np.random.default_rng(3)
    x = (3 * rng.standard_normal((33, 96))).astype("float32")
    w = (1 + 0.3 * rng.standard_normal(96)).astype("float32")
    dy = rng.standard_normal((33, 96)).astype("float32")
    eps = 1e-5
    y, r = ops.glm_rms_norm(paddle.to_tensor(x), paddle.to_tensor(w), eps)
    x64, w64, dy64 = x.astype(np.float64), w.astype(np.float64), dy.astype(np.float64)
    r64 = 1 / np.sqrt((x64**2).mean(-1, keepdims=True) + eps)
    n64 = x64 * r64
    np.testing.assert_array_max_ulp(y.numpy(), (w64 * n64).astype("float32"), maxulp=2)
    np.testing.assert_allclose(r.numpy(), r64[:, 0], rtol=2e-7)
    dx, dw = ops.glm_rms_norm_backward(paddle.to_tensor(x), paddle.to_tensor(w), r, paddle.to_tensor(dy))
    gn = dy64 * w64
    dx64 = r64 * (gn - n64 * (gn * n64).mean(-1, keepdims=True))
    np.testing.assert_allclose(dx.numpy(), dx64, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(dw.numpy(), (dy64 * n64).sum(0), rtol=1e-5, atol=1e-6)


def test_rms_norm_frozen_input_or_weight_gets_no_gradient(ops):
    """A PyLayer must answer None for an input that needs no gradient (a frozen weight, a
    constant input); both the kernel and the fallback do."""
    from paddleformers_glm.modeling.norms import RMSNorm

    for off in (False, True):
        norm = RMSNorm(16)
        norm.weight.stop_gradient = True
        x = paddle.randn([3, 16])
        x.stop_gradient = False
        with cpu_kernels.disabled() if off else contextlib.nullcontext():
            norm(x).sum().backward()
        assert x.grad is not None and norm.weight.grad is None
        norm.weight.stop_gradient = False
        with cpu_kernels.disabled() if off else contextlib.nullcontext():
            norm(paddle.randn([3, 16])).sum().backward()
        assert norm.weight.grad is not None


def test_grouped_matmul_matches_per_group_numpy(ops):
    if not hasattr(ops, "glm_grouped_matmul"):
        pytest.fail("the grouped matmul was left out of the build (no libmklml_intel in Paddle's libs)")
    rng = np.random.default_rng(4)
    counts = [3, 0, 5, 1, 0, 7]
    A, K, N = sum(counts), 12, 10
    x = rng.standard_normal((A, K)).astype("float32")
    w = rng.standard_normal((len(counts), K, N)).astype("float32")
    dy = rng.standard_normal((A, N)).astype("float32")
    ws = [paddle.to_tensor(m) for m in w]
    y = ops.glm_grouped_matmul(paddle.to_tensor(x), ws, counts).numpy()
    dws = [paddle.full([K, N], float("nan")) for _ in counts]  # every element must be written
    dx = ops.glm_grouped_matmul_backward(paddle.to_tensor(x), ws, paddle.to_tensor(dy), dws, counts)[0]
    dw = np.stack([t.numpy() for t in dws])
    starts = np.concatenate([[0], np.cumsum(counts)])
    for e in range(len(counts)):
        rows = slice(starts[e], starts[e + 1])
        np.testing.assert_allclose(y[rows], x[rows] @ w[e], rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(dx.numpy()[rows], dy[rows] @ w[e].T, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(dw[e], x[rows].T @ dy[rows], rtol=1e-5, atol=1e-5)
    assert not np.any(dw[[1, 4]])  # experts without rows: zero gradient


def test_grouped_matmul_rejects_group_sizes_that_do_not_cover_the_rows(ops):
    x, w = paddle.zeros([5, 4]), [paddle.zeros([4, 3]), paddle.zeros([4, 3])]
    with pytest.raises(Exception, match="group sizes sum to 4 but x has 5 rows"):
        ops.glm_grouped_matmul(x, w, [1, 3])
    with pytest.raises(Exception, match="3 group sizes for 2 weight matrices"):
        ops.glm_grouped_matmul(x, w, [1, 3, 1])
    with pytest.raises(Exception, match=r"weight 1 is not \[4, 3\]"):
        ops.glm_grouped_matmul(x, [w[0], paddle.zeros([3, 3])], [2, 3])


def test_usable_only_for_fp32_contiguous_cpu_tensors(ops):
    a = paddle.zeros([4, 6])
    assert cpu_kernels.usable(a) is ops
    assert cpu_kernels.usable(a, a.astype("float64")) is None
    with cpu_kernels.disabled():
        assert cpu_kernels.usable(a) is None
    assert cpu_kernels.usable(a) is ops


def test_failed_build_warns_once_and_falls_back(monkeypatch):
    """No compiler, a compile error, ...: one RuntimeWarning naming the error, then the fallbacks."""
    monkeypatch.setattr(cpu_kernels, "_state", {"tried": False, "ops": None, "error": None, "off": 0})

    def broken(*a, **k):
        raise RuntimeError("g++: not found")

    monkeypatch.setattr(cpu_kernels, "build", broken)
    with pytest.warns(RuntimeWarning, match="could not be built.*g\\+\\+: not found"):
        assert cpu_kernels.cpu_ops() is None
    assert cpu_kernels.cpu_ops() is None and cpu_kernels.usable(paddle.zeros([2])) is None
    # and the model still runs (the fallbacks)
    s = paddle.to_tensor(np.random.default_rng(5).standard_normal((2, 3, 8)).astype("float32"))
    p = glm_ops.masked_softmax_(s, paddle.zeros([2, 8]))
    np.testing.assert_allclose(p.numpy().sum(-1), 1.0, rtol=1e-6)


@contextlib.contextmanager
def _fds_untouched():
    """Inside, any redirection of a file descriptor fails the test; on exit, fds 1 and 2 still
    name the files they named on entry."""

    def no_dup2(*a, **k):
        raise AssertionError("the loader redirected a file descriptor")

    before = [(os.fstat(fd).st_dev, os.fstat(fd).st_ino) for fd in (1, 2)]
    with pytest.MonkeyPatch.context() as m:
        m.setattr(os, "dup2", no_dup2)
        yield
    assert [(os.fstat(fd).st_dev, os.fstat(fd).st_ino) for fd in (1, 2)] == before


def test_a_compile_error_is_raised_by_build_and_logged_to_its_file(tmp_path, capfd):
    """The compiler's complaint goes to build.log (and the raised message), not to this process's
    stdout / stderr: fd-level capture sees none of it, and no fd is redirected."""
    bad = tmp_path / "bad.cc"
    bad.write_text("// no Paddle header: the compiler stops at once\nthis is not C++;\n")
    with _fds_untouched(), pytest.raises(RuntimeError, match="Failed to build bad.cc") as err:
        cpu_kernels.build(source=bad, cache_root=str(tmp_path / "cache"))
    logs = list((tmp_path / "cache").glob("*/build.log"))
    assert len(logs) == 1 and "this is not C++" in logs[0].read_text()
    assert "bad.cc:2" in str(err.value)  # the compiler's error line, in the message
    out, errs = capfd.readouterr()
    errs = "\n".join(ln for ln in errs.splitlines() if not ln.startswith("[glm52] building"))  # our announcement
    assert "this is not C++" not in out + errs and "error" not in (out + errs).lower()


def test_loading_a_built_library_leaves_the_fds_alone(ops):
    """A load of the built library (what every new process does) redirects no file descriptor and
    writes nothing to them: Paddle's loader messages go to build.log. (In a fresh process: a
    process registers the library's ops once.)"""
    code = (
        "import os, sys\n"
        "import paddle\n"  # Paddle's own import warns (no ccache): before the part under test
        "sys.stderr.write('MARK\\n')\n"
        "def no(*a, **k): raise AssertionError('a file descriptor was redirected')\n"
        "os.dup2 = no\n"
        "ids = lambda: [(os.fstat(fd).st_dev, os.fstat(fd).st_ino) for fd in (1, 2)]\n"
        "before = ids()\n"
        "from paddleformers_glm.ops import kernels\n"
        "ops = kernels.build()\n"
        "print('ok', hasattr(ops, 'glm_masked_softmax'), ids() == before)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout == "ok True True\n" and out.stderr.split("MARK\n", 1)[1] == "", (out.stdout, out.stderr)


def test_old_environment_names_still_work_with_a_deprecation_warning(monkeypatch, tmp_path):
    monkeypatch.delenv("GLM52_KERNEL_CACHE", raising=False)
    monkeypatch.setenv("PADDLEFORMERS_GLM_KERNEL_CACHE", str(tmp_path))
    with pytest.warns(DeprecationWarning, match="PADDLEFORMERS_GLM_KERNEL_CACHE is deprecated.*GLM52_KERNEL_CACHE"):
        assert cpu_kernels.env_setting("GLM52_KERNEL_CACHE") == str(tmp_path)
    monkeypatch.setenv("GLM52_KERNEL_CACHE", "new")  # the new name wins, no warning
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert cpu_kernels.env_setting("GLM52_KERNEL_CACHE") == "new"


def test_the_build_lock_is_exclusive(tmp_path):
    """A second holder waits until the first releases (fcntl here, msvcrt on Windows)."""
    lock = tmp_path / ".lock"
    order = []

    def second():
        with cpu_kernels._exclusive(lock):
            order.append("b")

    with cpu_kernels._exclusive(lock):
        t = threading.Thread(target=second)
        t.start()
        t.join(0.5)
        order.append("a")
        assert t.is_alive()  # still waiting for the lock
    t.join(10)
    assert order == ["a", "b"]


def test_environment_switch_turns_the_kernels_off():
    code = "from paddleformers_glm.ops import kernels as cpu; print('ops', cpu.cpu_ops() is None)"
    env = dict(os.environ, GLM52_CPU_KERNELS="0")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "ops True" in out.stdout


def test_a_built_library_loads_without_the_build_step(ops):
    """Once built (the `built` marker in its cache folder), a new process loads the library
    directly: Paddle's `load` (which runs a setup.py subprocess, ~2 s) is not called."""
    code = (
        "import paddle.utils.cpp_extension as ce\n"
        "def no(*a, **k): raise AssertionError('load was called')\n"
        "ce.load = no\n"
        "from paddleformers_glm.ops import kernels as cpu\n"
        "ops = cpu.build()\n"
        "print('ok', hasattr(ops, 'glm_masked_softmax'))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "ok True" in out.stdout


def test_head_matmul_reads_each_heads_first_columns(ops):
    """out[n, h] = a[n, h, :Din] @ w[h]; backward: da zero past Din, dw per head (numpy)."""
    if not hasattr(ops, "glm_head_matmul"):
        pytest.fail("the head matmul was left out of the build (no libmklml_intel in Paddle's libs)")
    rng = np.random.default_rng(6)
    N, H, D, Din, Dout = 37, 5, 11, 8, 6
    a = rng.standard_normal((N, H, D)).astype("float32")
    w = rng.standard_normal((H, Din, Dout)).astype("float32")
    g = rng.standard_normal((N, H, Dout)).astype("float32")
    out = ops.glm_head_matmul(paddle.to_tensor(a), paddle.to_tensor(w)).numpy()
    np.testing.assert_allclose(out, np.einsum("nhi,hio->nho", a[..., :Din], w), rtol=1e-5, atol=1e-5)
    da, dw = ops.glm_head_matmul_backward(paddle.to_tensor(a), paddle.to_tensor(w), paddle.to_tensor(g))
    np.testing.assert_allclose(da.numpy()[..., :Din], np.einsum("nho,hio->nhi", g, w), rtol=1e-5, atol=1e-5)
    assert not np.any(da.numpy()[..., Din:])
    np.testing.assert_allclose(dw.numpy(), np.einsum("nhi,nho->hio", a[..., :Din], g), rtol=1e-5, atol=1e-5)
    with pytest.raises(Exception, match="head matmul: weight"):
        ops.glm_head_matmul(paddle.to_tensor(a), paddle.zeros([H, D + 1, Dout]))


def test_latent_attention_output_projection_same_with_and_without_kernels():
    """The latent form's output side: W_uv per head + o_proj (kernels) against W_uv folded into
    o_proj (Paddle ops), through a whole model: logits and every gradient to fp32 rounding."""
    from tests._tiny import tiny_model, tokens

    model = tiny_model(seed=3)
    model.set_attn_implementation("latent")
    ids = tokens(2, 29, seed=4)
    res = []
    for off in (True, False):
        model.clear_gradients()
        with cpu_kernels.disabled() if off else contextlib.nullcontext():
            out = model(ids, labels=ids)
            out.loss.backward()
        grads = {n: p.grad.numpy() for n, p in model.named_parameters() if p.grad is not None}
        res.append((out.logits.numpy(), grads))
    np.testing.assert_allclose(res[1][0], res[0][0], rtol=1e-5, atol=1e-5)
    assert res[0][1].keys() == res[1][1].keys()
    for name, ref in res[0][1].items():
        np.testing.assert_allclose(
            res[1][1][name], ref, rtol=1e-4, atol=1e-5 * max(1.0, float(np.abs(ref).max())), err_msg=name
        )


def test_cross_entropy_kernel_matches_paddle_and_fp64(ops):
    """causal_lm_loss with the kernel against Paddle's cross_entropy and an fp64 reference:
    ignored (-100) rows give no loss and no gradient; a label outside the vocabulary is an error
    naming it."""
    from paddleformers_glm.modeling.model import causal_lm_loss

    rng = np.random.default_rng(7)
    x0 = (4 * rng.standard_normal((2, 11, 37))).astype("float32")
    labels = rng.integers(0, 37, (2, 11))
    labels[0, 4] = labels[1, 7] = -100
    res = []
    for off in (True, False):
        x = paddle.to_tensor(x0, stop_gradient=False)
        with cpu_kernels.disabled() if off else contextlib.nullcontext():
            loss = causal_lm_loss(x, paddle.to_tensor(labels))
            loss.backward()
        res.append((float(loss), x.grad.numpy()))
    target = np.concatenate([labels[:, 1:], np.full((2, 1), -100)], 1).reshape(-1)
    logits = x0.reshape(-1, 37).astype(np.float64)
    lse = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    keep = target != -100
    exact = (lse[keep] - logits[keep, target[keep]]).mean()
    assert abs(res[1][0] - exact) < 1e-5 and abs(res[0][0] - exact) < 1e-5
    np.testing.assert_allclose(res[1][1], res[0][1], rtol=1e-5, atol=1e-7)
    assert not np.any(res[1][1].reshape(-1, 37)[~keep])
    bad = labels.copy()
    bad[1, 2] = 37
    with pytest.raises(Exception, match="target 37 at row 12 is outside the vocabulary"):
        causal_lm_loss(paddle.to_tensor(x0), paddle.to_tensor(bad))


def _topk_with_gaps(rng, B, S, K):
    """A causal top-k [B, S, K] with empty slots (-1) and, in batch 0, queries without any key
    (left padding)."""
    t = np.full((B, S, K), -1, np.int64)
    for b in range(B):
        for i in range(S):
            if b == 0 and i < 3:
                continue  # no key at all
            n = min(i + 1, K) - (i % 3 == 0)
            t[b, i, :n] = rng.choice(i + 1, n, replace=False)
    return paddle.to_tensor(t)


def test_topk_tables_and_masks_equal_the_paddle_op_forms(ops):
    """prepare_topk's index tables, the dense chunks' masks and the per-head dense mask: the
    kernels give exactly the Paddle-op forms (empty slots, queries without keys included)."""
    rng = np.random.default_rng(8)
    B, S, K = 2, 23, 6
    topk = _topk_with_gaps(rng, B, S, K)
    got = attn.prepare_topk(topk)
    with cpu_kernels.disabled():
        want = attn.prepare_topk(topk)
    for name in ("rows", "mask", "sel", "has_key"):
        np.testing.assert_array_equal(getattr(got, name).numpy(), getattr(want, name).numpy(), err_msg=name)
    for r0, r1, c1 in ((0, 8, 8), (8, 23, 23), (23, 30, 7)):
        sel, has = got.sel[r0:r1], got.has_key[r0:r1]
        kernel = glm_ops.candidate_mask(sel, has, c1)
        with cpu_kernels.disabled():
            ref = glm_ops.candidate_mask(sel, has, c1)
        np.testing.assert_array_equal(kernel.numpy(), ref.numpy())
    d = attn.dense_topk_mask(topk, S)
    with cpu_kernels.disabled():
        ref = attn.dense_topk_mask(topk, S)
    np.testing.assert_array_equal(d.numpy(), ref.numpy())
    with pytest.raises(Exception, match="selected column 7 in row 0 is not below 5"):
        ops.glm_selection_mask(paddle.to_tensor(np.array([[7, -1]], np.int64)), 5, 0.0, True)


def test_selection_ops_take_int32_ids_and_no_rows(ops):
    """An int32 top-k (what a caller's own top-k may give) raised the kernel's dtype error in
    topk_tables, selection_mask and candidate_mask, and a [B, 0, k] one topk_tables' "0 rows are not
    whole batches" error; int32 gives what int64 gives, and no rows give empty tables, as the
    Paddle-op form does."""
    topk = _topk_with_gaps(np.random.default_rng(3), 2, 9, 4)
    want = glm_ops.topk_tables(topk)
    got = glm_ops.topk_tables(topk.astype("int32"))
    has_key = want[2]
    sel = topk.reshape([18, 4])
    for w, g in (
        *zip(want, got),
        (glm_ops.selection_mask(sel, 9, -1.0), glm_ops.selection_mask(sel.astype("int32"), 9, -1.0)),
        (glm_ops.candidate_mask(sel, has_key, 9), glm_ops.candidate_mask(sel.astype("int32"), has_key, 9)),
    ):
        assert g.dtype == w.dtype
        np.testing.assert_array_equal(g.numpy(), w.numpy())
    for shape in ([1, 0, 4], [0, 5, 4]):
        rows, mask, has_key = glm_ops.topk_tables(paddle.zeros(shape, "int64"))
        assert (rows.shape, mask.shape, has_key.shape) == ([0, 4], [0, 4], [0])


@pytest.mark.parametrize("interleave", [True, False])
@pytest.mark.parametrize("rope_first", [True, False])
@pytest.mark.parametrize("heads", [None, 3])
def test_rope_concat_is_bitwise_rope_heads_and_concat(ops, interleave, rope_first, heads):
    """The fused rope + concat against rope_heads + concat (the fallback): forward bitwise (no
    contracted multiply-adds), gradients of both inputs to rounding; cos/sin per batch."""
    from paddleformers_glm.ops import rope_concat

    rng = np.random.default_rng(9)
    B, S, Da, Dr = 2, 7, 5, 8
    lead = (B, S) if heads is None else (B, S, heads)
    a0 = rng.standard_normal(lead + (Da,)).astype("float32")
    r0 = rng.standard_normal(lead + (Dr,)).astype("float32")
    ang = rng.standard_normal((B, S, Dr // 2)).astype("float32")
    cos, sin = paddle.to_tensor(np.cos(ang)), paddle.to_tensor(np.sin(ang))
    g = paddle.to_tensor(rng.standard_normal(lead + (Da + Dr,)).astype("float32"))
    res = []
    for off in (True, False):
        a, r = paddle.to_tensor(a0, stop_gradient=False), paddle.to_tensor(r0, stop_gradient=False)
        with cpu_kernels.disabled() if off else contextlib.nullcontext():
            out = rope_concat(a, r, cos, sin, interleave, rope_first)
            (out * g).sum().backward()
        res.append((out.numpy(), a.grad.numpy(), r.grad.numpy()))
    np.testing.assert_array_equal(res[1][0], res[0][0])
    np.testing.assert_array_equal(res[1][1], res[0][1])
    np.testing.assert_allclose(res[1][2], res[0][2], rtol=1e-6, atol=1e-7)


def test_a_build_says_so_while_it_runs(tmp_path, capfd, monkeypatch):
    """A first use compiles for a while: one line says so before the compiler starts (and says
    nothing under GLM52_QUIET=1)."""
    bad = tmp_path / "bad.cc"
    bad.write_text('#include "paddle/extension.h"\nthis is not C++;\n')
    seen = {}

    def spy(*a, **k):  # stands in for the compiler: what was printed before it would start
        seen["err_before_compiler"] = capfd.readouterr().err
        raise RuntimeError("the compiler is not run by this test")

    monkeypatch.setattr(cpu_kernels, "_compile", spy)
    monkeypatch.delenv("GLM52_QUIET", raising=False)
    with pytest.raises(RuntimeError):
        cpu_kernels.build(source=bad, cache_root=str(tmp_path / "cache"))
    assert "[glm52] building the CPU kernels" in seen["err_before_compiler"]
    monkeypatch.setenv("GLM52_QUIET", "1")
    with pytest.raises(RuntimeError):
        cpu_kernels.build(source=bad, cache_root=str(tmp_path / "cache2"))
    assert "building" not in seen["err_before_compiler"]


# ------------------------------------------------------------------ non-finite inputs
def _both(fn):
    """fn() with the kernels, then with the Paddle-op fallbacks."""
    out = [fn()]
    with cpu_kernels.disabled():
        out.append(fn())
    return out


def _same_nonfinite(a, b, what):
    """The same elements are non-finite (NaN and inf are both 'not a number you can train on')."""
    a, b = np.asarray(a), np.asarray(b)
    np.testing.assert_array_equal(np.isfinite(a), np.isfinite(b), err_msg=what)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_kernels_and_fallbacks_agree_on_nonfinite_inputs(ops, bad):
    """One NaN / +inf / -inf in the input: every op gives non-finite values at the same places with
    the kernel and with its fallback, forward and gradients, and never a finite loss where the
    exact value is not.  Paddle's CPU cross_entropy and softmax skip a NaN or +inf in a row (a NaN
    row's loss came out 2.649, torch's is nan): the fallbacks mark those rows themselves."""
    rng = np.random.default_rng(10)

    def ce(col):
        x0 = rng.standard_normal((4, 9)).astype("float32")
        x0[1, col] = bad
        target = np.array([0, 3, 5, -100])

        def run():
            x = paddle.to_tensor(x0, stop_gradient=False)
            loss = glm_ops.cross_entropy_sum(x, paddle.to_tensor(target), -100)
            loss.backward()
            return float(loss), x.grad.numpy()

        return run

    for col, what in ((3, "target logit"), (1, "another logit")):
        (lk, gk), (lf, gf) = _both(ce(col))
        _same_nonfinite(lk, lf, f"cross entropy loss, {what} {bad}")
        _same_nonfinite(gk, gf, f"cross entropy grad, {what} {bad}")
        exact_finite = bad == -np.inf and col != 3  # -inf on a non-target logit only drops it
        assert np.isfinite(lk) == exact_finite, (what, lk)

    x0 = rng.standard_normal((4, 16)).astype("float32")
    x0[1, 3] = bad

    def norm_and_swiglu():
        x = paddle.to_tensor(x0, stop_gradient=False)
        w = paddle.to_tensor(np.ones(16, "float32"), stop_gradient=False)
        y = glm_ops.rms_norm(x, w, 1e-6)
        s = glm_ops.swiglu(x)
        (y.sum() + s.sum()).backward()
        return y.numpy(), s.numpy(), x.grad.numpy(), w.grad.numpy()

    for name, k, f in zip(("rms_norm", "swiglu", "d input", "d weight"), *_both(norm_and_swiglu)):
        _same_nonfinite(k, f, f"{name} with {bad}")

    s0 = rng.standard_normal((2, 3, 8)).astype("float32")
    s0[0, 1, 2] = bad
    m0 = _mask(rng, (2, 8))
    k, f = _both(lambda: glm_ops.masked_softmax_(paddle.to_tensor(s0), paddle.to_tensor(m0)).numpy())
    _same_nonfinite(k, f, f"masked softmax with {bad}")
    assert np.isfinite(k[0, 1]).all() == (bad == -np.inf)  # NaN / +inf in a row: the whole row NaN

    p0 = np.full((2, 8), 1 / 8, "float32")
    d0 = rng.standard_normal((2, 8)).astype("float32")
    d0[0, 1] = bad
    k, f = _both(lambda: glm_ops.softmax_backward(paddle.to_tensor(p0), paddle.to_tensor(d0)).numpy())
    _same_nonfinite(k, f, f"softmax backward with {bad}")


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_a_nonfinite_lm_head_gives_a_nonfinite_loss_with_and_without_kernels(ops, bad):
    """The whole model with one NaN / inf in lm_head: the loss is non-finite either way (measured
    before the fallbacks were fixed: nan with the kernels, 5.545177 = ln V without)."""
    from tests._tiny import tiny_model, tokens

    model = tiny_model(seed=1)
    w = model.lm_head.weight
    w0 = w.numpy()
    w0[3, 5] = bad
    w.set_value(w0)
    ids = tokens(2, 16, seed=2)
    k, f = _both(lambda: float(model(ids, labels=ids).loss))
    assert not np.isfinite(k) and not np.isfinite(f), (k, f)


def _torch_rows():
    """torch's own cross-entropy and softmax on non-finite rows (tools/make_nonfinite_reference.py)."""
    path = os.path.join(os.path.dirname(__file__), "fixtures", "nonfinite", "torch_rows.json")
    with open(path) as f:
        rec = json.load(f)

    def dec(v):
        return np.array(v, dtype=object).astype("float32")  # "nan"/"inf"/"-inf" strings parse as floats

    return rec, dec


def test_the_fallback_cross_entropy_and_softmax_match_torch_on_nonfinite_rows():
    """torch (the reference, recorded in the fixture) on the same rows: which losses, gradient rows
    and probabilities are finite, and the finite values themselves."""
    rec, dec = _torch_rows()
    x0, target = dec(rec["logits"]), np.array(rec["target"])
    want_loss, want_probs = dec(rec["cross_entropy"]), dec(rec["softmax"])
    with cpu_kernels.disabled():
        x = paddle.to_tensor(x0, stop_gradient=False)
        rows = paddle.nn.functional.cross_entropy(x, paddle.to_tensor(target).unsqueeze(-1), reduction="none")
        lp = glm_ops.loss.with_nonfinite_rows(rows.squeeze(-1), x, paddle.to_tensor(target), -100)
        got = lp.numpy()
        np.testing.assert_array_equal(np.isfinite(got), np.isfinite(want_loss))
        np.testing.assert_array_equal(np.isnan(got), np.isnan(want_loss))
        np.testing.assert_array_equal(got[np.isinf(want_loss)], want_loss[np.isinf(want_loss)])
        fin = np.isfinite(want_loss)
        np.testing.assert_allclose(got[fin], want_loss[fin], rtol=1e-6)
        pp = glm_ops.masked_softmax_(paddle.to_tensor(x0[None]), paddle.zeros([1, 3]))[0].numpy()
    np.testing.assert_array_equal(np.isfinite(pp), np.isfinite(want_probs))
    fin = np.isfinite(want_probs)
    np.testing.assert_allclose(pp[fin], want_probs[fin], rtol=1e-6, atol=1e-7)


@pytest.mark.reference
def test_the_nonfinite_rows_fixture_is_what_torch_computes():
    """The fixture above is torch's current output (regenerated live; needs the reference extra)."""
    pytest.importorskip("torch", reason="the reference extra (torch) is not installed")
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "tools"))
    try:
        import make_nonfinite_reference as maker
    finally:
        sys.path.pop(0)
    rec, _ = _torch_rows()
    assert maker.build() == rec
