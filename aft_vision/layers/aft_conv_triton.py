"""Fused windowed AFT-conv (Eq. 6) in Triton, forward and backward (docs/operators.md, "The Triton kernel").

Per head ``[N, D] = exp(-m) * colsum(X) + K @ X`` with ``K = exp(w - m) - exp(-m)`` inside the window: one program per
8 x 8 tile of queries and the halo of keys it reaches, batch and channels as the product's N dimension. Triton is
imported on first use; on the CPU the kernels need Triton's interpreter (``TRITON_INTERPRET=1`` before first use).
"""
import os
from typing import Dict, Optional, Tuple

import torch

from ._checks import check_conv_inputs
from .dispatch import output_dtype

__all__ = ['aft_conv2d_triton', 'triton_available', 'triton_unavailable_reason']

# Query (or key) tile of one program: TILE_Y x TILE_X positions (the M dimension of the products).
TILE_Y = 8
TILE_X = 8
# Halo positions per step of the windowed product (its K dimension) and channels per program (its N dimension).
BLOCK_K = 32
BLOCK_N_MAX = 64
MAX_KERNEL_SIZE = 31

_KERNELS: Dict[bool, Tuple[object, object]] = {}


def _interpret_requested() -> bool:
    return os.environ.get('TRITON_INTERPRET', '0').lower() in ('1', 'true', 'yes', 'on')


def triton_unavailable_reason() -> Optional[str]:
    """Why the Triton kernel cannot run here (triton missing, or neither CUDA nor ``TRITON_INTERPRET=1``), or None."""
    try:
        import triton  # noqa: F401
    except Exception as exc:  # ImportError, or a broken install
        return f'triton could not be imported ({type(exc).__name__}: {exc})'
    if torch.cuda.is_available() or _interpret_requested():
        return None
    return 'no CUDA device is available and TRITON_INTERPRET=1 is not set (the interpreter runs the kernel on CPU)'


def triton_available() -> bool:
    """True when triton imports and either a CUDA device is present or ``TRITON_INTERPRET=1`` is set."""
    return triton_unavailable_reason() is None


