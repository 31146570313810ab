"""Device policy: how the AFT operators trade exactness for speed on each kind of device.

Two behaviours, chosen per call from the input's device type unless ``device_policy`` says otherwise:

* ``'cpu'`` (default on CPU and any non-CUDA device): every exp, sum and division runs in float32 (float64 for
  float64 inputs) with autocast disabled, and entries whose shifted sums underflowed or cancelled are found on the host
  and recomputed exactly (``_stable.py``): exact for any finite input. Under bfloat16 (autocast, or a model cast to
  it) the dense form's matrix products take bfloat16 operands with float32 accumulation, as SDPA's do: bfloat16 has
  float32's exponent range, so a weight that is normal in float32 stays normal, the host check still finds every
  underflowed denominator, and the result is exact to the rounding of those operands (the suite's bfloat16 bound) for
  any finite input. float16 products stay float32 here (its range would hide underflow from the check). The depthwise
  convolution runs in float32: its windowed correction can be negative, and a bfloat16 output would be rounded before
  the global term cancels against it.
* ``'cuda'`` (default on CUDA): no host synchronisation and no data-dependent branch, so CUDA graphs and
  ``torch.compile(fullgraph=True)`` capture the operators. The matrix products run in the autocast dtype (bfloat16 /
  float16, float32 accumulation) on the positive, max-shifted form of the sums; the depthwise convolution runs in
  float32. Denominators are floored at ``TINY`` instead of repaired, so the result is
  finite for any finite input and exact to rounding while every query's bias row spans less than ~50 in log space
  (see ``functional.py`` for the per-method bound).

``device_policy('cuda')`` makes the operators behave on any tensors as they do on CUDA, which is how the CPU tests
prove the CUDA behaviour. The policy sets the arithmetic only: which method ``'auto'`` picks and the convolution's
memory layout follow the tensors' device (``dispatch.py``), so the 'cuda' policy on CPU tensors runs CPU kernels.
While exporting (torch.export, ONNX, jit tracing) or compiling, the data-dependent repair is off whatever the policy:
an exported graph keeps the 'cuda' policy's guarantee (finite for any finite input, exact to rounding within the
bounds ``functional.py`` states; docs/deployment.md).
"""
import contextlib
import os
from typing import Iterator, Optional

import torch

__all__ = ['device_policy', 'get_device_policy', 'POLICIES']

POLICIES = ('cpu', 'cuda')
_ENV = 'AFT_DEVICE_POLICY'
_override: Optional[str] = None


def _check(kind: Optional[str], origin: str) -> Optional[str]:
    if kind is not None and kind not in POLICIES:
        raise ValueError(f"{origin} must be one of {', '.join(POLICIES)} (or None), got {kind!r}")
    return kind


_ENV_DEFAULT = _check(os.environ.get(_ENV) or None, _ENV)  # read once, at import


@contextlib.contextmanager
def device_policy(kind: Optional[str]) -> Iterator[None]:
    """Make the AFT operators behave as on device type ``kind`` ('cpu' or 'cuda'), whatever the inputs' device.

    ``None`` restores the default (the inputs' device type). The environment variable ``AFT_DEVICE_POLICY``, read at
    import, sets a process-wide default the same way. Not thread-local: set it around whole forward and backward passes.

    Example:
        >>> with device_policy('cuda'):  # the CUDA arithmetic and no host sync, on CPU tensors
        ...     out = aft_conv2d(q, k, v, w)
    """
    global _override
    previous, _override = _override, _check(kind, 'device_policy')
    try:
        yield
    finally:
        _override = previous


def get_device_policy(device: torch.device) -> str:
    """The policy for inputs on ``device``: the ``device_policy`` override, else ``AFT_DEVICE_POLICY``, else
    'cuda' for CUDA tensors and 'cpu' for everything else."""
    if _override is not None:
        return _override
    if _ENV_DEFAULT is not None:
        return _ENV_DEFAULT
    return 'cuda' if device.type == 'cuda' else 'cpu'


def product_dtype(device: torch.device, input_dtype: torch.dtype, compute_dtype: torch.dtype,
                  policy: str) -> torch.dtype:
    """The dtype the AFT matrix products run in (float32 accumulation).

    With float32 arithmetic, the 16-bit dtype in use: the autocast dtype where autocast is on, else a 16-bit input
    dtype (a model cast to it). The 'cuda' policy takes bfloat16 and float16, the 'cpu' policy bfloat16 only (module
    docstring). Otherwise ``compute_dtype`` (float32, or float64 for float64 inputs). Call it before autocast is
    disabled.
    """
    if compute_dtype != torch.float32:
        return compute_dtype
    if _autocast_enabled(device):
        half = torch.get_autocast_dtype(device.type)
    else:
        half = input_dtype
    if half == torch.bfloat16 or (half == torch.float16 and policy == 'cuda'):
        return half
    return compute_dtype


def _autocast_enabled(device: torch.device) -> bool:
    """Whether autocast is on for ``device``'s type (never on a type autocast does not know, such as meta)."""
    return device.type in ('cpu', 'cuda', 'xpu', 'mps') and torch.is_autocast_enabled(device.type)


def no_autocast(device: torch.device):
    """Disable autocast on ``device``'s type, so matrix products and convolutions run in the dtype cast to."""
    if _autocast_enabled(device):
        return torch.autocast(device_type=device.type, enabled=False)
    return contextlib.nullcontext()
