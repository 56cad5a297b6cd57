"""Pure-PyTorch reference implementations of scaled dot-product attention.

These functions are the ground truth the flash3 CUDA kernels are tested
against. They never import ``flash3._C`` and work on CPU and GPU tensors.

Conventions (shared with the kernels):

* Tensors are laid out ``(batch, seqlen, nheads, headdim)``:
  ``q`` is ``(b, sq, h, d)``, ``k`` and ``v`` are ``(b, sk, hk, d)``.
* Grouped-query attention (GQA/MQA) when ``h % hk == 0``: query head ``i``
  reads kv head ``i // (h // hk)``.
* ``softmax_scale`` defaults to ``1 / sqrt(d)``.
* Causal masking is bottom-right aligned (FlashAttention-2/3 convention):
  query row ``i`` sees key ``j`` iff ``j <= i + sk - sq``. See
  :func:`causal_mask` for drawn examples.
* Sliding windows (``window_size=(left, right)``, -1 unbounded) are bottom-right
  aligned too: row ``i`` sees key ``j`` iff
  ``i + sk - sq - left <= j <= i + sk - sq + right``; causal sets ``right`` to 0
  (see :func:`window_mask`).
* ``softcap > 0`` replaces each scaled score ``s`` by ``softcap * tanh(s / softcap)``
  before the mask and the softmax.
* ``sinks`` (one logit per query head) join every row's softmax denominator
  without a value.
* A row that sees no key (causal with ``sq > sk``, a window past the keys, or
  ``sk == 0``) has output 0 and log-sum-exp ``-inf`` (the sink with sinks); no
  NaN is produced.
* ``lse`` is float32 of shape ``(b, h, sq)`` and equals the logsumexp over
  visible keys (and the sink) of the (capped) ``softmax_scale * q . k``. The
  backward pass needs it to recompute the softmax probabilities without storing
  them.

Two references are provided:

* :func:`attention_ref` materialises the full score matrix. With
  ``upcast=True`` it is the high-precision "truth"; with ``upcast=False`` it
  mimics a naive same-precision PyTorch implementation, whose error sets the
  tolerance for kernel tests (kernel error vs the fp64 truth must be at most
  ``2 * (same-precision error) + floor``).
* :func:`attention_blockwise` runs the online-softmax loop of the kernel
  design block by block, so the algorithm (running max, rescaling, exp2 with
  the folded scale, masking, tail handling) can be checked on CPU before any
  CUDA is involved.
"""

import math

import torch

__all__ = ["causal_mask", "window_mask", "attention_ref", "attention_blockwise"]

LOG2_E = math.log2(math.e)


def causal_mask(sq, sk, device=None):
    """Return the bool ``(sq, sk)`` mask of keys visible to each query row.

    The mask is bottom-right aligned: query row ``i`` sees key ``j`` iff
    ``j <= i + (sk - sq)``. Aligning the last query with the last key is
    what makes causal attention correct for decoding with a KV cache, where
    the ``sq`` new queries are the last ``sq`` positions of a sequence of
    length ``sk``. ``x`` marks a visible key, ``.`` a masked one.

    sq=3, sk=5 (offset sk - sq = 2; every row sees at least 3 keys)::

              k0 k1 k2 k3 k4
        q0  [  x  x  x  .  . ]
        q1  [  x  x  x  x  . ]
        q2  [  x  x  x  x  x ]

    sq=5, sk=3 (offset -2; rows q0 and q1 see no key at all, so their
    output is 0 and their lse is -inf)::

              k0 k1 k2
        q0  [  .  .  . ]
        q1  [  .  .  . ]
        q2  [  x  .  . ]
        q3  [  x  x  . ]
        q4  [  x  x  x ]
    """
    rows = torch.arange(sq, device=device).unsqueeze(1)
    cols = torch.arange(sk, device=device).unsqueeze(0)
    return cols <= rows + (sk - sq)


