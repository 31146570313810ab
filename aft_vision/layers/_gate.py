"""The last step every AFT operator shares: ``sigmoid(q) * N / D``, and its gradient."""
from typing import Optional, Tuple

import torch

from ._stable import TINY

__all__ = ['gate', 'gate_inplace', 'gate_backward', 'per_channel', 'sum_last']


def per_channel(x: torch.Tensor, group: int, dim: int = -1) -> torch.Tensor:
    """``x`` with h heads on axis ``dim`` repeated to h * group value channels (channel c from head c // group).
    Exported graphs take this form, not a broadcast (..., h, 1) view, which OpenVINO ran 10x slower; the other sizes
    stay -1 in the expand, so traced graphs keep their dynamic axes."""
    if group == 1:
        return x
    dim = dim % x.dim()
    sizes = [-1] * (dim + 1) + [group] + [-1] * (x.dim() - dim - 1)
    return x.unsqueeze(dim + 1).expand(sizes).flatten(dim, dim + 1)


def sum_last(x: torch.Tensor) -> torch.Tensor:
    """x summed over its last dim (a view where that dim has one entry: no pass over memory)."""
    return x.squeeze(-1) if x.shape[-1] == 1 else x.sum(-1)


def gate(q: torch.Tensor, numerator: torch.Tensor, denominator: torch.Tensor, tiny: float = TINY) -> torch.Tensor:
    """``sigmoid(q) * N / D`` for q, N (..., C) and D (..., Ck) broadcast to its channels, floored at ``tiny``."""
    group = numerator.shape[-1] // denominator.shape[-1]
    return torch.sigmoid(q) * (numerator / per_channel(denominator.clamp_min(tiny), group))


def gate_inplace(q: torch.Tensor, numerator: torch.Tensor, denominator: torch.Tensor) -> torch.Tensor:
    """``gate`` without autograd or temporaries, rounded alike: N (a buffer the caller discards) divided in place."""
    out = torch.sigmoid(q)  # (..., C)
    mixed = numerator.unflatten(-1, (denominator.shape[-1], -1)).div_(denominator.clamp_min(TINY).unsqueeze(-1))
    return out.unflatten(-1, mixed.shape[-2:]).mul_(mixed).flatten(-2)


def gate_backward(grad_out: torch.Tensor, q: torch.Tensor, numerator: torch.Tensor, denominator: torch.Tensor,
                  out: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of ``gate`` in q, N (..., C) and D (..., Ck); with ``out`` (..., C + Ck) those of N and D are written
    into it side by side (no autograd) and returned as its views."""
    denominator = denominator.clamp_min(TINY).unsqueeze(-1)  # (..., Ck, 1)
    mixed = numerator.unflatten(-1, (denominator.shape[-2], -1)) / denominator  # (..., Ck, C / Ck)
    grad_out = grad_out.unflatten(-1, mixed.shape[-2:])
    gate_q = torch.sigmoid(q).unflatten(-1, mixed.shape[-2:])
    gated = grad_out * gate_q
    channels = q.shape[-1]
    scaled = gated * mixed  # grad_out * sigmoid(q) * N / D, (..., Ck, C / Ck)
    if out is None:
        grad_num, grad_den = gated.div_(denominator), scaled.sum(-1)
    else:
        grad_num = torch.div(gated, denominator, out=out[..., :channels].unflatten(-1, mixed.shape[-2:]))
        grad_den = torch.sum(scaled, -1, out=out[..., channels:])
    grad_den = grad_den.div_(denominator.squeeze(-1)).neg_()  # (..., Ck)
    grad_q = scaled.mul_(gate_q.neg_().add_(1.0))  # times 1 - sigmoid(q)
    return grad_q.flatten(-2), grad_num.flatten(-2), grad_den
