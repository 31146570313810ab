"""AFT-conv's sums (Eq. 6) by one depthwise convolution plus a global sum, O(T s^2 C).

With ``m_i = max(0, max w_i)`` (a shift that cancels in N / D) every key contributes ``exp(-m_i)`` times its token and
the keys inside the window ``exp(w - m_i) - exp(-m_i)`` more:

    [N | D] = conv(X, exp(w - m) - exp(-m)) + exp(-m) * sum_t' X,   X = [exp(k - kmax) v | exp(k - kmax)]

The kernel is negative where w < 0, so D can lose relative accuracy ``eps * exp(max(0, -min w))`` to cancellation
(float32: 1e-3 at min w = -9.7): the arithmetic here always runs in float32 (float64 for float64 inputs), and the
'cpu' policy recomputes exactly any entry whose D fell below a fraction of its scale (``functional.py``).

``DepthwiseMix`` is the autograd Function: it saves only q, k, v, w and recomputes the rest in backward; the
gradients of the tokens and of the (C + h, s, s) kernel come from one ``convolution_backward``, the kernel's are
summed per head into the (h, s, s) bias.
"""
from typing import Tuple

import torch
import torch.nn.functional as F

from ._gate import gate, gate_backward
from .policy import no_autocast

__all__ = ['DepthwiseMix', 'depthwise_mix', 'depthwise_sums']


def _tokens(k: torch.Tensor, v: torch.Tensor):
    """X (B, H, W, C + h), exp(k - kmax) (B, H, W, h) and exp(k - kmax) v (B, H, W, h, d)."""
    batch, height, width, num_heads = k.shape
    exp_k = torch.exp(k - k.amax(dim=(1, 2), keepdim=True).detach())  # (B, H, W, h), max 1 per image and head
    exp_kv = exp_k.unsqueeze(-1) * v.view(batch, height, width, num_heads, -1)  # (B, H, W, h, d)
    return torch.cat([exp_kv.flatten(3), exp_k], dim=-1), exp_k, exp_kv


def _kernel(w: torch.Tensor, head_dim: int):
    """The depthwise kernel (C + h, 1, s, s), the floor exp(-m) per channel (C + h,) and exp(w - m) (h, s, s)."""
    shift = w.detach().amax(dim=(1, 2)).clamp_min(0.0)  # (h,) m
    floor = torch.exp(-shift)  # (h,) weight of a key outside the window
    inside = torch.exp(w - shift.view(-1, 1, 1))  # (h, s, s)
    kernel = inside - floor.view(-1, 1, 1)
    kernel = torch.cat([kernel.repeat_interleave(head_dim, dim=0), kernel]).unsqueeze(1)  # (C + h, 1, s, s)
    return kernel, torch.cat([floor.repeat_interleave(head_dim), floor]), inside


def _nchw(tokens: torch.Tensor, contiguous: bool) -> torch.Tensor:
    """(B, H, W, n) -> (B, n, H, W): a channels-last view (fast on CPU) or a contiguous copy (fast in cuDNN)."""
    x = tokens.permute(0, 3, 1, 2)
    return x.contiguous() if contiguous else x


def depthwise_sums(k: torch.Tensor, v: torch.Tensor, w: torch.Tensor,
                   contiguous: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """[N | D] (B, H, W, C + h) by the depthwise convolution; plain autograd (TorchScript, recomputation). Also the
    scale of D, ``exp(-m) * sum exp(k - kmax)`` (B, 1, 1, h), detached: the global term D's cancellation eats into."""
    tokens, _, _ = _tokens(k, v)
    kernel, floor, _ = _kernel(w, v.shape[-1] // k.shape[-1])
    s = w.shape[-1]
    local = F.conv2d(_nchw(tokens, contiguous), kernel, padding=s // 2, groups=kernel.shape[0])
    global_term = tokens.sum(dim=(1, 2), keepdim=True) * floor  # (B, 1, 1, C + h)
    return local.permute(0, 2, 3, 1) + global_term, global_term[..., v.shape[-1]:].detach()


class DepthwiseMix(torch.autograd.Function):
    """``sigmoid(q) * N / D`` by the depthwise convolution; saves q, k, v, w and recomputes the rest in backward.

    Inputs: q, v (B, H, W, C), k (B, H, W, h), w (h, s, s), any float dtypes, computed in ``dtype``. Returns the output
    (B, H, W, C) and, not differentiable, D (B, H, W, h) and its scale (B, 1, 1, h) for the caller's exactness check.
    """

    @staticmethod
    def forward(ctx, q, k, v, w, contiguous, dtype):
        ctx.save_for_backward(q, k, v, w)
        ctx.contiguous, ctx.dtype = contiguous, dtype
        q, k, v, w = (x.to(dtype) for x in (q, k, v, w))
        sums, scale = depthwise_sums(k, v, w, contiguous)
        channels = q.shape[-1]
        denominator = sums[..., channels:]
        ctx.mark_non_differentiable(denominator, scale)
        return gate(q, sums[..., :channels], denominator), denominator, scale

    @staticmethod
    def backward(ctx, grad_out, _grad_denominator, _grad_scale):
        inputs = ctx.saved_tensors
        q, k, v, w = (x.to(ctx.dtype) for x in inputs)
        channels, num_heads, s = q.shape[-1], k.shape[-1], w.shape[-1]
        with no_autocast(q.device):
            tokens, exp_k, exp_kv = _tokens(k, v)  # (B, H, W, C + h)
            kernel, floor, inside = _kernel(w, channels // num_heads)
            x = _nchw(tokens, ctx.contiguous)
            local = F.conv2d(x, kernel, padding=s // 2, groups=kernel.shape[0])
            sums = local.permute(0, 2, 3, 1) + tokens.sum(dim=(1, 2), keepdim=True) * floor
            grad_q, grad_num, grad_den = gate_backward(
                grad_out.to(ctx.dtype), q, sums[..., :channels], sums[..., channels:])
            grad_sums = torch.cat([grad_num, grad_den], dim=-1)  # (B, H, W, C + h)
            grad_x, grad_kernel, _ = torch.ops.aten.convolution_backward(
                _nchw(grad_sums, ctx.contiguous), x, kernel, None, [1, 1], [s // 2, s // 2], [1, 1], False, [0, 0],
                kernel.shape[0], [True, True, False])
        grad_tokens = grad_x.permute(0, 2, 3, 1) + grad_sums.sum(dim=(1, 2), keepdim=True) * floor
        grad_kv = grad_tokens[..., :channels].view(exp_kv.shape)  # (B, H, W, h, d)
        grad_v = grad_kv * exp_k.unsqueeze(-1)
        grad_k = (grad_kv * exp_kv).sum(-1) + grad_tokens[..., channels:] * exp_k
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
    """``sigmoid(q) * N / D``, D and its scale by ``DepthwiseMix`` (plain autograd while scripting). See
    ``DepthwiseMix``."""
    if torch.jit.is_scripting():
        q, k, v, w = q.to(dtype), k.to(dtype), v.to(dtype), w.to(dtype)
        sums, scale = depthwise_sums(k, v, w, contiguous)
        channels = q.shape[-1]
        return gate(q, sums[..., :channels], sums[..., channels:]), sums[..., channels:], scale
    else:
        return DepthwiseMix.apply(q, k, v, w, contiguous, dtype)
