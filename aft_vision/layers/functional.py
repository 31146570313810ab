"""Functional AFT operators: Eqs. 2, 4, 5 and 6 of Zhai et al., "An Attention Free Transformer" (arXiv 2105.14103).

Like ``torch.nn.functional.scaled_dot_product_attention``, these take projected queries, keys and values and return
the mixed tokens. All of them:

* subtract maxima before ``exp`` (keys per image and channel over positions, biases per query row), never across
  the batch, and recompute exactly any entry whose shifted terms underflowed (see ``_stable.py``), so the result is
  finite and accurate for any finite input;
* run the exp-and-sum arithmetic in float32 (float64 for float64 inputs) with autocast disabled, and return the
  promoted input dtype (bfloat16 in, bfloat16 out under autocast);
* never build a (B, T, T, C) tensor.
"""
import contextlib
from typing import List

import torch
import torch.nn.functional as F
from timm.layers import register_notrace_function

from ._stable import TINY, any_flagged, conv_bias_rows, exporting, recompute_flagged, safe_ratio

__all__ = ['aft_full', 'aft_local', 'aft_simple', 'aft_conv2d']

# A shifted AFT-conv denominator below this fraction of its scale is dominated by the cancellation in
# ``exp(w) - 1``: such entries are recomputed exactly.
_CANCEL_TOL = 1e-2
# aft_conv2d(method='auto') uses the dense per-head product while h * T * T stays below this many elements.
_DENSE_MAX_ELEMENTS = 1 << 20


def _check(name: str, tensor: torch.Tensor, ndim: int, layout: str):
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f'{name} must be a torch.Tensor, got {type(tensor).__name__}')
    if not tensor.is_floating_point():
        raise ValueError(f'{name} must be a floating-point tensor, got dtype {tensor.dtype}')
    if tensor.dim() != ndim:
        raise ValueError(f'{name} must be {ndim}-D {layout}, got shape {list(tensor.shape)}')


def _check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ndim: int, layout: str, key_layout: str):
    _check('q', q, ndim, layout)
    _check('k', k, ndim, key_layout)
    _check('v', v, ndim, layout)
    if q.shape != v.shape:
        raise ValueError(f'q and v must have the same shape {layout}, got q {list(q.shape)} and v {list(v.shape)}')
    if k.shape[:-1] != q.shape[:-1]:
        raise ValueError(f'k must match q in every dim but the last, got q {list(q.shape)} and k {list(k.shape)}')
    if q.device != k.device or q.device != v.device:
        raise ValueError(f'q, k and v must be on one device, got {q.device}, {k.device} and {v.device}')
    if q.numel() == 0:
        raise ValueError(f'q must not be empty, got shape {list(q.shape)}')


@register_notrace_function
def check_tokens(x: torch.Tensor, layout: str, dim: int, seq_len: int = -1) -> None:
    """Check a module input: ``x`` must be ``len(layout)``-D with last dim ``dim`` (and ``seq_len`` tokens if >= 0).

    Registered as an fx leaf, so symbolic tracing records the check instead of branching on proxies.
    """
    ndim = 4 if layout.startswith('(B, H, W') else 3
    if x.dim() != ndim or x.shape[-1] != dim or (seq_len >= 0 and x.shape[1] != seq_len):
        raise ValueError(f'expected tokens {layout}, got shape {list(x.shape)}')


def _check_bias(w: torch.Tensor, seq_len: int):
    _check('w', w, 2, '(T, T)')
    if w.shape[0] != seq_len or w.shape[1] != seq_len:
        raise ValueError(f'w must have shape (T, T) = ({seq_len}, {seq_len}), got {list(w.shape)}')


def _compute_dtype(tensors: List[torch.Tensor]) -> torch.dtype:
    for tensor in tensors:
        if tensor.dtype == torch.float64:
            return torch.float64
    return torch.float32


