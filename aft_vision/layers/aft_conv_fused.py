"""The fused AFT-conv kernels (Eq. 6) in Triton: one pass over q, k, v in their own (B, H, W, C) layout and dtype.

Per query the logits ``k_t' + w(t' - t)`` (bias 0 outside the window) are summed as a softmax with a running maximum,
as FlashAttention does: every term is at most 1 and the largest is 1, so no denominator can underflow and nothing is
repaired. Keys in rows no query of a tile reaches carry no bias: their sums are shared by the tile (one exp per key).
The forward writes the gated output and one log-sum-exp per query and head; the backward recomputes the weights from
it. ``functional.py`` imports this module on first use; on the CPU the kernels need ``TRITON_INTERPRET=1``.
"""
from typing import Tuple

import torch
import triton
import triton.language as tl

from .dispatch import compute_dtype, output_dtype

__all__ = ['fused_forward', 'fused_backward']

BLOCK_M = 32  # queries per program (rows of the products)
BLOCK_K = 32  # keys per step


@triton.jit
def _bias(w_ptr, head, qy, qx, ky, kx, ok, S: tl.constexpr, R: tl.constexpr):
    """The window bias of query (qy, qx) (M,) and key (ky, kx) (N,): (M, N), 0 outside the window."""
    a = ky[None, :] - qy[:, None] + R
    b = kx[None, :] - qx[:, None] + R
    inside = (a >= 0) & (a < S) & (b >= 0) & (b < S) & ok
    return tl.load(w_ptr + head * S * S + a * S + b, mask=inside, other=0.0)  # w in the accumulation dtype


