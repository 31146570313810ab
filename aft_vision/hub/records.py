"""How a checkpoint was trained and evaluated, read from the run that made it (the main job's ``results.json``, timm
``train.py``'s ``args.yaml`` or the ``args`` in its checkpoints), the architecture a name or published folder
rebuilds, and the preprocessing it is published with: the record with the publish flags over it, each entry checked
against the model. timm records neither beside a checkpoint it did not publish, and its ``resolve_data_config`` fills
gaps but checks nothing."""
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import timm
import torch
from timm.data import resolve_data_config
from timm.models import parse_model_name, split_model_name_tag

from ..checkpoints.files import load_weights
from ..models import DEPRECATED_TAGS

__all__ = ['source_architecture', 'source_file', 'read_hub_config', 'read_training_record', 'TrainingRecord',
           'DATA_CONFIG_KEYS', 'resolve_publish_data_config', 'CROP_MODES', 'INTERPOLATIONS']

# pretrained_cfg entries that say how weights were trained and evaluated (timm's resolve_data_config reads them)
DATA_CONFIG_KEYS = ('input_size', 'test_input_size', 'crop_pct', 'crop_mode', 'interpolation', 'mean', 'std')
INTERPOLATIONS = ('nearest', 'bilinear', 'bicubic', 'box', 'hamming', 'lanczos')
CROP_MODES = ('center', 'squash', 'border')


def source_architecture(name: str, model_kwargs: Optional[Dict[str, Any]] = None) -> Tuple[str, Dict[str, Any]]:
    """The architecture (no tag; a deprecated tag's current one) and arguments that rebuild ``name``: a source's
    config.json ``model_args`` but ``num_classes`` (the head gives it), ``model_kwargs`` over them. FileNotFoundError
    without config.json."""
    model_kwargs = dict(model_kwargs or {})
    source, model_id = parse_model_name(name)
    if not source:
        return split_model_name_tag(DEPRECATED_TAGS.get(model_id, model_id))[0], model_kwargs
    config = read_hub_config(name)
    return config['architecture'], {**config['model_args'], **model_kwargs}


def source_file(name: str, files: Sequence[str], what: str = '', local_files_only: bool = False) -> Path:
    """The first of ``files`` (``what`` they hold) in a ``local-dir:`` folder or (downloaded, or from the cache; only
    from the cache with ``local_files_only``) an ``hf-hub:`` repository; FileNotFoundError naming the source, what is
    missing and the files where none is there."""
    source, model_id = parse_model_name(name)
    if source == 'local-dir':
        for file in files:
            if (Path(model_id) / file).is_file():
                return Path(model_id) / file
    else:
        from huggingface_hub import hf_hub_download
        from huggingface_hub.utils import EntryNotFoundError, LocalEntryNotFoundError

        repo, _, revision = model_id.partition('@')
        for file in files:
            try:
                return Path(hf_hub_download(repo, file, revision=revision or None, local_files_only=local_files_only))
            except (EntryNotFoundError, LocalEntryNotFoundError):
                pass
    listed = ' or '.join(files)
    raise FileNotFoundError(f'{name}: no {f"{what} ({listed})" if what else listed} in {model_id} (aft-vision publish '
                            'writes them)')


