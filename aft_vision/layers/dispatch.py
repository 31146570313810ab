"""The switches of how an AFT call runs, in one place (as timm's ``layers/config.py``): the method, the device policy,
capture. ``functional.py`` reads them per call.

Method: fixed when an AFT-conv layer is built (``method=``, ``mixer_kwargs``, else ``set_conv_method``'s default,
first ``AFT_CONV_METHOD`` or 'auto': one switch for timm's scripts, as timm's ``TIMM_FUSED_ATTN``); 'auto' picks per
call by ``choose_conv_method``'s cost tables (``DISPATCH_TABLES``, docs/performance.md). Policy (``device_policy``,
``AFT_DEVICE_POLICY``): 'cpu' repairs underflowed or cancelled entries on the host, exact for any finite input;
'cuda' never syncs and floors denominators, exact within stated bounds (docs/operators.md). Both variables are read
when first needed, so a bad value is an error of the call that reads it, naming the variable, never of an import.
``capturing()`` (export, jit tracing, compiling) is the one capture check: every mixer takes its plain-autograd form,
nothing is repaired; ``exporting()`` also sends 'auto' and 'tuned' to 'conv', which runs at any size on any runtime.
"""
import contextlib
import os
from typing import Dict, Iterator, Optional, Tuple

import torch

__all__ = ['METHODS', 'DISPATCH_TABLES', 'POLICIES', 'set_conv_method', 'get_conv_method', 'device_policy',
           'forced_policy', 'exporting', 'capturing', 'no_autocast']

# torch.compiler.is_exporting() tells torch.export from torch.compile from 2.14 on (2.7-2.13: True under both)
_EXPORT_FLAG_TRUSTED = torch.__version__ >= (2, 14)
METHODS = ('auto', 'dense', 'conv', 'tuned')  # 'tuned': the faster form timed on the device, tuning.py
POLICIES = ('cpu', 'cuda')

# device type -> (ratio, kappa, beta, largest h * T * T for the dense form), fitted as docs/operators.md#dispatch says
DISPATCH_TABLES: Dict[str, Tuple[float, float, float, int]] = {
    'cpu': (0.42, 100.0, 1e5, 1 << 24), 'cuda': (16.0, 64.0, 0.0, 1 << 27)}


def check_choice(value: str, allowed: Tuple[str, ...] = METHODS, origin: str = 'method') -> str:
    """``value`` if it is one of ``allowed``, else a ValueError naming ``origin``."""
    if value not in allowed:
        raise ValueError(f"{origin} must be one of {', '.join(allowed)}, got {value!r}")
    return value


def _from_env(name: str, allowed: Tuple[str, ...]) -> Optional[str]:
    """The environment variable ``name`` (any case), checked against ``allowed``; None where unset or empty."""
    value = os.environ.get(name, '').strip()
    return check_choice(value.lower(), allowed, name) if value else None


_default_method: Optional[str] = None  # set_conv_method's; None: AFT_CONV_METHOD, else 'auto'


def set_conv_method(method: str) -> None:
    """Set the method of AFT-conv layers built from now on without one, and of ``aft_conv2d`` calls without one."""
    global _default_method
    _default_method = check_choice(method)


def get_conv_method() -> str:
    """The process default: ``set_conv_method``'s, else ``AFT_CONV_METHOD``, else 'auto'."""
    return _default_method or _from_env('AFT_CONV_METHOD', METHODS) or 'auto'


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


_override: Optional[str] = None


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


def forced_policy() -> Optional[str]:
    """The ``device_policy`` in force, else ``AFT_DEVICE_POLICY``; None: each call takes its tensors' device's
    (``functional.get_device_policy``)."""
    return _override or _from_env('AFT_DEVICE_POLICY', POLICIES)


def no_autocast():
    """Disable autocast where it is on (CUDA, else the CPU, XPU or MPS), so products run in the dtype cast to."""
    for device_type in ('cuda', 'cpu', 'xpu', 'mps'):
        if torch.is_autocast_enabled(device_type):
            return torch.autocast(device_type=device_type, enabled=False)
    return contextlib.nullcontext()
