"""Results written into views of a preallocated buffer (X = [exp(k) v | exp(k)] and its gradient) in one pass."""
from typing import Callable

import torch

__all__ = ['write_into']


def write_into(out: torch.Tensor, op: Callable[..., torch.Tensor], *args) -> torch.Tensor:
    """``op(*args)`` written into ``out`` (often a strided view) and returned: through ``out=`` in eager mode, one pass
    and no temporary; as a result copied in while torch.compile traces, which takes no strided ``out=`` tensors."""
    if torch.compiler.is_compiling():
        return out.copy_(op(*args))
    return op(*args, out=out)