def read_hub_config(name: str, local_files_only: bool = False) -> Dict[str, Any]:
    """A ``local-dir:`` folder's or ``hf-hub:`` repository's config.json in timm's layout, checked: ``architecture``
    registered, ``model_args`` an object (``hub.load_model`` builds with them), ``num_classes`` and ``label_names``
    that agree, the data config (``DATA_CONFIG_KEYS``) present and in range. ``{'path', 'architecture',
    'model_args', 'num_classes', 'label_names', 'data_config', 'notes'}``; ValueError naming the file and the field.
    ``local_files_only``: an ``hf-hub:`` repository from the cache alone."""
    path = source_file(name, ('config.json',), local_files_only=local_files_only)
    config = _read_json_object(path, 'Hub config')
    cfg = config.get('pretrained_cfg', config)  # timm also reads the older single-object layout
    architecture, model_args = config.get('architecture'), config.get('model_args', {})
    if not isinstance(architecture, str) or not timm.is_model(architecture):
        raise ValueError(f'{path}: "architecture" must name a registered model, got {architecture!r}')
    for key, value in (('pretrained_cfg', cfg), ('model_args', model_args)):
        if not isinstance(value, dict):
            raise ValueError(f'{path}: "{key}" must be a JSON object, got {type(value).__name__}')
    num_classes = config.get('num_classes', cfg.get('num_classes'))
    if not isinstance(num_classes, int) or isinstance(num_classes, bool) or num_classes < 0 or cfg.get(
            'num_classes', num_classes) != num_classes:
        raise ValueError(f'{path}: "num_classes" must be a whole number >= 0 that pretrained_cfg agrees with, got '
                         f'{num_classes!r} and {cfg.get("num_classes")!r}')
    missing = [key for key in DATA_CONFIG_KEYS if cfg.get(key) is None and key not in ('test_input_size', 'crop_mode')]
    if missing:  # the model would be fed as the architecture's defaults say, not as its weights were evaluated
        raise ValueError(f'{path}: "pretrained_cfg" lacks {", ".join(missing)} (how to feed the model; timm writes it)')
    labels = config.get('label_names', cfg.get('label_names', cfg.get('labels')))
    names = list(labels.values()) if isinstance(labels, dict) else labels
    if labels is not None and not (isinstance(names, list) and len(names) == num_classes
                                   and all(isinstance(label, str) for label in names)):
        raise ValueError(f'{path}: "label_names" must be {num_classes} strings, one per class (num_classes), got '
                         f'{type(labels).__name__} of {len(labels) if isinstance(labels, (list, dict)) else 1}')
    model_args = {key: value for key, value in model_args.items() if key != 'num_classes'}  # older folders kept it
    try:
        data_config = _check_data_config({k: cfg[k] for k in DATA_CONFIG_KEYS if k in cfg},
                                         model_args.get('in_chans', 3))
    except ValueError as error:
        raise ValueError(f'{path}: "pretrained_cfg": {error}') from None
    notes = cfg.get('notes') if isinstance(cfg.get('notes'), list) else []
    notes = [note for note in notes if isinstance(note, str)]
    return {'path': path, 'architecture': architecture, 'model_args': model_args, 'num_classes': num_classes,
            'label_names': names, 'data_config': data_config, 'notes': notes}


@dataclass
class TrainingRecord:
    """How a checkpoint was trained and evaluated, read from the run that made it."""
    source: str  # the file, by name (for messages and the model card: no local paths)
    data_config: Dict[str, Any] = field(default_factory=dict)  # the DATA_CONFIG_KEYS the run fixed
    architecture: Optional[str] = None  # a registered name, or a local-dir: / hf-hub: source
    model_kwargs: Dict[str, Any] = field(default_factory=dict)
    timm_args: Optional[Dict[str, Any]] = None  # train.py's: the data config resolves from them as train.py did
    label_names: Optional[List[str]] = None  # a published folder's
    notes: List[str] = field(default_factory=list)  # how it was trained, for the published pretrained_cfg


def _read_json_object(path: Path, what: str = 'results file') -> Dict[str, Any]:
    """A JSON object from ``path``; ValueError naming ``what`` and the file otherwise."""
    try:
        value = json.loads(path.read_text(encoding='utf-8'))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f'{what} {path}: not readable JSON ({error})') from None
    if not isinstance(value, dict):
        raise ValueError(f'{what} {path} must hold a JSON object, got a {type(value).__name__}')
    return value


def _record_from_results(results: Dict[str, Any], path: Path) -> Optional[TrainingRecord]:
    # the main job's results.json: its data_config (None: metrics alone)
    if not isinstance(results.get('data_config'), dict):
        return None
    data_config = {k: v for k, v in results['data_config'].items() if k in DATA_CONFIG_KEYS}
    sizes = results.get('train_img_sizes') or [data_config.get('input_size', [0])[-1]]
    return TrainingRecord(f'{path.name} (aft_vision.train)', data_config, results.get('architecture'),
                          dict(results.get('model_kwargs') or {}),
                          notes=[f'trained by aft_vision.train at {", ".join(map(str, sizes))} px'])


