"""Publishing AFT models in the layout timm's Hub loader reads, and uploading them with huggingface_hub.

``build_hub_folder`` writes ``config.json`` (through timm's own ``save_config_for_hf``), ``model.safetensors`` and a
``README.md`` model card. ``publish`` builds that folder in a temporary place and either moves it to ``out_dir``
(dry run) or uploads it; nothing half-written is left behind when either fails. The Hub token is read by
huggingface_hub from the user's login or ``HF_TOKEN`` and never printed or written.
"""
import json
import tempfile
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import timm
import torch
from timm.models import load_model_config_from_hf, parse_model_name, save_for_hf, split_model_name_tag

from ._io import atomic_dir, load_weights, sha256sum
from .transfer import unwrap_state_dict
from .version import __version__

__all__ = ['build_hub_folder', 'publish', 'load_checkpoint_into', 'source_architecture']

_CITATION = """@article{zhai2021attention,
  title={An Attention Free Transformer},
  author={Zhai, Shuangfei and Talbott, Walter and Srivastava, Nitish and Huang, Chen and Goh, Hanlin and
          Zhang, Ruixiang and Susskind, Josh},
  journal={arXiv preprint arXiv:2105.14103},
  year={2021}
}"""


def source_architecture(name: str, model_kwargs: Optional[Dict[str, Any]] = None) -> Tuple[str, Dict[str, Any]]:
    """The registered architecture and the arguments that rebuild ``name`` with ``model_kwargs`` applied.

    For a ``local-dir:`` / ``hf-hub:`` source these are the architecture and ``model_args`` its config.json records,
    updated by ``model_kwargs`` (the class count is left to the checkpoint's head); for a registered name, the name
    without its pretrained tag and ``model_kwargs``. A model fine-tuned from a published folder is republished this way.

    Raises:
        FileNotFoundError: A ``local-dir:`` folder has no config.json.
    """
    model_kwargs = dict(model_kwargs or {})
    source, model_id = parse_model_name(name)
    if not source:
        return split_model_name_tag(model_id)[0], model_kwargs
    if source == 'hf-hub':
        _, architecture, saved = load_model_config_from_hf(model_id)
    else:
        config_file = Path(model_id) / 'config.json'
        if not config_file.is_file():
            raise FileNotFoundError(f'{name}: no config.json in {model_id} (write one with aft-vision publish)')
        config = json.loads(config_file.read_text())
        architecture, saved = config['architecture'], config.get('model_args')
    saved = {key: value for key, value in (saved or {}).items() if key != 'num_classes'}
    return architecture, {**saved, **model_kwargs}


def load_checkpoint_into(model_name: str, checkpoint: str, **model_kwargs) -> torch.nn.Module:
    """Build ``model_name`` sized to the checkpoint's head and load the checkpoint strictly.

    Raises:
        ValueError: The file is unreadable or its tensors do not fit the architecture (key and shapes named).
    """
    state_dict = unwrap_state_dict(load_weights(checkpoint))
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
    return model.eval()


def _model_card(
        model: torch.nn.Module,
        model_name: str,
        repo_id: str,
        results: Optional[Dict],
        datasets: Sequence[str],
        base_model: Optional[str],
        training: Optional[str],
        license_name: str,
) -> str:
    """The README.md model card: YAML metadata, then what the model is, its training, metrics, usage, citation."""
    cfg = model.pretrained_cfg
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
        f'- **Input size:** {tuple(cfg.get("input_size", ()))}, crop_pct {cfg.get("crop_pct")}',
        '- **Paper:** [An Attention Free Transformer](https://arxiv.org/abs/2105.14103)',
    ]
    if datasets:
        lines.append(f'- **Dataset:** {", ".join(datasets)}')
    if base_model:
        lines.append(f'- **Initialised from:** {base_model}')
    lines += ['', '## Training', training or 'No training details were provided by the publisher.', '']
    lines += ['## Metrics']
    if results:
        lines += ['| metric | value |', '|---|---|']
        lines += [f'| {name} | {value} |' for name, value in results.items()]
    else:
        lines.append('No evaluation results were provided by the publisher.')
    lines += [
        '',
        '## Usage',
        '```python',
        'import aft_vision  # registers the AFT architectures with timm',
        'import timm',
        '',
        f"model = timm.create_model('hf-hub:{repo_id}', pretrained=True).eval()",
        'config = timm.data.resolve_data_config({}, model=model)',
        'transform = timm.data.create_transform(**config)',
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
) -> None:
    """Write ``config.json``, ``model.safetensors`` and ``README.md`` for ``model`` into ``folder``."""
    if label_names is not None and len(label_names) != model.num_classes:
        raise ValueError(f'{len(label_names)} label names given for a model with {model.num_classes} classes')
    model_config = {'label_names': list(label_names)} if label_names else None
    save_for_hf(model, str(folder), model_config=model_config, safe_serialization=True)
    card = _model_card(model, model_name, repo_id, results, datasets, base_model, training, license_name)
    (folder / 'README.md').write_text(card, encoding='utf-8')


def publish(
        checkpoint: str,
        model_name: str,
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
) -> Dict[str, str]:
    """Publish an AFT checkpoint: a local folder (``dry_run``) or a Hub upload.

    ``model_kwargs`` rebuild a non-default architecture (e.g. ``patch_size=4``); timm records them in config.json.

    Returns:
        ``{'folder' or 'url': ..., 'sha256': sha256 of model.safetensors}``.

    Raises:
        ValueError: Bad checkpoint, repo id, labels or results file.
        FileExistsError: ``out_dir`` exists and ``force`` is False.
        RuntimeError: The upload failed (the message says which step).
    """
    if repo_id.count('/') != 1 or not all(repo_id.split('/')):
        raise ValueError(f"repo id must look like 'org/name', got {repo_id!r}")
    if dry_run and not out_dir:
        raise ValueError('a dry run needs an output folder (--out-dir)')
    results = None
    if results_file:
        try:
            results = json.loads(Path(results_file).read_text())
        except (OSError, json.JSONDecodeError) as error:
            raise ValueError(f'cannot read results file {results_file}: {error}') from None
        if not isinstance(results, dict):
            raise ValueError(f'results file {results_file} must hold a JSON object of metric -> value')
    model = load_checkpoint_into(model_name, checkpoint, **(model_kwargs or {}))
    folder_args = dict(model_name=model_name, repo_id=repo_id, label_names=label_names, results=results,
                       datasets=datasets, base_model=base_model, training=training)
    if dry_run:
        with atomic_dir(out_dir, force=force) as staging:
            build_hub_folder(model, staging, **folder_args)
        return {'folder': str(out_dir), 'sha256': sha256sum(Path(out_dir) / 'model.safetensors')}

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
    return {'url': str(getattr(commit, 'commit_url', commit)), 'sha256': digest}
