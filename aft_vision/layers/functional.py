"""Functional AFT operators (Eqs. 2, 4, 5, 6 of Zhai et al., arXiv 2105.14103), like ``F.scaled_dot_product_attention``:
projected q, k, v in, mixed tokens out (promoted dtype); no (B, T, T, C) tensor. Each call checks its inputs, picks
its form and dtypes here, then runs one form file (``dense_mix.py``: the products; ``depthwise_mix.py``: the window;
``simple_mix.py``). Under the 'cpu' policy exact to the rounding of the operands for any finite input (the repair of
``_stable.py``); under 'cuda' (and when captured) finite for any finite input, exact within the bounds each function
states (docs/operators.md)."""
from typing import List, Optional

import torch
from timm.layers import register_notrace_function

from ._stable import CANCEL_TOL, TINY, flag_below, recompute_flagged
from .dense_mix import dense_mix
from .depthwise_mix import depthwise_mix
from .dispatch import (DISPATCH_TABLES, capturing, check_choice, exporting, forced_policy, get_conv_method, no_autocast,
                       plain_forms)
from .simple_mix import simple_mix
from .tuning import tuned_method

__all__ = ['aft_full', 'aft_local', 'aft_simple', 'aft_conv2d', 'choose_conv_method', 'get_device_policy',
           'product_dtype', 'compute_dtype', 'output_dtype', 'check_conv_inputs']


def check_tensor(name: str, tensor: torch.Tensor, ndim: int, layout: str):
    """``tensor`` (argument ``name``): a floating-point torch.Tensor with ``ndim`` dims laid out as ``layout``."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f'{name} must be a torch.Tensor, got {type(tensor).__name__}')
    if not tensor.is_floating_point():
        raise ValueError(f'{name} must be a floating-point tensor, got dtype {tensor.dtype}')
    if tensor.dim() != ndim:
        raise ValueError(f'{name} must be {ndim}-D {layout}, got shape {list(tensor.shape)}')


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ndim: int, layout: str, key_layout: str):
    """q and v in ``layout``, k in ``key_layout`` over the same positions, one device, empty in the batch only."""
    for name, tensor, tensor_layout in (('q', q, layout), ('k', k, key_layout), ('v', v, layout)):
        check_tensor(name, tensor, ndim, tensor_layout)
    if q.shape != v.shape:
        raise ValueError(f'q and v must have the same shape {layout}, got q {list(q.shape)} and v {list(v.shape)}')
    if k.shape[:-1] != q.shape[:-1]:
        raise ValueError(f'k must match q in every dim but the last, got q {list(q.shape)} and k {list(k.shape)}')
    if q.device != k.device or q.device != v.device:
        raise ValueError(f'q, k and v must be on one device, got {q.device}, {k.device} and {v.device}')
    if key_layout == layout and k.shape != q.shape:
        raise ValueError(f'k must have the shape of q {layout}, got q {list(q.shape)} and k {list(k.shape)}')
    if q.numel() == 0 and q.shape[0] != 0:
        raise ValueError(f'q must not be empty but in its batch dim, got shape {list(q.shape)}')


def check_conv_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, w: torch.Tensor) -> None:
    """Check AFT-conv's q, v (B, H, W, C), k (B, H, W, h) with h dividing C, and w (h, s, s) with s odd."""
    check_qkv(q, k, v, 4, '(B, H, W, C)', '(B, H, W, h)')
    check_tensor('w', w, 3, '(h, s, s)')
    channels, num_heads = q.shape[-1], k.shape[-1]
    if channels % num_heads:
        raise ValueError(f'C = {channels} (q {list(q.shape)}) is not divisible by h = {num_heads} '
                         f'(k {list(k.shape)})')
    if w.shape[0] != num_heads or w.shape[1] != w.shape[2]:
        raise ValueError(f'w must have shape (h, s, s) with h = {num_heads}, got {list(w.shape)}')
    if w.shape[1] % 2 == 0:
        raise ValueError(f'kernel size s must be odd, got w of shape {list(w.shape)}')


