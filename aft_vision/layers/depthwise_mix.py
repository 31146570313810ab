"""AFT-conv's sums by one depthwise convolution plus a global sum, O(T s^2 C), in float32 (float64 for float64):
``[N | D] = conv(X, exp(w - m) - exp(-m)) + exp(-m) sum X``, ``X = [exp(k - kmax) v | exp(k - kmax)]``, m = max w, 0.
A negative kernel (w < 0) can cancel D, which the 'cpu' policy repairs. ``DepthwiseMix`` saves only q, k, v, w; its
backward takes the convolution's gradients by forward convolutions, faster than the libraries' own on CPU and CUDA."""
from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from ._gate import gate, gate_backward, gate_inplace, per_channel
from ._stable import TINY
from .dispatch import capturing, no_autocast

__all__ = ['DepthwiseMix', 'depthwise_mix', 'depthwise_mix_nchw', 'depthwise_sums', 'depthwise_conv_backward']


def _tokens_into(k: torch.Tensor, v: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """X (B, H, W, C + h) written in one buffer (no autograd), exp(k - kmax) (B, H, W, h) and the view
    exp(k - kmax) v (B, H, W, h, d) of X. exp runs contiguous (10x faster on CPU) and is copied in."""
    batch, height, width, num_heads = k.shape
    channels = v.shape[-1]
    tokens = v.new_empty(batch, height, width, channels + num_heads)
    exp_k = torch.sub(k, k.amax(dim=(1, 2), keepdim=True)).exp_()  # (B, H, W, h), max 1 per image and head
    tokens[..., channels:].copy_(exp_k)
    exp_kv = tokens[..., :channels].unflatten(-1, (num_heads, -1))  # (B, H, W, h, d), a view
    torch.mul(v.view(batch, height, width, num_heads, -1), exp_k.unsqueeze(-1), out=exp_kv)
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


def depthwise_conv_backward(grad: torch.Tensor, x: torch.Tensor,
                            kernel: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Gradients of ``F.conv2d(x, kernel, padding=s // 2, groups=n)`` (odd s) in x (B, n, H, W) and the kernel
    (n, 1, s, s), by forward depthwise convolutions: the input's with the flipped kernel, the kernel's per image with
    that image's ``grad`` (B, n, H, W) as the kernel, summed over images."""
    groups, pad = kernel.shape[0], kernel.shape[-1] // 2
    grad_x = F.conv2d(grad, kernel.flip(-2, -1), padding=pad, groups=groups)
    per_image = grad.contiguous()  # (B, n, H, W): image b is a contiguous (n, 1, H, W) kernel
    grad_kernel = F.conv2d(x[:1], per_image[0].unsqueeze(1), padding=pad, groups=groups)  # (1, n, s, s)
    for b in range(1, x.shape[0]):
        grad_kernel += F.conv2d(x[b:b + 1], per_image[b].unsqueeze(1), padding=pad, groups=groups)
    return grad_x, grad_kernel.view(kernel.shape)


def _window(x: torch.Tensor, kernel: torch.Tensor, height: Optional[int], width: Optional[int]) -> torch.Tensor:
    """The windowed sums of a map x (B, n, H, W) by the depthwise kernel (n, 1, s, s), zero padded; of token rows
    (B, T = H * W, n) given ``height`` and ``width``, as rows."""
    if height is None or width is None:
        return F.conv2d(x, kernel, padding=kernel.shape[-1] // 2, groups=kernel.shape[0])
    x = x.reshape(x.shape[0], height, width, x.shape[-1]).permute(0, 3, 1, 2)  # (B, n, H, W), channels last
    return _local(x, kernel).flatten(1, 2)


def depthwise_sums(k: torch.Tensor, v: torch.Tensor, w: torch.Tensor, height: Optional[int] = None,
                   width: Optional[int] = None) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """N, D and D's detached scale in plain autograd, laid out for runtimes (element-wise nodes in the inputs' layout,
    two convolutions, no concatenation): for token rows k (B, T, h), v (B, T, C) of an H x W map N (B, T, C),
    D (B, T, h) and the scale (B, 1, h); for channel-first maps (``height`` None) the same as maps."""
    keys, channel, shape = ([2, 3], 1, [1, -1, 1, 1]) if height is None else ([1], -1, [-1])
    group = int(v.shape[channel]) // int(k.shape[channel])  # a constant of the graph: the kernel's shape must be known
    exp_k = torch.exp(k - k.amax(dim=keys, keepdim=True).detach())  # (B, T, h) or (B, h, H, W), max 1 per head
    exp_kv = per_channel(exp_k, group, dim=channel) * v  # (B, T, C) or (B, C, H, W)
    kernel, floor, _ = _head_kernel(w)  # (h, s, s), (h,)
    scale = exp_k.sum(dim=keys, keepdim=True) * floor.view(shape)  # (B, 1, h) or (B, h, 1, 1)
    numerator = _window(exp_kv, kernel.repeat_interleave(group, dim=0).unsqueeze(1), height, width) \
        + exp_kv.sum(dim=keys, keepdim=True) * per_channel(floor, group).view(shape)
    denominator = _window(exp_k, kernel.unsqueeze(1), height, width) + scale
    return numerator, denominator, scale.detach()


def depthwise_mix_nchw(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``sigmoid(q) * N / D`` on channel-first maps q, v (B, C, H, W), k (B, h, H, W) by ``depthwise_sums``: the
    channel-first graph's form (``models/aft_conv.py``), D floored at ``TINY`` (no repair)."""
    numerator, denominator, _ = depthwise_sums(k, v, w)
    group = int(v.shape[1]) // int(k.shape[1])
    return torch.sigmoid(q) * (numerator / per_channel(denominator.clamp_min(TINY), group, dim=1))


def _sums_into(tokens: torch.Tensor, kernel: torch.Tensor, floor: torch.Tensor, contiguous: bool):
    """[N | D] (B, H, W, C + h), the global term (B, 1, 1, C + h) and the convolution's input, no autograd."""
    x = _nchw(tokens, contiguous)
    global_term = tokens.sum(dim=(1, 2), keepdim=True).mul_(floor)  # (B, 1, 1, C + h)
    return _local(x, kernel).add_(global_term), global_term, x


class DepthwiseMix(torch.autograd.Function):
    """``sigmoid(q) * N / D`` and (not differentiable) D (B, H, W, h) and its scale (B, 1, 1, h) for q, v
    (B, H, W, C), k (B, H, W, h), w (h, s, s), computed in ``dtype``."""

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
        with no_autocast():
            tokens, exp_k, exp_kv = _tokens_into(k, v)  # (B, H, W, C + h)
            kernel, floor, inside = _kernel(w, channels // num_heads)
            sums, _, x = _sums_into(tokens, kernel, floor, ctx.contiguous)
            grad_sums = torch.empty_like(tokens)  # (B, H, W, C + h): [grad N | grad D]
            grad_q, _, _ = gate_backward(
                grad_out.to(ctx.dtype), q, sums[..., :channels], sums[..., channels:], out=grad_sums)
            grad_x, grad_kernel = depthwise_conv_backward(_nchw(grad_sums, ctx.contiguous), x, kernel)
        grad_tokens = grad_x.permute(0, 2, 3, 1).add_(grad_sums.sum(dim=(1, 2), keepdim=True).mul_(floor))
        grad_kv = grad_tokens[..., :channels].unflatten(-1, (num_heads, -1))  # (B, H, W, h, d)
        grad_v = grad_kv * exp_k.unsqueeze(-1)
        grad_k = grad_kv.mul_(exp_kv).sum(-1).add_(grad_tokens[..., channels:].mul_(exp_k))
        grad_kernel = grad_kernel.squeeze(1)  # (C + h, s, s): a head's value channels and its key channel
        grad_w = (grad_kernel[:channels].view(num_heads, -1, s, s).sum(1) + grad_kernel[channels:]) * inside
        grads = (grad_q, grad_k, grad_v.flatten(3), grad_w)
        return tuple(g.reshape(x.shape).to(x.dtype) for g, x in zip(grads, inputs)) + (None, None)


def depthwise_mix(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, w: torch.Tensor, contiguous: bool,
                  dtype: torch.dtype, plain: bool = False) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``DepthwiseMix``, or ``depthwise_sums`` inside TorchScript, while ``capturing()`` and where ``plain``."""
    if torch.jit.is_scripting() or capturing() or plain:
        height, width = q.shape[1], q.shape[2]
        numerator, denominator, scale = depthwise_sums(
            k.to(dtype).flatten(1, 2), v.to(dtype).flatten(1, 2), w.to(dtype), height, width)
        out = gate(q.to(dtype).flatten(1, 2), numerator, denominator)  # (B, T, C)
        return out.view(q.shape), denominator.view(k.shape), scale.unsqueeze(1)
    else:
        return DepthwiseMix.apply(q, k, v, w, contiguous, dtype)