def _build_kernels():
    """Define the Triton kernels (imports triton), once per interpreter mode."""
    import triton
    import triton.language as tl

    @triton.jit
    def window_product_kernel(x_ptr, kern_ptr, glob_ptr, out_ptr, height, width, n_cols, ksize, radius, tiles_x,
                              TRANSPOSE: tl.constexpr, TY: tl.constexpr, TX: tl.constexpr, BLOCK_K: tl.constexpr,
                              BLOCK_N: tl.constexpr, IEEE: tl.constexpr):
        # x (h, T, N): X or dS; kern (h, s * s): K; glob (h, N): exp(-m) * column sums; out (h, T, N) float32
        """out[i, t, n] = glob[i, n] + sum over t' in the window of K_i[t' - t] * x[i, t', n] (t - t' when
        TRANSPOSE) for a TY x TX tile of rows t, the halo walked BLOCK_K positions at a time."""
        pid_tile = tl.program_id(0)
        head = tl.program_id(1).to(tl.int64)
        pid_n = tl.program_id(2)
        num_pos = height * width
        y0 = (pid_tile // tiles_x) * TY
        x0 = (pid_tile % tiles_x) * TX
        rm = tl.arange(0, TY * TX)
        ry = y0 + rm // TX  # (M,) row positions of the tile
        rx = x0 + rm % TX
        row_ok = (ry < height) & (rx < width)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = rn < n_cols
        # halo of the tile, clipped to the map
        hy_lo = tl.maximum(y0 - radius, 0)
        hy_hi = tl.minimum(y0 + TY + radius, height)
        hx_lo = tl.maximum(x0 - radius, 0)
        hx_hi = tl.minimum(x0 + TX + radius, width)
        halo_w = hx_hi - hx_lo
        halo = (hy_hi - hy_lo) * halo_w
        x_head = x_ptr + head * num_pos * n_cols
        kern_head = kern_ptr + head * ksize * ksize
        acc = tl.zeros((TY * TX, BLOCK_N), dtype=tl.float32)
        for j0 in range(0, halo, BLOCK_K):
            rj = j0 + tl.arange(0, BLOCK_K)
            col_ok = rj < halo
            cy = hy_lo + rj // halo_w  # (BLOCK_K,) halo positions
            cx = hx_lo + rj % halo_w
            if TRANSPOSE:
                dy = ry[:, None] - cy[None, :]  # (M, BLOCK_K)
                dx = rx[:, None] - cx[None, :]
            else:
                dy = cy[None, :] - ry[:, None]
                dx = cx[None, :] - rx[:, None]
            a = dy + radius
            b = dx + radius
            inside = (a >= 0) & (a < ksize) & (b >= 0) & (b < ksize) & col_ok[None, :] & row_ok[:, None]
            e = tl.load(kern_head + a * ksize + b, mask=inside, other=0.0)  # (M, BLOCK_K) float32
            xt = tl.load(x_head + (cy * width + cx).to(tl.int64)[:, None] * n_cols + rn[None, :],
                         mask=col_ok[:, None] & n_ok[None, :], other=0.0)  # (BLOCK_K, BLOCK_N)
            if IEEE:
                acc = tl.dot(e, xt, acc, input_precision='ieee')
            else:  # half operands: K as a sum of two half-precision parts, so it cancels the global term alike
                e_hi = e.to(xt.dtype)
                e_lo = (e - e_hi.to(tl.float32)).to(xt.dtype)
                acc = tl.dot(e_hi, xt, acc)
                acc = tl.dot(e_lo, xt, acc)
        glob = tl.load(glob_ptr + head * n_cols + rn, mask=n_ok, other=0.0)  # (BLOCK_N,)
        acc = acc + glob[None, :]
        out_off = (ry * width + rx).to(tl.int64)[:, None] * n_cols + rn[None, :]
        tl.store(out_ptr + head * num_pos * n_cols + out_off, acc, mask=row_ok[:, None] & n_ok[None, :])

    @triton.jit
    def bias_grad_kernel(ds_ptr, x_ptr, dk_ptr, height, width, n_cols, ksize, radius, tiles_x,
                         TY: tl.constexpr, TX: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_S: tl.constexpr):
        # ds (h, T, N) float32, x (h, T, N); dk (h, s * s) float32, one atomic add per (head, offset) per program
        """dK[i, o] += sum over this tile's queries t and channels n of dS[i, t, n] * X[i, t + o, n]."""
        pid_tile = tl.program_id(0)
        head = tl.program_id(1).to(tl.int64)
        pid_n = tl.program_id(2)
        num_pos = height * width
        y0 = (pid_tile // tiles_x) * TY
        x0 = (pid_tile % tiles_x) * TX
        rm = tl.arange(0, TY * TX)
        ry = y0 + rm // TX
        rx = x0 + rm % TX
        row_ok = (ry < height) & (rx < width)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = rn < n_cols
        base = head * num_pos * n_cols
        ds = tl.load(ds_ptr + base + (ry * width + rx).to(tl.int64)[:, None] * n_cols + rn[None, :],
                     mask=row_ok[:, None] & n_ok[None, :], other=0.0).to(tl.float32)  # (M, BLOCK_N)
        ro = tl.arange(0, BLOCK_S)
        acc = tl.zeros((BLOCK_S,), dtype=tl.float32)
        # offsets whose keys can lie on the map for some query of the tile: dy in [-y_last, height - 1 - y0]
        a_lo = tl.maximum(radius - (tl.minimum(y0 + TY, height) - 1), 0)
        a_hi = tl.minimum(radius + height - y0, ksize)
        b_lo = tl.maximum(radius - (tl.minimum(x0 + TX, width) - 1), 0)
        b_hi = tl.minimum(radius + width - x0, ksize)
        for a in range(a_lo, a_hi):
            ky = ry + (a - radius)  # (M,) key row of offset row a
            for b in range(b_lo, b_hi):
                kx = rx + (b - radius)
                ok = row_ok & (ky >= 0) & (ky < height) & (kx >= 0) & (kx < width)
                xt = tl.load(x_ptr + base + (ky * width + kx).to(tl.int64)[:, None] * n_cols + rn[None, :],
                             mask=ok[:, None] & n_ok[None, :], other=0.0).to(tl.float32)  # (M, BLOCK_N)
                val = tl.sum(tl.sum(ds * xt, axis=1), axis=0)
                acc = tl.where(ro == a * ksize + b, acc + val, acc)
        tl.atomic_add(dk_ptr + head * ksize * ksize + ro, acc, mask=ro < ksize * ksize)

    return window_product_kernel, bias_grad_kernel


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _launch(which: int, tensors: Tuple[torch.Tensor, ...], height: int, width: int, ksize: int, **constexprs) -> None:
    """Run kernel ``which`` of ``_build_kernels()`` (built once per interpreter mode) on ``tensors`` (the first
    (h, T, N)), one program per tile, head and block of columns."""
    interpret = _interpret_requested()
    if interpret not in _KERNELS:
        _KERNELS[interpret] = _build_kernels()
    num_heads, _, n_cols = tensors[0].shape
    tiles_x, block_n = -(-width // TILE_X), min(BLOCK_N_MAX, max(16, _next_pow2(n_cols)))
    grid = (-(-height // TILE_Y) * tiles_x, num_heads, -(-n_cols // block_n))
    _KERNELS[interpret][which][grid](*tensors, height, width, n_cols, ksize, ksize // 2, tiles_x, TY=TILE_Y, TX=TILE_X,
                                     BLOCK_N=block_n, **constexprs)


def _operand_dtype(dtype: torch.dtype) -> torch.dtype:
    """Dtype of the product operands: half types stay (tensor cores), everything else is float32."""
    return dtype if dtype in (torch.float16, torch.bfloat16) else torch.float32


def _window_product(x: torch.Tensor, kern: torch.Tensor, glob: torch.Tensor, height: int, width: int, ksize: int,
                    transpose: bool) -> torch.Tensor:
    """``glob + windowed K @ x`` per head (``K^T`` when ``transpose``) for x (h, T, N); returns float32 (h, T, N)."""
    out = torch.empty(x.shape, device=x.device, dtype=torch.float32)
    _launch(0, (x, kern, glob, out), height, width, ksize, TRANSPOSE=transpose, BLOCK_K=BLOCK_K,
            IEEE=x.dtype == torch.float32)
    return out


def _bias_grad(ds: torch.Tensor, x: torch.Tensor, height: int, width: int, ksize: int) -> torch.Tensor:
    """dK (h, s * s) float32: sum over images, channels and queries of dS[t] * X[t + offset]."""
    dk = torch.zeros(x.shape[0], ksize * ksize, device=x.device, dtype=torch.float32)
    _launch(1, (ds, x, dk), height, width, ksize, BLOCK_S=_next_pow2(ksize * ksize))
    return dk


def _mix(k: torch.Tensor, v: torch.Tensor, w: torch.Tensor, op_dtype: torch.dtype):
    """The forward pieces, in float32: exp(k - kmax) (B, H, W, h), X (h, T, B (d + 1)) in ``op_dtype``,
    K (h, s * s), exp(-m) (h,), exp(w - m) (h, s, s), N / D (B, H, W, h, d) and D (B, H, W, h, 1). D is raised to its
    exact lower bound ``exp(min(0, min w) - m) * sum exp(k - kmax)`` and N / D clamped to each image's value range:
    no change where the sums are exact, finite and bounded where the correction cancelled."""
    batch, height, width, num_heads = k.shape
    d, ksize = v.shape[-1] // num_heads, w.shape[-1]
    kf = k.float()
    vf = v.float().view(batch, height, width, num_heads, d)
    kmax = kf.detach().amax(dim=(1, 2), keepdim=True)  # (B, 1, 1, h)
    ek = torch.exp(kf - kmax)  # (B, H, W, h)
    x = torch.cat([ek.unsqueeze(-1) * vf, ek.unsqueeze(-1)], dim=-1)  # (B, H, W, h, d + 1)
    x = x.permute(3, 1, 2, 0, 4).reshape(num_heads, height * width, batch * (d + 1)).to(op_dtype).contiguous()
    wf = w.detach().float()
    m = wf.amax(dim=(1, 2), keepdim=True).clamp_min(0.0)  # (h, 1, 1)
    bias_scale = torch.exp(wf - m)  # (h, s, s)
    floor = torch.exp(-m)  # (h, 1, 1)
    kern = (bias_scale - floor).reshape(num_heads, -1).contiguous()  # (h, s * s)
    colsum = x.float().sum(dim=1)  # (h, N): the same rounded operand as the kernel's, so the split cancels alike
    glob = floor.view(num_heads, 1) * colsum  # (h, N): the exp(-m) part of E, over all keys
    s = _window_product(x, kern, glob, height, width, ksize, transpose=False)  # (h, T, N)
    s = s.view(num_heads, height, width, batch, d + 1).permute(3, 1, 2, 0, 4)  # (B, H, W, h, d + 1)
    numer, denom = s[..., :d], s[..., d:]
    lowest = torch.exp(wf.amin(dim=(1, 2)).clamp_max(0.0) - m.view(num_heads))  # (h,) smallest entry of E
    bound = lowest[:, None] * colsum.view(num_heads, batch, d + 1)[..., d]  # (h, B)
    denom = torch.maximum(denom, bound.t().reshape(batch, 1, 1, num_heads, 1))  # (B, H, W, h, 1)
    v_lo = vf.detach().amin(dim=(1, 2), keepdim=True)  # (B, 1, 1, h, d)
    v_hi = vf.detach().amax(dim=(1, 2), keepdim=True)
    mixed = torch.minimum(torch.maximum(numer / denom, v_lo), v_hi)  # (B, H, W, h, d)
    return ek, x, kern, floor.view(num_heads), bias_scale, mixed, denom


class _AFTConv2dTriton(torch.autograd.Function):

    @staticmethod
    def forward(ctx, q, k, v, w):
        out_dtype = output_dtype(q, k, v)
        mixed = _mix(k, v, w, _operand_dtype(out_dtype))[5]  # (B, H, W, h, d)
        ctx.save_for_backward(q, k, v, w)
        return (torch.sigmoid(q.float()).view(mixed.shape) * mixed).reshape(q.shape).to(out_dtype)  # (B, H, W, C)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, w = ctx.saved_tensors
        (batch, height, width, channels), num_heads, ksize = q.shape, k.shape[-1], w.shape[-1]
        d, op_dtype = channels // num_heads, _operand_dtype(output_dtype(q, k, v))
        ek, x, kern, floor, bias_scale, mixed, denom = _mix(k, v, w, op_dtype)  # recomputed forward
        shape5 = (batch, height, width, num_heads, d)
        gate = torch.sigmoid(q.float()).view(shape5)
        g = grad_out.float().reshape(shape5)
        dq = g * mixed * gate * (1.0 - gate)
        g_gated = g * gate
        d_numer = g_gated / denom
        d_denom = -(g_gated * mixed).sum(dim=-1, keepdim=True) / denom  # (B, H, W, h, 1)
        ds = torch.cat([d_numer, d_denom], dim=-1)  # (B, H, W, h, d + 1)
        ds = ds.permute(3, 1, 2, 0, 4).reshape(num_heads, height * width, batch * (d + 1)).contiguous()  # (h, T, N)
        dk = dv = dw = None
        if ctx.needs_input_grad[1] or ctx.needs_input_grad[2]:
            ds_op = ds.to(op_dtype if op_dtype == torch.bfloat16 else torch.float32)  # G / D may overflow float16
            glob_t = floor[:, None] * ds_op.float().sum(dim=1)  # (h, N)
            dx = _window_product(ds_op, kern, glob_t, height, width, ksize, transpose=True)  # (h, T, N)
            dx = dx.view(num_heads, height, width, batch, d + 1).permute(3, 1, 2, 0, 4)  # (B, H, W, h, d + 1)
            dxv, dxd = dx[..., :d], dx[..., d:]
            ek5 = ek.unsqueeze(-1)  # (B, H, W, h, 1)
            dv = (dxv * ek5).reshape(q.shape).to(v.dtype)
            vf = v.float().view(shape5)
            dk = (ek5 * ((dxv * vf).sum(dim=-1, keepdim=True) + dxd)).reshape(k.shape).to(k.dtype)
        if ctx.needs_input_grad[3]:
            dkern = _bias_grad(ds, x, height, width, ksize).view(num_heads, ksize, ksize)  # (h, s, s)
            dw = (dkern * bias_scale).to(w.dtype)
        return dq.reshape(q.shape).to(q.dtype), dk, dv, dw


def aft_conv2d_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """AFT-conv (Eq. 6) by the fused Triton kernel, ``aft_conv2d``'s contract with s <= 31, no host sync and no repair
    under either policy: error about float32 eps times ``exp(max(0, -min w))`` of the value scale, finite and bounded
    for any finite input (docs/operators.md). RuntimeError where Triton cannot run (no CUDA, no interpreter)."""
    check_conv_inputs(q, k, v, w)
    reason = None if triton_available() else (triton_unavailable_reason() or 'triton_available() is False')
    if reason is None and q.device.type != 'cuda' and not _interpret_requested():
        reason = f'tensors on {q.device} need the Triton interpreter (set TRITON_INTERPRET=1 before first use)'
    if reason is not None:
        raise RuntimeError(f"aft_conv2d(method='triton') cannot run: {reason}")
    if w.shape[-1] > MAX_KERNEL_SIZE:
        raise ValueError(f'the Triton kernel supports s <= {MAX_KERNEL_SIZE}, got w of shape {list(w.shape)}')
    return _AFTConv2dTriton.apply(q, k, v, w.to(q.device))