def compute_dtype(tensors: List[torch.Tensor]) -> torch.dtype:
    """The dtype of the operators' float arithmetic: float64 if any input is float64, else float32."""
    return torch.float64 if any([tensor.dtype == torch.float64 for tensor in tensors]) else torch.float32


def output_dtype(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.dtype:
    return torch.promote_types(torch.promote_types(q.dtype, k.dtype), v.dtype)


def get_device_policy(device: torch.device) -> str:
    """'cuda' while ``capturing()``, else ``forced_policy()``, else 'cuda' on CUDA and 'cpu' elsewhere."""
    return 'cuda' if capturing() else forced_policy() or ('cuda' if device.type == 'cuda' else 'cpu')


def product_dtype(device: torch.device, input_dtype: torch.dtype, compute_dtype: torch.dtype) -> torch.dtype:
    """The dtype of the products form's operands (float32 accumulation): bfloat16 under bfloat16 autocast or for
    bfloat16 inputs, else ``compute_dtype`` (float16's range cannot hold the softmax-scaled sums). Call it before
    autocast is disabled."""
    autocast = device.type in ('cpu', 'cuda', 'xpu', 'mps') and torch.is_autocast_enabled(device.type)
    half = torch.get_autocast_dtype(device.type) if autocast else input_dtype
    return half if half == torch.bfloat16 and compute_dtype == torch.float32 else compute_dtype


_COMPILED_BATCH = 64  # the batch 'auto' assumes in a compiled graph, whose batch size may change between calls


def choose_conv_method(device_type: str, batch: int, height: int, width: int, channels: int, num_heads: int,
                       kernel_size: int) -> str:
    """'dense' or 'conv' for B, H, W, C, h, s on ``device_type`` (others use the CPU table): the cheaper of
    ``T^2 (C + h) (1 + kappa h / (B (C + h)))`` and ``ratio T A (C + h) + beta`` (A: the usable window) per image."""
    ratio, kappa, beta, max_weights = DISPATCH_TABLES['cuda' if device_type == 'cuda' else 'cpu']
    num_keys, width_n = height * width, channels + num_heads
    window = min(kernel_size, 2 * height - 1) * min(kernel_size, 2 * width - 1)
    dense = num_keys * num_keys * width_n * (1.0 + kappa * num_heads / (batch * width_n))
    conv = ratio * num_keys * window * width_n + beta
    return 'dense' if dense <= conv and num_heads * num_keys * num_keys <= max_weights else 'conv'


def _operands(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dtype: torch.dtype, mm_dtype: torch.dtype):
    """q, k, v as the products form takes them: as given in ``mm_dtype`` (16-bit), else in ``dtype``."""
    return [x if x.dtype == mm_dtype else x.to(dtype) for x in [q, k, v]]


@register_notrace_function
def aft_full(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, w: torch.Tensor, causal: bool = False) -> torch.Tensor:
    """AFT-full (Eq. 2): ``sigmoid(q_t) * sum_t' exp(k_t' + w_tt') v_t' / sum_t' exp(k_t' + w_tt')`` for q, k, v
    (B, T, C) and a (T, T) bias ``w[query, key]``, by ``dense_mix.py``; ``causal`` keeps t' <= t. Under 'cuda' exact
    to rounding while each row of ``w`` and the keys each span less than ~40 (beyond, finite)."""
    check_qkv(q, k, v, 3, '(B, T, C)', '(B, T, C)')
    check_tensor('w', w, 2, '(T, T)')
    if w.shape[0] != q.shape[1] or w.shape[1] != q.shape[1]:
        raise ValueError(f'w must have shape (T, T) = ({q.shape[1]}, {q.shape[1]}), got {list(w.shape)}')
    out_dtype = output_dtype(q, k, v)
    dtype = compute_dtype([q, k, v, w])
    if q.shape[0] == 0:  # an empty batch, as timm's attention answers it
        return (q * 0.0).to(out_dtype)
    if torch.jit.is_scripting():
        return _aft_full(q, k, v, w, causal, dtype, dtype, 'cpu', True).to(out_dtype)
    else:
        plain = plain_forms()
        policy = get_device_policy(q.device)
        mm_dtype = product_dtype(q.device, out_dtype, dtype)
        with no_autocast():
            return _aft_full(q, k, v, w, causal, dtype, mm_dtype, policy, plain).to(out_dtype)


def _aft_full(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, w: torch.Tensor, causal: bool, dtype: torch.dtype,
              mm_dtype: torch.dtype, policy: str, plain: bool, tiny: float = TINY) -> torch.Tensor:
    q, k, v = _operands(q, k, v, dtype, mm_dtype)
    w = w.to(device=q.device, dtype=dtype)
    out, denominator = dense_mix(q, k, v, w, None, causal, mm_dtype, policy, plain)
    bad = flag_below(denominator, denominator.new_full((), 2 * tiny), policy)  # (B, T, C): underflowed (floored)
    if bad is not None:
        if causal:
            w = w.masked_fill(torch.ones_like(w, dtype=torch.bool).triu(1), float('-inf'))
        out = recompute_flagged(out.to(dtype), bad, k.to(dtype), v.to(dtype), 'pairwise', bias=w, gate=q.to(dtype))
    return out


@register_notrace_function
def aft_local(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, w: torch.Tensor, window: int,
              causal: bool = False) -> torch.Tensor:
    """AFT-local (Eq. 4): ``aft_full`` with ``w[t, t']`` set to 0 where ``|t - t'| >= window`` (keys outside the
    window still contribute, with bias 0)."""
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f'window must be a positive int, got {window}')
    check_tensor('w', w, 2, '(T, T)')
    pos = torch.arange(w.shape[0], device=w.device)
    outside = (pos.unsqueeze(1) - pos.unsqueeze(0)).abs() >= window  # (T, T)
    return aft_full(q, k, v, w.masked_fill(outside, 0.0), causal=causal)


