"""AFT-conv's 'tuned' method, as ``torch.backends.cudnn.benchmark``: the first call of a key times both forms on its
own inputs and keeps the faster for the key's later calls. A compiled graph takes a choice recorded before tracing
(at the largest batch recorded), else the table ('auto'); nothing is timed in a trace."""
import statistics
import threading
import time
from collections import OrderedDict
from typing import Callable, Dict, Tuple

import torch

from .dispatch import DISPATCH_TABLES

__all__ = ['tuned_method', 'tuned_choices', 'clear_tuned_choices']

MAX_KEYS, REPEATS = 256, 3  # the record keeps the newest keys; timed calls per form after one warm-up (median)
_lock = threading.Lock()  # held while timing and inserting; a lookup reads without it
_choices: Dict[Tuple, Tuple[str, Dict[str, float]]] = OrderedDict()  # key -> (method, {method: ms})


def _ms(run: Callable, inputs, method: str, training: bool) -> float:
    """Median ms of ``run(*inputs, method=method)``, then backward of a fixed random gradient when ``training``."""
    generator, grad, times = torch.Generator(inputs[0].device).manual_seed(0), None, []  # the global RNG untouched
    for _ in range(REPEATS + 1):
        start = time.perf_counter()
        with torch.set_grad_enabled(training):
            out = run(*inputs, method=method)
        if training:
            grad = torch.randn(out.shape, generator=generator, device=out.device) if grad is None else grad
            out.backward(grad.to(out.dtype))
        out.view(-1)[0].item()  # reading a value back waits for the device's queue, whatever the device
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times[1:])


def tuned_method(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, w: torch.Tensor, mm_dtype: torch.dtype,
                 run: Callable) -> str:
    """The form recorded for this call's key, else the faster of ``run(q, k, v, w, method='dense' / 'conv')`` timed
    now on detached inputs. Key: device, batch (to a power of 2: a choice holds from B to 2B - 1, as the dense form's
    share of per-call work shrinks like 1 / B), H, W, C, h, s, the products' dtype ``mm_dtype``, and training (grad
    enabled and an input requiring it: forward and backward timed, else the forward)."""
    batch, height, width, channels = q.shape
    training = torch.is_grad_enabled() and any([x.requires_grad for x in (q, k, v, w)])
    rest = (q.device, height, width, channels, k.shape[-1], w.shape[-1], mm_dtype, training)
    if torch.compiler.is_compiling():  # the batch may be symbolic: any recorded batch
        return _recorded(rest)
    key = (1 << (batch.bit_length() - 1),) + rest
    choice = _choices.get(key)
    if choice is None:
        with _lock:
            choice = _choices.get(key)
            if choice is None:
                inputs = [x.detach().requires_grad_(training and x.requires_grad) for x in (q, k, v, w)]
                limit = DISPATCH_TABLES['cuda' if q.device.type == 'cuda' else 'cpu'][3]  # dense weights that fit
                methods = ['dense', 'conv'] if k.shape[-1] * (height * width) ** 2 <= limit else ['conv']
                times = {method: _ms(run, inputs, method, training) for method in methods}
                choice = _choices[key] = (min(times, key=times.get), times)
                while len(_choices) > MAX_KEYS:
                    _choices.popitem(last=False)
    return choice[0]


@torch.compiler.assume_constant_result
def _recorded(rest: Tuple) -> str:
    """What was recorded for ``rest`` (a key without its batch) at the largest batch, else 'auto'."""
    with _lock:
        found = [(key[0], method) for key, (method, _) in _choices.items() if key[1:] == rest]
    return max(found)[1] if found else 'auto'


def tuned_choices() -> Dict[str, Tuple[str, Dict[str, float]]]:
    """What 'tuned' recorded, oldest first: {key, e.g. 'cpu B 8-15 14x14 C 384 h 384 s 15 bfloat16 training':
    (method, {method: median ms})}."""
    with _lock:
        return {f"{d} B {b}-{2 * b - 1} {hh}x{ww} C {c} h {h} s {s} {str(dt)[6:]} {'training' if t else 'inference'}":
                choice for (b, d, hh, ww, c, h, s, dt, t), choice in _choices.items()}


def clear_tuned_choices() -> None:
    """Forget every recorded choice: the next 'tuned' call of each key times again."""
    with _lock:
        _choices.clear()
