"""A traffic count of one AFT mixer call: the aten ops that run a kernel and the bytes they read and write, counted on
the path CUDA takes without a GPU (``count_layer``).

``TrafficCounter``'s rules (docs/performance.md, "Counting what a layer moves"): an op counts once if it runs a kernel
(not views, storage aliases, metadata queries, bare allocations, ops returning no tensor); its bytes are those of its
distinct tensor inputs plus outputs, each ``tensor_bytes`` (a broadcast view moves its storage once); an in-place op's
tensor is input and output, ``out=`` and ``copy_`` / ``fill_`` / ``zero_`` / ``new_*`` destinations outputs only; a
custom operator is refused (its kernels are unseen), as are the kernels inside one aten op (cuDNN's transposes).
"""
import collections
from typing import Dict, Optional

import timm
import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from ..layers import AFTConv2d, AFTFull, AFTSimple, aft_conv2d, aft_full, aft_simple, choose_conv_method, device_policy

__all__ = ['TrafficCounter', 'tensor_bytes', 'layer_shape', 'mixer_inputs', 'mixer_call', 'auto_method',
           'count_layer', 'autocast', 'saved_bytes', 'saved_on_cuda_path']

_ALLOCATIONS = {'aten::empty', 'aten::empty_strided', 'aten::new_empty', 'aten::new_empty_strided',
                'aten::empty_like'}
_WRITE_ONLY = {'aten::copy_', 'aten::fill_', 'aten::zero_', 'aten::new_zeros', 'aten::new_ones', 'aten::new_full'}
_QUERIES = {'aten::sym_size', 'aten::sym_stride', 'aten::sym_numel', 'aten::sym_storage_offset', 'aten::size',
            'aten::stride', 'aten::numel', 'aten::dim', 'aten::is_contiguous', 'aten::is_strides_like_format',
            'aten::is_non_overlapping_and_dense', 'prim::device', 'prim::layout', 'prim::dtype'}


def tensor_bytes(tensor: torch.Tensor) -> int:
    """The bytes ``tensor`` spans in its storage: ``element_size * min(numel, 1 + sum((size - 1) * stride))``."""
    if tensor.numel() == 0:
        return 0
    span = 1 + sum((size - 1) * abs(stride) for size, stride in zip(tensor.shape, tensor.stride()))
    return tensor.element_size() * min(tensor.numel(), span)


def _total(tensors) -> int:
    """The bytes of the distinct ``tensors``: two are the same where storage, offset, shape, strides and dtype are."""
    distinct = {(StorageWeakRef(t.untyped_storage()).cdata, t.storage_offset(), tuple(t.shape), t.stride(), t.dtype): t
                for t in tensors}
    return sum(tensor_bytes(tensor) for tensor in distinct.values())


class TrafficCounter(TorchDispatchMode):
    """Counts the aten ops that run a kernel and the bytes they move, by the module docstring's rules.

    Attributes:
        ops: Ops counted.
        bytes: Bytes read and written by them.
        by_name: Op overload name -> [count, bytes], for the largest items.
    """

    def __init__(self):
        super().__init__()
        self.ops, self.bytes = 0, 0
        self.by_name: Dict[str, list] = collections.defaultdict(lambda: [0, 0])

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        schema = func._schema
        if schema.name in _QUERIES or schema.name in _ALLOCATIONS:
            return out
        if func.namespace not in ('aten', 'prims'):
            raise RuntimeError(f'TrafficCounter cannot see inside {func}: count its ops or leave it out')
        written = [arg for arg in schema.arguments if arg.alias_info is not None and arg.alias_info.is_write]
        bound = dict(zip((arg.name for arg in schema.arguments), args), **kwargs)
        outputs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        if not outputs or (not written and self._aliases(schema, outputs, args, kwargs)):
            return out
        mutated = [t for arg in written for t in tree_leaves(bound.get(arg.name)) if isinstance(t, torch.Tensor)]
        out_args = {id(t) for arg in written if arg.is_out for t in tree_leaves(bound.get(arg.name))}
        if schema.name in _WRITE_ONLY:  # the destination (or template) is written, not read
            out_args.add(id(args[0]))
        inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) and id(t) not in out_args]
        moved = _total(inputs) + _total(outputs + mutated)
        self.ops += 1
        self.bytes += moved
        tally = self.by_name[str(func)]
        tally[0] += 1
        tally[1] += moved
        return out

    @staticmethod
    def _aliases(schema, outputs, args, kwargs) -> bool:
        """Whether every output is a view of an input: by the schema's alias info, else by shared storage."""
        if schema.returns and all(ret.alias_info is not None for ret in schema.returns):
            return True
        storages = {StorageWeakRef(t.untyped_storage()).cdata for t in tree_leaves((args, kwargs))
                    if isinstance(t, torch.Tensor)}
        return all(StorageWeakRef(t.untyped_storage()).cdata in storages for t in outputs)