@register_notrace_function
def aft_simple(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False) -> torch.Tensor:
    """AFT-simple (Eq. 5): ``sigmoid(q_t) * sum_t' softmax(k)_t' v_t'`` for q, k, v (B, T, C), linear in T, in the
    inputs' dtype (bfloat16 under autocast; sums in float32); ``causal`` takes prefix sums, in float32 (under 'cuda'
    exact while a prefix's largest key is within ~50 of the maximum)."""
    check_qkv(q, k, v, 3, '(B, T, C)', '(B, T, C)')
    out_dtype = output_dtype(q, k, v)
    dtype = compute_dtype([q, k, v])
    if q.shape[0] == 0:
        return (q * 0.0).to(out_dtype)
    if not torch.jit.is_scripting():
        mm_dtype = product_dtype(q.device, out_dtype, dtype)
        with no_autocast():
            policy = get_device_policy(q.device)
            return _aft_simple(q, k, v, causal, dtype, mm_dtype, policy, plain_forms()).to(out_dtype)
    else:
        return _aft_simple(q, k, v, causal, dtype, dtype, 'cpu', True).to(out_dtype)


def _aft_simple(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, dtype: torch.dtype,
                mm_dtype: torch.dtype, policy: str, plain: bool, tiny: float = TINY) -> torch.Tensor:
    if not causal:
        q, k, v = _operands(q, k, v, dtype, mm_dtype)
    out, denominator = simple_mix(q, k, v, causal, dtype, plain)
    if causal and denominator is not None:  # a prefix whose keys all lie far below the sequence's largest
        bad = flag_below(denominator, denominator.new_full((), tiny), policy)
        if bad is not None:
            out = recompute_flagged(out, bad, k.to(dtype), v.to(dtype), 'none', causal=True, gate=q.to(dtype))
    return out