def window_mask(sq, sk, window_size=(-1, -1), causal=False, device=None):
    """The bool ``(sq, sk)`` mask of a sliding window, bottom-right aligned as in
    FlashAttention: row ``i`` sees key ``j`` iff
    ``i + sk - sq - left <= j <= i + sk - sq + right``, a side of -1 being unbounded;
    ``causal`` sets ``right`` to 0. ``window_size=(-1, -1)`` is no mask, ``(-1, 0)`` is
    :func:`causal_mask`.

    sq=5, sk=5, window_size=(1, 1)::

              k0 k1 k2 k3 k4
        q0  [  x  x  .  .  . ]
        q1  [  x  x  x  .  . ]
        q2  [  .  x  x  x  . ]
        q3  [  .  .  x  x  x ]
        q4  [  .  .  .  x  x ]

    sq=3, sk=6, window_size=(1, 0) (bottom-right aligned: the last query sits
    on the last key; each row sees its own position and the key before it)::

              k0 k1 k2 k3 k4 k5
        q0  [  .  .  x  x  .  . ]
        q1  [  .  .  .  x  x  . ]
        q2  [  .  .  .  .  x  x ]
    """
    left, right = window_size
    if causal:
        right = 0
    rows = torch.arange(sq, device=device).unsqueeze(1) + (sk - sq)
    cols = torch.arange(sk, device=device).unsqueeze(0)
    visible = torch.ones(sq, sk, dtype=torch.bool, device=device)
    if left >= 0:
        visible &= cols >= rows - left
    if right >= 0:
        visible &= cols <= rows + right
    return visible


def _resolve_scale(softmax_scale, headdim):
    return 1.0 / math.sqrt(headdim) if softmax_scale is None else softmax_scale


def _expand_kv_heads(k, v, nheads):
    """Repeat kv heads so that query head ``i`` pairs with kv head ``i // group``.

    A kernel indexes the shared kv head instead of copying it; the copy is
    fine for a reference and keeps the math below free of GQA bookkeeping.
    """
    nheads_kv = k.shape[2]
    if nheads % nheads_kv != 0:
        raise ValueError(f"nheads ({nheads}) must be a multiple of nheads_kv ({nheads_kv})")
    group = nheads // nheads_kv
    if group == 1:
        return k, v
    return k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)


