"""The one loader every command runs a model through (``load_model``), and the checks a command line makes before it.

A registered name (with its tag), a checkpoint with the run record beside it, a ``local-dir:`` folder or an
``hf-hub:`` repository all become the model, its weights and the preprocessing they were evaluated with: a file's
weights loaded strictly (never resampled to fit, as timm's source loading would) and finite. Every failure is one
ValueError line naming the file, the field, the model or the key.
"""
import contextlib
import difflib
import socket
import sys
from typing import Any, Dict, Optional, Tuple
from urllib.parse import urlparse

import timm
import torch
from safetensors import SafetensorError
from timm.models import parse_model_name
from torch.overrides import TorchFunctionMode

from ..checkpoints.files import load_weights
from ..checkpoints.transfer import check_finite, select_weights, unwrap_state_dict
from ..models import DEPRECATED_TAGS, fit_checkpoint
from .records import (read_hub_config, read_training_record, resolve_publish_data_config, source_architecture,
                      source_file)

__all__ = ['load_model', 'create_aft_model', 'check_model_name', 'check_pretrained', 'check_aft_model',
           'check_init_weights', 'check_model_kwargs', 'check_source', 'warn_random_weights',
           'check_runs_at_data_config']

HUB_TIMEOUT_S = 3.0  # how long a connection to the Hub may take before it counts as offline
WEIGHT_FILES = ('model.safetensors', 'pytorch_model.bin', 'open_clip_pytorch_model.bin')  # timm's order
RANDOM_WEIGHTS = 'random weights'  # what ``load_model`` says a bare name holds
_BUILD_ERRORS = (TypeError, ValueError, ZeroDivisionError, AssertionError, RuntimeError, KeyError, IndexError)


def _first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return (lines[0] if lines else type(error).__name__) + (' ...' if len(lines) > 1 else '')


def check_model_name(name: str) -> None:
    """ValueError unless ``name`` is a ``:`` source or registered with a known (or deprecated) tag (the closest names or
    tags said)."""
    if ':' in name:
        return
    architecture = name.split('.')[0]
    if not timm.is_model(architecture):
        close = difflib.get_close_matches(architecture, timm.list_models('aft_*'), n=3, cutoff=0.5)
        hint = f'did you mean {", ".join(close)}?' if close else f'AFT models: {", ".join(timm.list_models("aft_*"))}'
        raise ValueError(f'unknown model {name!r}; {hint}')
    try:
        timm.models.get_pretrained_cfg(DEPRECATED_TAGS.get(name, name))
    except RuntimeError as error:  # an unknown tag
        raise ValueError(f'{error} Tags: {", ".join(timm.list_models(architecture, include_tags=True))}') from None


def create_aft_model(name: str, pretrained: bool = False, **kwargs) -> torch.nn.Module:
    """``timm.create_model`` with a clear error for unknown names and tags (``check_model_name``)."""
    check_model_name(name)
    return timm.create_model(name, pretrained=pretrained, **kwargs)


def check_pretrained(name: str, classifier: bool = False) -> None:
    """ValueError unless ``name``'s tag has weights (``classifier``: a trained head) on a reachable Hub or in its cache
    (``_check_hub``), before any download."""
    if ':' in name:
        return
    check_model_name(name)
    cfg = timm.models.get_pretrained_cfg(DEPRECATED_TAGS.get(name, name))
    if not cfg.has_weights:
        tagged = ', '.join(timm.list_pretrained(f'{name.split(".")[0]}.*')) or 'none'
        raise ValueError(f'{name} has no pretrained weights (tag .{cfg.tag}); tags with weights: {tagged}')
    if classifier and not cfg.num_classes:
        raise ValueError(f'{name} has no trained classifier: its weights are a backbone to fine-tune from '
                         f'(num_classes=0)')
    if cfg.hf_hub_id:
        _check_hub(cfg.hf_hub_id, 'model.safetensors')


def check_aft_model(name: str) -> None:
    """Raise ValueError unless the registered ``name`` (or the architecture its folder names) is an AFT model."""
    architecture = name if ':' not in name else source_architecture(name)[0]
    if architecture.split('.')[0] not in timm.list_models('aft_*'):
        raise ValueError(f'{name} is not an AFT model (only AFT models serve here); AFT models: '
                         f'{", ".join(timm.list_models("aft_*"))}')


def check_model_kwargs(name: str, model_kwargs: Dict[str, Any], defaults: Optional[Dict[str, Any]] = None) -> None:
    """ValueError in one line unless ``name`` builds with ``model_kwargs`` (over ``defaults``), on the meta device."""
    if model_kwargs:
        with torch.device('meta'):
            _build(name.split('.')[0] if ':' not in name else name, {**(defaults or {}), **model_kwargs}, model_kwargs)


