"""``DSACache``'s part of transformers' ``Cache`` interface: ``get_seq_length(layer_idx)``, ``len``,
``crop``, ``batch_select_indices``, ``batch_repeat_interleave``, ``get_max_length``, as transformers
5.23's ``DynamicCache`` has them (measured on the tiny checkpoint's cache there, a
``DynamicCache`` of ``DynamicIndexedLayer``s):

- ``len(cache)`` 8 (num_hidden_layers); ``get_seq_length(i)`` the length for 0 <= i < 8 and for
  -8 <= i < 0, 0 for i >= 8, IndexError below -8; keyword ``layer_idx`` too.
- ``crop(n)``: n < 0 removes -n tokens (all of them when -n exceeds the length: length 0), 0 nothing,
  n > 0 ValueError ("Calling `crop` with a positive value ... is not supported"); continuing after
  ``crop(-2)`` gives the uncached forward's logits (within 4e-6 there).
- ``batch_select_indices(idx)``: keeps rows idx in that order (a list, a tensor, repeats, a bool
  mask), an index out of range IndexError; ``batch_repeat_interleave(k)`` each row k times;
  continuing either gives the uncached forward's logits of those rows.
- ``get_max_length()`` -1 (no maximum: the cache grows), with or without ``layer_idx``.

The model-independent tests check against the uncached forward; the ``reference`` test against
transformers' own cache live.
"""

from __future__ import annotations

import numpy as np
import paddle
import pytest

from paddleformers_glm.modeling import GlmMoeDsaForCausalLM
from paddleformers_glm.modeling.cache import DSACache

from .conftest import FIXTURES

CKPT = FIXTURES / "tiny" / "checkpoint"


@pytest.fixture(scope="module")
def model():
    m = GlmMoeDsaForCausalLM.from_pretrained(CKPT, dtype="float32")
    m.eval()
    return m


def _ids(B=3, S=12, seed=0):
    return np.random.default_rng(seed).integers(3, 256, (B, S)).astype("int64")


def _cache(model, ids, n):
    return model(paddle.to_tensor(ids[:, :n])).past_key_values


def _uncached(model, ids):
    return model(paddle.to_tensor(ids), use_cache=False).logits.numpy()


def test_seq_length_per_layer_and_len_as_transformers(model):
    cache = _cache(model, _ids(), 8)
    L = model.config.num_hidden_layers
    assert len(cache) == L == 8
    for i in (0, 3, L - 1, -1, -L):
        assert cache.get_seq_length(i) == cache.get_seq_length(layer_idx=i) == 8
    assert cache.get_seq_length() == 8
    assert cache.get_seq_length(L) == cache.get_seq_length(100) == 0  # a layer the cache has no states of
    with pytest.raises(IndexError):
        cache.get_seq_length(-L - 1)
    assert cache.get_max_length() == cache.get_max_length(0) == cache.get_max_length(100) == -1


def test_crop_removes_the_last_tokens_and_the_forward_continues(model):
    ids = _ids()
    cache = _cache(model, ids, 8)
    cache.crop(0)
    assert cache.get_seq_length() == 8
    with pytest.raises(ValueError, match="positive value"):
        cache.crop(3)
    assert cache.get_seq_length() == 8
    cache.crop(-2)
    assert cache.get_seq_length() == 6
    got = model(paddle.to_tensor(ids[:, 6:9]), past_key_values=cache).logits.numpy()
    np.testing.assert_allclose(got, _uncached(model, ids[:, :9])[:, 6:9], atol=2e-5)
    cache.crop(-20)  # more than it holds: empty, as transformers
    assert cache.get_seq_length() == 0
    got = model(paddle.to_tensor(ids[:, :4]), past_key_values=cache).logits.numpy()
    np.testing.assert_allclose(got, _uncached(model, ids[:, :4]), atol=2e-5)


