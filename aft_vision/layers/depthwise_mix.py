"""AFT-conv's sums (Eq. 6) by one depthwise convolution plus a global sum, O(T s^2 C).

With ``m_i = max(0, max w_i)`` (a shift that cancels in N / D) every key contributes ``exp(-m_i)`` times its token and
the keys inside the window ``exp(w - m_i) - exp(-m_i)`` more:

    [N | D] = conv(X, exp(w - m) - exp(-m)) + exp(-m) * sum_t' X,   X = [exp(k - kmax) v | exp(k - kmax)]

The kernel is negative where w < 0, so D can lose relative accuracy ``eps * exp(max(0, -min w))`` to cancellation
(float32: 1e-3 at min w = -9.7): the arithmetic here always runs in float32 (float64 for float64 inputs), and the
'cpu' policy recomputes exactly any entry whose D fell below a fraction of its scale (``functional.py``).

``DepthwiseMix`` is the autograd Function: it saves only q, k, v, w and recomputes the rest in backward. X and the
gradient of [N | D] are each written into one (B, H, W, C + h) buffer, no concatenation. The convolution's two
gradients come from ``depthwise_conv_backward`` by the method ``dispatch.choose_depthwise_backward`` names; the
kernel's are summed per head into the (h, s, s) bias.
"""
from typing import Tuple

import torch
import torch.nn.functional as F

from ._gate import gate, gate_backward, gate_inplace, per_channel
from ._stable import TINY, exporting
from ._write import write_into
from .dispatch import choose_depthwise_backward
from .policy import no_autocast

__all__ = ['DepthwiseMix', 'depthwise_mix', 'depthwise_mix_nchw', 'depthwise_sums', 'depthwise_conv_backward']


