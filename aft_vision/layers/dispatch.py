"""How an AFT call runs, in one place (as timm's ``layers/config.py``): the method, the device policy, capture.

Method: fixed when an AFT-conv layer is built (``method=``, ``mixer_kwargs``, else ``set_conv_method``'s default,
first ``AFT_CONV_METHOD`` or 'auto': one switch for timm's scripts, as timm's ``TIMM_FUSED_ATTN``);
'auto' picks per call by ``choose_conv_method``'s cost tables (docs/performance.md). Policy (``device_policy``,
``AFT_DEVICE_POLICY``): 'cpu' repairs underflowed or cancelled entries on the host, exact for any finite input;
'cuda' never syncs and floors denominators, exact within stated bounds (docs/operators.md). ``capturing()`` (export,
jit tracing, compiling) is the one capture check: every mixer takes its plain-autograd form, nothing is repaired;
``exporting()`` also sends 'auto' and 'fused' to 'conv', which runs at any size on any runtime.
"""
import contextlib
import os
from typing import Dict, Iterator, List, Optional, Tuple

import torch

__all__ = ['METHODS', 'DISPATCH_TABLES', 'POLICIES', 'set_conv_method', 'get_conv_method', 'choose_conv_method',
           'device_policy', 'get_device_policy', 'product_dtype', 'exporting', 'capturing']

# torch.compiler.is_exporting() tells torch.export from torch.compile from 2.14 on (2.7-2.13: True under both)
_EXPORT_FLAG_TRUSTED = torch.__version__ >= (2, 14)
METHODS = ('auto', 'dense', 'conv', 'fused')

# device type -> (ratio, kappa, beta, largest h * T * T for the dense form), fitted as docs/operators.md#dispatch says
DISPATCH_TABLES: Dict[str, Tuple[float, float, float, int]] = {
    'cpu': (0.42, 100.0, 1e5, 1 << 24), 'cuda': (16.0, 64.0, 0.0, 1 << 27)}


def check_choice(value: str, allowed: Tuple[str, ...] = METHODS, origin: str = 'method') -> str:
    """``value`` if it is one of ``allowed``, else a ValueError naming ``origin``."""
    if value not in allowed:
        raise ValueError(f"{origin} must be one of {', '.join(allowed)}, got {value!r}")
    return value


_default_method = check_choice(os.environ.get('AFT_CONV_METHOD') or 'auto', METHODS, 'AFT_CONV_METHOD')


def set_conv_method(method: str) -> None:
    """Set the method of AFT-conv layers built from now on without one, and of ``aft_conv2d`` calls without one."""
    global _default_method
    _default_method = check_choice(method)


def get_conv_method() -> str:
    """The process default ``set_conv_method`` set (``AFT_CONV_METHOD``, else 'auto', unless changed)."""
    return _default_method


def exporting() -> bool:
    """True while torch.export, ONNX export or ``torch.jit.trace`` records a graph for another runtime. Before torch
    2.14, ``torch.compiler.is_exporting()`` also answers True under plain ``torch.compile``: there only ONNX export and
    jit tracing count (a bare ``torch.export`` on such a torch records what a compiled call would run)."""
    if torch.jit.is_scripting():
        return False
    else:
        is_exporting = getattr(torch.compiler, 'is_exporting', None)  # torch >= 2.7
        exported = _EXPORT_FLAG_TRUSTED and is_exporting is not None and is_exporting()
        return exported or torch.jit.is_tracing() or torch.onnx.is_in_onnx_export()


def capturing() -> bool:
    """True while a graph is recorded (``exporting()``) or compiled: no host sync, no autograd Function (the jit
    tracer records a Function's outputs out of order). False in TorchScript, as both calls answer there."""
    return exporting() or torch.compiler.is_compiling()


def choose_conv_method(device_type: str, batch: int, height: int, width: int, channels: int, num_heads: int,
                       kernel_size: int) -> str:
    """'dense' or 'conv' for B, H, W, C, h, s on ``device_type`` (others use the CPU table): the cheaper of
    ``T^2 (C + h) (1 + kappa h / (B (C + h)))`` and ``ratio T A (C + h) + beta`` (A: the usable window) per image."""
    ratio, kappa, beta, max_weights = DISPATCH_TABLES['cuda' if device_type == 'cuda' else 'cpu']
    num_keys, width_n = height * width, channels + num_heads
    window = min(kernel_size, 2 * height - 1) * min(kernel_size, 2 * width - 1)
    dense = num_keys * num_keys * width_n * (1.0 + kappa * num_heads / (batch * width_n))
    conv = ratio * num_keys * window * width_n + beta
    return 'dense' if dense <= conv and num_heads * num_keys * num_keys <= max_weights else 'conv'


POLICIES = ('cpu', 'cuda')
_ENV = 'AFT_DEVICE_POLICY'
_override: Optional[str] = None
_ENV_DEFAULT = os.environ.get(_ENV) and check_choice(os.environ[_ENV], POLICIES, _ENV)


@contextlib.contextmanager
def device_policy(kind: Optional[str]) -> Iterator[None]:
    """Make the AFT operators behave as on device type ``kind`` ('cpu', 'cuda'; None: the inputs'), not
    thread-local: around whole forward and backward passes."""
    global _override
    previous, _override = _override, kind and check_choice(kind, POLICIES, 'device_policy')
    try:
        yield
    finally:
        _override = previous


def get_device_policy(device: torch.device) -> str:
    """The ``device_policy`` in force, else ``AFT_DEVICE_POLICY``, else 'cuda' on CUDA and 'cpu' elsewhere."""
    return _override or _ENV_DEFAULT or ('cuda' if device.type == 'cuda' else 'cpu')


def compute_dtype(tensors: List[torch.Tensor]) -> torch.dtype:
    """The dtype of the operators' arithmetic: float64 if any input is float64, else float32."""
    return torch.float64 if any([tensor.dtype == torch.float64 for tensor in tensors]) else torch.float32


def output_dtype(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.dtype:
    return torch.promote_types(torch.promote_types(q.dtype, k.dtype), v.dtype)


def product_dtype(device: torch.device, input_dtype: torch.dtype, compute_dtype: torch.dtype,
                  policy: str) -> torch.dtype:
    """The dtype of the matrix products (float32 accumulation): the 16-bit autocast or input dtype where the policy
    takes it (bfloat16; float16 under 'cuda' only, its range would hide underflow from the repair), else
    ``compute_dtype``. Call it before autocast is disabled."""
    half = torch.get_autocast_dtype(device.type) if _autocast_enabled(device) else input_dtype
    takes_half = half == torch.bfloat16 or (half == torch.float16 and policy == 'cuda')
    return half if takes_half and compute_dtype == torch.float32 else compute_dtype


def _autocast_enabled(device: torch.device) -> bool:
    return device.type in ('cpu', 'cuda', 'xpu', 'mps') and torch.is_autocast_enabled(device.type)


def no_autocast(device: torch.device):
    """Disable autocast on ``device``'s type, so products and convolutions run in the dtype cast to."""
    if _autocast_enabled(device):
        return torch.autocast(device_type=device.type, enabled=False)
    return contextlib.nullcontext()
