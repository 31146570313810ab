"""Which evaluation of AFT-conv ``method='auto'`` picks: a pure function of the device type and the shapes.

Per layer (B images, T = H W positions, C channels, h heads, window area A = s^2, or the part of it the map can use):

* the dense form builds and reads its (h, T, T) weights several times (exp, products, gradient) and multiplies them
  with the tokens in one batched product of ``B T^2 (C + h)`` multiply-adds, narrow (N = B (C + h) / h) when h is
  large: cost ~ ``kappa h T^2 + B T^2 (C + h)``;
* the depthwise convolution costs ``B T A (C + h)`` multiply-adds at a lower rate (memory-bound, large kernels far
  from peak): cost ~ ``B T A (C + h) * ratio``.

So the dense form wins while ``T (1 + kappa h / (B (C + h))) <= ratio * A`` and its weights ``h T^2`` stay below a size
limit. ``kappa`` (the per-weight overhead, in multiply-adds of the product) and ``ratio`` (the convolution's cost per
multiply-add relative to the product's) are measured per device type with ``aft-vision bench --ops`` (forward +
backward of one layer, every method, the layers of the registered models):

* ``'cpu'``: fitted to this project's 2-core x86 CPU, float32, batch 8 (and 64 for the digits model): the faster
  method in 13 of 14 measured layers of the registered models at 224 and 384 px, the 14th a tie (README,
  Performance).
* ``'cuda'``: provisional, from the H100 figures in the project's GPU notes (float32 dense 1.4 ms vs contiguous NCHW
  depthwise 0.78 ms forward at 14 x 14, h = 384, s = 15, batch 64, before the bfloat16 products existed) and the
  arithmetic of the bfloat16 dense form; to be replaced by ``aft-vision bench --ops --device cuda``.

``'triton'`` is never chosen automatically until a measurement on the device supports it.

The depthwise method's backward pass has two evaluations (``depthwise_mix.depthwise_conv_backward``), chosen per
device type by ``DEPTHWISE_BACKWARDS`` unless ``depthwise_backward(...)`` says otherwise:

* ``'forward_conv'`` (CPU and every other non-CUDA type): both gradients by forward depthwise convolutions. oneDNN's
  depthwise backward on this CPU is 10-40x slower than its forward for AFT's large windows, the forward
  convolutions about 1-3x the forward's time.
* ``'convolution_backward'`` (CUDA): the library's own backward, as before; cuDNN's large-kernel depthwise backward
  was measured slow too (GPU notes), so ``'forward_conv'`` may win there: measure it with
  ``aft-vision bench --ops --device cuda`` (it times both).
"""
import contextlib
from typing import Dict, Iterator, Optional, Tuple

import torch

__all__ = ['CONV_METHODS', 'DISPATCH_TABLES', 'DEPTHWISE_BACKWARD_METHODS', 'DEPTHWISE_BACKWARDS',
           'choose_conv_method', 'choose_depthwise_backward', 'depthwise_backward']

CONV_METHODS = ('dense', 'conv', 'triton')

# device type -> (ratio, kappa, largest h * T * T for the dense form); see the module docstring
DISPATCH_TABLES: Dict[str, Tuple[float, float, int]] = {
    'cpu': (7.5, 300.0, 1 << 24),
    'cuda': (16.0, 64.0, 1 << 27),
}

DEPTHWISE_BACKWARD_METHODS = ('forward_conv', 'convolution_backward')
# device type -> how the depthwise method's backward computes the convolution's gradients; see the module docstring
DEPTHWISE_BACKWARDS: Dict[str, str] = {'cpu': 'forward_conv', 'cuda': 'convolution_backward'}
_backward_override: Optional[str] = None


@contextlib.contextmanager
def depthwise_backward(method: Optional[str]) -> Iterator[None]:
    """Make the depthwise method's backward pass use ``method`` ('forward_conv' or 'convolution_backward') on every
    device; ``None`` restores the per-device default. Not thread-local: set it around whole backward passes.

    Example:
        >>> with depthwise_backward('forward_conv'):  # the forward-convolution gradients on a GPU too
        ...     aft_conv2d(q, k, v, w, method='conv').sum().backward()
    """
    global _backward_override
    if method is not None and method not in DEPTHWISE_BACKWARD_METHODS:
        raise ValueError(f"method must be one of {', '.join(DEPTHWISE_BACKWARD_METHODS)} or None, got {method!r}")
    previous, _backward_override = _backward_override, method
    try:
        yield
    finally:
        _backward_override = previous


def choose_depthwise_backward(device_type: str) -> str:
    """The depthwise backward for tensors on ``device_type``: the ``depthwise_backward`` override, else the table's
    entry (the CPU one for types it does not name)."""
    if _backward_override is not None:
        return _backward_override
    return DEPTHWISE_BACKWARDS.get(device_type, DEPTHWISE_BACKWARDS['cpu'])


def choose_conv_method(
        device_type: str,
        dtype: torch.dtype,
        batch: int,
        height: int,
        width: int,
        channels: int,
        num_heads: int,
        kernel_size: int,
) -> str:
    """The AFT-conv method for these shapes on ``device_type`` ('cpu', 'cuda'; any other type uses the CPU table).

    Args:
        device_type: The device type (or the device policy in force).
        dtype: The inputs' dtype (the tables were measured in float32 on CPU; on CUDA the products run in bfloat16
            under autocast, which the 'cuda' table assumes).
        batch: Images per call (the dense form's fixed cost of building its weights is shared by the batch).
        height: Token-grid height H.
        width: Token-grid width W.
        channels: Channels C.
        num_heads: Heads h.
        kernel_size: Window size s.

    Returns:
        'dense' or 'conv'.
    """
    ratio, kappa, max_weights = DISPATCH_TABLES['cuda'] if device_type == 'cuda' else DISPATCH_TABLES['cpu']
    num_keys = height * width
    window = min(kernel_size, 2 * height - 1) * min(kernel_size, 2 * width - 1)  # the part of s x s a map can use
    overhead = 1.0 + kappa * num_heads / (batch * (channels + num_heads))
    if num_keys * overhead <= ratio * window and num_heads * num_keys * num_keys <= max_weights:
        return 'dense'
    return 'conv'
