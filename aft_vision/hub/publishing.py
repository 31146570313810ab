"""Publishing AFT models in the layout timm's Hub loader reads, and uploading them with huggingface_hub.

``build_hub_folder`` writes ``config.json`` (through timm's own ``save_config_for_hf``), ``model.safetensors`` and a
``README.md`` model card. ``publish`` builds that folder in a temporary place and either moves it to ``out_dir``
(dry run) or uploads it; nothing half-written is left behind when either fails. The Hub token is read by
huggingface_hub from the user's login or ``HF_TOKEN`` and never printed or written.

``config.json`` follows timm's convention so that every standard client rebuilds the model and its preprocessing:
``model_args`` holds the architecture's own arguments only (no ``num_classes``, and ``in_chans`` / ``global_pool``
only where they differ from the architecture's defaults: ``create_model``, transformers' ``TimmWrapper`` and timm's
scripts give those separately), and ``pretrained_cfg`` says how the weights were trained and evaluated (input size,
crop, interpolation, mean, std), read from the run that made the checkpoint (``hub_records.read_training_record``:
the main job's ``results.json`` or timm ``train.py``'s ``args.yaml``) and checked against the model
(``hub_data_config``). The public names of both modules are importable from here as well.
"""
import inspect
import json
import logging
import tempfile
import warnings
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import timm
import torch
from timm.models import parse_model_name, save_for_hf

from ..checkpoints.files import atomic_dir, load_weights, sha256sum
from ..checkpoints.transfer import select_weights
from ..version import __version__
from .data_config import CROP_MODES, INTERPOLATIONS, resolve_publish_data_config
from .records import DATA_CONFIG_KEYS, TrainingRecord, _read_json_object, read_training_record, source_architecture

__all__ = ['build_hub_folder', 'publish', 'load_checkpoint_into', 'model_from_checkpoint', 'source_architecture',
           'read_training_record', 'resolve_publish_data_config', 'TrainingRecord', 'DATA_CONFIG_KEYS', 'CROP_MODES',
           'INTERPOLATIONS']

_logger = logging.getLogger(__name__)

# numeric entries of the main job's results.json that are settings of the run, not metrics for the model card
_RUN_SETTINGS = ('epochs', 'img_size', 'eval_img_size', 'world_size', 'wall_seconds', 'seed')

_CITATION = """@article{zhai2021attention,
  title={An Attention Free Transformer},
  author={Zhai, Shuangfei and Talbott, Walter and Srivastava, Nitish and Huang, Chen and Goh, Hanlin and
          Zhang, Ruixiang and Susskind, Josh},
  journal={arXiv preprint arXiv:2105.14103},
  year={2021}
}"""


def _strip_client_args(model: torch.nn.Module, config_file: Path) -> Dict[str, Any]:
    """Rewrite ``config.json`` with ``model_args`` free of create_model's own arguments; return the config.

    ``num_classes`` is the top-level entry (timm) and transformers passes it itself; ``in_chans`` and ``global_pool``
    stay only where they differ from what the architecture builds without them (3 channels, its default pooling),
    since a client given only ``model_args`` could not rebuild the model otherwise.
    """
    config = json.loads(config_file.read_text())
    model_args = dict(config.get('model_args') or {})
    signature = inspect.signature(type(model).__init__).parameters
    default_pool = signature['global_pool'].default if 'global_pool' in signature else None
    model_args.pop('num_classes', None)
    if model_args.get('in_chans') == 3:
        model_args.pop('in_chans')
    if 'global_pool' in model_args and model_args['global_pool'] == default_pool:
        model_args.pop('global_pool')
    config['model_args'] = model_args
    if not model_args:
        config.pop('model_args')
    config_file.write_text(json.dumps(config, indent=2))
    return config


