"""The top-k itself (ties broken as torch's), and index tables and additive masks built from a
top-k selection (-1 = empty slot)."""

from __future__ import annotations

import paddle

from .kernels import computes_on_cpu, usable


def topk(x: paddle.Tensor, k: int) -> tuple[paddle.Tensor, paddle.Tensor]:
    """(values, indices) of the k largest of x over its last axis, largest first: ``paddle.topk``
    with exact ties broken as ``torch.topk`` (HF's) breaks them on CPU.

    Both CPU kernels sort (value, index) pairs with the same comparator (NaN largest) by the same
    ``std::partial_sort`` or ``std::nth_element`` + ``std::sort``, so equal values go to the same
    index, but they switch at different row lengths: torch takes partial_sort when k * 64 <= n,
    Paddle when k * 64 < n. At n = 64 k exactly (the indexer's 2048 of 128K keys, the tiny
    model's 8 of 512, a router's 1 of 64 experts) they then choose different sets among equal
    values (tests/test_topk_ties.py: 95% of the tiny indexer's slots at S = 512). There one -inf
    column is appended: Paddle then takes partial_sort too, whose heap never admits the -inf.
    Only when x is computed on the CPU (its place; while ``paddle.jit.to_static`` traces, where a
    tensor's place is not readable, the device Paddle computes on): a CPU tensor in a GPU build's
    process gets the torch order too; the GPU kernels are other algorithms, and the copy would
    cost one score chunk."""
    n = x.shape[-1]
    if k * 64 == n and computes_on_cpu(x):
        x = paddle.concat([x, paddle.full([*x.shape[:-1], 1], float("-inf"), x.dtype)], axis=-1)
    return paddle.topk(x, k, axis=-1)


def topk_tables(
    topk_idx: paddle.Tensor, n_keys: int | None = None
) -> tuple[paddle.Tensor, paddle.Tensor, paddle.Tensor]:
    """(rows [B*S, k] int64, mask [B*S, k] fp32, has_key [B*S] bool) for a top-k [B, S, k].

    `rows` index the table [B*T keys; B keyless rows], T = ``n_keys`` (default S: the queries are the
    keys): a selected key j of batch b is row b*T + j; an empty slot points at any key of its batch
    and gets mask -inf; a query with no key at all (left padding) points all its slots at its
    batch's keyless row with mask 0, so its softmax is uniform and it gets that row (the values'
    fp32 sum weighed as HF eager's all-masked additive-mask softmax weighs them, `keyless_value`).  ``n_keys`` other than S: the queries are
    a share of a longer key sequence (a context-parallel rank's queries over every key).
    One compiled pass where usable (T = S), else about fifteen Paddle ops.
    """
    B, S, K = topk_idx.shape
    T = S if n_keys is None else int(n_keys)
    topk_idx = _int64(topk_idx)
    ops = usable(topk_idx) if T == S and B * S else None  # the kernel splits whole batches of S rows
    if ops is not None:
        return tuple(ops.glm_topk_tables(topk_idx.reshape([B * S, K]), S))  # type: ignore[return-value]
    with paddle.no_grad():
        valid = topk_idx >= 0
        has_key = valid.any(axis=-1)
        has_k = has_key.unsqueeze(-1).expand([B, S, K])
        base = (paddle.arange(B, dtype="int64") * T).reshape([B, 1, 1]).expand([B, S, K])
        mean_row = (paddle.arange(B, dtype="int64") + B * T).reshape([B, 1, 1]).expand([B, S, K])
        rows = paddle.where(valid, topk_idx + base, paddle.where(has_k, base, mean_row))
        live = paddle.logical_or(valid, paddle.logical_not(has_k))
        mask = paddle.where(live, paddle.zeros([B, S, K], "float32"), paddle.full([B, S, K], float("-inf"), "float32"))
        return rows.reshape([B * S, K]), mask.reshape([B * S, K]), has_key.reshape([B * S])


def _int64(ids: paddle.Tensor) -> paddle.Tensor:
    """Key ids as int64, the index type of every gather and scatter here and of the kernels (an
    int32 top-k, which a caller's own selection may give, raised the kernel's dtype error)."""
    return ids if ids.dtype == paddle.int64 else ids.astype("int64")


def _scatter_mask(sel: paddle.Tensor, width: int, fill: float) -> paddle.Tensor:
    """Additive mask [R, width + 1] for selections sel [R, K] (-1 = empty): 0 at each row's selected
    columns, `fill` elsewhere; empty slots land in the extra dump column `width`. One flat scatter."""
    R, K = sel.shape
    W = width + 1
    col = paddle.where(sel >= 0, sel, paddle.full([R, K], width, "int64"))
    flat = (col + (paddle.arange(R, dtype="int64") * W).unsqueeze(1).expand([R, K])).reshape([-1])
    return paddle.scatter(paddle.full([R * W], fill, "float32"), flat, paddle.zeros([R * K], "float32")).reshape([R, W])


def selection_mask(sel: paddle.Tensor, width: int, fill: float) -> paddle.Tensor:
    """Additive mask [R, width] for selections sel [R, K] (-1 = empty) of columns < width: 0 at the
    selected columns, `fill` elsewhere (no S x S intermediate beyond the result)."""
    sel = _int64(sel)
    ops = usable(sel)
    if ops is not None:
        return ops.glm_selection_mask(sel, width, fill, False)
    return _scatter_mask(sel, width, fill)[:, :width].contiguous()


def candidate_mask(sel: paddle.Tensor, has_key: paddle.Tensor, c1: int) -> paddle.Tensor:
    """Additive mask [C, c1 + 1] over a dense chunk's candidates (keys < c1, then the batch's mean
    row): 0 at the selected keys (and at the mean row for a query without keys), -inf elsewhere."""
    sel = _int64(sel)
    ops = usable(sel)
    if ops is not None:
        return ops.glm_selection_mask(sel, c1, float("-inf"), True)
    C = sel.shape[0]
    W = c1 + 2  # candidates (keys < c1, the mean row) + the dump column
    m = _scatter_mask(sel, c1 + 1, float("-inf")).reshape([-1])
    mean_col = paddle.where(has_key, paddle.full([C], W - 1, "int64"), paddle.full([C], c1, "int64"))
    m = paddle.scatter(m, mean_col + paddle.arange(C, dtype="int64") * W, paddle.zeros([C], "float32"))
    return m.reshape([C, W])[:, : c1 + 1].contiguous()


def bin_counts(ids: paddle.Tensor, length: int) -> paddle.Tensor:
    """How often each of ``0 .. length-1`` occurs in ``ids`` (int64 ``[length]``; every id must be in
    that range), as ``paddle.bincount(ids, minlength=length)`` counts them, without its host reads:
    on a GPU ``bincount`` copies the ids' minimum and maximum to the host to size its output, a
    stream synchronisation per call, where this output's length is known: off the CPU a scatter-add of
    ones (integer sums, so the same counts in any order).  On the CPU there is no sync to avoid and
    ``bincount`` is the faster (``index_add`` costs about 45x more there: 2.1 ms vs 46 us for 32k ids)."""
    flat = ids.reshape([-1]).astype("int64")
    if computes_on_cpu(flat):
        return paddle.bincount(flat, minlength=length)
    return paddle.index_add(paddle.zeros([length], dtype="int64"), flat, 0, paddle.ones_like(flat))
