"""One loader for every command that runs a model: what a user names (a registered name, its pretrained tag, a
checkpoint file with the run record beside it, a ``local-dir:`` folder or an ``hf-hub:`` repository) becomes the model
with its weights and the preprocessing they were evaluated with, the same on every path.

A checkpoint's run record (``read_training_record``, as ``publish`` reads it) gives the architecture arguments and
the data config, so ``--checkpoint RUN/model.safetensors`` and ``local-dir:RUN/hub`` answer alike. Every failure is
one ValueError line naming the file, the model or the key: damaged weights, a non-AFT model, arguments that do not
build, an unreachable Hub.
"""
import os
import socket
import sys
from pathlib import Path
from typing import Any, Dict, Optional, Tuple
from urllib.parse import urlparse

import timm
import torch
from safetensors import SafetensorError
from timm.models import parse_model_name

from ..checkpoints.files import load_weights
from ..checkpoints.transfer import is_vit_state_dict, unwrap_state_dict
from ..models import check_model_name
from ..models.aft_conv import AFTConvTransformer, checkpoint_filter_fn as aft_conv_filter
from .data_config import resolve_publish_data_config
from .publishing import model_from_checkpoint
from .records import read_training_record, source_architecture

__all__ = ['load_model', 'check_aft_model', 'check_init_weights', 'check_model_kwargs', 'check_source',
           'warn_random_weights', 'RANDOM_WEIGHTS']

HUB_TIMEOUT_S = 3.0  # how long a connection to the Hub may take before it counts as offline
WEIGHT_FILES = ('model.safetensors', 'pytorch_model.bin', 'open_clip_pytorch_model.bin')  # timm's order
RANDOM_WEIGHTS = 'random weights'  # what ``load_model`` says a bare name holds
_BUILD_ERRORS = (TypeError, ValueError, ZeroDivisionError, AssertionError, RuntimeError, KeyError, IndexError)


def _first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return (lines[0] if lines else type(error).__name__) + (' ...' if len(lines) > 1 else '')


def check_aft_model(name: str) -> None:
    """Raise ValueError unless the registered ``name`` (or the architecture its folder names) is an AFT model."""
    architecture = name if ':' not in name else source_architecture(name)[0]
    if architecture.split('.')[0] not in timm.list_models('aft_*'):
        raise ValueError(f'{name} is not an AFT model (only AFT models serve here); AFT models: '
                         f'{", ".join(timm.list_models("aft_*"))}')


def check_model_kwargs(name: str, model_kwargs: Dict[str, Any], defaults: Optional[Dict[str, Any]] = None) -> None:
    """Build ``name`` with ``model_kwargs`` (over ``defaults``) on the meta device (no memory, no weights).

    Raises:
        ValueError: The model cannot be built with them, as one line naming the arguments and the error.
    """
    if not model_kwargs:
        return
    try:
        with torch.device('meta'):
            timm.create_model(name.split('.')[0] if ':' not in name else name, **{**(defaults or {}), **model_kwargs})
    except _BUILD_ERRORS as error:
        given = ' '.join(f'{key}={value}' for key, value in model_kwargs.items())
        raise ValueError(f'{name} cannot be built with {given} ({type(error).__name__}: {_first_line(error)})'
                         ) from None


def _hub_reachable() -> bool:
    """False when huggingface_hub is offline (HF_HUB_OFFLINE) or its endpoint answers no connection within
    ``HUB_TIMEOUT_S`` (no retries: an offline machine is told in seconds, not after a minute of backoff)."""
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return False
    endpoint = urlparse(constants.ENDPOINT)
    try:
        socket.create_connection((endpoint.hostname, endpoint.port or 443), timeout=HUB_TIMEOUT_S).close()
    except OSError:
        return False
    return True


def _check_hub(repo_id: str) -> None:
    """An ``hf-hub:`` repository: loaded from the Hub, or (offline) from the cache, else one line. Offline, the
    process goes on in huggingface_hub's offline mode so that nothing retries."""
    from huggingface_hub import constants, try_to_load_from_cache

    if _hub_reachable():
        return
    os.environ['HF_HUB_OFFLINE'] = '1'
    constants.HF_HUB_OFFLINE = True
    repo, _, revision = repo_id.partition('@')
    if not isinstance(try_to_load_from_cache(repo, 'config.json', revision=revision or None), str):
        raise ValueError(f'hf-hub:{repo_id}: the Hub cannot be reached ({constants.ENDPOINT}, offline or '
                         f'HF_HUB_OFFLINE set) and {repo} is not in the cache {constants.HF_HUB_CACHE}')


def check_source(name: str) -> None:
    """For a ``local-dir:`` / ``hf-hub:`` source: the folder's config.json and weights readable, the Hub reachable or
    the repository cached; ValueError (one line naming the file) otherwise. Registered names pass."""
    source, model_id = parse_model_name(name)
    if source == 'hf-hub':
        _check_hub(model_id)
    elif source == 'local-dir':
        folder = Path(model_id)
        source_architecture(name)  # config.json there and readable
        weights = next((folder / file for file in WEIGHT_FILES if (folder / file).is_file()), None)
        if weights is None:
            raise ValueError(f'{name}: no weights in {folder} (one of {", ".join(WEIGHT_FILES)})')
        load_weights(weights)  # damaged, empty or hostile: one line naming the file


