"""AFT-simple's sums (Eq. 5): ``SoftmaxPool`` for the whole sequence, ``sigmoid(q) * sum_T softmax_T(k) v`` (the
denominator is 1: nothing divides, in the inputs' dtype); ``SimpleMix`` for prefix sums (causal). Both save only
q, k, v (and the pooled values, (B, 1, C)); for ``create_graph=True`` both backwards take the plain form's autograd."""
from typing import Tuple

import torch

from ._shared import TINY, gate

__all__ = ['SoftmaxPool', 'SimpleMix', 'simple_sums', 'softmax_pool']


def simple_sums(k: torch.Tensor, v: torch.Tensor, causal: bool) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """N, D ((B, T, C) causal, else (B, 1, C)) and exp(k - kmax) (B, T, C)."""
    exp_k = torch.exp(k - k.amax(dim=1, keepdim=True).detach())  # (B, T, C), max 1 per image and channel
    if causal:
        return torch.cumsum(exp_k * v, dim=1), torch.cumsum(exp_k, dim=1), exp_k
    return (exp_k * v).sum(dim=1, keepdim=True), exp_k.sum(dim=1, keepdim=True), exp_k


def _sum_back(grad: torch.Tensor, causal: bool) -> torch.Tensor:
    """The gradient of the (prefix) sums with respect to their terms: reversed prefix sums, or a broadcast."""
    if causal:
        return torch.flip(torch.cumsum(torch.flip(grad, [1]), dim=1), [1])
    return grad.sum(dim=1, keepdim=True)


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
            return _plain_grads((q, k, v), grad_out, False, q.dtype)
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


class SimpleMix(torch.autograd.Function):
    """``sigmoid(q) * N / D`` and (not differentiable) D for q, k, v (B, T, C), computed in ``dtype``."""

    @staticmethod
    def forward(ctx, q, k, v, causal, dtype):
        ctx.save_for_backward(q, k, v)
        ctx.causal, ctx.dtype = causal, dtype
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
        numerator, denominator, _ = simple_sums(k, v, causal)
        ctx.mark_non_differentiable(denominator)
        return gate(q, numerator, denominator), denominator

    @staticmethod
    def backward(ctx, grad_out, _grad_denominator):
        inputs = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph=True: the in-place work below has no second derivative
            return _plain_grads(inputs, grad_out, ctx.causal, ctx.dtype) + (None, None)
        q, k, v = (x.to(ctx.dtype) for x in inputs)
        numerator, denominator, exp_k = simple_sums(k, v, ctx.causal)
        grad_q, grad_num, grad_den = gate_backward(grad_out.to(ctx.dtype), q, numerator, denominator)
        grad_kv = _sum_back(grad_num, ctx.causal)  # (B, T or 1, C), the gradient of exp(k) v
        grad_v = grad_kv * exp_k
        grad_k = (grad_kv * v + _sum_back(grad_den, ctx.causal)) * exp_k
        grads = (grad_q, grad_k, grad_v)
        return tuple(g.to(x.dtype) for g, x in zip(grads, inputs)) + (None, None)


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


def _plain(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, dtype: torch.dtype) -> torch.Tensor:
    """The output in plain autograd: ``sigmoid(q)`` times the softmax pool, or the causal prefix sums in ``dtype``."""
    if not causal:
        return torch.sigmoid(q) * softmax_pool(k, v)
    numerator, denominator, _ = simple_sums(k.to(dtype), v.to(dtype), causal)
    return gate(q.to(dtype), numerator, denominator)


def _plain_grads(inputs: Tuple[torch.Tensor, ...], grad_out: torch.Tensor, causal: bool, dtype: torch.dtype):
    """The plain form's gradients in q, k, v, themselves differentiable (``torch.func.vjp`` records for autograd)."""
    return torch.func.vjp(lambda *qkv: _plain(*qkv, causal, dtype), *inputs)[1](grad_out)
