"""AFT-conv's 'tuned' method, as ``torch.backends.cudnn.benchmark``: the first call of a key times both forms on its
own inputs and keeps the faster for the key's later calls; a compiled graph or a torch.func transform takes what was
recorded before (else the table)."""
import contextlib
import threading
import time
from typing import Callable, Dict, List

import torch

from ._shared import DISPATCH_TABLES, plain_autograd, plain_forms

__all__ = ['tuned_method', 'tuned_choices']

MAX_KEYS, REPEATS = 256, 3  # the record keeps the newest keys; timed calls per form after one warm-up (median)
_lock = threading.Lock()  # held only to insert and evict, never across a timing (a timed call may re-enter)
_choices: dict[tuple, tuple[str, dict[str, float]]] = {}  # (B to a power of 2, rest) -> (method, {method: ms})


def _ms(run: Callable, inputs: List[torch.Tensor], method: str, training: bool) -> float:
    """Median ms of ``run(*inputs, method=method)``, and its backward of a fixed random gradient when ``training``."""
    grad, times = torch.randn(inputs[0].shape, generator=torch.Generator().manual_seed(0)).to(inputs[0].device), []
    for _ in range(REPEATS + 1):
        start = time.perf_counter()
        with torch.set_grad_enabled(training):
            out = run(*inputs, method=method)
            if training:
                out.backward(grad)
        out.view(-1)[0].item()  # reading a value back waits for the device's queue, whatever the device
        times.append((time.perf_counter() - start) * 1e3)
    return sorted(times[1:])[REPEATS // 2]


def _time_forms(inputs: List[torch.Tensor], methods: List[str], training: bool, run: Callable) -> Dict[str, float]:
    """{method: median ms} timed in a thread of its own: outside the caller's autograd state (a checkpoint's or any
    saved-tensor hooks, a backward in progress), under the caller's autocast and plain-autograd switch."""
    device_type = inputs[0].device.type
    autocast = torch.is_autocast_enabled(device_type) if device_type in ('cpu', 'cuda', 'xpu', 'mps') else False
    autocast_dtype = torch.get_autocast_dtype(device_type) if autocast else None
    plain = plain_forms()
    inputs[0][(0,) * inputs[0].dim()].item()  # the inputs written, whatever queue wrote them: the timer runs its own
    times: Dict[str, float] = {}
    failure: List[BaseException] = []

    def time_each():
        try:
            casting = torch.autocast(device_type, dtype=autocast_dtype) if autocast else contextlib.nullcontext()
            with casting, plain_autograd(plain):
                for method in methods:
                    leaves = [x.detach().requires_grad_(training and x.requires_grad) for x in inputs]
                    times[method] = _ms(run, leaves, method, training)
        except BaseException as error:  # raised again in the caller's thread
            failure.append(error)

    worker = threading.Thread(target=time_each, name='aft-tuned-timing')
    worker.start()
    worker.join()
    if failure:
        raise failure[0]
    return times


def tuned_method(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, w: torch.Tensor, mm_dtype: torch.dtype,
                 run: Callable) -> str:
    """The form recorded for this call's key, else the faster of ``run(q, k, v, w, method='dense' / 'conv')`` timed
    now on detached inputs ('conv' untimed beyond the table's size limit). Key: B to a power of 2 (the dense form's
    per-call work weighs like 1 / B), then ``rest``: the device, H, W, C, h, s, the products' dtype ``mm_dtype`` and
    whether training (grad enabled and an input requiring it: forward and backward timed, else the forward). Under
    ``torch.compile`` or a torch.func transform (whose inputs are wrappers, nothing to time) the record of ``rest``
    at its largest batch answers, else 'auto'."""
    (batch, height, width, channels), heads = q.shape, k.shape[-1]
    training = torch.is_grad_enabled() and any([x.requires_grad for x in (q, k, v, w)])
    rest = (q.device, height, width, channels, heads, w.shape[-1], mm_dtype, training)
    if torch.compiler.is_compiling():  # any batch; a map of symbolic size takes the table (or any map, torch < 2.8)
        static = getattr(torch.fx.experimental.symbolic_shapes, 'has_static_value', lambda n: False)
        return _recorded(rest) if all([static(n) for n in (height, width, channels)]) else 'auto'
    if torch._C._are_functorch_transforms_active():
        return _recorded(rest)
    key = (1 << (batch.bit_length() - 1), rest)
    if (choice := _choices.get(key)) is None:
        fits = heads * (height * width) ** 2 <= DISPATCH_TABLES['cuda' if q.is_cuda else 'cpu'][3]
        times = _time_forms([q, k, v, w], ['dense', 'conv'] if fits else [], training, run)  # else none to time
        with _lock:  # another thread may have recorded the key meanwhile: the first record stands
            choice = _choices.setdefault(key, (min(times, key=times.get, default='conv'), times))
            if len(_choices) > MAX_KEYS:
                del _choices[next(iter(_choices))]
    return choice[0]


@torch.compiler.assume_constant_result
def _recorded(rest: tuple) -> str:
    """The method recorded for ``rest`` at the largest batch, else 'auto' (the table)."""
    found = [(key[0], method) for key, (method, _) in list(_choices.items()) if key[1] == rest]  # a copy: inserts go on
    return max(found or [(0, 'auto')])[1]


def tuned_choices(clear: bool = False) -> dict[str, tuple[str, dict[str, float]]]:
    """What 'tuned' recorded, oldest first: {key, e.g. 'cpu B 8-15 14x14 C 384 h 384 s 15 bfloat16 training': (method,
    {method: median ms})}; ``clear`` then forgets it all, so that the next call of each key times again."""
    record = {f"{d} B {b}-{2 * b - 1} {hh}x{ww} C {c} h {h} s {s} {str(dt)[6:]} {'training' if t else 'inference'}":
              choice for (b, (d, hh, ww, c, h, s, dt, t)), choice in list(_choices.items())}
    if clear:
        with _lock:
            _choices.clear()
    return record