def read_training_record(checkpoint: str, results_file: Optional[str] = None) -> Optional[TrainingRecord]:
    """The record of the run that made ``checkpoint``, or None: ``results_file`` or ``results.json`` beside it (the
    main job), ``args.yaml`` beside it or the ``args`` inside it (timm ``train.py``). ValueError if unreadable."""
    folder = Path(checkpoint).parent
    candidates = [Path(results_file)] if results_file else []
    candidates += [folder / 'results.json'] if (folder / 'results.json').is_file() else []
    for path in dict.fromkeys(candidates):
        record = _record_from_results(_read_json_object(path), path)
        if record is not None:
            return record
    if (folder / 'config.json').is_file():  # a published folder: what it was published with
        config = read_hub_config(f'local-dir:{folder}')
        notes = [note for note in config['notes'] if not note.startswith(('preprocessing from', 'No weights'))]
        return TrainingRecord('config.json (the published folder)', config['data_config'], f'local-dir:{folder}',
                              config['model_args'], label_names=config['label_names'], notes=notes)
    args_file, args = folder / 'args.yaml', None
    if args_file.is_file():
        import yaml  # a timm dependency; train.py writes args.yaml with yaml.safe_dump(vars(args))
        try:
            args = yaml.safe_load(args_file.read_text())
        except (OSError, yaml.YAMLError) as error:
            raise ValueError(f'cannot read timm train.py arguments {args_file}: {error}') from None
        if not isinstance(args, dict):
            raise ValueError(f'{args_file} must hold train.py\'s arguments as a mapping, got {type(args).__name__}')
        source = 'args.yaml (timm train.py)'
    elif Path(checkpoint).suffix != '.safetensors' and Path(checkpoint).is_file():
        embedded = load_weights(checkpoint, device='meta').get('args')  # train.py stores an argparse.Namespace
        args = vars(embedded) if hasattr(embedded, '__dict__') else None
        source = f'the train.py arguments inside {Path(checkpoint).name}'
    if args is None:
        return None
    size = args.get('img_size') or (args.get('input_size') or [None])[-1]
    return TrainingRecord(source, architecture=args.get('model') or None,
                          model_kwargs=dict(args.get('model_kwargs') or {}), timm_args=dict(args),
                          notes=[f'trained by timm train.py at {size or "default"} px, {args.get("epochs")} epochs'])


def _spatial(value: Any, in_chans: int, name: str) -> Tuple[int, int, int]:
    size = [value] if isinstance(value, int) else list(value) if isinstance(value, (list, tuple)) else None
    if not size or len(size) not in (1, 2, 3) or not all(isinstance(n, int) and n > 0 for n in size):
        raise ValueError(f'{name} must be N, (H, W) or (C, H, W) of positive integers, got {value!r}')
    if len(size) == 3 and size[0] != in_chans:
        raise ValueError(f'{name} {tuple(size)} has {size[0]} channels, the model takes {in_chans}')
    height, width = (size * 2)[:2] if len(size) == 1 else size[-2:]
    return in_chans, height, width


def _check_data_config(config: Dict[str, Any], in_chans: int) -> Dict[str, Any]:
    # sizes as (C, H, W) of the model's channels, 0 < crop_pct <= 1, known modes, 1 or C positive std / mean in [0, 1]
    checked = {}
    for key, value in ((key, value) for key, value in config.items() if value is not None):
        if key not in DATA_CONFIG_KEYS:
            raise ValueError(f'unknown data config entry {key!r}; known: {", ".join(DATA_CONFIG_KEYS)}')
        if key in ('input_size', 'test_input_size'):
            value = _spatial(value, in_chans, key)
        elif key == 'crop_pct' and not (isinstance(value, (int, float)) and 0 < value <= 1):
            raise ValueError(f'crop_pct must be in (0, 1], got {value!r}')
        elif key in ('crop_mode', 'interpolation'):
            choices = CROP_MODES if key == 'crop_mode' else INTERPOLATIONS
            if value not in choices:
                raise ValueError(f'{key} must be one of {choices}, got {value!r}')
        elif key in ('mean', 'std'):
            values = [value] if isinstance(value, (int, float)) else list(value)
            if len(values) not in (1, in_chans) or not all(
                    isinstance(v, (int, float)) and not isinstance(v, bool) and (v > 0 if key == 'std' else 0 <= v <= 1)
                    for v in values):
                raise ValueError(f'{key} must be 1 or {in_chans} numbers, '
                                 f'{"positive" if key == "std" else "in [0, 1]"}, got {value!r}')
            value = tuple(float(v) for v in values) * (in_chans if len(values) == 1 else 1)
        checked[key] = float(value) if key == 'crop_pct' else value
    small, large = checked.get('input_size'), checked.get('test_input_size')
    if small and large and (large[1] < small[1] or large[2] < small[2]):
        raise ValueError(f'test_input_size {large} is below input_size {small}: it names a larger size that scores at '
                         'least as well')
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
