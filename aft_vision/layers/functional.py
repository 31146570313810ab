"""Functional AFT operators (Eqs. 2, 4, 5, 6 of Zhai et al., arXiv 2105.14103), like ``F.scaled_dot_product_attention``:
projected q, k, v in, mixed tokens out (promoted dtype); only the inputs saved for backward, no (B, T, T, C) tensor.
Under the 'cpu' policy exact to the rounding of the operands for any finite input; under 'cuda' (and when captured)
finite for any finite input, exact within the bounds each function states (docs/operators.md)."""
import importlib.util
import os
from typing import Optional, Tuple

import torch
from timm.layers import register_notrace_function

from ._checks import check_conv_inputs, check_qkv, check_tensor
from ._stable import CANCEL_TOL, TINY, flag_below, recompute_flagged
from .dense_mix import dense_mix, log_weights
from .depthwise_mix import depthwise_mix
from .dispatch import (check_choice, choose_conv_method, compute_dtype, exporting, get_conv_method, get_device_policy,
                       no_autocast, output_dtype, product_dtype)
from .simple_mix import simple_mix

__all__ = ['aft_full', 'aft_local', 'aft_simple', 'aft_conv2d']


@register_notrace_function
def aft_full(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, w: torch.Tensor, causal: bool = False) -> torch.Tensor:
    """AFT-full (Eq. 2): ``sigmoid(q_t) * sum_t' exp(k_t' + w_tt') v_t' / sum_t' exp(k_t' + w_tt')`` for q, k, v
    (B, T, C) and a (T, T) bias ``w[query, key]``, by ``dense_mix.py``; ``causal`` keeps t' <= t. Under 'cuda' exact
    to rounding while each row of ``w`` spans less than ~50 (beyond, finite)."""
    check_qkv(q, k, v, 3, '(B, T, C)', '(B, T, C)')
    check_tensor('w', w, 2, '(T, T)')
    if w.shape[0] != q.shape[1] or w.shape[1] != q.shape[1]:
        raise ValueError(f'w must have shape (T, T) = ({q.shape[1]}, {q.shape[1]}), got {list(w.shape)}')
    out_dtype = output_dtype(q, k, v)
    dtype = compute_dtype([q, k, v, w])
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
    """AFT-simple (Eq. 5): ``sigmoid(q_t) * sum_t' softmax(k)_t' v_t'`` for q, k, v (B, T, C), linear in T, in float32;
    ``causal`` takes prefix sums (under 'cuda' exact while a prefix's largest key is within ~50 of the maximum)."""
    check_qkv(q, k, v, 3, '(B, T, C)', '(B, T, C)')
    if torch.jit.is_scripting():
        return _aft_simple(q, k, v, causal, 'cpu')
    else:
        with no_autocast(q.device):
            return _aft_simple(q, k, v, causal, get_device_policy(q.device))


def _aft_simple(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, policy: str,
                tiny: float = TINY) -> torch.Tensor:
    out_dtype = output_dtype(q, k, v)
    dtype = compute_dtype([q, k, v])
    out, denominator = simple_mix(q, k, v, causal, dtype)
    if causal:  # a prefix whose keys all lie far below the sequence's largest
        bad = flag_below(denominator, denominator.new_full((), tiny), policy)
        if bad is not None:
            out = recompute_flagged(out, bad, k.to(dtype), v.to(dtype), 'none', causal=True, gate=q.to(dtype))
    return out.to(out_dtype)


@register_notrace_function
def aft_conv2d(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, w: torch.Tensor,
               method: Optional[str] = None) -> torch.Tensor:
    """AFT-conv (Eq. 6) on a 2-D token grid: every key of the image contributes, those inside the s x s window
    around the query with the extra bias ``w``.

    ``method`` (None: ``get_conv_method()``): 'fused' (the operator ``torch.ops.aft_vision.aft_conv2d``: the fused
    Triton kernels on CUDA, exact for any finite input), 'dense' (``dense_mix.py``), 'conv' (``depthwise_mix.py``) or
    'auto' (``dispatch.py``). Under 'cuda' the dense form is exact to rounding while a head's bias spans less than
    ~50, the conv form to ``6e-8 * exp(max(0, -min w))`` of its denominator.

    Args:
        q: Queries (B, H, W, C), before the sigmoid. v: Values (B, H, W, C).
        k: Keys (B, H, W, h), one per head; channel c of q and v belongs to head ``c // (C // h)``.
        w: Position bias (h, s, s), s odd; ``w[i, a, b]`` links the query at (y, x) to the key at
            (y + a - s//2, x + b - s//2). The window may be larger than the map.
    """
    check_conv_inputs(q, k, v, w)
    out_dtype = output_dtype(q, k, v)
    dtype = compute_dtype([q, k, v, w])
    if torch.jit.is_scripting():  # TorchScript, like export, takes the convolution for 'auto' and 'fused'
        dense = method is not None and method == 'dense'
        return _aft_conv2d(q, k, v, w, 'dense' if dense else 'conv', dtype, dtype, 'cpu')[0].to(out_dtype)
    else:
        method = check_choice(get_conv_method() if method is None else method)
        if exporting() and method in ('auto', 'fused'):  # the conv form runs at any size on any runtime
            method = 'conv'
        elif method == 'auto':  # the cost model's choice on the tensors' device
            batch, height, width, channels = q.shape
            method = choose_conv_method(q.device.type, batch, height, width, channels, k.shape[-1], w.shape[-1])
        if method == 'fused':
            return _fused_op(q, k, v, w.to(q.device))[0]
        policy = get_device_policy(q.device)
        mm_dtype = product_dtype(q.device, out_dtype, dtype, policy)
        with no_autocast(q.device):
            return _aft_conv2d(q, k, v, w, method, dtype, mm_dtype, policy)[0].to(out_dtype)