def model_from_checkpoint(
        model_name: str,
        checkpoint: str,
        use_ema: bool = True,
        **model_kwargs,
) -> Tuple[torch.nn.Module, str]:
    """Build ``model_name`` sized to the checkpoint's head and load the checkpoint strictly, its weights taken as timm
    takes them (``select_weights``: EMA first unless ``use_ema`` is False, DDP / compile prefixes stripped).

    Returns:
        The model in eval mode, and which of the checkpoint's weights it holds.

    Raises:
        ValueError: The file is unreadable or its tensors do not fit the architecture (key and shapes named).
    """
    state_dict, weights = select_weights(load_weights(checkpoint), use_ema)
    head = state_dict.get('head.weight')
    if head is not None and 'num_classes' not in model_kwargs:
        model_kwargs['num_classes'] = head.shape[0]
    model = timm.create_model(model_name, pretrained=False, **model_kwargs)
    expected = model.state_dict()
    missing = sorted(set(expected) - set(state_dict))
    unexpected = sorted(set(state_dict) - set(expected))
    if missing or unexpected:
        raise ValueError(f'{checkpoint} does not fit {model_name}: missing {missing[:4]}, unexpected {unexpected[:4]}')
    for key, tensor in state_dict.items():
        if tensor.shape != expected[key].shape:
            raise ValueError(f'{checkpoint} does not fit {model_name}: {key!r} has shape {list(tensor.shape)}, '
                             f'the model expects {list(expected[key].shape)}')
    model.load_state_dict(state_dict)
    _logger.info('loaded %s of %s', weights, checkpoint)
    return model.eval(), weights


def load_checkpoint_into(model_name: str, checkpoint: str, use_ema: bool = True, **model_kwargs) -> torch.nn.Module:
    """``model_from_checkpoint``'s model: ``model_name`` holding the checkpoint's weights (EMA first)."""
    return model_from_checkpoint(model_name, checkpoint, use_ema, **model_kwargs)[0]


def _model_card(
        model: torch.nn.Module,
        model_name: str,
        repo_id: str,
        results: Optional[Dict],
        datasets: Sequence[str],
        base_model: Optional[str],
        training: Optional[str],
        license_name: str,
        pretrained_cfg: Dict[str, Any],
        data_config_source: Optional[str],
) -> str:
    """The README.md model card: YAML metadata, then what the model is, its training, metrics, usage, citation."""
    # not timm's generate_readme: it writes no base_model:, lowercases dataset names (Hub ids are case-sensitive)
    # and has no place for the preprocessing, metrics and the aft_vision import the usage needs
    cfg = pretrained_cfg
    num_params = sum(p.numel() for p in model.parameters())
    meta = ['---', 'library_name: timm', f'license: {license_name}', 'pipeline_tag: image-classification', 'tags:']
    meta += [f'- {tag}' for tag in ('image-classification', 'timm', 'aft_vision', 'attention-free-transformer')]
    if datasets:
        meta += ['datasets:'] + [f'- {name}' for name in datasets]
    if base_model:
        meta.append(f'base_model: {base_model}')
    meta.append('---')
    lines = meta + [
        f'# Model card for {repo_id.split("/")[-1]}',
        '',
        f'An Attention Free Transformer (AFT, Zhai et al. 2021) image classifier: architecture `{model_name}` from '
        f'[aft_vision](https://github.com/aft-vision/aft_vision), a timm plugin.',
        '',
        '## Model details',
        f'- **Architecture:** `{model_name}` ({num_params / 1e6:.2f}M parameters, {model.num_classes} classes)',
        f'- **Input size:** {tuple(cfg.get("input_size", ()))}, crop_pct {cfg.get("crop_pct")}, crop_mode '
        f'{cfg.get("crop_mode")}, {cfg.get("interpolation")} interpolation, mean {tuple(cfg.get("mean", ()))}, '
        f'std {tuple(cfg.get("std", ()))}'
        + (f'; test input size {tuple(cfg["test_input_size"])}' if cfg.get('test_input_size') else ''),
        f'- **Preprocessing from:** {data_config_source or "the publisher"}',
        '- **Paper:** [An Attention Free Transformer](https://arxiv.org/abs/2105.14103)',
    ]
    if datasets:
        lines.append(f'- **Dataset:** {", ".join(datasets)}')
    if base_model:
        lines.append(f'- **Initialised from:** {base_model}')
    lines += ['', '## Training', training or 'No training details were provided by the publisher.', '']
    lines += ['## Metrics']
    metrics = {name: value for name, value in (results or {}).items()
               if isinstance(value, (int, float)) and not isinstance(value, bool) and name not in _RUN_SETTINGS}
    if metrics:
        lines += ['| metric | value |', '|---|---|']
        lines += [f'| {name} | {value} |' for name, value in metrics.items()]
    else:
        lines.append('No evaluation results were provided by the publisher.')
    lines += [
        '',
        '## Usage',
        '`import aft_vision` first: it registers the AFT architectures with timm, which both clients below build '
        'from `config.json`. With timm (its data config holds the preprocessing above):',
        '',
        '```python',
        'import aft_vision  # registers the AFT architectures with timm',
        'import timm',
        'from PIL import Image',
        '',
        f"model = timm.create_model('hf-hub:{repo_id}', pretrained=True).eval()",
        'config = timm.data.resolve_data_config({}, model=model)',
        'transform = timm.data.create_transform(**config)',
        "logits = model(transform(Image.open('image.png').convert('RGB')).unsqueeze(0))",
        '```',
        '',
        'With Hugging Face transformers (its timm wrapper reads the same `config.json`):',
        '',
        '```python',
        'import aft_vision  # registers the AFT architectures with timm',
        'from transformers import pipeline',
        '',
        f"classifier = pipeline('image-classification', model='{repo_id}')",
        "print(classifier('image.png'))",
        '```',
        '',
        '## Citation',
        '```bibtex',
        _CITATION,
        '```',
        '',
    ]
    return '\n'.join(lines)