def _output_dtype(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.dtype:
    return torch.promote_types(torch.promote_types(q.dtype, k.dtype), v.dtype)


def _full_precision(device: torch.device):
    """Disable autocast so matmul and conv run in the dtype we cast to."""
    if device.type in ('cpu', 'cuda', 'xpu', 'mps') and torch.is_autocast_enabled(device.type):
        return torch.autocast(device_type=device.type, enabled=False)
    return contextlib.nullcontext()


def _pairwise_average(k: torch.Tensor, v: torch.Tensor, log_bias: torch.Tensor, tiny: float = TINY) -> torch.Tensor:
    """Weighted average with a (T, T) log bias shared by all channels; k, v (B, T, C) -> (B, T, C)."""
    num_channels = v.shape[-1]
    bias_max = log_bias.amax(dim=-1, keepdim=True).detach()  # (T, 1), finite: the diagonal is never masked
    weights = torch.exp(log_bias - bias_max)  # (T, T)
    exp_k = torch.exp(k - k.amax(dim=1, keepdim=True).detach())  # (B, T, C)
    tokens = torch.cat([exp_k * v, exp_k], dim=-1).transpose(0, 1)  # (T, B, 2C)
    sums = torch.mm(weights, tokens.reshape(tokens.shape[0], -1)).view(tokens.shape).transpose(0, 1)  # (B, T, 2C)
    numerator, denominator = sums[..., :num_channels], sums[..., num_channels:]
    bad = denominator < tiny
    if not any_flagged(bad):
        return numerator / denominator
    return recompute_flagged(safe_ratio(numerator, denominator, bad), bad, k, v, 'pairwise', bias=log_bias)


@register_notrace_function
def aft_full(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, w: torch.Tensor, causal: bool = False) -> torch.Tensor:
    """AFT-full (Eq. 2): ``sigmoid(q_t) * sum_t' exp(k_t' + w_tt') v_t' / sum_t' exp(k_t' + w_tt')``.

    Memory is O(B * T * C) plus the (T, T) bias: the bias is exponentiated once and applied with one matrix product.

    Args:
        q: Queries (B, T, C), before the sigmoid.
        k: Keys (B, T, C).
        v: Values (B, T, C).
        w: Pair-wise position bias (T, T); ``w[t, t']`` links query t to key t'.
        causal: Restrict the sums to t' <= t.

    Returns:
        Mixed tokens (B, T, C) in the promoted dtype of q, k and v.
    """
    _check_qkv(q, k, v, 3, '(B, T, C)', '(B, T, C)')
    if k.shape != q.shape:
        raise ValueError(f'k must have the shape of q (B, T, C), got q {list(q.shape)} and k {list(k.shape)}')
    _check_bias(w, q.shape[1])
    if torch.jit.is_scripting():
        return _aft_full(q, k, v, w, causal)
    with _full_precision(q.device):
        return _aft_full(q, k, v, w, causal)


def _aft_full(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, w: torch.Tensor, causal: bool) -> torch.Tensor:
    out_dtype = _output_dtype(q, k, v)
    dtype = _compute_dtype([q, k, v, w])
    q, k, v, w = q.to(dtype), k.to(dtype), v.to(dtype), w.to(device=q.device, dtype=dtype)
    if causal:
        later = torch.ones_like(w, dtype=torch.bool).triu(1)
        w = w.masked_fill(later, float('-inf'))
    out = torch.sigmoid(q) * _pairwise_average(k, v, w)
    return out.to(out_dtype)


@register_notrace_function
def aft_local(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        w: torch.Tensor,
        window: int,
        causal: bool = False,
) -> torch.Tensor:
    """AFT-local (Eq. 4): AFT-full with ``w[t, t']`` replaced by 0 where ``|t - t'| >= window``.

    Positions outside the window still contribute with bias 0 (global connectivity), unlike hard-local attention.

    Args:
        q: Queries (B, T, C), before the sigmoid.
        k: Keys (B, T, C).
        v: Values (B, T, C).
        w: Pair-wise position bias (T, T).
        window: Window size s >= 1; ``window >= T`` gives AFT-full.
        causal: Restrict the sums to t' <= t.

    Returns:
        Mixed tokens (B, T, C).
    """
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f'window must be a positive int, got {window}')
    _check('w', w, 2, '(T, T)')
    pos = torch.arange(w.shape[0], device=w.device)
    outside = (pos.unsqueeze(1) - pos.unsqueeze(0)).abs() >= window  # (T, T)
    return aft_full(q, k, v, w.masked_fill(outside, 0.0), causal=causal)


@register_notrace_function
def aft_simple(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False) -> torch.Tensor:
    """AFT-simple (Eq. 5): ``sigmoid(q_t) * sum_t' softmax(k)_t' v_t'``, linear in T.

    Args:
        q: Queries (B, T, C), before the sigmoid.
        k: Keys (B, T, C).
        v: Values (B, T, C).
        causal: Restrict the sums to t' <= t (prefix sums).

    Returns:
        Mixed tokens (B, T, C).
    """
    _check_qkv(q, k, v, 3, '(B, T, C)', '(B, T, C)')
    if k.shape != q.shape:
        raise ValueError(f'k must have the shape of q (B, T, C), got q {list(q.shape)} and k {list(k.shape)}')
    if torch.jit.is_scripting():
        return _aft_simple(q, k, v, causal)
    with _full_precision(q.device):
        return _aft_simple(q, k, v, causal)


