"""AFT-conv's sums by depthwise convolutions plus a global sum, O(T s^2 C): ``N = conv(p v, E - f) + f sum p v``,
``D = conv(p, E - f) + f``, ``p = softmax_T(k)``, E and f the softmax of the zero-padded window table and its pad cell
(the plain form ``depthwise_sums``: ``exp(w - m)`` and ``exp(-m)``, m = max(0, max w); N / D cancels the scale).
A negative kernel (w < 0) can cancel D: it is summed in float32, and the 'cpu' policy repairs what cancelled.
``DepthwiseMix``'s backward takes the convolutions' gradients by forward convolutions (docs/operators.md)."""
from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from ._shared import TINY, no_autocast, per_channel, sum_last

__all__ = ['DepthwiseMix', 'depthwise_mix_nchw', 'depthwise_sums', 'depthwise_conv_backward', 'window_table']


def window_table(w: torch.Tensor) -> torch.Tensor:
    """AFT-conv's bias (h, s, s) as its window table (h, s + 1, s + 1) in w's dtype: the softmax over the window
    zero-padded by one row and column (the pad cell: a key outside the window, bias 0). Both forms build on it."""
    side = w.shape[-1] + 1
    return torch.softmax(F.pad(w, [0, 1, 0, 1]).flatten(1), dim=-1).view(-1, side, side)


def _head_kernel(w: torch.Tensor):
    """Per head: the kernel exp(w - m) - exp(-m) (h, s, s), the floor exp(-m) (h,) and exp(w - m) (h, s, s)."""
    shift = w.detach().amax(dim=(1, 2)).clamp_min(0.0)  # (h,) m
    floor = torch.exp(-shift)  # (h,) weight of a key outside the window
    inside = torch.exp(w - shift.view(-1, 1, 1))  # (h, s, s)
    return inside - floor.view(-1, 1, 1), floor, inside