class _TensorLimit(TorchFunctionMode):
    """Within it (this thread only, as ``torch.device`` is), a ValueError once a build makes more than ``most`` tensors
    (``why`` that many): counted at the factory calls that make every parameter and buffer."""
    FACTORIES = frozenset((torch.empty, torch.zeros, torch.ones, torch.full, torch.rand, torch.randn, torch.tensor,
                           torch.arange, torch.linspace, torch.eye))

    def __init__(self, most: int, why: str):
        super().__init__()
        self.made, self.most, self.why = 0, most, why

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in self.FACTORIES:
            self.made += 1
            if self.made > self.most:
                raise ValueError(f'more than {self.most} tensors, {self.why}')
        return func(*args, **(kwargs or {}))


def _build(name: str, kwargs: Dict[str, Any], given: Dict[str, Any], where: str = '', limit: str = '',
           most: int = -1) -> torch.nn.Module:
    # timm.create_model, a failure in one line naming the arguments ``given`` (and ``where`` they came from); stopped
    # once it makes more than ``most`` tensors (``limit`` says why that many), if most >= 0
    try:
        with _TensorLimit(most, limit) if most >= 0 else contextlib.nullcontext():
            return timm.create_model(name, **kwargs)
    except _BUILD_ERRORS as error:
        given = ' '.join(f'{key}={value!r}' for key, value in given.items())
        raise ValueError(f'{where}{name} cannot be built with {given} ({type(error).__name__}: {_first_line(error)})'
                         ) from None


def _check_hub(repo_id: str, filename: str = 'config.json') -> bool:
    """True if the Hub answers within ``HUB_TIMEOUT_S`` (no retries); False if it does not but ``filename`` is cached
    (the caller's downloads then read the cache only: ``local_files_only``); else ValueError. Changes no setting."""
    from huggingface_hub import constants, try_to_load_from_cache

    if not constants.HF_HUB_OFFLINE:
        endpoint = urlparse(constants.ENDPOINT)
        try:
            socket.create_connection((endpoint.hostname, endpoint.port or 443), timeout=HUB_TIMEOUT_S).close()
            return True
        except OSError:
            pass
    repo, _, revision = repo_id.partition('@')
    if not isinstance(try_to_load_from_cache(repo, filename, revision=revision or None), str):
        raise ValueError(f'hf-hub:{repo_id}: the Hub cannot be reached ({constants.ENDPOINT}, offline or '
                         f'HF_HUB_OFFLINE set) and {repo} is not in the cache {constants.HF_HUB_CACHE}')
    return False


def check_source(name: str) -> bool:
    """ValueError unless a ``local-dir:``'s config.json and weights' header read, or ``hf-hub:`` is up or cached.
    False where an ``hf-hub:`` source is to be read from the cache alone (the Hub did not answer), else True."""
    source, model_id = parse_model_name(name)
    if source == 'hf-hub':
        return _check_hub(model_id)
    if source == 'local-dir':
        source_architecture(name)  # config.json there and readable
        # there; damaged, empty or hostile: one line naming the file
        load_weights(source_file(name, WEIGHT_FILES, 'weights'), device='meta')
    return True


def _check_fits(state_dict: Dict[str, torch.Tensor], expected: Dict[str, torch.Tensor], what: str) -> None:
    """ValueError naming the first missing / unexpected keys, or the first tensor of another shape or of another dtype
    (but another floating-point one: cast as timm casts it)."""
    missing, unexpected = sorted(set(expected) - set(state_dict)), sorted(set(state_dict) - set(expected))
    if missing or unexpected:
        raise ValueError(f'{what}: {len(missing)} keys missing {missing[:4]}, {len(unexpected)} unexpected '
                         f'{unexpected[:4]}')
    for key, tensor in state_dict.items():
        if tensor.shape != expected[key].shape:
            raise ValueError(f'{what}: {key!r} has shape {list(tensor.shape)}, the model expects '
                             f'{list(expected[key].shape)}')
        if tensor.dtype != expected[key].dtype and not all(t.is_floating_point() for t in (tensor, expected[key])):
            raise ValueError(f'{what}: {key!r} is {tensor.dtype}, the model expects {expected[key].dtype}')


def check_init_weights(path: str, name: str, model_kwargs: Dict[str, Any], num_classes: int) -> None:
    """ValueError unless ``--init-from`` weights fit the model after ``models.fit_checkpoint`` (every key and shape)."""
    weights = unwrap_state_dict(load_weights(path), what=path)
    what = f'{path} does not fit {name} (with {num_classes} classes)'
    with torch.device('meta'):
        model = timm.create_model(name, num_classes=num_classes, **model_kwargs)
        try:
            fitted = fit_checkpoint(weights, model, log=lambda text: None)  # as the trainer will load them
        except ValueError as error:  # a ViT the transfer cannot map
            raise ValueError(f'{what}: {_first_line(error)}') from None
    _check_fits(fitted, model.state_dict(), what)


def warn_random_weights(name: str, weights: str) -> None:
    """Say on stderr that a bare name's model has random weights (every command allows it, and says so)."""
    if weights == RANDOM_WEIGHTS:
        print(f'warning: {name} has random weights (no --checkpoint, --pretrained or local-dir: / hf-hub: source): '
              'its outputs mean nothing', file=sys.stderr)


