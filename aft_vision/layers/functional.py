"""Functional AFT operators (Eqs. 2, 4, 5, 6 of Zhai et al., arXiv 2105.14103), like ``F.scaled_dot_product_attention``:
projected q, k, v in, mixed tokens out (promoted dtype). Each reads top to bottom: ``_plan`` checks the inputs and
decides how the call runs, one form file computes (``dense_mix.py``, ``depthwise_mix.py``, ``simple_mix.py``), and
under the 'cpu' policy ``flag_below`` / ``recompute_flagged`` repair what underflowed or cancelled."""
import contextlib
from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F
from timm.layers import register_notrace_function

from . import _shared
from ._shared import (CANCEL_TOL, DISPATCH_TABLES, METHODS, POLICIES, TINY, _CHUNK_ELEMENTS, _COMPILED_BATCH,
                      _EXPORT_FLAG_TRUSTED, gate, get_conv_method)
from .dense_mix import DenseMix, dense_plain
from .depthwise_mix import DepthwiseMix, depthwise_sums
from .simple_mix import PrefixMix, SoftmaxPool, prefix_plain, softmax_pool
from .tuning import tuned_method

__all__ = ['aft_full', 'aft_local', 'aft_simple', 'aft_conv2d', 'choose_conv_method']

# ---------------------------------------------------------------------------------------------------------------------
# The 'cpu' policy's exact repair: where the largest key and the largest bias sit apart, the max-shifted sums can
# underflow (or, for AFT-conv's ``exp(w) - 1`` kernel, cancel); ``flag_below`` finds those entries on the host and
# ``recompute_flagged`` recomputes them as a float64 softmax over the joint logits ``k + b``. Training flags none.


def flag_below(values: torch.Tensor, threshold: torch.Tensor) -> Optional[torch.Tensor]:
    """The mask of ``values`` below ``threshold`` (broadcast), or None where none is below or on meta tensors. One
    host check, on the minimum over the dims ``threshold`` is constant along; the mask is built only when some
    minimum is below or NaN (``amin`` propagates NaN: a NaN is never below)."""
    if values.device.type == 'meta' or values.numel() == 0:
        return None
    offset = values.dim() - threshold.dim()
    dims: List[int] = []
    for dim in range(values.dim()):
        if dim < offset or threshold.shape[dim - offset] == 1:
            dims.append(dim)
    least = values.amin(dim=dims, keepdim=True) if len(dims) > 0 else values
    if not bool(((least < threshold) | torch.isnan(least)).any()):
        return None
    below = values < threshold
    return below if bool(below.any()) else None