@register_notrace_function
def aft_conv2d(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, w: torch.Tensor,
               method: Optional[str] = None) -> torch.Tensor:
    """AFT-conv (Eq. 6) on a 2-D token grid: every key of the image contributes, those inside the s x s window
    around the query with the extra bias ``w``.

    ``method`` (None: ``get_conv_method()``): 'dense' (the products, ``dense_mix.py``), 'conv' (the window,
    ``depthwise_mix.py``), 'auto' (``choose_conv_method``) or 'tuned' (the faster on the first call of its key,
    ``tuning.py``); 'conv' for both while exporting. Under 'cuda' the dense form is exact to rounding while a head's
    bias and its keys each span less than ~40, the conv form's D (float32) to ``6e-8 * exp(max(0, -min w))`` of
    itself, its N to its operands' rounding (bfloat16 under bfloat16) times as much.

    Args:
        q: Queries (B, H, W, C), before the sigmoid. v: Values (B, H, W, C).
        k: Keys (B, H, W, h), one per head; channel c of q and v belongs to head ``c // (C // h)``.
        w: Position bias (h, s, s), s odd; ``w[i, a, b]`` links the query at (y, x) to the key at
            (y + a - s//2, x + b - s//2). The window may be larger than the map.
    """
    check_conv_inputs(q, k, v, w)
    out_dtype = output_dtype(q, k, v)
    dtype = compute_dtype([q, k, v, w])
    if q.shape[0] == 0:
        return (q * 0.0).to(out_dtype)
    if not torch.jit.is_scripting():
        method = check_choice(get_conv_method() if method is None else method)
        if method == 'tuned' and not exporting():  # the form timed fastest for such calls here (tuning.py), or 'auto'
            method = tuned_method(q, k, v, w, product_dtype(q.device, out_dtype, dtype), aft_conv2d)
        if exporting() and method in ('auto', 'tuned'):  # the conv form runs at any size on any runtime
            method = 'conv'
        elif method == 'auto':  # the cost model's choice on the tensors' device
            batch, height, width, channels = q.shape
            if torch.compiler.is_compiling():  # the batch may be symbolic: decide by the map alone, no guard on it
                batch = _COMPILED_BATCH
            method = choose_conv_method(q.device.type, batch, height, width, channels, k.shape[-1], w.shape[-1])
        plain = plain_forms()
        policy = get_device_policy(q.device)
        mm_dtype = product_dtype(q.device, out_dtype, dtype)
        with no_autocast():
            return _aft_conv2d(q, k, v, w, method, dtype, mm_dtype, policy, plain).to(out_dtype)
    else:  # TorchScript, like export, takes the convolution for 'auto'
        dense = method is not None and method == 'dense'
        return _aft_conv2d(q, k, v, w, 'dense' if dense else 'conv', dtype, dtype, 'cpu', True).to(out_dtype)


def _aft_conv2d(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, w: torch.Tensor, method: str, dtype: torch.dtype,
                mm_dtype: torch.dtype, policy: str, plain: bool, tiny: float = TINY,
                cancel_tol: float = CANCEL_TOL) -> torch.Tensor:
    """The output of the dense or conv form, repaired under the 'cpu' policy."""
    batch, height, width, channels = q.shape
    num_heads = k.shape[-1]
    num_keys = height * width
    w = w.to(q.device)
    if method == 'dense':
        rows = [x.flatten(1, 2) for x in _operands(q, k, v, dtype, mm_dtype)]  # (B, T, .) token rows
        out, denominator = dense_mix(rows[0], rows[1], rows[2], w.to(dtype), (height, width), False, mm_dtype, policy,
                                     plain)
        out, denominator = out.view(q.shape), denominator.view(k.shape)
        threshold = denominator.new_full((), 2 * tiny)  # the largest joint term underflowed (D floored at tiny)
    else:
        out, denominator, scale = depthwise_mix(q, k, v, w, dtype, mm_dtype, policy, plain)
        threshold = (scale * cancel_tol).clamp_min(tiny)  # (B, 1, 1, h): mostly cancellation (or underflow)
    bad = flag_below(denominator, threshold, policy)  # (B, H, W, h)
    if bad is not None:
        flags = bad.unsqueeze(-1).expand(batch, height, width, num_heads, channels // num_heads)
        out = recompute_flagged(out.to(dtype).flatten(1, 2), flags.reshape(batch, num_keys, channels),
                                k.to(dtype).flatten(1, 2), v.to(dtype).flatten(1, 2), 'conv', bias=w.to(dtype),
                                grid_w=width, gate=q.to(dtype).flatten(1, 2)).view(q.shape)  # as token rows (B, T, n)
    return out