def test_crop_of_a_left_padded_cache_keeps_each_rows_positions(model):
    """crop counts slots; each row's rope position goes back by its real tokens among them, so the
    continued row decodes as the row alone would."""
    ids = _ids(2, 10, seed=4)
    mask = np.ones((2, 10), "int64")
    mask[0, :3] = 0
    cache = model(paddle.to_tensor(ids[:, :7]), attention_mask=paddle.to_tensor(mask[:, :7])).past_key_values
    cache.crop(-2)
    got = model(
        paddle.to_tensor(ids[:, 5:10]), attention_mask=paddle.to_tensor(mask), past_key_values=cache
    ).logits.numpy()
    alone = _uncached(model, ids[:1, 3:10])  # row 0 without its padding
    np.testing.assert_allclose(got[0], alone[0, 2:], atol=2e-5)
    np.testing.assert_allclose(got[1], _uncached(model, ids[1:])[0, 5:], atol=2e-5)


@pytest.mark.parametrize(
    "indices, rows",
    [([2, 0], [2, 0]), ("tensor", [1, 1]), ("bool", [0, 2]), ([-1], [2])],
    ids=["list", "tensor-repeats", "bool-mask", "negative"],
)
def test_batch_select_indices_keeps_those_rows(model, indices, rows):
    ids = _ids()
    cache = _cache(model, ids, 8)
    if indices == "tensor":
        indices = paddle.to_tensor([1, 1])
    elif indices == "bool":
        indices = paddle.to_tensor([True, False, True])
    cache.batch_select_indices(indices)
    assert cache.batch_size == len(rows) and cache.get_seq_length() == 8
    got = model(paddle.to_tensor(ids[rows, 8:10]), past_key_values=cache).logits.numpy()
    np.testing.assert_allclose(got, _uncached(model, ids[rows, :10])[:, 8:10], atol=2e-5)


def test_batch_select_indices_out_of_range_and_repeat_interleave(model):
    ids = _ids()
    cache = _cache(model, ids, 8)
    with pytest.raises(IndexError, match="out of bounds"):
        cache.batch_select_indices([5])
    assert cache.batch_size == 3
    cache.batch_repeat_interleave(2)
    rep = np.repeat(ids, 2, axis=0)
    got = model(paddle.to_tensor(rep[:, 8:10]), past_key_values=cache).logits.numpy()
    np.testing.assert_allclose(got, _uncached(model, rep[:, :10])[:, 8:10], atol=2e-5)


def test_reserve_grows_without_losing_rows(model):
    ids = _ids()
    cache = _cache(model, ids, 8)
    before = cache.layers[0].latent[:, :8].numpy()
    cache.reserve(40)
    assert cache.capacity == 40 and cache.key_valid.shape[1] == 40 and cache.layers[0].latent.shape[1] == 40
    np.testing.assert_array_equal(cache.layers[0].latent[:, :8].numpy(), before)
    got = model(paddle.to_tensor(ids[:, 8:10]), past_key_values=cache).logits.numpy()
    np.testing.assert_allclose(got, _uncached(model, ids[:, :10])[:, 8:10], atol=2e-5)
    empty = DSACache(2, 1)
    empty.reserve(5)
    assert empty.capacity == 5 and empty.key_valid is None  # allocated by the first forward