def _aft_simple(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, tiny: float = TINY) -> torch.Tensor:
    out_dtype = _output_dtype(q, k, v)
    dtype = _compute_dtype([q, k, v])
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    if causal:
        exp_k = torch.exp(k - k.amax(dim=1, keepdim=True).detach())  # (B, T, C)
        numerator = torch.cumsum(exp_k * v, dim=1)
        denominator = torch.cumsum(exp_k, dim=1)
        bad = denominator < tiny
        if any_flagged(bad):
            mixed = recompute_flagged(safe_ratio(numerator, denominator, bad), bad, k, v, 'none', causal=True)
        else:
            mixed = numerator / denominator
    else:
        mixed = (F.softmax(k, dim=1) * v).sum(dim=1, keepdim=True)  # (B, 1, C)
    out = torch.sigmoid(q) * mixed
    return out.to(out_dtype)


def _conv_sums_depthwise(exp_kv: torch.Tensor, exp_k: torch.Tensor, w: torch.Tensor, bias_max: torch.Tensor):
    """Numerator and denominator of Eq. 6 by one depthwise convolution, and sum(exp(k)); NHWC in, NHWC out."""
    num_heads, s = w.shape[0], w.shape[-1]
    head_dim = exp_kv.shape[-1] // num_heads
    floor = torch.exp(-bias_max)  # (h,) weight of a key outside the window
    kernel = torch.exp(w - bias_max.view(-1, 1, 1)) - floor.view(-1, 1, 1)  # (h, s, s): exp(w) - 1, shifted
    kernel = torch.cat([kernel.repeat_interleave(head_dim, dim=0), kernel])  # (C + h, s, s)
    floor = torch.cat([floor.repeat_interleave(head_dim), floor])  # (C + h,)
    tokens = torch.cat([exp_kv, exp_k], dim=-1)  # (B, H, W, C + h)
    # NHWC tokens are a channels-last NCHW view: the depthwise convolution reads them without a copy
    local = F.conv2d(tokens.permute(0, 3, 1, 2), kernel.unsqueeze(1), padding=s // 2, groups=kernel.shape[0])
    totals = tokens.sum(dim=(1, 2), keepdim=True)  # (B, 1, 1, C + h)
    return local.permute(0, 2, 3, 1) + totals * floor, totals[..., -num_heads:]


def _conv_sums_dense(exp_kv: torch.Tensor, exp_k: torch.Tensor, log_bias: torch.Tensor):
    """Numerator and denominator of Eq. 6 by a per-head (h, T, T) product; NHWC in, NHWC out."""
    batch, height, width, num_heads = exp_k.shape
    num_keys = height * width
    tokens = torch.cat([exp_kv.view(batch, num_keys, num_heads, -1), exp_k.view(batch, num_keys, num_heads, 1)], dim=-1)
    tokens = tokens.permute(2, 1, 0, 3)  # (h, T, B, d + 1)
    weights = torch.exp(log_bias - log_bias.amax(dim=-1, keepdim=True).detach())  # (h, T, T)
    sums = torch.bmm(weights, tokens.reshape(num_heads, num_keys, -1)).view(tokens.shape)  # (h, T, B, d + 1)
    sums = sums.permute(2, 1, 0, 3)  # (B, T, h, d + 1)
    return torch.cat([
        sums[..., :-1].reshape(batch, height, width, -1),
        sums[..., -1].reshape(batch, height, width, num_heads),
    ], dim=-1)


def check_conv_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, w: torch.Tensor) -> None:
    """Check AFT-conv's q, v (B, H, W, C), k (B, H, W, h) with h dividing C, and w (h, s, s) with s odd."""
    _check_qkv(q, k, v, 4, '(B, H, W, C)', '(B, H, W, h)')
    _check('w', w, 3, '(h, s, s)')
    channels, num_heads = q.shape[-1], k.shape[-1]
    if channels % num_heads:
        raise ValueError(f'C = {channels} (q {list(q.shape)}) is not divisible by h = {num_heads} '
                         f'(k {list(k.shape)})')
    if w.shape[0] != num_heads or w.shape[1] != w.shape[2]:
        raise ValueError(f'w must have shape (h, s, s) with h = {num_heads}, got {list(w.shape)}')
    if w.shape[1] % 2 == 0:
        raise ValueError(f'kernel size s must be odd, got w of shape {list(w.shape)}')


