"""The sparsity regulariser of Eq. 9: ``sum_i entropy(softmax(w_i))`` over AFT-conv heads, weight 0.001 in the paper.

The paper applies it to AFT-conv's per-head ``s x s`` biases only (Sec. 8), so AFT-full / AFT-local biases (one
(T, T) matrix, not a per-head kernel) are left out. Two ways to train with it:

* the project's trainer: ``aft-vision train --sparsity-weight 0.001`` (``python -m aft_vision.train``);
* timm's ``train.py``, which has no loss hook: ``--device-modules aft_vision.timm_sparsity`` (see that module) adds
  the term to every ``timm.task.ClassificationTask`` loss through :func:`add_to_timm_tasks`, which also makes
  AFT-conv's windows follow each step's size under ``--train-img-sizes`` as the project's trainer does
  (``forward_at_size``; ``aft_vision.timm_train`` does that alone).
"""
from typing import Callable, Optional

import torch
from torch import nn

from ..layers import AFTConv2d
from ..models.aft_conv import forward_at_size

__all__ = ['position_bias_entropy', 'add_to_timm_tasks']


def position_bias_entropy(model: nn.Module) -> torch.Tensor:
    """Sum over every AFTConv2d layer and head of the entropy of ``softmax`` over that head's effective bias.

    The bias is Eq. 8's ``w`` (``dense_bias()``; for ``AFTConv2dOneHot`` the logits its offsets are drawn from). Add
    ``weight * position_bias_entropy(model)`` (the paper: weight 0.001) to the loss to push each head's bias towards a
    few offsets. Works on wrapped models (DDP, ``torch.compile``). Models without AFT-conv layers give 0.
    """
    total = None
    for module in model.modules():
        if isinstance(module, AFTConv2d):
            logits = module.dense_bias().flatten(1).float()  # (h, s*s); the logits of a one-hot layer
            entropy = -(torch.softmax(logits, -1) * torch.log_softmax(logits, -1)).sum()
            total = entropy if total is None else total + entropy
    if total is None:
        return torch.zeros((), device=next(model.parameters()).device)
    return total


_timm_forward: Optional[Callable] = None  # ClassificationTask.forward before add_to_timm_tasks replaced it


def add_to_timm_tasks(weight: float = 0.001, follow_windows: bool = True) -> None:
    """Make every ``timm.task.ClassificationTask`` (the task timm's ``train.py`` builds) add the Eq. 9 term and run
    AFT-conv with its windows following each step's size.

    The task's output becomes ``forward_at_size(model, input)`` (``model(input)`` unless an AFT-conv model with
    ``resize_mode='window'`` gets another size than it was built for) and its loss ``criterion(output, target) +
    weight * position_bias_entropy(model)``. Calling it again replaces both settings; ``weight=0`` with
    ``follow_windows=False`` restores timm's own ``forward``. Distillation tasks are left unchanged.
    """
    global _timm_forward
    from timm.task import ClassificationTask

    if _timm_forward is None:
        _timm_forward = ClassificationTask.forward
    if not weight and not follow_windows:
        ClassificationTask.forward = _timm_forward
        return
    plain = _timm_forward

    def forward(self, input: torch.Tensor, target: torch.Tensor):
        if follow_windows:
            output = forward_at_size(self.trainable_module, input)
            result = {'loss': self.criterion(output, target), 'output': output}
        else:
            result = plain(self, input, target)
        if weight:
            result['loss'] = result['loss'] + weight * position_bias_entropy(self.trainable_module)
        return result

    forward.__doc__ = (f'{plain.__doc__ or ""}\n\n(aft_vision: AFT-conv windows follow the size: {follow_windows}; '
                       f'the loss includes {weight} x the Eq. 9 entropy.)')
    ClassificationTask.forward = forward