@pytest.mark.reference
def test_cache_api_equals_transformers_dynamic_cache(model):
    """The same calls on transformers 5.23's cache of the same checkpoint: the same lengths, the same
    refusals, and the continued forward's logits equal."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    hf = transformers.GlmMoeDsaForCausalLM.from_pretrained(
        str(CKPT), dtype=torch.float32, attn_implementation="eager"
    ).eval()
    ids = _ids()
    T = torch.tensor(ids)
    with torch.no_grad():
        theirs = hf(T[:, :8]).past_key_values
    ours = _cache(model, ids, 8)
    assert len(ours) == len(theirs)
    for i in (0, 5, 7, 8, 100, -1, -8):
        assert ours.get_seq_length(i) == theirs.get_seq_length(i), i
        assert ours.get_seq_length(layer_idx=i) == theirs.get_seq_length(layer_idx=i), i
    for c in (ours, theirs):
        with pytest.raises(IndexError):
            c.get_seq_length(-9)
        with pytest.raises(ValueError, match="positive value"):
            c.crop(3)
    assert ours.get_max_length() == theirs.get_max_length() and ours.get_max_length(3) == theirs.get_max_length(3)
    for c in (ours, theirs):
        c.crop(0)
        c.crop(-2)
    assert ours.get_seq_length() == theirs.get_seq_length() == 6
    with torch.no_grad():
        want = hf(T[:, 6:9], past_key_values=theirs).logits.numpy()
    got = model(paddle.to_tensor(ids[:, 6:9]), past_key_values=ours).logits.numpy()
    np.testing.assert_allclose(got, want, atol=2e-5)
    for c, idx in ((ours, paddle.to_tensor([2, 0])), (theirs, torch.tensor([2, 0]))):
        c.batch_select_indices(idx)
        c.batch_repeat_interleave(2)
    rows = [2, 2, 0, 0]
    with torch.no_grad():
        want = hf(T[rows, 9:11], past_key_values=theirs).logits.numpy()
    got = model(paddle.to_tensor(ids[rows, 9:11]), past_key_values=ours).logits.numpy()
    np.testing.assert_allclose(got, want, atol=2e-5)
    for c in (ours, theirs):
        c.crop(-20)
    assert ours.get_seq_length() == theirs.get_seq_length() == 0


def test_forward_takes_a_cache_position_that_is_the_next_slots():
    """transformers 5.23's forward takes ``cache_position`` (an older decoding loop passes it) and
    ignores it, even a wrong one (measured: ``[3]`` after 8 cached tokens gave the logits of none).
    Ours raised TypeError (unexpected keyword); now it takes the right value with the same logits and
    refuses a wrong one by name rather than ignore it."""
    from ._tiny import tiny_model, tokens

    model = tiny_model()
    model.eval()
    ids = tokens(1, 9)
    out = model(ids[:, :8], use_cache=True)
    want = model(ids[:, 8:], past_key_values=out.past_key_values).logits.numpy()
    out = model(ids[:, :8], use_cache=True, cache_position=paddle.arange(8))
    got = model(ids[:, 8:], past_key_values=out.past_key_values, cache_position=paddle.to_tensor([8])).logits
    np.testing.assert_array_equal(got.numpy(), want)
    fresh = model(ids[:, :8], use_cache=True).past_key_values
    with pytest.raises(ValueError, match=r"cache_position \[3\] is not the next 1 slots of the cache \(8\.\.8\)"):
        model(ids[:, 8:], past_key_values=fresh, cache_position=paddle.to_tensor([3]))


def test_odd_arguments_to_the_cache_methods_are_refused_by_name(model):
    """Float or 2-D indices were truncated and flattened (``[1.7]`` kept row 1; torch refuses
    non-integer indices), ``batch_repeat_interleave(2.5)`` became 2 and ``(0)`` a Paddle error,
    ``crop(np.int64(-1))`` was a TypeError (transformers takes numpy integers), and a bf16 model's
    cache given to a float32 model failed in a matmul kernel."""
    import paddle

    ids = paddle.to_tensor(np.random.default_rng(0).integers(3, 256, (2, 6)))
    cache = model(ids, use_cache=True).past_key_values
    with pytest.raises(IndexError, match="indices must be a 1-D list or tensor of ints"):
        cache.batch_select_indices(paddle.to_tensor([1.7]))
    with pytest.raises(IndexError, match="of shape \\[1, 2\\]"):
        cache.batch_select_indices(paddle.to_tensor([[0, 1]]))
    for bad in (2.5, 0, True):
        with pytest.raises(ValueError, match="repeats must be an int >= 1"):
            cache.batch_repeat_interleave(bad)
    assert cache.batch_size == 2 and cache.get_seq_length() == 6  # unchanged by the refusals
    cache.crop(np.int64(-1))
    assert cache.get_seq_length() == 5
    b16 = GlmMoeDsaForCausalLM.from_pretrained(CKPT, dtype="bfloat16")
    b16.eval()
    other = b16(ids, use_cache=True).past_key_values
    with pytest.raises(ValueError, match="past_key_values holds bfloat16 rows, the model computes in float32"):
        model(ids[:, :1], past_key_values=other)
    with pytest.raises(ValueError, match="past_key_values holds bfloat16 rows"):
        model.generate(paddle.concat([ids, ids[:, :1]], axis=1), past_key_values=other, max_new_tokens=1)