def _conv(x: torch.Tensor, kernel: torch.Tensor, extra: torch.Tensor) -> torch.Tensor:
    """``conv(x, kernel) + extra`` (B, n, H, W) for x (B, n, H, W), the kernel (n, 1, s, s) zero padded, ``extra``
    (B, n): on contiguous planes one convolution over the (1, B n) planes, ``extra`` its bias; else two steps."""
    batch, channels, height, width = x.shape
    if not x.is_contiguous():
        sums = F.conv2d(x, kernel, padding=kernel.shape[-1] // 2, groups=channels)
        return sums.add_(extra[:, :, None, None])
    sums = F.conv2d(x.view(1, -1, height, width), kernel.repeat(batch, 1, 1, 1), extra.flatten().to(x.dtype),
                    padding=kernel.shape[-1] // 2, groups=batch * channels)  # (1, B n, H, W)
    return sums.view(x.shape)


def depthwise_conv_backward(grad: torch.Tensor, x: torch.Tensor, kernel: torch.Tensor,
                            floor: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Gradients of ``conv(x, kernel) + floor * sum x`` (odd s) in x (B, n, H, W) and the kernel (n, 1, s, s) by
    forward convolutions: the input's with the flipped kernel; the kernel's with ``grad`` as the kernel, in one call
    over the (1, B n) planes where both are contiguous, else per image (channels-last: oneDNN's fast path)."""
    batch, channels, pad = x.shape[0], x.shape[1], kernel.shape[-1] // 2
    grad_x = _conv(grad, kernel.flip(-2, -1), grad.sum(dim=(2, 3)).mul_(floor))
    if x.is_contiguous() and grad.is_contiguous():
        per_image = F.conv2d(x.view(1, -1, *x.shape[2:]), grad.view(-1, 1, *grad.shape[2:]), padding=pad,
                             groups=batch * channels)  # (1, B n, s, s)
        return grad_x, per_image.view(batch, *kernel.shape).sum(0)
    per_image = grad.contiguous()  # (B, n, H, W): image b is a contiguous (n, 1, H, W) kernel
    grad_kernel = F.conv2d(x[:1], per_image[0].unsqueeze(1), padding=pad, groups=channels)  # (1, n, s, s)
    for b in range(1, batch):
        grad_kernel += F.conv2d(x[b:b + 1], per_image[b].unsqueeze(1), padding=pad, groups=channels)
    return grad_x, grad_kernel.view(kernel.shape)


def _window(x: torch.Tensor, kernel: torch.Tensor, height: Optional[int], width: Optional[int]) -> torch.Tensor:
    """The windowed sums of a map x (B, n, H, W) by the depthwise kernel (n, 1, s, s), zero padded; of token rows
    (B, T = H * W, n) given ``height`` and ``width``, as rows."""
    if height is not None and width is not None:
        x = x.reshape(x.shape[0], height, width, x.shape[-1]).permute(0, 3, 1, 2)  # (B, n, H, W), channels last
    sums = F.conv2d(x, kernel, padding=kernel.shape[-1] // 2, groups=kernel.shape[0])
    return sums if height is None or width is None else sums.permute(0, 2, 3, 1).flatten(1, 2)


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


class DepthwiseMix(torch.autograd.Function):
    """``sigmoid(q) * N / D``, D (B, H, W, h) and its global term (h,) for q, v (B, H, W, C), k (B, H, W, h), w
    (h, s, s): p, p v, N and D in float32 (float64 for float64 ``dtype``), the gate and the output in ``dtype``, as NCHW
    planes (``planes``) or channels-last."""

    @staticmethod
    def forward(ctx, q, k, v, w, planes, dtype):
        heads = (k.shape[-1], q.shape[-1] // k.shape[-1])
        wide = torch.promote_types(dtype, torch.float32)  # p, p v, N and D: the split's sums cancel where w < 0
        # p (B, H, W, h) and p v (B, H, W, C): views of contiguous (B, n, H, W) planes, or channels-last maps
        keys = k.new_empty(k.shape[0], k.shape[3], k.shape[1], k.shape[2], dtype=wide).permute(0, 2, 3, 1) if planes \
            else torch.empty_like(k, dtype=wide)
        torch.softmax(k.flatten(1, 2), 1, dtype=wide, out=keys.flatten(1, 2))  # over the positions: sums to 1
        values = v.new_empty(v.shape[0], v.shape[3], v.shape[1], v.shape[2], dtype=wide).permute(0, 2, 3, 1) \
            if planes else torch.empty_like(v, dtype=wide)
        torch.mul(v.to(wide).unflatten(-1, heads), keys.unsqueeze(-1), out=values.unflatten(-1, heads))
        table = window_table(w.to(wide))  # (h, s + 1, s + 1): E inside the window, f at the pad cell
        s = w.shape[-1]
        inside, floor = table[:, :s, :s], table[:, s, s]  # (h, s, s), (h,)
        kernel_keys = torch.sub(inside, floor.view(-1, 1, 1)).unsqueeze(1)  # (h, 1, s, s): D's kernel E - f
        kernel = kernel_keys.expand(-1, heads[1], -1, -1).reshape(-1, 1, s, s)  # (C, 1, s, s): N's, head c // d
        global_term = values.sum(dim=(1, 2)).mul_(floor.view(-1, 1).expand(-1, heads[1]).reshape(-1))  # (B, C)
        numerator = _conv(values.permute(0, 3, 1, 2), kernel, global_term).permute(0, 2, 3, 1)  # (B, H, W, C)
        denominator = F.conv2d(keys.permute(0, 3, 1, 2), kernel_keys, floor, padding=kernel.shape[-1] // 2,
                               groups=heads[0]).permute(0, 2, 3, 1)  # (B, H, W, h): f sum p = f, the bias
        clamped = torch.clamp(denominator, min=floor.new_full((), TINY), out=torch.empty_like(keys, dtype=dtype))
        gated = torch.sigmoid(q.to(dtype))  # (B, H, W, C)
        out = torch.mul(gated.unflatten(-1, heads), numerator.unflatten(-1, heads),
                        out=torch.empty_like(gated).unflatten(-1, heads)).div_(clamped.unsqueeze(-1))  # N cancelled
        ctx.save_for_backward(gated, values, keys, clamped, out, kernel, kernel_keys, inside, floor)
        ctx.dtypes = (q.dtype, k.dtype, v.dtype, w.dtype)
        ctx.mark_non_differentiable(denominator, floor)
        ctx.set_materialize_grads(False)  # no zeros made for D's gradient
        return out.flatten(-2), denominator, floor

    @staticmethod
    def backward(ctx, grad_out, _grad_denominator, _grad_scale):
        if torch.is_grad_enabled():
            raise RuntimeError("DepthwiseMix's backward has no second derivative: for create_graph=True run the "
                               "forward under aft_vision.layers.plain_autograd()")
        if grad_out is None:  # the output was not used
            return (None,) * 6
        gated, values, keys, denominator, out, kernel, kernel_keys, inside, floor = ctx.saved_tensors
        heads = out.shape[-2:]
        with no_autocast():
            grad_out = grad_out.to(out.dtype).unflatten(-1, heads)  # (B, H, W, h, d)
            scaled = grad_out * out  # g out
            grad_q = torch.addcmul(scaled, scaled, gated.unflatten(-1, heads), value=-1.0)  # g out (1 - sigmoid(q))
            grad_num = torch.mul(grad_out, gated.unflatten(-1, heads), out=torch.empty_like(values).unflatten(
                -1, heads)).div_(denominator.unsqueeze(-1)).flatten(-2)  # g sigmoid(q) / D, in the layout of p v
            grad_den = torch.addcdiv(floor.new_zeros(()), sum_last(scaled), denominator, value=-1.0,
                                     out=torch.empty_like(keys))  # -sum(g out) / D per head
            grad_values, grad_kernel = depthwise_conv_backward(
                grad_num.permute(0, 3, 1, 2), values.permute(0, 3, 1, 2), kernel, per_channel(floor, heads[1]))
            grad_keys, grad_kernel_keys = depthwise_conv_backward(
                grad_den.permute(0, 3, 1, 2), keys.permute(0, 3, 1, 2), kernel_keys, floor)
            grad_values = grad_values.permute(0, 2, 3, 1).unflatten(-1, heads)  # (B, H, W, h, d)
            grad_v = torch.mul(grad_values, keys.unsqueeze(-1), out=torch.empty_like(out))
            grad_k = sum_last(grad_values * values.unflatten(-1, heads))  # (B, H, W, h) in float32
            grad_k = grad_k.addcmul_(grad_keys.permute(0, 2, 3, 1), keys)  # p (dL/dp): softmax's scale is free
            grad_kernel = grad_kernel.view(*heads, *kernel.shape[-2:]).sum(1, dtype=inside.dtype)  # (h, s, s)
            grad_w = grad_kernel.add_(grad_kernel_keys.squeeze(1)).mul_(inside)  # E dL/dE: Z and m are free
        grads = (grad_q.flatten(-2), grad_k, grad_v.flatten(-2), grad_w)
        return tuple(g.to(dtype) for g, dtype in zip(grads, ctx.dtypes)) + (None, None)
