"""The preprocessing an AFT model is published with: the run's record with the publish flags over it, each entry
checked against the model (timm's ``resolve_data_config`` fills gaps but checks nothing)."""
from typing import Any, Dict, Optional, Tuple

import torch
from timm.data import resolve_data_config

from .records import DATA_CONFIG_KEYS, TrainingRecord

__all__ = ['resolve_publish_data_config', 'CROP_MODES', 'INTERPOLATIONS']

INTERPOLATIONS = ('nearest', 'bilinear', 'bicubic', 'box', 'hamming', 'lanczos')
CROP_MODES = ('center', 'squash', 'border')


def _spatial(value: Any, in_chans: int, name: str) -> Tuple[int, int, int]:
    size = [value] if isinstance(value, int) else list(value) if isinstance(value, (list, tuple)) else None
    if not size or len(size) not in (1, 2, 3) or not all(isinstance(n, int) and n > 0 for n in size):
        raise ValueError(f'{name} must be N, (H, W) or (C, H, W) of positive integers, got {value!r}')
    if len(size) == 3 and size[0] != in_chans:
        raise ValueError(f'{name} {tuple(size)} has {size[0]} channels, the model takes {in_chans}')
    height, width = (size * 2)[:2] if len(size) == 1 else size[-2:]
    return in_chans, height, width


def _check_data_config(config: Dict[str, Any], in_chans: int) -> Dict[str, Any]:
    # sizes as (C, H, W) of the model's channels, 0 < crop_pct <= 1, known modes, positive std
    checked = {}
    for key, value in config.items():
        if value is None:
            continue
        if key not in DATA_CONFIG_KEYS:
            raise ValueError(f'unknown data config entry {key!r}; known: {", ".join(DATA_CONFIG_KEYS)}')
        if key in ('input_size', 'test_input_size'):
            value = _spatial(value, in_chans, key)
        elif key == 'crop_pct':
            if not isinstance(value, (int, float)) or not 0 < value <= 1:
                raise ValueError(f'crop_pct must be in (0, 1], got {value!r}')
            value = float(value)
        elif key == 'crop_mode' and value not in CROP_MODES:
            raise ValueError(f'crop_mode must be one of {CROP_MODES}, got {value!r}')
        elif key == 'interpolation' and value not in INTERPOLATIONS:
            raise ValueError(f'interpolation must be one of {INTERPOLATIONS}, got {value!r}')
        elif key in ('mean', 'std'):
            values = [value] if isinstance(value, (int, float)) else list(value)
            if len(values) not in (1, in_chans) or not all(isinstance(v, (int, float)) for v in values):
                raise ValueError(f'{key} must be 1 or {in_chans} numbers, got {value!r}')
            if key == 'std' and not all(v > 0 for v in values):
                raise ValueError(f'std must be positive, got {value!r}')
            value = tuple(float(v) for v in values) * (in_chans if len(values) == 1 else 1)
        checked[key] = value
    return checked


def resolve_publish_data_config(model: torch.nn.Module, record: Optional[TrainingRecord] = None,
                                overrides: Optional[Dict[str, Any]] = None) -> Tuple[Optional[Dict[str, Any]], str]:
    """``(data_config or None: the default config, where it came from)``: ``overrides`` over the run's ``record`` (a
    timm ``train.py`` one resolved as ``train.py`` did); ValueError for an entry that does not fit the model."""
    in_chans = getattr(model, 'in_chans', 3)
    overrides = _check_data_config(dict(overrides or {}), in_chans)
    if record is None:
        if not overrides:
            return None, (f'no record of how the weights were trained or evaluated: the default config of '
                          f'{model.pretrained_cfg.get("architecture")}, not measured with these weights')
        unset = [key for key in DATA_CONFIG_KEYS if key not in overrides and key != 'test_input_size']
        return overrides, (f'{", ".join(overrides)} from the command line; '
                           f'{", ".join(unset) or "nothing"} from the architecture\'s default config')
    timm_args = record.timm_args
    resolved = record.data_config if timm_args is None else resolve_data_config(dict(timm_args), model=model)
    config = {**_check_data_config(dict(resolved), in_chans), **overrides}
    source = record.source + (f'; {", ".join(overrides)} from the command line' if overrides else '')
    return config, source
