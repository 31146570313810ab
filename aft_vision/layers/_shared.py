"""What the AFT operators (``functional.py``) and their forms share: the switches of how a call runs (method, device
policy, capture), in one place as timm's ``layers/config.py``, and the last step of every form (``gate``, heads spread
over channels, the floor). docs/operators.md#how-one-call-runs says what each switch does. ``AFT_CONV_METHOD`` and
``AFT_DEVICE_POLICY`` are read once, as the package is imported (as timm reads ``TIMM_FUSED_ATTN``: a graph compiled
on the first call guards on nothing that call changes), and checked where used: a bad value is the error of each call
that needs it, naming the variable, never of the import."""
import contextlib
import os
import threading
from typing import Dict, Iterator, Optional, Tuple

import torch

__all__ = ['METHODS', 'POLICIES', 'DISPATCH_TABLES', 'TINY', 'CANCEL_TOL', 'set_conv_method', 'get_conv_method',
           'device_policy', 'plain_autograd', 'exporting', 'capturing', 'get_device_policy', 'plain_forms',
           'no_autocast', 'per_channel', 'sum_last', 'gate']

METHODS = ('auto', 'dense', 'conv', 'tuned')  # 'tuned': the faster form timed on the device, tuning.py
POLICIES = ('cpu', 'cuda')
# device type -> (ratio, kappa, beta, largest h * T * T for the dense form), fitted as docs/operators.md#dispatch says
DISPATCH_TABLES: Dict[str, Tuple[float, float, float, int]] = {
    'cpu': (0.42, 100.0, 1e5, 1 << 24), 'cuda': (16.0, 64.0, 0.0, 1 << 27)}
# torch.compiler.is_exporting() tells torch.export from torch.compile from 2.14 on (2.7-2.13: True under both)
_EXPORT_FLAG_TRUSTED = torch.__version__ >= (2, 14)
_COMPILED_BATCH = 64  # the batch 'auto' assumes in a compiled graph, whose batch size may change between calls

_default_method: Optional[str] = None  # set_conv_method's
_override: Optional[str] = None  # device_policy's
_plain = threading.local()  # plain_autograd's switch, per thread


def check_choice(value: str, allowed: Tuple[str, ...] = METHODS, origin: str = 'method') -> str:
    """``value`` if it is one of ``allowed``, else a ValueError naming ``origin``."""
    if value not in allowed:
        raise ValueError(f"{origin} must be one of {', '.join(allowed)}, got {value!r}")
    return value


def read_environment() -> Dict[str, Optional[str]]:
    """AFT_CONV_METHOD and AFT_DEVICE_POLICY as set (any case), None where unset or empty; not checked yet."""
    return {name: os.environ.get(name, '').strip().lower() or None for name in ('AFT_CONV_METHOD', 'AFT_DEVICE_POLICY')}


_environment = read_environment()  # read once, at import


def _from_environment(name: str, allowed: Tuple[str, ...]) -> Optional[str]:
    """The environment variable ``name`` as read at import, checked against ``allowed`` (ValueError naming it)."""
    value = _environment[name]
    return value if value is None else check_choice(value, allowed, name)


def set_conv_method(method: str) -> None:
    """Set the method of AFT-conv layers built from now on without one, and of ``aft_conv2d`` calls without one."""
    global _default_method
    _default_method = check_choice(method)


def get_conv_method() -> str:
    """The process default: ``set_conv_method``'s, else ``AFT_CONV_METHOD``, else 'auto'."""
    return _default_method or _from_environment('AFT_CONV_METHOD', METHODS) or 'auto'


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


@contextlib.contextmanager
def plain_autograd(enabled: bool = True) -> Iterator[None]:
    """Inside (per thread; also ``@plain_autograd()``) the AFT operators run plain autograd: any order's derivatives."""
    previous, _plain.on = getattr(_plain, 'on', False), enabled
    try:
        yield
    finally:
        _plain.on = previous


def exporting() -> bool:
    """True while torch.export, ONNX export or ``torch.jit.trace`` records a graph for another runtime. Before torch
    2.14, ``torch.compiler.is_exporting()`` also answers True under plain ``torch.compile``: there only ONNX export and
    jit tracing count. False in TorchScript."""
    if torch.jit.is_scripting():
        return False
    else:
        is_exporting = getattr(torch.compiler, 'is_exporting', None)  # torch >= 2.7
        exported = _EXPORT_FLAG_TRUSTED and is_exporting is not None and is_exporting()
        return exported or torch.jit.is_tracing() or torch.onnx.is_in_onnx_export()


def capturing() -> bool:
    """True while a graph is recorded (``exporting()``), compiled or transformed by torch.func: no host sync, no
    autograd Function (the jit tracer records a Function's outputs out of order). False in TorchScript."""
    if torch.jit.is_scripting():
        return False
    else:
        return exporting() or torch.compiler.is_compiling() or torch._C._are_functorch_transforms_active()


def get_device_policy(device: torch.device) -> str:
    """'cuda' while ``capturing()``, else ``device_policy``'s, else ``AFT_DEVICE_POLICY``, else 'cuda' on CUDA and
    'cpu' elsewhere."""
    forced = _override or _from_environment('AFT_DEVICE_POLICY', POLICIES)
    return 'cuda' if capturing() else forced or ('cuda' if device.type == 'cuda' else 'cpu')


def plain_forms() -> bool:
    """True where the operators take their plain-autograd forms: while ``capturing()`` or in ``plain_autograd()``."""
    return capturing() or getattr(_plain, 'on', False)


def no_autocast():
    """Disable autocast where it is on (CUDA, else the CPU, XPU or MPS), so products run in the dtype cast to."""
    for device_type in ('cuda', 'cpu', 'xpu', 'mps'):
        if torch.is_autocast_enabled(device_type):
            return torch.autocast(device_type=device_type, enabled=False)
    return contextlib.nullcontext()


# ---------------------------------------------------------------------------------------------------------------------
# What the forms share: the floor, heads spread over channels, the gate

# A shifted denominator below exp(-50) means the largest joint term was lost to underflow: recompute exactly.
TINY = 1.9287e-22
# An AFT-conv denominator below this fraction of its scale is mostly the cancellation in ``exp(w) - 1``: repaired.
CANCEL_TOL = 1e-2
# Entries recomputed per chunk, times the sequence length, bounds the repair's memory.
_CHUNK_ELEMENTS = 1 << 22


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