def build_hub_folder(
        model: torch.nn.Module,
        folder: Path,
        model_name: str,
        repo_id: str,
        label_names: Optional[List[str]] = None,
        results: Optional[Dict] = None,
        datasets: Sequence[str] = (),
        base_model: Optional[str] = None,
        training: Optional[str] = None,
        license_name: str = 'apache-2.0',
        data_config: Optional[Dict[str, Any]] = None,
        data_config_source: Optional[str] = None,
) -> None:
    """Write ``config.json``, ``model.safetensors`` and ``README.md`` for ``model`` into ``folder``.

    Args:
        data_config: How the weights were trained and evaluated (``DATA_CONFIG_KEYS``, see
            ``resolve_publish_data_config``); None publishes the architecture's default config.
        data_config_source: Where ``data_config`` came from, for the model card.
    """
    if label_names is not None and len(label_names) != model.num_classes:
        raise ValueError(f'{len(label_names)} label names given for a model with {model.num_classes} classes')
    model_config = {'label_names': list(label_names)} if label_names else None
    save_for_hf(model, str(folder), model_config=model_config, safe_serialization=True, data_config=data_config)
    config = _strip_client_args(model, folder / 'config.json')
    card = _model_card(model, model_name, repo_id, results, datasets, base_model, training, license_name,
                       config['pretrained_cfg'], data_config_source)
    (folder / 'README.md').write_text(card, encoding='utf-8')