def _tokens_into(k: torch.Tensor, v: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """X (B, H, W, C + h) written in place (no autograd), exp(k - kmax) (B, H, W, h, contiguous) and the view
    exp(k - kmax) v (B, H, W, h, d) of X. exp runs on a contiguous tensor (on a strided view CPU kernels take a scalar
    path, 10x slower) and is copied into X; the product is written straight into its view."""
    batch, height, width, num_heads = k.shape
    channels = v.shape[-1]
    tokens = v.new_empty(batch, height, width, channels + num_heads)
    exp_k = torch.sub(k, k.amax(dim=(1, 2), keepdim=True)).exp_()  # (B, H, W, h), max 1 per image and head
    tokens[..., channels:].copy_(exp_k)
    exp_kv = tokens[..., :channels].unflatten(-1, (num_heads, -1))  # (B, H, W, h, d), a view
    write_into(exp_kv, torch.mul, v.view(batch, height, width, num_heads, -1), exp_k.unsqueeze(-1))
    return tokens, exp_k, exp_kv


def _head_kernel(w: torch.Tensor):
    """Per head: the kernel exp(w - m) - exp(-m) (h, s, s), the floor exp(-m) (h,) and exp(w - m) (h, s, s)."""
    shift = w.detach().amax(dim=(1, 2)).clamp_min(0.0)  # (h,) m
    floor = torch.exp(-shift)  # (h,) weight of a key outside the window
    inside = torch.exp(w - shift.view(-1, 1, 1))  # (h, s, s)
    return inside - floor.view(-1, 1, 1), floor, inside


def _kernel(w: torch.Tensor, head_dim: int):
    """The depthwise kernel (C + h, 1, s, s), the floor exp(-m) per channel (C + h,) and exp(w - m) (h, s, s)."""
    kernel, floor, inside = _head_kernel(w)
    kernel = torch.cat([kernel.repeat_interleave(head_dim, dim=0), kernel]).unsqueeze(1)  # (C + h, 1, s, s)
    return kernel, torch.cat([floor.repeat_interleave(head_dim), floor]), inside


def _nchw(tokens: torch.Tensor, contiguous: bool) -> torch.Tensor:
    """(B, H, W, n) -> (B, n, H, W): a channels-last view (fast on CPU) or a contiguous copy (fast in cuDNN)."""
    x = tokens.permute(0, 3, 1, 2)
    return x.contiguous() if contiguous else x


def _local(x: torch.Tensor, kernel: torch.Tensor) -> torch.Tensor:
    """The windowed sums (B, H, W, n) of x (B, n, H, W) by the depthwise kernel (n, 1, s, s), zero padded."""
    return F.conv2d(x, kernel, padding=kernel.shape[-1] // 2, groups=kernel.shape[0]).permute(0, 2, 3, 1)


def depthwise_conv_backward(grad: torch.Tensor, x: torch.Tensor, kernel: torch.Tensor,
                            method: str) -> Tuple[torch.Tensor, torch.Tensor]:
    """Gradients of ``F.conv2d(x, kernel, padding=s // 2, groups=n)`` (odd s) for the upstream ``grad``.

    ``'forward_conv'``: both by forward depthwise convolutions, the same products as the native backward summed in
    another order. The input's is the convolution of ``grad`` with the flipped kernel; the kernel's, per image, the
    convolution of x (padded by s // 2) with that image's ``grad`` as an (n, 1, H, W) kernel, summed over images.
    ``'convolution_backward'``: ``aten.convolution_backward``.

    Args:
        grad: Upstream gradient (B, n, H, W), any strides.
        x: Input (B, n, H, W).
        kernel: Depthwise kernel (n, 1, s, s).
        method: ``'forward_conv'`` or ``'convolution_backward'``.

    Returns:
        The gradients of x (B, n, H, W) and of the kernel (n, 1, s, s).
    """
    groups, pad = kernel.shape[0], kernel.shape[-1] // 2
    if method == 'convolution_backward':
        grad_x, grad_kernel, _ = torch.ops.aten.convolution_backward(
            grad, x, kernel, None, [1, 1], [pad, pad], [1, 1], False, [0, 0], groups, [True, True, False])
        return grad_x, grad_kernel
    if method != 'forward_conv':
        raise ValueError(f"method must be 'forward_conv' or 'convolution_backward', got {method!r}")
    grad_x = F.conv2d(grad, kernel.flip(-2, -1), padding=pad, groups=groups)
    per_image = grad.contiguous()  # (B, n, H, W): image b is a contiguous (n, 1, H, W) kernel
    grad_kernel = F.conv2d(x[:1], per_image[0].unsqueeze(1), padding=pad, groups=groups)  # (1, n, s, s)
    for b in range(1, x.shape[0]):
        grad_kernel += F.conv2d(x[b:b + 1], per_image[b].unsqueeze(1), padding=pad, groups=groups)
    return grad_x, grad_kernel.view(kernel.shape)


def _window_sums(rows: torch.Tensor, kernel: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """The windowed sums (B, T, n) of token rows (B, T = H * W, n) by the depthwise kernel (n, 1, s, s), zero padded."""
    x = rows.reshape(rows.shape[0], height, width, rows.shape[-1]).permute(0, 3, 1, 2)  # (B, n, H, W), channels last
    return _local(x, kernel).flatten(1, 2)


def depthwise_sums(k: torch.Tensor, v: torch.Tensor, w: torch.Tensor, height: int,
                   width: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """N (B, T, C), D (B, T, h) and D's scale ``exp(-m) * sum exp(k - kmax)`` (B, 1, h; detached: the global term D's
    cancellation eats into) for token rows k (B, T, h), v (B, T, C) of an H x W map, in plain autograd: the form that
    exported and scripted graphs take.

    It is laid out for the runtimes that run those graphs (OpenVINO, onnxruntime): the element-wise nodes work on
    token rows with the channels innermost and on same-shaped operands (``per_channel``), where a (B, H, W, C) map is
    taken for an NCHW tensor and laid out with H innermost; N and D come from two depthwise convolutions (no
    concatenation of X, no split of the sums), so the only layout changes are the convolutions' own."""
    group = int(v.shape[-1]) // int(k.shape[-1])  # a constant of the graph: the kernel's shape must be known
    exp_k = torch.exp(k - k.amax(dim=1, keepdim=True).detach())  # (B, T, h), max 1 per image and head
    exp_kv = per_channel(exp_k, group) * v  # (B, T, C)
    kernel, floor, _ = _head_kernel(w)  # (h, s, s), (h,)
    scale = exp_k.sum(dim=1, keepdim=True) * floor  # (B, 1, h)
    numerator = _window_sums(exp_kv, kernel.repeat_interleave(group, dim=0).unsqueeze(1), height, width) \
        + exp_kv.sum(dim=1, keepdim=True) * per_channel(floor, group)
    denominator = _window_sums(exp_k, kernel.unsqueeze(1), height, width) + scale
    return numerator, denominator, scale.detach()


def depthwise_mix_nchw(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, w: torch.Tensor,
                       tiny: float = TINY) -> torch.Tensor:
    """``sigmoid(q) * N / D`` on channel-first maps q, v (B, C, H, W), k (B, h, H, W) in plain autograd, the sums by
    two depthwise convolutions and global sums as in ``depthwise_sums``: the form of the channel-first graph
    (``models/aft_conv.py: export_layout``), whatever the layer's method. D is floored at ``tiny``, as ``gate``
    floors it; the graph cannot repair cancelled entries (the 'cuda' policy's bound, as every exported form)."""
    group = int(v.shape[1]) // int(k.shape[1])  # a constant of the graph: the kernel's shape must be known
    exp_k = torch.exp(k - k.amax(dim=(2, 3), keepdim=True).detach())  # (B, h, H, W), max 1 per image and head
    exp_kv = per_channel(exp_k, group, dim=1) * v  # (B, C, H, W)
    kernel, floor, _ = _head_kernel(w)  # (h, s, s), (h,)
    pad = kernel.shape[-1] // 2
    numerator = F.conv2d(exp_kv, kernel.repeat_interleave(group, dim=0).unsqueeze(1), padding=pad,
                         groups=exp_kv.shape[1]) + exp_kv.sum(dim=(2, 3), keepdim=True) * \
        per_channel(floor, group).view(1, -1, 1, 1)
    denominator = F.conv2d(exp_k, kernel.unsqueeze(1), padding=pad, groups=exp_k.shape[1]) \
        + exp_k.sum(dim=(2, 3), keepdim=True) * floor.view(1, -1, 1, 1)  # (B, h, H, W)
    return torch.sigmoid(q) * (numerator / per_channel(denominator.clamp_min(tiny), group, dim=1))


def _sums_into(tokens: torch.Tensor, kernel: torch.Tensor, floor: torch.Tensor, contiguous: bool):
    """[N | D] (B, H, W, C + h) and the global term (B, 1, 1, C + h), no autograd: the global term is added in place
    to the convolution's output, and the convolution's input (B, C + h, H, W) is returned for the backward pass."""
    x = _nchw(tokens, contiguous)
    global_term = tokens.sum(dim=(1, 2), keepdim=True).mul_(floor)  # (B, 1, 1, C + h)
    return _local(x, kernel).add_(global_term), global_term, x


class DepthwiseMix(torch.autograd.Function):
    """``sigmoid(q) * N / D`` by the depthwise convolution; saves q, k, v, w and recomputes the rest in backward.

    Inputs: q, v (B, H, W, C), k (B, H, W, h), w (h, s, s), any float dtypes, computed in ``dtype``. Returns the output
    (B, H, W, C) and, not differentiable, D (B, H, W, h) and its scale (B, 1, 1, h) for the caller's exactness check.
    The convolution's gradients take ``dispatch.choose_depthwise_backward``'s method for the input's device type.
    """

    @staticmethod
    def forward(ctx, q, k, v, w, contiguous, dtype):
        ctx.save_for_backward(q, k, v, w)
        ctx.contiguous, ctx.dtype = contiguous, dtype
        q, k, v, w = (x.to(dtype) for x in (q, k, v, w))
        channels = q.shape[-1]
        tokens, _, _ = _tokens_into(k, v)
        kernel, floor, _ = _kernel(w, channels // k.shape[-1])
        sums, global_term, _ = _sums_into(tokens, kernel, floor, contiguous)
        denominator, scale = sums[..., channels:], global_term[..., channels:]
        ctx.mark_non_differentiable(denominator, scale)
        return gate_inplace(q, sums[..., :channels], denominator), denominator, scale

    @staticmethod
    def backward(ctx, grad_out, _grad_denominator, _grad_scale):
        inputs = ctx.saved_tensors
        q, k, v, w = (x.to(ctx.dtype) for x in inputs)
        channels, num_heads, s = q.shape[-1], k.shape[-1], w.shape[-1]
        with no_autocast(q.device):
            tokens, exp_k, exp_kv = _tokens_into(k, v)  # (B, H, W, C + h)
            kernel, floor, inside = _kernel(w, channels // num_heads)
            sums, _, x = _sums_into(tokens, kernel, floor, ctx.contiguous)
            grad_sums = torch.empty_like(tokens)  # (B, H, W, C + h): [grad N | grad D]
            grad_q, _, _ = gate_backward(
                grad_out.to(ctx.dtype), q, sums[..., :channels], sums[..., channels:], out=grad_sums)
            grad_x, grad_kernel = depthwise_conv_backward(
                _nchw(grad_sums, ctx.contiguous), x, kernel, choose_depthwise_backward(q.device.type))
        grad_tokens = grad_x.permute(0, 2, 3, 1).add_(grad_sums.sum(dim=(1, 2), keepdim=True).mul_(floor))
        grad_kv = grad_tokens[..., :channels].unflatten(-1, (num_heads, -1))  # (B, H, W, h, d)
        grad_v = grad_kv * exp_k.unsqueeze(-1)
        grad_k = grad_kv.mul_(exp_kv).sum(-1).add_(grad_tokens[..., channels:].mul_(exp_k))
        grad_kernel = grad_kernel.squeeze(1)  # (C + h, s, s): a head's value channels and its key channel
        grad_w = (grad_kernel[:channels].view(num_heads, -1, s, s).sum(1) + grad_kernel[channels:]) * inside
        grads = (grad_q, grad_k, grad_v.flatten(3), grad_w)
        return tuple(g.reshape(x.shape).to(x.dtype) for g, x in zip(grads, inputs)) + (None, None)


def depthwise_mix(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        w: torch.Tensor,
        contiguous: bool,
        dtype: torch.dtype,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``sigmoid(q) * N / D``, D and its scale by ``DepthwiseMix``; by ``depthwise_sums`` in plain autograd while
    scripted or exported (``_stable.exporting``: the TorchScript tracer records an autograd Function's outputs out of
    order, and runtimes run the plain form faster). See ``DepthwiseMix``."""
    if torch.jit.is_scripting() or exporting():
        batch, height, width, channels = q.shape
        num_heads = k.shape[-1]
        numerator, denominator, scale = depthwise_sums(
            k.to(dtype).flatten(1, 2), v.to(dtype).flatten(1, 2), w.to(dtype), height, width)
        out = gate(q.to(dtype).flatten(1, 2), numerator, denominator)  # (B, T, C)
        return (out.view(batch, height, width, channels), denominator.view(batch, height, width, num_heads),
                scale.unsqueeze(1))
    else:
        return DepthwiseMix.apply(q, k, v, w, contiguous, dtype)