def check_init_weights(path: str, name: str, model_kwargs: Dict[str, Any], num_classes: int) -> None:
    """Weights a training run starts from (``--init-from``) fit ``name`` built with ``model_kwargs`` and a head of
    ``num_classes``: the model's own, every key and shape, or a ViT / DeiT's (``transfer_vit_weights`` maps them).

    Raises:
        ValueError: The file is unreadable, or the first missing or unexpected key, or mismatched shape, named.
    """
    weights = unwrap_state_dict(load_weights(path))
    with torch.device('meta'):
        model = timm.create_model(name, num_classes=num_classes, **model_kwargs)
    expected = model.state_dict()
    if is_vit_state_dict(weights) and not is_vit_state_dict(expected):
        return
    if isinstance(model, AFTConvTransformer):  # windows and patch resampled to the model's, as the trainer loads them
        weights = aft_conv_filter(weights, model)
    missing, unexpected = sorted(set(expected) - set(weights)), sorted(set(weights) - set(expected))
    if missing or unexpected:
        raise ValueError(f'{path} does not fit {name}: {len(missing)} keys missing {missing[:3]}, '
                         f'{len(unexpected)} unexpected {unexpected[:3]}')
    for key, tensor in weights.items():
        if tensor.shape != expected[key].shape:
            raise ValueError(f'{path} does not fit {name}: {key!r} has shape {list(tensor.shape)}, the model (with '
                             f'{num_classes} classes) expects {list(expected[key].shape)}')


def warn_random_weights(name: str, weights: str) -> None:
    """The one rule for a bare name in every command: allowed, and said on stderr once the command has succeeded
    (a refusal stays one line)."""
    if weights == RANDOM_WEIGHTS:
        print(f'warning: {name} has random weights (no --checkpoint, --pretrained or local-dir: / hf-hub: source): '
              'its outputs mean nothing', file=sys.stderr)


def _data_config_of(model: torch.nn.Module, checkpoint: str) -> str:
    """Give ``model`` the preprocessing the run record beside ``checkpoint`` says its weights were evaluated with,
    as ``publish`` would publish it; returns where it came from."""
    config, source = resolve_publish_data_config(model, read_training_record(checkpoint))
    if config:
        model.pretrained_cfg = {**model.pretrained_cfg, **config}
    return source


def load_model(
        name: str,
        checkpoint: Optional[str] = None,
        pretrained: bool = False,
        use_ema: bool = True,
        model_kwargs: Optional[Dict[str, Any]] = None,
        aft_only: bool = True,
) -> Tuple[torch.nn.Module, str]:
    """The model ``name`` names, with its weights and data config (``model.pretrained_cfg``), in eval mode.

    Args:
        name: A registered model (with a tag), or a ``local-dir:`` / ``hf-hub:`` source (its weights always load).
        checkpoint: A weight file (safetensors, weights-only PyTorch, a timm training checkpoint): ``name`` is built
            with the run record's arguments (``model_kwargs`` over them), sized to its head, and given the record's
            data config, as ``publish`` would publish it.
        pretrained: The tag's pretrained weights.
        use_ema: A training checkpoint's EMA weights where it has them (timm's rule), else its trained ones.
        aft_only: Refuse a model that is not an AFT model.

    Returns:
        The model and, in words, which weights it holds: ``RANDOM_WEIGHTS`` for a bare name, allowed in every
        command, which then says so (``warn_random_weights``).

    Raises:
        ValueError: Unknown or non-AFT model, damaged weights, arguments that do not build, an unreachable Hub; one
            line naming the file, the model or the key.
    """
    model_kwargs = dict(model_kwargs or {})
    check_model_name(name)
    check_source(name)
    if aft_only:
        check_aft_model(name)
    if checkpoint:
        record = read_training_record(checkpoint)
        kwargs = {**(record.model_kwargs if record else {}), **model_kwargs}
        architecture = name
        if ':' in name:
            architecture, kwargs = source_architecture(name, kwargs)
        check_model_kwargs(architecture, kwargs)
        model, weights = model_from_checkpoint(architecture, checkpoint, use_ema, **kwargs)
        source = _data_config_of(model, checkpoint)
        return model.eval(), f'{weights}; data config: {source}'
    check_model_kwargs(name, model_kwargs)
    loads = pretrained or ':' in name
    try:
        model = timm.create_model(name, pretrained=loads, **model_kwargs)
    except (SafetensorError, RuntimeError, OSError, ValueError) as error:  # weights that do not fit or read
        raise ValueError(f'{name}: its weights cannot be loaded ({type(error).__name__}: '
                         f'{_first_line(error)})') from None
    return model.eval(), 'pretrained weights' if loads else RANDOM_WEIGHTS