def layer_shape(name: str, img_size: int) -> Dict:
    """The first AFT layer of a registered model at ``img_size`` (built on meta): its kind ('conv', 'full',
    'simple'), grid, width and, for AFT-conv, heads and window; for AFT-full, the tokens T (prefix included)."""
    model = timm.create_model(name, img_size=img_size, device='meta')
    layer = next((m for m in model.modules() if isinstance(m, (AFTConv2d, AFTFull, AFTSimple))), None)
    if layer is None:
        raise ValueError(f'{name} has no AFT layer')
    patch = model.patch_embed.patch_size
    shape = {'height': img_size // patch[0], 'width': img_size // patch[1], 'channels': layer.dim}
    if isinstance(layer, AFTConv2d):
        return {'kind': 'conv', **shape, 'num_heads': layer.num_heads, 'kernel_size': layer.kernel_size}
    tokens = layer.seq_len if isinstance(layer, AFTFull) else shape['height'] * shape['width'] \
        + getattr(model, 'num_prefix_tokens', 0)
    return {'kind': 'full' if isinstance(layer, AFTFull) else 'simple', **shape, 'tokens': tokens}


def mixer_inputs(shape: Dict, batch_size: int, precision: str, device):
    """q, k, v (in bfloat16 for 'bf16', float16 for 'fp16': what autocast's qkv projection hands the mixer) and w
    (float32; None for AFT-simple), random leaves requiring grad."""
    dtype = {'fp32': torch.float32, 'bf16': torch.bfloat16, 'fp16': torch.float16}[precision]
    if shape['kind'] == 'conv':
        grid = (batch_size, shape['height'], shape['width'])
        sizes = [(*grid, shape['channels']), (*grid, shape['num_heads']), (*grid, shape['channels'])]
        w = (shape['num_heads'], shape['kernel_size'], shape['kernel_size'])
    else:
        sizes = [(batch_size, shape['tokens'], shape['channels'])] * 3
        w = (shape['tokens'], shape['tokens']) if shape['kind'] == 'full' else None
    qkv = [torch.randn(size, dtype=dtype, device=device, requires_grad=True) for size in sizes]
    return (*qkv, None if w is None else torch.randn(w, device=device, requires_grad=True))


def mixer_call(shape: Dict, method: Optional[str] = None):
    """The mixer call of ``shape``'s kind, f(q, k, v, w); ``method``: AFT-conv's."""
    return {'conv': lambda q, k, v, w: aft_conv2d(q, k, v, w, method=method), 'full': aft_full,
            'simple': lambda q, k, v, w: aft_simple(q, k, v)}[shape['kind']]


_METHOD_OF = {'full': 'dense', 'simple': 'simple'}  # what the other kinds' call is named in reports


def auto_method(shape: Dict, batch_size: int, device_type: str = 'cuda') -> str:
    """The method 'auto' picks for the layer on ``device_type`` (AFT-full: 'dense', AFT-simple: 'simple')."""
    if shape['kind'] != 'conv':
        return _METHOD_OF[shape['kind']]
    return choose_conv_method(device_type, batch_size, shape['height'], shape['width'], shape['channels'],
                              shape['num_heads'], shape['kernel_size'])


def count_layer(name_or_shape, img_size: int, batch_size: int, precision: str, method: Optional[str] = None) -> Dict:
    """Ops and MB (1e6 bytes) of the mixer call of a model's first AFT layer (``name_or_shape``: a registered name at
    ``img_size``, or a ``layer_shape``), forward and forward + backward, on the path CUDA takes, computing nothing.

    The forward runs on fake CUDA tensors under CUDA's policy; the autograd engine refuses those, so the backward runs
    on fake CPU tensors under ``device_policy('cuda')`` (the CPU's branch where a layer branches on the device type).
    The second of two calls is counted, as a GPU runs every step after the first (per-size tables cached).

    Returns:
        Dict with 'method' (``method``, else CUDA's 'auto'), 'forward_ops', 'forward_mb', 'ops', 'mb' (forward +
        backward), 'largest' (op -> [count, MB], forward + backward) and the layer's shape.
    """
    shape = layer_shape(name_or_shape, img_size) if isinstance(name_or_shape, str) else dict(name_or_shape)
    method = method or auto_method(shape, batch_size)
    mix = mixer_call(shape, method)
    with torch._subclasses.fake_tensor.FakeTensorMode(), device_policy('cuda'):
        for _ in range(2):  # counted the second time: what a layer builds once per size is built (the steady state)
            counter, inputs = TrafficCounter(), mixer_inputs(shape, batch_size, precision, 'cuda')
            with counter:
                mix(*inputs)
            forward_ops, forward_bytes = counter.ops, counter.bytes
            out = mix(*mixer_inputs(shape, batch_size, precision, 'cpu'))
            grad = torch.randn_like(out)
            with counter:
                out.backward(grad)
    largest = sorted(counter.by_name.items(), key=lambda item: -item[1][1])[:5]
    return {**shape, 'batch_size': batch_size, 'precision': precision, 'method': method, 'forward_ops': forward_ops,
            'forward_mb': forward_bytes / 1e6, 'ops': counter.ops, 'mb': counter.bytes / 1e6,
            'largest': {op: [count, moved / 1e6] for op, (count, moved) in largest}}


def autocast(device: torch.device, precision: str):
    """Autocast to ``precision`` ('bf16', 'fp16') on ``device``; nothing for 'fp32'."""
    return torch.autocast(device.type, torch.bfloat16 if precision == 'bf16' else torch.float16,
                          enabled=precision != 'fp32')


def saved_bytes(model: torch.nn.Module, images: torch.Tensor, precision: str) -> int:
    """Bytes autograd saves for the backward of one training forward of ``model`` on ``images`` under ``precision``'s
    autocast: each storage once (``saved_tensors_hooks``), the parameters' own left out."""
    model.train()
    params = {StorageWeakRef(p.untyped_storage()).cdata for p in model.parameters()}
    storages = {}

    def pack(tensor):
        key = StorageWeakRef(tensor.untyped_storage()).cdata
        if key not in params:
            storages[key] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor), autocast(images.device, precision):
        model(images)
    return sum(storages.values())


def saved_on_cuda_path(name: str, img_size: int, batch_size: int, precision: str) -> int:
    """``saved_bytes`` of a training forward of the registered model ``name`` (AFT or not) at ``img_size`` as a GPU
    would keep it, computed without one: fake CPU images under the 'cuda' policy, AFT-conv layers on the method CUDA's
    'auto' picks (the CPU's branches on the device type aside, as ``count_layer``'s backward)."""
    kwargs, shape = {}, layer_shape(name, img_size) if name.startswith('aft_') else None
    if shape is not None and shape['kind'] == 'conv':
        kwargs['mixer_kwargs'] = {'method': auto_method(shape, batch_size)}
    model = timm.create_model(name, img_size=img_size, device='meta', **kwargs).to_empty(device='cpu')  # no init
    with torch._subclasses.fake_tensor.FakeTensorMode(allow_non_fake_inputs=True), device_policy('cuda'):
        return saved_bytes(model, torch.randn(batch_size, 3, img_size, img_size), precision)
