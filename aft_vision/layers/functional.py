"""Functional AFT operators: Eqs. 2, 4, 5 and 6 of Zhai et al., "An Attention Free Transformer" (arXiv 2105.14103).

Like ``torch.nn.functional.scaled_dot_product_attention``, these take projected queries, keys and values and return
the mixed tokens. All of them:

* subtract maxima before ``exp`` (keys per image and channel over positions, biases per query row or head), never
  across the batch, and compute the sums in a positive form (``dense_mix.py``, ``depthwise_mix.py``);
* save only their inputs for the backward pass and recompute the rest there (training memory of the order of the
  inputs, like fused attention);
* behave as the device policy says (``policy.py``): under 'cpu' (the default on CPU) the arithmetic runs in float32
  (float64 for float64 inputs), matrix products take bfloat16 operands under bfloat16, and every entry whose shifted
  sums underflowed or cancelled is recomputed exactly (``_stable.py``), so the result is exact to the rounding of its
  operands for any finite input; under 'cuda' (the default on CUDA) nothing is copied to the host, matrix products run
  in the autocast dtype with float32 accumulation, and the result is finite for any finite input and exact to rounding
  within the bounds each function states;
* return the promoted input dtype (bfloat16 in, bfloat16 out under autocast) and never build a (B, T, T, C) tensor.
"""
from typing import List

import torch
from timm.layers import register_notrace_function

from ._checks import check_bias, check_conv_inputs, check_qkv, check_tensor
from ._stable import TINY, exporting, flag_below, recompute_flagged
from .dense_mix import dense_mix, log_weights
from .depthwise_mix import depthwise_mix
from .dispatch import choose_conv_method
from .policy import get_device_policy, no_autocast, product_dtype
from .simple_mix import simple_mix

__all__ = ['aft_full', 'aft_local', 'aft_simple', 'aft_conv2d']

# A depthwise-path AFT-conv denominator below this fraction of its scale is dominated by the cancellation in
# ``exp(w) - 1``: under the 'cpu' policy such entries are recomputed exactly.
_CANCEL_TOL = 1e-2


def _compute_dtype(tensors: List[torch.Tensor]) -> torch.dtype:
    for tensor in tensors:
        if tensor.dtype == torch.float64:
            return torch.float64
    return torch.float32