def attention_ref(q, k, v, causal=False, softmax_scale=None, upcast=True, window_size=(-1, -1), softcap=0.0,
                  sinks=None):
    """Attention by materialising the full ``softmax(scale * Q K^T) V``.

    Args:
        q: ``(b, sq, h, d)``.
        k, v: ``(b, sk, hk, d)`` with ``h % hk == 0``.
        causal: apply the bottom-right aligned causal mask (see
            :func:`causal_mask`).
        softmax_scale: multiplier of ``Q K^T``; defaults to ``1 / sqrt(d)``.
        upcast: if True, compute everything in float64 and return ``out`` in
            float64: this is the accuracy "truth". If False, behave like a
            naive PyTorch implementation in the input precision: both
            matmuls run in the input dtype, the softmax runs in float32 and
            the probabilities are cast back to the input dtype before the
            ``P V`` matmul (as FlashAttention's own test reference does);
            ``out`` is returned in the input dtype. Its error against the
            float64 truth is the yardstick for kernel tolerances.
        window_size: ``(left, right)`` sliding window, bottom-right aligned, -1 for an
            unbounded side (:func:`window_mask`); ``(-1, -1)`` is no window.
        softcap: if > 0, the scaled scores become ``softcap * tanh(scores / softcap)``
            before the mask and the softmax; ``lse`` is taken over the capped scores.
        sinks: ``None`` or ``(h,)``: one logit per head (natural-log units) that joins
            each row's softmax denominator with no value:
            ``out_i = sum_j exp(z_ij) v_j / (exp(sink) + sum_j exp(z_ij))`` and
            ``lse_i = log(exp(sink) + sum_j exp(z_ij))``. Gradients flow to it.

    Returns:
        ``(out, lse)``: ``out`` is ``(b, sq, h, d)`` (float64 if ``upcast``,
        else ``q.dtype``); ``lse`` is float32 ``(b, h, sq)``, the logsumexp
        of the scaled (and capped) scores over visible keys and the sink
        (``-inf`` for rows that see no key and have no sink, whose ``out`` is 0;
        with a sink such a row has ``out`` 0 and ``lse`` the sink).
    """
    nheads, headdim = q.shape[2], q.shape[3]
    scale = _resolve_scale(softmax_scale, headdim)
    k, v = _expand_kv_heads(k, v, nheads)
    if upcast:
        q, k, v = q.double(), k.double(), v.double()
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    else:
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k).float() * scale
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)

    if causal or tuple(window_size) != (-1, -1):
        visible = window_mask(q.shape[1], k.shape[1], window_size, causal, device=q.device)
        scores = scores.masked_fill(~visible, float("-inf"))
    if sinks is not None:
        # The sink is one more column with no value: softmax over [scores, sink].
        sink_col = sinks.to(device=scores.device, dtype=scores.dtype).view(1, -1, 1, 1)
        scores = torch.cat([scores, sink_col.expand(scores.shape[0], -1, scores.shape[2], 1)], dim=-1)
    lse = torch.logsumexp(scores, dim=-1)
    # A row with every score at -inf attends to nothing: its probabilities (and output)
    # are 0. Filling before the softmax, rather than cleaning its 0/0 NaNs after, keeps
    # the row's gradients 0 instead of NaN.
    empty_rows = (scores == float("-inf")).all(dim=-1, keepdim=True)
    probs = torch.softmax(scores.masked_fill(empty_rows, 0.0), dim=-1).masked_fill(empty_rows, 0.0)
    if sinks is not None:
        probs = probs[..., :-1]
    out = torch.einsum("bhqk,bkhd->bqhd", probs.to(v.dtype), v)
    return out, lse.float()