def check_runs_at_data_config(model: torch.nn.Module, what: str) -> None:
    """ValueError unless ``model`` takes an image of its ``pretrained_cfg``'s ``input_size`` and ``test_input_size``:
    its forward run on the meta device (shapes alone: nothing computed or held, whatever the size)."""
    meta = {key: tensor.to('meta') for key, tensor in [*model.named_parameters(), *model.named_buffers()]}
    for key in ('input_size', 'test_input_size'):
        size = model.pretrained_cfg.get(key)
        try:
            torch.func.functional_call(model.eval(), meta, torch.zeros(1, *size, device='meta')) if size else None
        except (ValueError, RuntimeError, AssertionError) as error:
            raise ValueError(f'{what}: {key} {tuple(size)} is a size the model cannot run ({_first_line(error)})'
                             ) from None


def _from_checkpoint(name: str, checkpoint: str, use_ema: bool, model_kwargs: Dict, local_files_only: bool = False
                     ) -> Tuple[torch.nn.Module, str]:
    # name built (a source: as timm builds it, its config.json in pretrained_cfg) with the run record's arguments
    # under model_kwargs, sized to the head: on the meta device first (no number above the file's values; stopped past
    # twice its tensors), held to the keys, shapes and dtypes the file declares, then the file read once; loaded
    # strictly (never resampled); finite; an hf-hub: source from the cache alone with ``local_files_only``
    record = read_training_record(checkpoint)
    config = read_hub_config(name, local_files_only) if ':' in name else None  # a published folder or repo's
    kwargs = {**(config['model_args'] if config else {}), **(record.model_kwargs if record else {}), **model_kwargs}
    declared, weights = select_weights(load_weights(checkpoint, device='meta'), use_ema, str(checkpoint))
    if 'head.weight' in declared:
        kwargs.setdefault('num_classes', declared['head.weight'].shape[0])
    where = f'{config["path"]}: model_args{"" if config["model_args"] else " (none: the defaults)"}' if config else name
    if config and kwargs.get('num_classes', config['num_classes']) != config['num_classes']:
        raise ValueError(f'{config["path"]}: num_classes {config["num_classes"]} but the weights in {checkpoint} hold '
                         f'{kwargs["num_classes"]} classes')
    elements, prefix = sum(tensor.numel() for tensor in declared.values()), f'{where}: ' if config else ''
    for key, value in kwargs.items():  # a number above it sizes more than the file holds: refused before any work
        if any(isinstance(n, int) and n > elements for n in (value if isinstance(value, (list, tuple)) else [value])):
            raise ValueError(f'{where}: {key}={value!r} is more than the {elements} values in {checkpoint}')
    with torch.device('meta'):
        expected = _build(name, kwargs, kwargs, prefix, f'twice the {len(declared)} tensors in {checkpoint}',
                          2 * len(declared)).state_dict()
    _check_fits(declared, expected, f'{where} do not rebuild the weights in {checkpoint}' if config else
                f'{checkpoint} does not fit {name}')
    model = _build(name, kwargs, kwargs, prefix)
    model.load_state_dict(select_weights(load_weights(checkpoint), use_ema, str(checkpoint))[0])
    data_config, source = resolve_publish_data_config(model, record)  # as ``publish`` would publish it
    if data_config:  # read from a file: one the model runs
        model.pretrained_cfg = {**model.pretrained_cfg, **data_config}
        check_runs_at_data_config(model, str(config['path']) if config else record.source)
    return model.eval(), f'{weights}; data config: {source}'


def load_model(name: str, checkpoint: Optional[str] = None, pretrained: bool = False, use_ema: bool = True,
               model_kwargs: Optional[Dict[str, Any]] = None, aft_only: bool = True) -> Tuple[torch.nn.Module, str]:
    """``(model in eval mode, which weights it holds in words)`` for a registered ``name`` (random weights:
    ``RANDOM_WEIGHTS``, or its tag's with ``pretrained``), a ``local-dir:`` / ``hf-hub:`` source or a ``checkpoint``
    (both ``_from_checkpoint``); ``model.pretrained_cfg`` holds the data config. ``use_ema``: timm's rule; ``aft_only``:
    refuse other models. ValueError in one line naming the file, the field, the model or the key."""
    if checkpoint and pretrained:
        raise ValueError(f'{name}: pass a checkpoint or pretrained, not both')
    model_kwargs = dict(model_kwargs or {})
    check_model_name(name)
    cached_only = not check_source(name)  # this call's answer: an unreachable Hub is not asked again
    if aft_only:
        check_aft_model(name)
    if checkpoint or ':' in name:
        weights = checkpoint or str(source_file(name, WEIGHT_FILES, 'weights', cached_only))
        return _from_checkpoint(name, weights, use_ema, model_kwargs, cached_only)
    check_model_kwargs(name, model_kwargs)
    try:
        model = timm.create_model(name, pretrained=pretrained, **model_kwargs)
    except (SafetensorError, RuntimeError, OSError, ValueError) as error:  # weights that do not fit or read
        raise ValueError(f'{name}: its weights cannot be loaded ({type(error).__name__}: '
                         f'{_first_line(error)})') from None
    check_finite(model.state_dict(), name)
    return model.eval(), 'pretrained weights' if pretrained else RANDOM_WEIGHTS