def conv_bias_rows(w: torch.Tensor, grid_w: int, num_keys: int, head: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """AFT-conv bias rows (..., T): ``w`` (h, s, s) in the window of query ``pos`` (map ``grid_w`` wide), 0 outside."""
    s = w.shape[-1]
    radius = s // 2
    key = torch.arange(num_keys, device=w.device)
    dy = torch.div(key, grid_w, rounding_mode='floor') - torch.div(pos, grid_w, rounding_mode='floor').unsqueeze(-1)
    dy, dx = dy + radius, key % grid_w - (pos % grid_w).unsqueeze(-1) + radius
    inside = (dy >= 0) & (dy < s) & (dx >= 0) & (dx < s)
    index = dy.clamp(0, s - 1) * s + dx.clamp(0, s - 1)
    values = w.reshape(w.shape[0], s * s)[head.unsqueeze(-1), index]
    return torch.where(inside, values, torch.zeros_like(values))


def recompute_flagged(out: torch.Tensor, bad: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q: torch.Tensor,
                      bias: Optional[torch.Tensor] = None, grid_w: int = 1,
                      chunk_elements: int = _CHUNK_ELEMENTS) -> torch.Tensor:
    """``out`` (B, T, C) with the entries ``bad`` flags recomputed exactly (differentiably) as ``sigmoid(q)`` times
    the softmax over keys k (B, T, Ck) of values v (B, T, C), the logits ``k + bias``: a (T, T) bias, the (h, s, s)
    AFT-conv window on a map ``grid_w`` wide, or None for AFT-simple's prefix (keys after the query left out);
    ``chunk_elements`` bounds the logits held at once."""
    num_keys = k.shape[1]
    channels_per_key = v.shape[2] // k.shape[2]
    flagged = bad.nonzero()  # (N, 3): image, query position, value channel
    chunk = max(1, chunk_elements // num_keys)
    for start in range(0, flagged.shape[0], chunk):
        img, pos, chan = flagged[start:start + chunk].unbind(1)  # (n,) each
        key_chan = torch.div(chan, channels_per_key, rounding_mode='floor')
        # float64: the sum of two large float32 terms is exact there, so the softmax keeps full precision
        logits = k[img, :, key_chan].double()  # (n, T)
        if bias is None:
            later = torch.arange(num_keys, device=k.device).unsqueeze(0) > pos.unsqueeze(1)
            logits = logits.masked_fill(later, float('-inf'))
        else:
            rows = bias[pos] if bias.dim() == 2 else conv_bias_rows(bias, grid_w, num_keys, key_chan, pos)
            logits = logits + rows.double()  # (n, T)
        weights = F.softmax(logits, dim=-1)  # (n, T)
        values = torch.sigmoid(q[img, pos, chan]) * (weights * v[img, :, chan].double()).sum(-1).to(out.dtype)  # (n,)
        indices: List[Optional[torch.Tensor]] = [img, pos, chan]
        out = out.index_put(indices, values)
    return out


# ---------------------------------------------------------------------------------------------------------------------
# The operators

def _plan(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, w: Optional[torch.Tensor], kind: str
          ) -> Tuple[torch.dtype, torch.dtype, torch.dtype, str, bool, bool, bool]:
    """Check a call's inputs (``kind`` 'seq': (B, T, C) tokens, 'conv': AFT-conv's grid; every error names the
    argument, the layout expected and the shape given), then decide once how it runs: (out_dtype, dtype, mm_dtype,
    policy, plain, exporting, autocast: on for q's device, to be turned off around the forms, which cast themselves).

    The output takes the promoted dtype of q, k, v; the arithmetic float64 if any input is float64, else float32; the
    products' operands bfloat16 under bfloat16 autocast or for bfloat16 inputs, else the arithmetic's (float16's
    range cannot hold the softmax-scaled sums). The policy and the plain forms as the module docstring says; the
    TorchScript plan: the plain forms, 'cpu'."""
    conv = kind == 'conv'
    layout, key_layout = ('(B, H, W, C)', '(B, H, W, h)') if conv else ('(B, T, C)', '(B, T, C)')
    named = [('q', q, layout), ('k', k, key_layout), ('v', v, layout)]
    if w is not None:
        named.append(('w', w, '(h, s, s)' if conv else '(T, T)'))
    for name, tensor, expected in named:
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f'{name} must be a torch.Tensor, got {type(tensor).__name__}')
        if not tensor.is_floating_point():
            raise ValueError(f'{name} must be a floating-point tensor, got dtype {tensor.dtype}')
        ndim = len(expected.split(','))
        if tensor.dim() != ndim:
            raise ValueError(f'{name} must be {ndim}-D {expected}, got shape {list(tensor.shape)}')
    if q.shape != v.shape:
        raise ValueError(f'q and v must have the same shape {layout}, got q {list(q.shape)} and v {list(v.shape)}')
    if k.shape[:-1] != q.shape[:-1] or (not conv and k.shape != q.shape):
        raise ValueError(f'k must be {key_layout} for q {layout}, got q {list(q.shape)} and k {list(k.shape)}')
    if q.device != k.device or q.device != v.device:
        raise ValueError(f'q, k and v must be on one device, got {q.device}, {k.device} and {v.device}')
    if q.numel() == 0 and q.shape[0] != 0:
        raise ValueError(f'q must not be empty but in its batch dim, got shape {list(q.shape)}')
    if w is not None and conv:
        channels, num_heads = q.shape[-1], k.shape[-1]
        if channels % num_heads:
            raise ValueError(f'C = {channels} (q {list(q.shape)}) is not divisible by h = {num_heads} '
                             f'(k {list(k.shape)})')
        if w.shape[0] != num_heads or w.shape[1] != w.shape[2]:
            raise ValueError(f'w must have shape (h, s, s) with h = {num_heads}, got {list(w.shape)}')
        if w.shape[1] % 2 == 0:
            raise ValueError(f'kernel size s must be odd, got w of shape {list(w.shape)}')
    elif w is not None and (w.shape[0] != q.shape[1] or w.shape[1] != q.shape[1]):
        raise ValueError(f'w must have shape (T, T) = ({q.shape[1]}, {q.shape[1]}), got {list(w.shape)}')

    out_dtype = torch.promote_types(torch.promote_types(q.dtype, k.dtype), v.dtype)
    wide = [q.dtype, k.dtype, v.dtype] if w is None else [q.dtype, k.dtype, v.dtype, w.dtype]
    dtype = torch.float64 if torch.float64 in wide else torch.float32
    if torch.jit.is_scripting():
        return out_dtype, dtype, dtype, 'cpu', True, False, False
    else:
        autocast = q.device.type in ('cpu', 'cuda', 'xpu', 'mps') and torch.is_autocast_enabled(q.device.type)
        half = torch.get_autocast_dtype(q.device.type) if autocast else out_dtype
        mm_dtype = half if half == torch.bfloat16 and dtype == torch.float32 else dtype
        is_exporting = getattr(torch.compiler, 'is_exporting', None)  # exporting()'s check, in the call's one plan
        recording = ((_EXPORT_FLAG_TRUSTED and is_exporting is not None and is_exporting()) or torch.jit.is_tracing()
                     or torch.onnx.is_in_onnx_export())
        captured = recording or torch.compiler.is_compiling() or torch._C._are_functorch_transforms_active()
        if captured:  # the variable is not read: a compiled graph guards on nothing it would not change
            policy = 'cuda'
        else:
            forced = _shared._override
            if forced is None and _shared._environment['AFT_DEVICE_POLICY'] is not None:
                forced = _shared._from_environment('AFT_DEVICE_POLICY', POLICIES)
            policy = forced or ('cuda' if q.device.type == 'cuda' else 'cpu')
        return out_dtype, dtype, mm_dtype, policy, captured or getattr(_shared._plain, 'on', False), recording, autocast


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
    q = q if q.dtype == mm_dtype else q.to(dtype)
    k = k if k.dtype == mm_dtype else k.to(dtype)
    return q, k, v if v.dtype == mm_dtype else v.to(dtype)


@register_notrace_function
def aft_full(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, w: torch.Tensor, causal: bool = False) -> torch.Tensor:
    """AFT-full (Eq. 2): ``sigmoid(q_t) * sum_t' exp(k_t' + w_tt') v_t' / sum_t' exp(k_t' + w_tt')`` for q, k, v
    (B, T, C) and a (T, T) bias ``w[query, key]``, by ``dense_mix.py``; ``causal`` keeps t' <= t."""
    out_dtype, dtype, mm_dtype, policy, plain, _, autocast = _plan(q, k, v, w, 'seq')
    if q.shape[0] == 0:  # an empty batch, as timm's attention answers it
        return (q * 0.0).to(out_dtype)
    if torch.jit.is_scripting():
        return _aft_full(q, k, v, w, causal, dtype, mm_dtype, policy, plain).to(out_dtype)
    else:
        with torch.autocast(q.device.type, enabled=False) if autocast else contextlib.nullcontext():
            return _aft_full(q, k, v, w, causal, dtype, mm_dtype, policy, plain).to(out_dtype)


def _aft_full(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, w: torch.Tensor, causal: bool, dtype: torch.dtype,
              mm_dtype: torch.dtype, policy: str, plain: bool, tiny: float = TINY) -> torch.Tensor:
    q = q if q.dtype == mm_dtype else q.to(dtype)  # the products' operands: as given in mm_dtype, else in dtype
    k = k if k.dtype == mm_dtype else k.to(dtype)
    v = v if v.dtype == mm_dtype else v.to(dtype)
    w = w.to(device=q.device, dtype=dtype)
    if causal:  # keys after the query left out
        w = w.masked_fill(torch.ones_like(w, dtype=torch.bool).triu(1), float('-inf'))
    if torch.jit.is_scripting() or plain:
        out, denominator = dense_plain(q, k, v, w, None, mm_dtype)
    else:
        out, denominator = DenseMix.apply(q, k, v, w, None, mm_dtype)
        denominator = denominator.flatten(2)
    bad = flag_below(denominator, denominator.new_full((), 2 * tiny)) if policy == 'cpu' else None  # underflowed
    if bad is not None:
        out = recompute_flagged(out.to(dtype), bad, k.to(dtype), v.to(dtype), q.to(dtype), w)
    return out


@register_notrace_function
def aft_local(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, w: torch.Tensor, window: int,
              causal: bool = False) -> torch.Tensor:
    """AFT-local (Eq. 4): ``aft_full`` with ``w[t, t']`` set to 0 where ``|t - t'| >= window`` (keys outside the
    window still contribute, with bias 0)."""
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f'window must be a positive int, got {window}')
    _plan(q, k, v, w, 'seq')  # checked before the mask is built from w
    pos = torch.arange(w.shape[0], device=w.device)
    outside = (pos.unsqueeze(1) - pos.unsqueeze(0)).abs() >= window  # (T, T)
    return aft_full(q, k, v, w.masked_fill(outside, 0.0), causal=causal)