def attention_blockwise(q, k, v, causal=False, softmax_scale=None, block_m=128, block_n=128):
    """Attention via the kernel's tiled online-softmax loop, in float32.

    For each ``block_m`` tile of query rows, iterate over ``block_n`` tiles
    of keys and keep, per row, a running max ``m`` of the raw scores, a
    running sum ``l`` of exponentials relative to ``m``, and an unnormalised
    output accumulator ``acc``. When a new tile raises the max, the old
    ``l`` and ``acc`` are rescaled by ``exp(scale * (m_old - m_new))`` so the
    exponentials never overflow. The output is normalised once, at the end,
    by ``l``, and ``lse = scale * m + log(l)``.

    Key tiles that lie entirely above the causal diagonal of the query tile
    are skipped, exactly as the kernel skips them. Sequence lengths need not
    be multiples of the tile sizes: tensors are zero-padded to whole tiles
    and padded key columns are masked to ``-inf`` (the "tail" mask), padded
    query rows are dropped at the end.

    Accumulation is float32 (the kernel's accumulator precision) for
    float16/bfloat16/float32 inputs and float64 for float64 inputs, so the
    algorithm itself can be checked to near machine precision.
    ``softmax_scale`` must be positive (as in the kernel), because the
    running max is taken over unscaled scores.

    Args and conventions are those of :func:`attention_ref`, plus the tile
    sizes ``block_m`` (query rows) and ``block_n`` (keys).

    Returns:
        ``(out, lse)``: ``out`` in ``q.dtype`` of shape ``(b, sq, h, d)``;
        ``lse`` float32 ``(b, h, sq)``. Rows that see no key give ``out`` 0
        and ``lse`` ``-inf``.
    """
    batch, seqlen_q, nheads, headdim = q.shape
    seqlen_k = k.shape[1]
    scale = _resolve_scale(softmax_scale, headdim)
    # The kernel computes exp(x) as exp2(x * log2(e)) because exp2 is a single
    # hardware instruction (MUFU.EX2) while exp is not. Folding log2(e) into
    # the softmax scale turns the per-element work into one FMA,
    # s * scale_log2 - m * scale_log2, followed by exp2.
    scale_log2 = scale * LOG2_E

    acc_dtype = torch.promote_types(q.dtype, torch.float32)
    out_dtype = q.dtype
    k, v = _expand_kv_heads(k, v, nheads)
    # (b, s, h, d) -> (b, h, s, d) so each head is a matrix of rows.
    q, k, v = (t.to(acc_dtype).transpose(1, 2) for t in (q, k, v))

    num_m_blocks = -(-seqlen_q // block_m)
    num_n_blocks = -(-seqlen_k // block_n)
    q = torch.nn.functional.pad(q, (0, 0, 0, num_m_blocks * block_m - seqlen_q))
    k = torch.nn.functional.pad(k, (0, 0, 0, num_n_blocks * block_n - seqlen_k))
    v = torch.nn.functional.pad(v, (0, 0, 0, num_n_blocks * block_n - seqlen_k))

    out = torch.empty(batch, nheads, num_m_blocks * block_m, headdim, dtype=acc_dtype, device=q.device)
    lse = torch.empty(batch, nheads, num_m_blocks * block_m, dtype=acc_dtype, device=q.device)
    causal_offset = seqlen_k - seqlen_q
    neg_inf = float("-inf")

    for m_block in range(num_m_blocks):
        row_start = m_block * block_m
        rows = torch.arange(row_start, row_start + block_m, device=q.device).unsqueeze(1)
        q_tile = q[:, :, row_start:row_start + block_m]

        n_block_end = num_n_blocks
        if causal:
            # The last row of this tile sees keys up to row + offset; tiles
            # starting beyond that are fully masked for every row of the tile.
            last_visible_key = row_start + block_m - 1 + causal_offset
            n_block_end = min(num_n_blocks, max(0, last_visible_key // block_n + 1))

        row_max = torch.full((batch, nheads, block_m, 1), neg_inf, dtype=acc_dtype, device=q.device)
        row_sum = torch.zeros(batch, nheads, block_m, 1, dtype=acc_dtype, device=q.device)
        acc = torch.zeros(batch, nheads, block_m, headdim, dtype=acc_dtype, device=q.device)

        for n_block in range(n_block_end):
            col_start = n_block * block_n
            cols = torch.arange(col_start, col_start + block_n, device=q.device).unsqueeze(0)
            k_tile = k[:, :, col_start:col_start + block_n]
            v_tile = v[:, :, col_start:col_start + block_n]

            scores = q_tile @ k_tile.transpose(-1, -2)
            masked = cols >= seqlen_k
            if causal:
                masked = masked | (cols > rows + causal_offset)
            scores = scores.masked_fill(masked, neg_inf)

            new_max = torch.maximum(row_max, scores.amax(dim=-1, keepdim=True))
            # A row with no visible key so far has max -inf; subtracting it
            # would give -inf - (-inf) = NaN. Using 0 instead makes every
            # exp2 below evaluate to exp2(-inf) = 0, which is the right value.
            safe_max = torch.where(new_max == neg_inf, torch.zeros_like(new_max), new_max)
            rescale = torch.exp2(row_max * scale_log2 - safe_max * scale_log2)
            probs = torch.exp2(scores * scale_log2 - safe_max * scale_log2)

            row_sum = row_sum * rescale + probs.sum(dim=-1, keepdim=True)
            acc = acc * rescale + probs @ v_tile
            row_max = new_max

        has_keys = row_sum > 0
        safe_sum = torch.where(has_keys, row_sum, torch.ones_like(row_sum))
        out[:, :, row_start:row_start + block_m] = torch.where(has_keys, acc / safe_sum, torch.zeros_like(acc))
        tile_lse = torch.where(has_keys, row_max * scale + torch.log(safe_sum), torch.full_like(row_sum, neg_inf))
        lse[:, :, row_start:row_start + block_m] = tile_lse.squeeze(-1)

    out = out[:, :, :seqlen_q].transpose(1, 2).to(out_dtype)
    return out, lse[:, :, :seqlen_q].float()
