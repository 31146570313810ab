"""The last step every AFT operator shares: ``sigmoid(q) * N / D``, and its gradient."""
from typing import Tuple

import torch

from ._stable import TINY

__all__ = ['gate', 'gate_backward']


def gate(q: torch.Tensor, numerator: torch.Tensor, denominator: torch.Tensor, tiny: float = TINY) -> torch.Tensor:
    """``sigmoid(q) * N / D`` for q, N (..., C) and D (..., Ck), each D broadcast over its C / Ck value channels and
    floored at TINY (a finite result for any input; exact inputs never come near it)."""
    mixed = numerator.unflatten(-1, (denominator.shape[-1], -1)) / denominator.clamp_min(tiny).unsqueeze(-1)
    return torch.sigmoid(q) * mixed.flatten(-2)


def gate_backward(
        grad_out: torch.Tensor,
        q: torch.Tensor,
        numerator: torch.Tensor,
        denominator: torch.Tensor,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of ``gate`` with respect to q, N (..., C) and D (..., Ck)."""
    denominator = denominator.clamp_min(TINY).unsqueeze(-1)  # (..., Ck, 1)
    mixed = numerator.unflatten(-1, (denominator.shape[-2], -1)) / denominator  # (..., Ck, C / Ck)
    grad_out = grad_out.unflatten(-1, mixed.shape[-2:])
    gate_q = torch.sigmoid(q).unflatten(-1, mixed.shape[-2:])
    grad_q = grad_out * mixed * gate_q * (1 - gate_q)
    gated = grad_out * gate_q
    grad_num = gated / denominator
    grad_den = -(gated * mixed).sum(-1) / denominator.squeeze(-1)  # (..., Ck)
    return grad_q.flatten(-2), grad_num.flatten(-2), grad_den