@register_notrace_function
def aft_simple(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False) -> torch.Tensor:
    """AFT-simple (Eq. 5): ``sigmoid(q_t) * sum_t' softmax(k)_t' v_t'`` for q, k, v (B, T, C), linear in T, in the
    inputs' dtype (bfloat16 under autocast; sums in float32); ``causal`` takes prefix sums, in float32."""
    out_dtype, dtype, mm_dtype, policy, plain, _, autocast = _plan(q, k, v, None, 'seq')
    if q.shape[0] == 0:
        return (q * 0.0).to(out_dtype)
    if torch.jit.is_scripting():
        return _aft_simple(q, k, v, causal, dtype, mm_dtype, policy, plain).to(out_dtype)
    else:
        with torch.autocast(q.device.type, enabled=False) if autocast else contextlib.nullcontext():
            return _aft_simple(q, k, v, causal, dtype, mm_dtype, policy, plain).to(out_dtype)


def _aft_simple(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, dtype: torch.dtype,
                mm_dtype: torch.dtype, policy: str, plain: bool, tiny: float = TINY) -> torch.Tensor:
    if not causal:  # the softmax pool: no denominator to floor
        q, k, v = _operands(q, k, v, dtype, mm_dtype)
        if torch.jit.is_scripting() or plain:
            return torch.sigmoid(q) * softmax_pool(k, v)
        return SoftmaxPool.apply(q, k, v)
    if torch.jit.is_scripting() or plain:
        out, denominator = prefix_plain(q, k, v, dtype)
    else:
        out, denominator = PrefixMix.apply(q, k, v, dtype)
    # a prefix whose keys all lie far below the sequence's largest
    bad = flag_below(denominator, denominator.new_full((), tiny)) if policy == 'cpu' else None
    if bad is not None:
        out = recompute_flagged(out, bad, k.to(dtype), v.to(dtype), q.to(dtype))
    return out