@register_notrace_function
def aft_conv2d(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        w: torch.Tensor,
        method: str = 'auto',
) -> torch.Tensor:
    """AFT-conv (Eq. 6) on a 2-D token grid.

    ``sigmoid(q) * (conv(exp(k) v, exp(w) - 1) + sum exp(k) v) / (conv(exp(k), exp(w) - 1) + sum exp(k))``: every key
    of the image contributes, keys inside the s x s window around the query with the extra bias ``w``.

    Two exact evaluations, chosen by ``method``:

    * ``'conv'``: one depthwise (``groups``) convolution over the NHWC tokens plus a global sum, O(T s^2 C).
    * ``'dense'``: the (h, T, T) per-head bias matrix times the tokens, O(T^2 C), faster for small maps.
    * ``'auto'`` (default): ``'dense'`` while h * T * T <= 2**20 elements, else ``'conv'``; always ``'conv'``
      while exporting (torch.export / ONNX), so the graph works at any input size.

    Exported graphs also leave out the exact recomputation of underflowed entries (``_stable.py``), which needs a
    data-dependent branch; it matters only for extreme inputs (key or bias gaps beyond ~50).

    Args:
        q: Queries (B, H, W, C), before the sigmoid.
        k: Keys (B, H, W, h), one channel per head; channel c of q and v belongs to head ``c // (C // h)``.
        v: Values (B, H, W, C).
        w: Position bias (h, s, s), s odd; ``w[i, a, b]`` links the query at (y, x) to the key at
            (y + a - s//2, x + b - s//2). The window may be larger than the map.
        method: ``'auto'``, ``'conv'`` or ``'dense'``.

    Returns:
        Mixed tokens (B, H, W, C).
    """
    check_conv_inputs(q, k, v, w)
    if method not in ('auto', 'conv', 'dense'):
        raise ValueError(f"method must be 'auto', 'conv' or 'dense', got '{method}'")
    if torch.jit.is_scripting():
        return _aft_conv2d(q, k, v, w, method)
    with _full_precision(q.device):
        return _aft_conv2d(q, k, v, w, method)


def _aft_conv2d(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        w: torch.Tensor,
        method: str,
        tiny: float = TINY,
        cancel_tol: float = _CANCEL_TOL,
        dense_max_elements: int = _DENSE_MAX_ELEMENTS,
) -> torch.Tensor:
    batch, height, width, channels = q.shape
    num_heads = k.shape[-1]
    num_keys = height * width
    if method == 'auto':  # exported graphs take the convolution: it holds for every input size
        small = num_heads * num_keys * num_keys <= dense_max_elements
        method = 'dense' if small and not exporting() else 'conv'
    head_dim = channels // num_heads
    out_dtype = _output_dtype(q, k, v)
    dtype = _compute_dtype([q, k, v, w])
    q, k, v, w = q.to(dtype), k.to(dtype), v.to(dtype), w.to(device=q.device, dtype=dtype)
    exp_k = torch.exp(k - k.amax(dim=(1, 2), keepdim=True).detach())  # (B, H, W, h)
    exp_kv = (exp_k.unsqueeze(-1) * v.view(batch, height, width, num_heads, head_dim)).flatten(3)  # (B, H, W, C)
    if method == 'dense':
        pos = torch.arange(num_keys, device=q.device)
        heads = torch.arange(num_heads, device=q.device)
        log_bias = conv_bias_rows(w, width, num_keys, heads.unsqueeze(1), pos.unsqueeze(0))  # (h, T, T)
        sums = _conv_sums_dense(exp_kv, exp_k, log_bias)
        limit = torch.full([1, 1, 1, num_heads], tiny, dtype=dtype, device=q.device)
    else:
        bias_max = w.detach().amax(dim=(1, 2)).clamp_min(0.0)  # (h,)
        sums, key_totals = _conv_sums_depthwise(exp_kv, exp_k, w, bias_max)
        limit = (key_totals.detach() * torch.exp(-bias_max) * cancel_tol).clamp_min(tiny)  # (B, 1, 1, h)
    numerator = sums[..., :channels].view(batch, height, width, num_heads, head_dim)
    denominator = sums[..., channels:].unsqueeze(-1)  # (B, H, W, h, 1), broadcast over each head's channels
    bad = denominator < limit.unsqueeze(-1)
    if any_flagged(bad):
        flags = bad.expand(numerator.shape).reshape(batch, num_keys, channels)
        mixed = safe_ratio(numerator, denominator, bad).reshape(batch, num_keys, channels)
        mixed = recompute_flagged(
            mixed, flags, k.reshape(batch, num_keys, num_heads), v.reshape(batch, num_keys, channels),
            'conv', bias=w, grid_w=width,
        ).view(batch, height, width, num_heads, head_dim)
    else:
        mixed = numerator / denominator
    out = (torch.sigmoid(q).reshape(mixed.shape) * mixed).view(batch, height, width, channels)
    return out.to(out_dtype)
