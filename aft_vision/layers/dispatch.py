"""Which evaluation of AFT-conv ``method='auto'`` picks: a pure function of the device type and the shapes.

Per layer (B images, T = H W positions, C channels, h heads, window area A = s^2, or the part of it the map can use):

* the dense form builds and reads its (h, T, T) weights several times (exp, products, gradient) and multiplies them
  with the tokens in one batched product of ``B T^2 (C + h)`` multiply-adds, narrow (N = B (C + h) / h) when h is
  large: cost ~ ``kappa h T^2 + B T^2 (C + h)``;
* the depthwise convolution costs ``B T A (C + h)`` multiply-adds at its own rate, forward and backward by forward
  convolutions, plus a fixed cost per image (the kernel's gradient is one small convolution per image): cost ~
  ``ratio * B T A (C + h) + beta * B``.

So the dense form wins while ``T^2 (1 + kappa h / (B (C + h))) (C + h) <= ratio T A (C + h) + beta`` (per image) and
its weights ``h T^2`` stay below a size limit. ``kappa`` (the per-weight overhead, in multiply-adds of the product),
``ratio`` (the convolution's cost per multiply-add relative to the product's) and ``beta`` (the convolution's cost per
image, in multiply-adds of the product) are measured per device type with ``aft-vision bench --ops`` (forward and
backward of one layer, every method, the layers of the registered models):

* ``'cpu'``: fitted to this project's 2-core x86 CPU, float32, batch 8 (64 for the digits model), after the
  depthwise backward moved to forward convolutions: the product ran at ~0.3 ns per multiply-add, kappa ~100 from the
  many-head layers, the convolution from 0.09 (h = 32, s = 25) to 0.56 (h = 192, s = 11) ns per multiply-add, ratio
  0.42 the value that keeps every measured layer on its faster method: the convolution in all eight layers of
  aft_conv_small, _small_11_h16, _tiny and _base_25_h32 at 224 and 384 px (the closest, _base_25_h32 at 224 px,
  71 vs 85 ms), the dense form for the digits model (4 x 4 tokens, s = 5, batch 64: 1.45 vs 3.17 ms, the per-image
  cost beta). Figures: docs/performance.md. With bfloat16 products (the 'cpu' policy under bfloat16) the dense
  form is faster (aft_conv_small_11_h16 at 224 px: 14.0 against 18.2 ms forward and backward on a 2-core AVX512-BF16
  CPU without AMX), but every one of those layers kept its faster method, so the table serves both dtypes.
* ``'cuda'``: provisional, from the earlier H100 figures in docs/performance.md (float32 dense 1.4 ms vs contiguous NCHW
  depthwise 0.78 ms forward at 14 x 14, h = 384, s = 15, batch 64, before the bfloat16 products existed) and the
  arithmetic of the bfloat16 dense form; no per-image term (cuDNN's own backward); to be replaced by
  ``aft-vision bench --ops --device cuda``.

``'triton'`` is never chosen automatically until a measurement on the device supports it.

The depthwise method's backward pass has two evaluations (``depthwise_mix.depthwise_conv_backward``), chosen per
device type by ``DEPTHWISE_BACKWARDS`` unless ``depthwise_backward(...)`` says otherwise:

* ``'forward_conv'`` (CPU and every other non-CUDA type): both gradients by forward depthwise convolutions. oneDNN's
  depthwise backward on this CPU is 10-40x slower than its forward for AFT's large windows, the forward
  convolutions about 1-3x the forward's time.
* ``'convolution_backward'`` (CUDA): the library's own backward, as before; cuDNN's large-kernel depthwise backward
  was measured slow too (docs/performance.md), so ``'forward_conv'`` may win there: measure it with
  ``aft-vision bench --ops --device cuda`` (it times both).
"""
import contextlib
from typing import Dict, Iterator, Optional, Tuple

import torch

__all__ = ['CONV_METHODS', 'DISPATCH_TABLES', 'DEPTHWISE_BACKWARD_METHODS', 'DEPTHWISE_BACKWARDS',
           'choose_conv_method', 'choose_depthwise_backward', 'depthwise_backward']

CONV_METHODS = ('dense', 'conv', 'triton')

# device type -> (ratio, kappa, beta, largest h * T * T for the dense form); see the module docstring
DISPATCH_TABLES: Dict[str, Tuple[float, float, float, int]] = {
    'cpu': (0.42, 100.0, 1e5, 1 << 24),
    'cuda': (16.0, 64.0, 0.0, 1 << 27),
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
        dtype: The dtype the dense form's products would run in (``policy.product_dtype``). On the CPU one table
            serves float32 and bfloat16: ``bench --ops --precision bf16`` found the same faster method in every layer
            it measured (docs/performance.md). The 'cuda' table assumes bfloat16 products (autocast).
        batch: Images per call (the dense form's fixed cost of building its weights is shared by the batch).
        height: Token-grid height H.
        width: Token-grid width W.
        channels: Channels C.
        num_heads: Heads h.
        kernel_size: Window size s.

    Returns:
        'dense' or 'conv'.
    """
    ratio, kappa, beta, max_weights = DISPATCH_TABLES['cuda'] if device_type == 'cuda' else DISPATCH_TABLES['cpu']
    num_keys, width_n = height * width, channels + num_heads
    window = min(kernel_size, 2 * height - 1) * min(kernel_size, 2 * width - 1)  # the part of s x s a map can use
    dense = num_keys * num_keys * width_n * (1.0 + kappa * num_heads / (batch * width_n))  # per image
    conv = ratio * num_keys * window * width_n + beta
    if dense <= conv and num_heads * num_keys * num_keys <= max_weights:
        return 'dense'
    return 'conv'