@register_notrace_function
def aft_conv2d(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, w: torch.Tensor,
               method: Optional[str] = None) -> torch.Tensor:
    """AFT-conv (Eq. 6) on a 2-D token grid: every key of the image contributes, those inside the s x s window
    around the query with the extra bias ``w``.

    ``method`` (None: ``get_conv_method()``): 'dense' (the products, ``dense_mix.py``), 'conv' (the window,
    ``depthwise_mix.py``), 'auto' (``choose_conv_method``) or 'tuned' (the faster on the first call of its key,
    ``tuning.py``); 'conv' for both while exporting. Exactness under each policy: docs/operators.md#exactness-bounds.

    Args:
        q: Queries (B, H, W, C), before the sigmoid. v: Values (B, H, W, C).
        k: Keys (B, H, W, h), one per head; channel c of q and v belongs to head ``c // (C // h)``.
        w: Position bias (h, s, s), s odd; ``w[i, a, b]`` links the query at (y, x) to the key at
            (y + a - s//2, x + b - s//2). The window may be larger than the map.
    """
    out_dtype, dtype, mm_dtype, policy, plain, recording, autocast = _plan(q, k, v, w, 'conv')
    if q.shape[0] == 0:
        return (q * 0.0).to(out_dtype)
    if torch.jit.is_scripting():  # TorchScript, like export, takes the convolution for 'auto'
        method = 'dense' if method is not None and method == 'dense' else 'conv'
        return _aft_conv2d(q, k, v, w, method, dtype, mm_dtype, policy, plain).to(out_dtype)
    else:
        method = get_conv_method() if method is None else method
        if method not in METHODS:
            raise ValueError(f"method must be one of {', '.join(METHODS)}, got '{method}'")
        if recording and method in ('auto', 'tuned'):  # the conv form runs at any size on any runtime
            method = 'conv'
        elif method == 'tuned':  # the form timed fastest for such calls here (tuning.py), or 'auto'
            method = tuned_method(q, k, v, w, mm_dtype, aft_conv2d)
        if method == 'auto':  # the cost model's choice on the tensors' device
            batch, height, width, channels = q.shape
            if torch.compiler.is_compiling():  # the batch may be symbolic: decide by the map alone, no guard on it
                batch = _COMPILED_BATCH
            method = choose_conv_method(q.device.type, batch, height, width, channels, k.shape[-1], w.shape[-1])
        with torch.autocast(q.device.type, enabled=False) if autocast else contextlib.nullcontext():
            return _aft_conv2d(q, k, v, w, method, dtype, mm_dtype, policy, plain).to(out_dtype)


