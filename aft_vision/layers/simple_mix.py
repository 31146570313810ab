"""AFT-simple's sums (Eq. 5): ``SoftmaxPool`` for the whole sequence, ``sigmoid(q) * sum_T softmax_T(k) v`` (the
denominator is 1: nothing divides, in the inputs' dtype); ``PrefixMix`` for the causal form's prefix sums. Both save
only q, k, v (and the pooled values, (B, 1, C)); for ``create_graph=True`` both backwards take the plain form's
autograd (``torch.func.vjp`` of it: gradients that are themselves differentiable)."""
from typing import Tuple

import torch

from ._shared import TINY, gate

__all__ = ['SoftmaxPool', 'PrefixMix', 'prefix_plain', 'softmax_pool']


def prefix_sums(k: torch.Tensor, v: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """N, D, the prefix sums over positions of exp(k - kmax) v and exp(k - kmax), and exp(k - kmax), all (B, T, C)."""
    exp_k = torch.exp(k - k.amax(dim=1, keepdim=True).detach())  # (B, T, C), max 1 per image and channel
    return torch.cumsum(exp_k * v, dim=1), torch.cumsum(exp_k, dim=1), exp_k


def prefix_plain(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dtype: torch.dtype
                 ) -> Tuple[torch.Tensor, torch.Tensor]:
    """The causal output ``sigmoid(q) * N / D`` and D (B, T, C) in plain autograd, computed in ``dtype``."""
    numerator, denominator, _ = prefix_sums(k.to(dtype), v.to(dtype))
    return gate(q.to(dtype), numerator, denominator), denominator


class SoftmaxPool(torch.autograd.Function):
    """``sigmoid(q) * N`` with ``N = sum_T softmax_T(k) v`` (B, 1, C) for q, k, v (B, T, C): no denominator, so no
    division and no floor; the backward recomputes the softmax and the gate."""

    @staticmethod
    def forward(ctx, q, k, v):
        pooled = softmax_pool(k, v)  # (B, 1, C)
        ctx.save_for_backward(q, k, v, pooled)
        return torch.sigmoid(q).mul_(pooled)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, pooled = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph=True: pooled was computed without a graph
            return torch.func.vjp(lambda q, k, v: torch.sigmoid(q) * softmax_pool(k, v), q, k, v)[1](grad_out)
        gate = torch.sigmoid(q)
        gated = grad_out * gate  # g sigmoid(q)
        grad_pooled = gated.sum(dim=1, keepdim=True)  # (B, 1, C)
        grad_q = torch.addcmul(gated, gated, gate, value=-1.0).mul_(pooled)  # g sigmoid (1 - sigmoid) N
        p = torch.softmax(k, dim=1)
        grad_v = p * grad_pooled
        grad_k = torch.addcmul(-pooled * grad_pooled, v, grad_pooled).mul_(p)  # p dN (v - N): softmax's Jacobian
        return grad_q, grad_k, grad_v


def softmax_pool(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``sum_T softmax_T(k) v`` (B, 1, C), summed in float32 at least whatever the inputs' dtype."""
    terms = torch.softmax(k, dim=1) * v  # (B, T, C)
    return terms.sum(dim=1, keepdim=True, dtype=torch.promote_types(terms.dtype, torch.float32)).to(terms.dtype)


class PrefixMix(torch.autograd.Function):
    """``prefix_plain``'s output and (not differentiable) D for q, k, v (B, T, C), saving only q, k, v."""

    @staticmethod
    def forward(ctx, q, k, v, dtype):
        ctx.save_for_backward(q, k, v)
        ctx.dtype = dtype
        out, denominator = prefix_plain(q, k, v, dtype)
        ctx.mark_non_differentiable(denominator)
        return out, denominator

    @staticmethod
    def backward(ctx, grad_out, _grad_denominator):
        inputs = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph=True: the in-place work below has no second derivative
            grads = torch.func.vjp(lambda *qkv: prefix_plain(*qkv, ctx.dtype)[0], *inputs)[1](grad_out)
            return grads + (None,)
        q, k, v = (x.to(ctx.dtype) for x in inputs)
        numerator, denominator, exp_k = prefix_sums(k, v)
        grad_q, grad_num, grad_den = gate_backward(grad_out.to(ctx.dtype), q, numerator, denominator)
        suffix = [torch.flip(torch.cumsum(torch.flip(g, [1]), dim=1), [1]) for g in (grad_num, grad_den)]  # (B, T, C)
        grad_v = suffix[0] * exp_k  # the prefix sums' gradients in their terms: the sums from each position on
        grad_k = (suffix[0] * v + suffix[1]) * exp_k
        grads = (grad_q, grad_k, grad_v)
        return tuple(g.to(x.dtype) for g, x in zip(grads, inputs)) + (None,)


def gate_backward(grad_out: torch.Tensor, q: torch.Tensor, numerator: torch.Tensor, denominator: torch.Tensor
                  ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of ``gate`` in q, N (..., C) and D (..., Ck)."""
    denominator = denominator.clamp_min(TINY).unsqueeze(-1)  # (..., Ck, 1)
    mixed = numerator.unflatten(-1, (denominator.shape[-2], -1)) / denominator  # (..., Ck, C / Ck)
    grad_out = grad_out.unflatten(-1, mixed.shape[-2:])
    gate_q = torch.sigmoid(q).unflatten(-1, mixed.shape[-2:])
    gated = grad_out * gate_q
    scaled = gated * mixed  # grad_out * sigmoid(q) * N / D, (..., Ck, C / Ck)
    grad_num, grad_den = gated.div_(denominator), scaled.sum(-1)
    grad_den = grad_den.div_(denominator.squeeze(-1)).neg_()  # (..., Ck)
    grad_q = scaled.mul_(gate_q.neg_().add_(1.0))  # times 1 - sigmoid(q)
    return grad_q.flatten(-2), grad_num.flatten(-2), grad_den
