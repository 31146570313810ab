"""The sparsity regulariser of Eq. 9: ``sum_i entropy(softmax(w_i))`` over AFT-conv heads, weight 0.001 in the paper."""
import torch
from torch import nn

from .layers import AFTConv2d

__all__ = ['position_bias_entropy']


def position_bias_entropy(model: nn.Module) -> torch.Tensor:
    """Sum over every AFTConv2d layer and head of the entropy of ``softmax`` over that head's effective bias.

    Add ``weight * position_bias_entropy(model)`` (the paper: weight 0.001) to the loss to push each head's bias
    towards a few offsets. Models without AFT-conv layers give 0.
    """
    total = None
    for module in model.modules():
        if isinstance(module, AFTConv2d):
            logits = module.effective_bias().flatten(1)  # (h, s*s)
            entropy = -(torch.softmax(logits, -1) * torch.log_softmax(logits, -1)).sum()
            total = entropy if total is None else total + entropy
    if total is None:
        return torch.zeros((), device=next(model.parameters()).device)
    return total