def _aft_conv2d(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, w: torch.Tensor, method: str, dtype: torch.dtype,
                mm_dtype: torch.dtype, policy: str, plain: bool, tiny: float = TINY,
                cancel_tol: float = CANCEL_TOL) -> torch.Tensor:
    """The output of the dense or conv form, repaired under the 'cpu' policy."""
    batch, height, width, channels = q.shape
    num_heads = k.shape[-1]
    w = w.to(q.device)
    if method == 'dense':
        rows = [x.flatten(1, 2) for x in _operands(q, k, v, dtype, mm_dtype)]  # (B, T, .) token rows
        if torch.jit.is_scripting() or plain:
            out, denominator = dense_plain(rows[0], rows[1], rows[2], w.to(dtype), (height, width), mm_dtype)
        else:
            out, denominator = DenseMix.apply(rows[0], rows[1], rows[2], w.to(dtype), (height, width), mm_dtype)
        out, denominator = out.view(q.shape), denominator.view(k.shape)
        threshold = denominator.new_full((), 2 * tiny)  # the largest joint term underflowed (D floored at tiny)
    else:
        if torch.jit.is_scripting() or plain:
            numerator, denominator, scale = depthwise_sums(
                k.to(dtype).flatten(1, 2), v.to(dtype).flatten(1, 2), w.to(dtype), height, width)
            out = gate(q.to(dtype).flatten(1, 2), numerator, denominator).view(q.shape)  # (B, H, W, C)
            denominator, scale = denominator.view(k.shape), scale.unsqueeze(1)
        else:  # the 'cuda' policy: NCHW planes, the gate in the products' dtype; 'cpu': channels-last, all wide
            planes = policy == 'cuda'
            out, denominator, scale = DepthwiseMix.apply(q, k, v, w, planes, mm_dtype if planes else dtype)
        threshold = (scale * cancel_tol).clamp_min(tiny)  # (B, 1, 1, h): mostly cancellation (or underflow)
    bad = flag_below(denominator, threshold) if policy == 'cpu' else None  # (B, H, W, h)
    if bad is not None:
        flags = bad.unsqueeze(-1).expand(batch, height, width, num_heads, channels // num_heads)
        out = recompute_flagged(out.to(dtype).flatten(1, 2), flags.reshape(batch, height * width, channels),
                                k.to(dtype).flatten(1, 2), v.to(dtype).flatten(1, 2), q.to(dtype).flatten(1, 2),
                                w.to(dtype), width).view(q.shape)  # as token rows (B, T, n)
    return out