def _output_dtype(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.dtype:
    return torch.promote_types(torch.promote_types(q.dtype, k.dtype), v.dtype)


@register_notrace_function
def aft_full(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, w: torch.Tensor, causal: bool = False) -> torch.Tensor:
    """AFT-full (Eq. 2): ``sigmoid(q_t) * sum_t' exp(k_t' + w_tt') v_t' / sum_t' exp(k_t' + w_tt')``.

    One positive (T, T) weight matrix ``exp(w - rowmax w)`` times ``[exp(k - kmax) v, exp(k - kmax)]`` with the batch
    and channels as the product's N dimension (``dense_mix.py``); memory O(B * T * C) plus the (T, T) bias. Under the
    'cuda' policy the product runs in the autocast dtype and the result is exact to rounding while each row of ``w``
    spans less than ~50 (beyond it the denominator is floored: finite, no longer exact); under 'cpu' it runs in
    bfloat16 under bfloat16 (float32 otherwise) and the result is exact to that rounding for any finite input.

    Args:
        q: Queries (B, T, C), before the sigmoid.
        k: Keys (B, T, C).
        v: Values (B, T, C).
        w: Pair-wise position bias (T, T); ``w[t, t']`` links query t to key t'.
        causal: Restrict the sums to t' <= t.

    Returns:
        Mixed tokens (B, T, C) in the promoted dtype of q, k and v.
    """
    check_qkv(q, k, v, 3, '(B, T, C)', '(B, T, C)')
    if k.shape != q.shape:
        raise ValueError(f'k must have the shape of q (B, T, C), got q {list(q.shape)} and k {list(k.shape)}')
    check_bias(w, q.shape[1])
    out_dtype = _output_dtype(q, k, v)
    dtype = _compute_dtype([q, k, v, w])
    if torch.jit.is_scripting():
        return _aft_full(q, k, v, w, causal, dtype, dtype, 'cpu').to(out_dtype)
    else:
        policy = get_device_policy(q.device)
        mm_dtype = product_dtype(q.device, out_dtype, dtype, policy)
        with no_autocast(q.device):
            return _aft_full(q, k, v, w, causal, dtype, mm_dtype, policy).to(out_dtype)


def _aft_full(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, w: torch.Tensor, causal: bool, dtype: torch.dtype,
              mm_dtype: torch.dtype, policy: str, tiny: float = TINY) -> torch.Tensor:
    w = w.to(q.device)
    out, denominator = dense_mix(q, k, v, w, None, causal, dtype, mm_dtype)
    bad = flag_below(denominator, denominator.new_full((), tiny), policy)  # (B, T, C): the largest term underflowed
    if bad is not None:
        log_bias = log_weights(w.to(dtype), None, causal)[0].t()  # (T queries, T keys)
        out = recompute_flagged(out, bad, k.to(dtype), v.to(dtype), 'pairwise', bias=log_bias, gate=q.to(dtype))
    return out


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
    check_tensor('w', w, 2, '(T, T)')
    pos = torch.arange(w.shape[0], device=w.device)
    outside = (pos.unsqueeze(1) - pos.unsqueeze(0)).abs() >= window  # (T, T)
    return aft_full(q, k, v, w.masked_fill(outside, 0.0), causal=causal)


@register_notrace_function
def aft_simple(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False) -> torch.Tensor:
    """AFT-simple (Eq. 5): ``sigmoid(q_t) * sum_t' softmax(k)_t' v_t'``, linear in T.

    Element-wise and reductions only, in float32 (float64 for float64 inputs) under every policy. The causal form
    uses prefix sums of ``exp(k - kmax)``; under 'cpu' entries whose prefix underflowed are recomputed exactly, under
    'cuda' their denominator is floored (finite; exact while a prefix's largest key is within ~50 of the maximum).

    Args:
        q: Queries (B, T, C), before the sigmoid.
        k: Keys (B, T, C).
        v: Values (B, T, C).
        causal: Restrict the sums to t' <= t (prefix sums).

    Returns:
        Mixed tokens (B, T, C).
    """
    check_qkv(q, k, v, 3, '(B, T, C)', '(B, T, C)')
    if k.shape != q.shape:
        raise ValueError(f'k must have the shape of q (B, T, C), got q {list(q.shape)} and k {list(k.shape)}')
    if torch.jit.is_scripting():
        return _aft_simple(q, k, v, causal, 'cpu')
    else:
        with no_autocast(q.device):
            return _aft_simple(q, k, v, causal, get_device_policy(q.device))


def _aft_simple(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, policy: str,
                tiny: float = TINY) -> torch.Tensor:
    out_dtype = _output_dtype(q, k, v)
    dtype = _compute_dtype([q, k, v])
    out, denominator = simple_mix(q, k, v, causal, dtype)
    if causal:  # a prefix whose keys all lie far below the sequence's largest
        bad = flag_below(denominator, denominator.new_full((), tiny), policy)
        if bad is not None:
            out = recompute_flagged(out, bad, k.to(dtype), v.to(dtype), 'none', causal=True, gate=q.to(dtype))
    return out.to(out_dtype)


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

    Evaluations, chosen by ``method`` (every one selectable on every device):

    * ``'dense'``: the (h, T, T) positive per-head weight matrix times ``[exp(k - kmax) v, exp(k - kmax)]``, the batch
      as the product's N dimension (``dense_mix.py``), O(T^2 C); its denominator cannot cancel, so the product takes
      bfloat16 operands under bfloat16 (``policy.product_dtype``).
    * ``'conv'``: one depthwise convolution plus a global sum (``depthwise_mix.py``), O(T s^2 C), in float32 (a
      contiguous NCHW input on CUDA, where cuDNN's channels-last depthwise path is slow; a channels-last view elsewhere,
      where oneDNN's NCHW depthwise path is slow).
    * ``'triton'``: the fused windowed kernel (``aft_conv_triton.py``), where Triton can run.
    * ``'auto'`` (default): ``dispatch.choose_conv_method`` from the tables measured per device type. While exporting
      (torch.export, ONNX, ``torch.jit.trace``) or scripted, ``'auto'`` and ``'triton'`` take ``'conv'``, so the graph
      works at any input size and on any runtime.

    Exactness: under the 'cpu' policy every entry whose denominator underflowed (dense) or cancelled (conv) is
    recomputed exactly on the host. Under 'cuda' (and in exported or compiled graphs) nothing is recomputed: the
    dense form is exact to rounding while a head's bias spans less than ~50, the conv form to a relative
    ``6e-8 * exp(max(0, -min w))`` of its denominator (1e-3 at min w = -9.7); beyond, the result stays finite.

    Args:
        q: Queries (B, H, W, C), before the sigmoid.
        k: Keys (B, H, W, h), one channel per head; channel c of q and v belongs to head ``c // (C // h)``.
        v: Values (B, H, W, C).
        w: Position bias (h, s, s), s odd; ``w[i, a, b]`` links the query at (y, x) to the key at
            (y + a - s//2, x + b - s//2). The window may be larger than the map.
        method: ``'auto'``, ``'dense'``, ``'conv'`` or ``'triton'``.

    Returns:
        Mixed tokens (B, H, W, C).
    """
    check_conv_inputs(q, k, v, w)
    if method not in ('auto', 'dense', 'conv', 'triton'):
        raise ValueError(f"method must be 'auto', 'dense', 'conv' or 'triton', got '{method}'")
    out_dtype = _output_dtype(q, k, v)
    dtype = _compute_dtype([q, k, v, w])
    if torch.jit.is_scripting():  # TorchScript, like export, takes the convolution for 'auto' and 'triton'
        return _aft_conv2d(q, k, v, w, 'dense' if method == 'dense' else 'conv', dtype, dtype, 'cpu').to(out_dtype)
    else:
        policy = get_device_policy(q.device)
        mm_dtype = product_dtype(q.device, out_dtype, dtype, policy)
        if exporting() and method in ('auto', 'triton'):  # exported graphs take the convolution: any input size
            method = 'conv'
        elif method == 'auto':
            method = choose_conv_method(  # the device's speed table for the dtype the dense products would run in
                q.device.type, mm_dtype, q.shape[0], q.shape[1], q.shape[2], q.shape[3], k.shape[-1], w.shape[-1])
        if method == 'triton':
            return _aft_conv2d_triton(q, k, v, w)
        with no_autocast(q.device):
            return _aft_conv2d(q, k, v, w, method, dtype, mm_dtype, policy).to(out_dtype)


@torch.jit.unused
def _aft_conv2d_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    from .aft_conv_triton import aft_conv2d_triton  # imports triton on first use only
    return aft_conv2d_triton(q, k, v, w)


def _aft_conv2d(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, w: torch.Tensor, method: str, dtype: torch.dtype,
                mm_dtype: torch.dtype, policy: str, tiny: float = TINY,
                cancel_tol: float = _CANCEL_TOL) -> torch.Tensor:
    batch, height, width, channels = q.shape
    num_heads = k.shape[-1]
    num_keys = height * width
    w = w.to(q.device)
    if method == 'dense':
        out, denominator = dense_mix(q.reshape(batch, num_keys, channels), k.reshape(batch, num_keys, num_heads),
                                     v.reshape(batch, num_keys, channels), w, (height, width), False, dtype, mm_dtype)
        out, denominator = out.view(q.shape), denominator.view(k.shape)
        threshold = denominator.new_full((), tiny)  # the largest joint term underflowed
    else:
        # the layout is the device's (cuDNN's channels-last depthwise path is slow), whatever the policy
        out, denominator, scale = depthwise_mix(q, k, v, w, q.device.type == 'cuda', dtype)
        threshold = (scale * cancel_tol).clamp_min(tiny)  # (B, 1, 1, h): mostly cancellation (or underflow)
    bad = flag_below(denominator, threshold, policy)  # (B, H, W, h)
    if bad is not None:
        flags = bad.unsqueeze(-1).expand(batch, height, width, num_heads, channels // num_heads)
        out = recompute_flagged(
            out.reshape(batch, num_keys, channels), flags.reshape(batch, num_keys, channels),
            k.to(dtype).reshape(batch, num_keys, num_heads), v.to(dtype).reshape(batch, num_keys, channels),
            'conv', bias=w.to(dtype), grid_w=width, gate=q.to(dtype).reshape(batch, num_keys, channels),
        ).view(q.shape)
    return out