def _aft_conv2d(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, w: torch.Tensor, method: str, dtype: torch.dtype,
                mm_dtype: torch.dtype, policy: str, tiny: float = TINY, cancel_tol: float = CANCEL_TOL,
                plain: bool = False) -> Tuple[torch.Tensor, torch.Tensor]:
    """The output and the denominator D (B, H, W, h) of the dense or conv form (repaired under 'cpu'); ``plain``:
    the conv form in plain autograd."""
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
        out, denominator, scale = depthwise_mix(q, k, v, w, q.device.type == 'cuda', dtype, plain)  # cuDNN: NCHW
        threshold = (scale * cancel_tol).clamp_min(tiny)  # (B, 1, 1, h): mostly cancellation (or underflow)
    bad = flag_below(denominator, threshold, policy)  # (B, H, W, h)
    if bad is not None:
        flags = bad.unsqueeze(-1).expand(batch, height, width, num_heads, channels // num_heads)
        out = recompute_flagged(out.flatten(1, 2), flags.reshape(batch, num_keys, channels), k.to(dtype).flatten(1, 2),
                                v.to(dtype).flatten(1, 2), 'conv', bias=w.to(dtype), grid_w=width,
                                gate=q.to(dtype).flatten(1, 2)).view(q.shape)  # as token rows (B, T, n)
    return out, denominator


# The operator: one graph node for eager, torch.compile and CUDA graphs; exports never see it (``exporting()``).
@torch.library.custom_op('aft_vision::aft_conv2d', mutates_args=())
def _fused_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, w: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """The gated output (B, H, W, C) and the log-sum-exp of each query's logits (B, H, W, h) in the arithmetic's
    dtype (``compute_dtype``)."""
    check_conv_inputs(q, k, v, w)
    if _kernels_run_on(q.device):
        from .aft_conv_fused import fused_forward  # imports triton on first use only
        return fused_forward(q, k, v, w)
    dtype = compute_dtype([q, k, v, w])
    policy = get_device_policy(q.device)
    with no_autocast(q.device):
        out, denominator = _aft_conv2d(q, k, v, w, 'conv', dtype, product_dtype(q.device, q.dtype, dtype, policy),
                                       policy)
    shift = k.detach().amax(dim=(1, 2), keepdim=True).to(dtype) + w.detach().amax(dim=(1, 2)).clamp_min(0.0).to(dtype)
    return out.to(output_dtype(q, k, v)).contiguous(), (torch.log(denominator.to(dtype)) + shift).contiguous()


@torch.library.custom_op('aft_vision::aft_conv2d_backward', mutates_args=())
def _fused_op_backward(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, w: torch.Tensor,
                       out: torch.Tensor, lse: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                                      torch.Tensor]:
    """Gradients in q, k, v, w: the fused kernels from ``out`` and ``lse``; elsewhere the conv form's, recomputed."""
    if _kernels_run_on(q.device):
        from .aft_conv_fused import fused_backward
        return fused_backward(grad, q, k, v, w, out, lse)
    dtype = compute_dtype([q, k, v, w])
    policy = get_device_policy(q.device)

    def plain(*inputs):  # the conv form in plain autograd (functorch cannot trace its autograd Function)
        with no_autocast(q.device):
            return _aft_conv2d(*inputs, 'conv', dtype, dtype, policy, plain=True)[0]

    grads = torch.func.vjp(plain, q, k, v, w)[1](grad.to(output_dtype(q, k, v)))
    return tuple(g.to(x.dtype).contiguous() for g, x in zip(grads, (q, k, v, w)))


def _kernels_run_on(device: torch.device) -> bool:
    """Whether the operator runs the Triton kernels on ``device``: CUDA, or the CPU under ``TRITON_INTERPRET=1``,
    with triton installed (else the conv form, as SDPA falls back to its math kernel)."""
    interpret = os.environ.get('TRITON_INTERPRET', '0').lower() in ('1', 'true', 'yes', 'on')
    return (device.type == 'cuda' or (device.type == 'cpu' and interpret)) and _HAS_TRITON


_HAS_TRITON = importlib.util.find_spec('triton') is not None


@_fused_op.register_fake
def _(q, k, v, w):
    return q.new_empty(q.shape, dtype=output_dtype(q, k, v)), k.new_empty(k.shape, dtype=compute_dtype([q, k, v, w]))


@_fused_op_backward.register_fake
def _(grad, q, k, v, w, out, lse):
    return tuple(x.new_empty(x.shape) for x in (q, k, v, w))


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs, *output)


def _backward(ctx, grad, _grad_lse):
    return _fused_op_backward(grad.contiguous(), *ctx.saved_tensors)


_fused_op.register_autograd(_backward, setup_context=_setup_context)