@triton.jit
def _near_rows(start, count, num_pos, width, height, R: tl.constexpr):
    """The rows [lo, hi) within R rows of positions [start, start + count) in raster order: where the window of one
    of them reaches (the rest see them, and they the rest, without bias)."""
    lo = tl.maximum(start // width - R, 0)
    hi = tl.minimum((tl.minimum(start + count, num_pos) - 1) // width + R + 1, height)
    return lo, hi


@triton.jit
def _product(a, b, USE_DOT: tl.constexpr, IEEE: tl.constexpr, OP: tl.constexpr, ACC: tl.constexpr):
    """a (M, N) times b (N, D) in ACC: a tensor-core product where the shapes allow (operands in OP for 16-bit
    inputs, exact otherwise), else a sum of broadcast products."""
    if USE_DOT:
        if IEEE:
            return tl.dot(a.to(ACC), b.to(ACC), input_precision='ieee')
        return tl.dot(a.to(OP), b.to(OP))
    return tl.sum(a.to(ACC)[:, :, None] * b.to(ACC)[None, :, :], axis=1)


@triton.jit
def forward_kernel(q_ptr, k_ptr, v_ptr, w_ptr, out_ptr, lse_ptr, height, width, num_heads, s_q, s_k, s_v,
                   S: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr,
                   USE_DOT: tl.constexpr, IEEE: tl.constexpr, ACC: tl.constexpr):
    # q, v, out: (B, T, C) rows s_q / s_v / C apart; k (B, T, h) rows s_k apart; w (h, S, S); lse (B, T, h)
    R: tl.constexpr = S // 2
    pid_m = tl.program_id(0)
    image = tl.program_id(1) // num_heads
    head = tl.program_id(1) % num_heads
    num_pos = height * width
    channels = num_heads * D
    rm = pid_m * BM + tl.arange(0, BM)
    m_ok = rm < num_pos
    qy, qx = rm // width, rm % width
    rd = tl.arange(0, BD)
    d_ok = rd < D
    k_img = k_ptr + image.to(tl.int64) * num_pos * s_k + head
    v_img = v_ptr + image.to(tl.int64) * num_pos * s_v + head * D
    # keys in rows [row_lo, row_hi) lie in some query's window of this tile; the others take no bias
    row_lo, row_hi = _near_rows(pid_m * BM, BM, num_pos, width, height, R)
    # the shared part: one running maximum, sum and weighted values for the tile
    m_far = tl.max(tl.full((BK,), float('-inf'), ACC), axis=0)
    l_far = tl.sum(tl.zeros((BK,), ACC), axis=0)
    acc_far = tl.zeros((BD,), ACC)
    num_near = (row_hi - row_lo) * width
    for j0 in range(0, num_pos - num_near, BK):  # the far keys, rows [0, row_lo) then [row_hi, H)
        rj = j0 + tl.arange(0, BK)
        k_ok = rj < num_pos - num_near
        rk = tl.where(rj < row_lo * width, rj, rj + num_near)
        keys = tl.load(k_img + rk * s_k, mask=k_ok, other=float('-inf')).to(ACC)  # (BK,)
        m_new = tl.maximum(m_far, tl.max(keys, axis=0))
        p = tl.exp(keys - m_new)  # (BK,)
        alpha = tl.exp(m_far - m_new)
        vals = tl.load(v_img + rk[:, None] * s_v + rd[None, :], mask=k_ok[:, None] & d_ok[None, :],
                       other=0.0).to(ACC)  # (BK, BD)
        l_far = l_far * alpha + tl.sum(p, axis=0)
        acc_far = acc_far * alpha + tl.sum(p[:, None] * vals, axis=0)
        m_far = m_new
    # the keys near the tile: per query and key, the bias inside the window
    m_i = tl.full((BM,), float('-inf'), ACC)
    l_i = tl.zeros((BM,), ACC)
    acc = tl.zeros((BM, BD), ACC)
    for j0 in range(row_lo * width, row_hi * width, BK):
        rk = j0 + tl.arange(0, BK)
        k_ok = rk < row_hi * width
        keys = tl.load(k_img + rk * s_k, mask=k_ok, other=0.0).to(ACC)  # (BK,)
        logits = keys[None, :] + _bias(w_ptr, head, qy, qx, rk // width, rk % width, k_ok[None, :], S, R)
        logits = tl.where(k_ok[None, :], logits, float('-inf'))  # (BM, BK)
        m_new = tl.maximum(m_i, tl.max(logits, axis=1))
        p = tl.exp(logits - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        vals = tl.load(v_img + rk[:, None] * s_v + rd[None, :], mask=k_ok[:, None] & d_ok[None, :], other=0.0)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + _product(p, vals, USE_DOT, IEEE, v_ptr.dtype.element_ty, ACC)
        m_i = m_new
    m_all = tl.maximum(m_i, m_far)  # (BM,): the largest logit of each query, attained
    near, far = tl.exp(m_i - m_all), tl.exp(m_far - m_all)
    denom = l_i * near + l_far * far  # >= 1
    mixed = (acc * near[:, None] + acc_far[None, :] * far[:, None]) / denom[:, None]  # (BM, BD)
    gates = tl.load(q_ptr + image.to(tl.int64) * num_pos * s_q + head * D + rm[:, None] * s_q + rd[None, :],
                    mask=m_ok[:, None] & d_ok[None, :], other=0.0).to(ACC)
    out = tl.sigmoid(gates) * mixed
    out_off = image.to(tl.int64) * num_pos * channels + head * D + rm[:, None] * channels + rd[None, :]
    tl.store(out_ptr + out_off, out.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & d_ok[None, :])
    lse_off = image.to(tl.int64) * num_pos * num_heads + rm * num_heads + head
    tl.store(lse_ptr + lse_off, m_all + tl.log(denom), mask=m_ok)


@triton.jit
def key_grad_kernel(k_ptr, v_ptr, w_ptr, lse_ptr, dout_ptr, delta_ptr, dk_ptr, dv_ptr, height, width, num_heads,
                    s_k, s_v, S: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, BM: tl.constexpr,
                    BN: tl.constexpr, USE_DOT: tl.constexpr, IEEE: tl.constexpr, ACC: tl.constexpr):
    # dout (B, T, C): grad * sigmoid(q); delta, lse (B, T, h), all ACC; dk (B, T, h), dv (B, T, C)
    """dv[t'] = sum_t P[t, t'] dout[t], dk[t'] = sum_t P[t, t'] (dout[t] . v[t'] - delta[t]) for a block of keys,
    P = exp(k[t'] + w(t' - t) - lse[t]); the queries no key of the block reaches in one shared sum."""
    R: tl.constexpr = S // 2
    pid_n = tl.program_id(0)
    image = tl.program_id(1) // num_heads
    head = tl.program_id(1) % num_heads
    num_pos = height * width
    channels = num_heads * D
    rn = pid_n * BN + tl.arange(0, BN)
    n_ok = rn < num_pos
    ky, kx = rn // width, rn % width
    rd = tl.arange(0, BD)
    d_ok = rd < D
    k_img = k_ptr + image.to(tl.int64) * num_pos * s_k + head
    keys = tl.load(k_img + rn * s_k, mask=n_ok, other=0.0).to(ACC)  # (BN,)
    vals = tl.load(v_ptr + image.to(tl.int64) * num_pos * s_v + head * D + rn[:, None] * s_v + rd[None, :],
                   mask=n_ok[:, None] & d_ok[None, :], other=0.0)  # (BN, BD)
    stat_img = image.to(tl.int64) * num_pos * num_heads + head
    dout_img = dout_ptr + image.to(tl.int64) * num_pos * channels + head * D
    # queries in rows [row_lo, row_hi) hold some key of the block in their window; the others see them with bias 0
    row_lo, row_hi = _near_rows(pid_n * BN, BN, num_pos, width, height, R)
    num_near = (row_hi - row_lo) * width
    # the far queries, shared by the block: P = exp(k[t'] - c) exp(c - lse[t]), c the least lse (each factor <= 1)
    c_far = tl.min(tl.full((BM,), float('inf'), ACC), axis=0)
    u_far = tl.zeros((BD,), ACC)  # sum_t exp(c - lse[t]) dout[t]
    z_far = tl.sum(tl.zeros((BM,), ACC), axis=0)  # sum_t exp(c - lse[t]) delta[t]
    for i0 in range(0, num_pos - num_near, BM):
        ri = i0 + tl.arange(0, BM)
        m_ok = ri < num_pos - num_near
        rm = tl.where(ri < row_lo * width, ri, ri + num_near)
        lse = tl.load(lse_ptr + stat_img + rm * num_heads, mask=m_ok, other=float('inf'))  # (BM,)
        delta = tl.load(delta_ptr + stat_img + rm * num_heads, mask=m_ok, other=0.0)
        dout = tl.load(dout_img + rm[:, None] * channels + rd[None, :], mask=m_ok[:, None] & d_ok[None, :],
                       other=0.0)  # (BM, BD)
        c_new = tl.minimum(c_far, tl.min(lse, axis=0))
        scale = tl.exp(c_new - lse)  # (BM,), 0 for padded queries
        rescale = tl.exp(c_new - c_far)
        u_far = u_far * rescale + tl.sum(scale[:, None] * dout, axis=0)
        z_far = z_far * rescale + tl.sum(scale * delta, axis=0)
        c_far = c_new
    weight = tl.exp(keys - c_far)  # (BN,): 0 where there is no far query
    dv = weight[:, None] * u_far[None, :]
    dk = weight * (tl.sum(vals.to(ACC) * u_far[None, :], axis=1) - z_far)
    # the near queries: per query and key, the bias inside the window
    for i0 in range(row_lo * width, row_hi * width, BM):
        rm = i0 + tl.arange(0, BM)
        m_ok = rm < row_hi * width
        lse = tl.load(lse_ptr + stat_img + rm * num_heads, mask=m_ok, other=float('inf'))  # (BM,)
        delta = tl.load(delta_ptr + stat_img + rm * num_heads, mask=m_ok, other=0.0)
        dout = tl.load(dout_img + rm[:, None] * channels + rd[None, :], mask=m_ok[:, None] & d_ok[None, :],
                       other=0.0)  # (BM, BD)
        logits = keys[None, :] + _bias(w_ptr, head, rm // width, rm % width, ky, kx, n_ok[None, :], S, R)
        p = tl.exp(logits - lse[:, None])  # (BM, BN); 0 for padded queries
        p = tl.where(n_ok[None, :], p, 0.0)
        dv += _product(tl.trans(p), dout, USE_DOT, IEEE, v_ptr.dtype.element_ty, ACC)
        dp = _product(dout, tl.trans(vals), USE_DOT, IEEE, v_ptr.dtype.element_ty, ACC)  # (BM, BN): dout[t] . v[t']
        dk += tl.sum(p * (dp - delta[:, None]), axis=0)
    tl.store(dk_ptr + image.to(tl.int64) * num_pos * num_heads + rn * num_heads + head,
             dk.to(dk_ptr.dtype.element_ty), mask=n_ok)
    dv_off = image.to(tl.int64) * num_pos * channels + head * D + rn[:, None] * channels + rd[None, :]
    tl.store(dv_ptr + dv_off, dv.to(dv_ptr.dtype.element_ty), mask=n_ok[:, None] & d_ok[None, :])


@triton.jit
def bias_grad_kernel(k_ptr, v_ptr, w_ptr, lse_ptr, dout_ptr, delta_ptr, dw_ptr, batch, height, width, num_heads,
                     s_k, s_v, S: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, BM: tl.constexpr,
                     ACC: tl.constexpr):
    # dw (tiles, h, S * S) ACC: this program's share, summed over its queries and every image
    """dw[o] = sum over images and this tile's queries t of P[t, t + o] (dout[t] . v[t + o] - delta[t])."""
    R: tl.constexpr = S // 2
    pid_m = tl.program_id(0)
    head = tl.program_id(1)
    num_pos = height * width
    channels = num_heads * D
    rm = pid_m * BM + tl.arange(0, BM)
    m_ok = rm < num_pos
    qy, qx = rm // width, rm % width
    rd = tl.arange(0, BD)
    d_ok = rd < D
    out_row = dw_ptr + (pid_m * num_heads + head).to(tl.int64) * S * S
    for o in range(S * S):
        ky = qy + o // S - R
        kx = qx + o % S - R
        ok = m_ok & (ky >= 0) & (ky < height) & (kx >= 0) & (kx < width)
        rk = ky * width + kx
        bias = tl.load(w_ptr + head * S * S + o)
        total = tl.sum(tl.zeros((BM,), ACC), axis=0)
        for image in range(batch):
            img = image * num_pos
            keys = tl.load(k_ptr + (img + rk) * s_k + head, mask=ok, other=0.0).to(ACC)
            lse = tl.load(lse_ptr + (img + rm) * num_heads + head, mask=ok, other=float('inf'))
            delta = tl.load(delta_ptr + (img + rm) * num_heads + head, mask=ok, other=0.0)
            mask2 = ok[:, None] & d_ok[None, :]
            vals = tl.load(v_ptr + (img + rk)[:, None] * s_v + head * D + rd[None, :], mask=mask2,
                           other=0.0).to(ACC)
            dout = tl.load(dout_ptr + (img + rm)[:, None] * channels + head * D + rd[None, :], mask=mask2,
                           other=0.0)
            p = tl.exp(keys + bias - lse)  # (BM,)
            total += tl.sum(p * (tl.sum(dout * vals, axis=1) - delta), axis=0)
        tl.store(out_row + o, total)


def _rows(x: torch.Tensor) -> Tuple[torch.Tensor, int]:
    """``x`` (B, H, W, n) as positions with unit channel stride and one position stride; that stride."""
    if x.stride(-1) != 1 or x.stride(1) != x.shape[2] * x.stride(2) or x.stride(0) != x.shape[1] * x.stride(1):
        x = x.contiguous()
    return x, x.stride(2)


def _layout(channels: int, num_heads: int, dtype: torch.dtype, acc: torch.dtype) -> dict:
    """The channel block of one head and how its products run (tensor cores from 16 channels on)."""
    head_dim = channels // num_heads
    use_dot = head_dim >= 16
    block_d = max(16 if use_dot else 1, 1 << max(0, (head_dim - 1).bit_length()))
    return dict(D=head_dim, BD=block_d, USE_DOT=use_dot, IEEE=dtype not in (torch.float16, torch.bfloat16),
                ACC=tl.float64 if acc == torch.float64 else tl.float32)


def fused_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  w: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """The gated output (B, H, W, C) in the promoted dtype of q, k, v and the log-sum-exp (B, H, W, h), float32
    (float64 for float64 inputs)."""
    batch, height, width, channels = q.shape
    num_heads, ksize = k.shape[-1], w.shape[-1]
    out_dtype, acc = output_dtype(q, k, v), compute_dtype([q, k, v, w])  # acc: every sum's and the log-sum-exp's
    (q, s_q), (k, s_k), (v, s_v) = _rows(q), _rows(k), _rows(v)
    out = torch.empty(q.shape, device=q.device, dtype=out_dtype)
    lse = torch.empty(k.shape, device=q.device, dtype=acc)
    grid = (-(-height * width // BLOCK_M), batch * num_heads)
    forward_kernel[grid](q, k, v, w.detach().to(acc).contiguous(), out, lse, height, width, num_heads, s_q, s_k, s_v,
                         S=ksize, BM=BLOCK_M, BK=BLOCK_K, **_layout(channels, num_heads, v.dtype, acc))
    return out, lse


def fused_backward(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, w: torch.Tensor,
                   out: torch.Tensor, lse: torch.Tensor) -> Tuple[torch.Tensor, ...]:
    """Gradients in q, k, v, w of ``fused_forward`` from its output and log-sum-exp, each in its input's dtype."""
    batch, height, width, channels = q.shape
    num_heads, ksize = k.shape[-1], w.shape[-1]
    acc = compute_dtype([q, k, v, w])
    gate = torch.sigmoid(q.to(acc))
    grad_out = grad.to(acc) * out.to(acc)  # grad * sigmoid(q) * mixed
    dq = (grad_out * (1.0 - gate)).to(q.dtype)
    delta = grad_out.view(batch, height, width, num_heads, -1).sum(-1).contiguous()  # (B, H, W, h)
    dout = (grad.to(acc) * gate).contiguous()  # (B, H, W, C): the gradient of the mixed values
    (k, s_k), (v, s_v) = _rows(k), _rows(v)
    w_acc, lse = w.detach().to(acc).contiguous(), lse.contiguous()
    layout = _layout(channels, num_heads, v.dtype, acc)
    dk = torch.empty(k.shape, device=q.device, dtype=k.dtype)
    dv = torch.empty(v.shape, device=q.device, dtype=v.dtype)
    num_pos = height * width
    key_grad_kernel[(-(-num_pos // BLOCK_K), batch * num_heads)](
        k, v, w_acc, lse, dout, delta, dk, dv, height, width, num_heads, s_k, s_v, S=ksize, BM=BLOCK_M, BN=BLOCK_K,
        **layout)
    tiles = -(-num_pos // BLOCK_M)
    partial = torch.empty(tiles, num_heads, ksize * ksize, device=q.device, dtype=acc)
    layout = {key: layout[key] for key in ('D', 'BD', 'ACC')}
    bias_grad_kernel[(tiles, num_heads)](k, v, w_acc, lse, dout, delta, partial, batch, height, width, num_heads, s_k,
                                         s_v, S=ksize, BM=BLOCK_M, **layout)
    dw = partial.sum(0).view(w.shape).to(w.dtype)  # (h, S, S), in a fixed order
    return dq, dk, dv, dw
