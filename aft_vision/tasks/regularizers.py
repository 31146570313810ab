"""The sparsity regulariser of Eq. 9, ``sum_i entropy(softmax(w_i))`` over AFT-conv heads (the paper's weight: 0.001;
in timm's ``train.py`` through ``python -m aft_vision.run --aft-sparsity``)."""
import torch
from torch import nn

from ..layers import AFTConv2d

__all__ = ['position_bias_entropy']


def position_bias_entropy(model: nn.Module) -> torch.Tensor:
    """Sum over every AFTConv2d layer and head of the entropy of ``softmax(w)`` over its bias (Eq. 8's ``w``; a
    one-hot layer's logits); 0 without AFT-conv layers. Works on wrapped models (DDP, ``torch.compile``)."""
    entropies = []
    for module in model.modules():
        if isinstance(module, AFTConv2d):
            logits = module.position_bias().flatten(1).float()  # (h, s*s); the logits of a one-hot layer
            entropies.append(-(torch.softmax(logits, -1) * torch.log_softmax(logits, -1)).sum())
    return sum(entropies) if entropies else torch.zeros((), device=next(model.parameters()).device)