def publish(
        checkpoint: str,
        model_name: Optional[str],
        repo_id: str,
        out_dir: Optional[str] = None,
        dry_run: bool = False,
        force: bool = False,
        label_names: Optional[List[str]] = None,
        results_file: Optional[str] = None,
        datasets: Sequence[str] = (),
        base_model: Optional[str] = None,
        training: Optional[str] = None,
        private: bool = False,
        model_kwargs: Optional[Dict] = None,
        data_config: Optional[Dict[str, Any]] = None,
        use_ema: bool = True,
) -> Dict[str, str]:
    """Publish an AFT checkpoint: a local folder (``dry_run``) or a Hub upload.

    How the weights were trained and evaluated (the ``pretrained_cfg`` timm and transformers preprocess with) comes
    from the run that made the checkpoint (``read_training_record``: the main job's results, timm ``train.py``'s
    ``args.yaml``), overridden by ``data_config`` (the ``DATA_CONFIG_KEYS``). Without either, the architecture's
    default config is published and a ``UserWarning`` (and the model card) says so.

    Args:
        model_name: The registered architecture, or a ``local-dir:`` / ``hf-hub:`` folder whose architecture and
            arguments the weights share; None takes the one the run record names.
        model_kwargs: Rebuild a non-default architecture (e.g. ``patch_size=4``), over the run record's; timm records
            them in config.json.
        data_config: Overrides of the recorded preprocessing (``input_size``, ``test_input_size``, ``crop_pct``,
            ``crop_mode``, ``interpolation``, ``mean``, ``std``).
        use_ema: Publish a training checkpoint's EMA weights where it has them (timm's rule), else its trained ones.

    Returns:
        ``{'folder' or 'url': ..., 'sha256': sha256 of model.safetensors, 'data_config_source': where the
        preprocessing came from, 'weights': which of the checkpoint's weights were published}``.

    Raises:
        ValueError: Bad checkpoint, repo id, labels, results file, run record or data config; no architecture.
        FileExistsError: ``out_dir`` exists and ``force`` is False.
        RuntimeError: The upload failed (the message says which step).
    """
    if repo_id.count('/') != 1 or not all(repo_id.split('/')):
        raise ValueError(f"repo id must look like 'org/name', got {repo_id!r}")
    if dry_run and not out_dir:
        raise ValueError('a dry run needs an output folder (--out-dir)')
    results = _read_json_object(Path(results_file)) if results_file else None
    record = read_training_record(checkpoint, results_file)
    kwargs = dict(model_kwargs or {})
    if model_name is None:
        if record is None or not record.architecture:
            raise ValueError(f'name the architecture of {checkpoint} (--model): no run record beside it names one')
        model_name, kwargs = source_architecture(record.architecture, {**record.model_kwargs, **kwargs})
    else:
        if record is not None:
            kwargs = {**record.model_kwargs, **kwargs}
        if parse_model_name(model_name)[0]:  # a published folder or Hub repo: its architecture and saved arguments
            model_name, kwargs = source_architecture(model_name, kwargs)
    model, weights = model_from_checkpoint(model_name, checkpoint, use_ema, **kwargs)
    data_config, source = resolve_publish_data_config(model, record, data_config)
    if data_config is None:
        warnings.warn(f'publishing {checkpoint} with {source}; give the run record or --input-size / --crop-pct',
                      UserWarning, stacklevel=2)
    folder_args = dict(model_name=model_name, repo_id=repo_id, label_names=label_names, results=results,
                       datasets=datasets, base_model=base_model, training=training, data_config=data_config,
                       data_config_source=source)
    if dry_run:
        with atomic_dir(out_dir, force=force) as staging:
            build_hub_folder(model, staging, **folder_args)
        return {'folder': str(out_dir), 'sha256': sha256sum(Path(out_dir) / 'model.safetensors'),
                'data_config_source': source, 'weights': weights}

    from huggingface_hub import HfApi
    with tempfile.TemporaryDirectory(prefix='aft-publish-') as staging:
        build_hub_folder(model, Path(staging), **folder_args)
        digest = sha256sum(Path(staging) / 'model.safetensors')
        api = HfApi(library_name='aft_vision', library_version=__version__)
        try:
            repo_id = api.create_repo(repo_id, private=private, exist_ok=True).repo_id
        except Exception as error:  # huggingface_hub raises many types; name the step and the cause
            raise RuntimeError(f'creating Hub repository {repo_id} failed: {type(error).__name__}: {error}') from None
        try:
            commit = api.upload_folder(repo_id=repo_id, folder_path=staging, commit_message='Add AFT model')
        except Exception as error:
            raise RuntimeError(f'uploading to {repo_id} failed: {type(error).__name__}: {error}') from None
    return {'url': str(getattr(commit, 'commit_url', commit)), 'sha256': digest, 'data_config_source': source,
            'weights': weights}
