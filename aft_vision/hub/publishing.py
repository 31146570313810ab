"""Publishing an AFT checkpoint in timm's Hub layout: timm's ``save_for_hf`` writes ``model.safetensors`` and
``config.json``, timm's ``generate_readme`` the model card, huggingface_hub uploads the folder (as timm's
``push_to_hf_hub`` does). Written here: the client-only ``model_args`` taken out of config.json, the preprocessing
and the run's notes read from the run that made the checkpoint (``records``), checked against the model, card text
kept as data, a folder written atomically and never replaced without ``force``, an upload only when asked, and upload
errors that name their step.
"""
import inspect
import json
import re
import tempfile
import warnings
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import torch
from huggingface_hub import ModelCard
from timm.models import parse_model_name, save_for_hf
from timm.models._hub import generate_readme  # push_to_hf_hub's card writer

from ..checkpoints.files import atomic_dir, sha256sum
from ..version import __version__
from .loading import check_runs_at_data_config, load_model
from .records import _read_json_object, read_training_record, resolve_publish_data_config, source_architecture

__all__ = ['publish']

# numeric entries of the main job's results.json that are settings of the run, not metrics for the model card
_RUN_SETTINGS = ('epochs', 'img_size', 'eval_img_size', 'world_size', 'wall_seconds', 'seed')
_USAGE = """```python
import aft_vision  # first: it registers the AFT architectures with timm, which both clients build from config.json
import timm
from PIL import Image
from transformers import pipeline

model = timm.create_model('hf-hub:REPO_ID', pretrained=True).eval()
transform = timm.data.create_transform(**timm.data.resolve_data_config({}, model=model))  # the preprocessing above
logits = model(transform(Image.open('image.png').convert('RGB')).unsqueeze(0))
classifier = pipeline('image-classification', model='REPO_ID')  # transformers' timm wrapper reads config.json too
print(classifier('image.png'))
```"""
_CITATION = """@article{zhai2021attention,
  title={An Attention Free Transformer},
  author={Zhai, Shuangfei and Talbott, Walter and Srivastava, Nitish and Huang, Chen and Goh, Hanlin and
          Zhang, Ruixiang and Susskind, Josh},
  journal={arXiv preprint arXiv:2105.14103},
  year={2021}
}"""


def _strip_client_args(model: torch.nn.Module, config_file: Path) -> Dict[str, Any]:
    """Drop from ``model_args`` what clients pass (timm writes it): ``num_classes``, default ``in_chans`` / pooling."""
    config = json.loads(config_file.read_text())
    signature = inspect.signature(type(model).__init__).parameters
    defaults = {'in_chans': 3, 'global_pool': signature['global_pool'].default if 'global_pool' in signature else None}
    model_args = {key: value for key, value in (config.pop('model_args', None) or {}).items()
                  if key != 'num_classes' and not (key in defaults and value == defaults[key])}
    if model_args:
        config['model_args'] = model_args
    config_file.write_text(json.dumps(config, indent=2))
    return config


def _model_card(model: torch.nn.Module, model_name: str, repo_id: str, cfg: Dict[str, Any],
                results: Optional[Dict] = None, datasets: Sequence[str] = (), base_model: Optional[str] = None,
                training: Optional[str] = None, license_name: str = 'apache-2.0',
                data_config_source: Optional[str] = None) -> str:
    """README.md by timm's ``generate_readme``; huggingface_hub's ``ModelCard`` then writes the metadata timm has no
    place for (``base_model``) or lowercases (dataset ids, which are case-sensitive)."""
    size = f'{tuple(cfg.get("input_size", ()))}' + (f', test {tuple(cfg["test_input_size"])}'
                                                    if cfg.get('test_input_size') else '')
    details = {
        'Architecture': f'`{model_name}` ({sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters, '
                        f'{model.num_classes} classes)',
        'Preprocessing': f'input size {size}, crop_pct {cfg.get("crop_pct")}, crop_mode {cfg.get("crop_mode")}, '
                         f'{cfg.get("interpolation")} interpolation, mean {tuple(cfg.get("mean", ()))}, '
                         f'std {tuple(cfg.get("std", ()))}',
        'Preprocessing from': data_config_source or 'the publisher',
        'Paper': '[An Attention Free Transformer](https://arxiv.org/abs/2105.14103)',
        'Trained on': ', '.join(datasets) or None, 'Initialised from': base_model,
        'Training': training or 'No training details were provided by the publisher.'}
    metrics = {name: value for name, value in (results or {}).items()
               if isinstance(value, (int, float)) and not isinstance(value, bool) and name not in _RUN_SETTINGS}
    table = '\n'.join(['| metric | value |', '|---|---|'] + [f'| {k} | {v} |' for k, v in metrics.items()])
    text = generate_readme({
        'tags': ['image-classification', 'timm', 'aft_vision', 'attention-free-transformer'], 'license': license_name,
        'description': f'An Attention Free Transformer (AFT, Zhai et al. 2021) image classifier: architecture '
                       f'`{model_name}` from [aft_vision](https://github.com/aft-vision/aft_vision), a timm plugin.',
        'details': {key: value for key, value in details.items() if value},
        'usage': _USAGE.replace('REPO_ID', repo_id),
        'comparison': table if metrics else 'No evaluation results were provided by the publisher.',
        'citation': _CITATION}, repo_id.split('/')[-1])
    card = ModelCard(text)
    card.data.datasets, card.data.base_model = list(datasets) or None, base_model
    return str(card)


def _check_card_text(texts: Dict[str, Sequence[Optional[str]]]) -> None:
    """ValueError naming the option of user text the card cannot hold as data: control characters, line breaks
    included (but in ``--training``)."""
    for option, values in texts.items():
        for value in filter(None, values):
            if any(ord(c) < 32 and not (option == '--training' and c == '\n') or ord(c) == 127 for c in value):
                raise ValueError(f'{option} {value!r}: control characters or line breaks cannot go into the card')


def publish(checkpoint: str, model_name: Optional[str], repo_id: str, out_dir: Optional[str] = None,
            dry_run: bool = False, force: bool = False, label_names: Optional[List[str]] = None,
            results_file: Optional[str] = None, datasets: Sequence[str] = (), base_model: Optional[str] = None,
            training: Optional[str] = None, private: bool = False, model_kwargs: Optional[Dict] = None,
            data_config: Optional[Dict[str, Any]] = None, use_ema: bool = True, upload: bool = False
            ) -> Dict[str, Optional[str]]:
    """Publish ``checkpoint`` as ``model_name`` (None: the run record's; or a published folder's) with ``model_kwargs``
    and ``data_config`` over the run record's (neither: the default config, with a UserWarning): a folder in
    ``out_dir`` (FileExistsError unless ``force``; never the folder it reads) and, only with ``upload`` (not with
    ``dry_run``), the Hub (RuntimeError naming the failed step; ``out_dir`` then written only if it succeeds).

    Returns:
        ``{'folder', 'url' (None where not written), 'sha256' (of model.safetensors), 'data_config_source',
        'weights'}``.
    """
    if not re.fullmatch(r'[\w.-]{1,96}/[\w.-]{1,96}', repo_id, re.ASCII):  # the Hub's characters, in one line
        raise ValueError(f"--repo-id must look like 'org/name' (letters, digits, '-', '_', '.'), got {repo_id!r}")
    if (upload and dry_run) or not (upload or out_dir):
        raise ValueError('say where to publish: --out-dir for a folder, --upload for the Hub (not with --dry-run)')
    _check_card_text({'--dataset': datasets, '--base-model': [base_model], '--training': [training]})
    source, model_id = parse_model_name(model_name or '')
    sources = [Path(checkpoint).parent] + ([Path(model_id)] if source == 'local-dir' else [])
    if out_dir and any((folder / 'config.json').is_file() and folder.resolve() == Path(out_dir).resolve()
                       for folder in sources):
        raise ValueError(f'--out-dir {out_dir} is the published folder read here: publish into another folder')
    results = _read_json_object(Path(results_file)) if results_file else None
    record = read_training_record(checkpoint, results_file)
    kwargs = {**(record.model_kwargs if record else {}), **(model_kwargs or {})}
    if model_name is None and (record is None or not record.architecture):
        raise ValueError(f'name the architecture of {checkpoint} (--model): no run record beside it names one')
    if model_name is None or parse_model_name(model_name)[0]:  # the record's, or a published folder's architecture
        model_name, kwargs = source_architecture(model_name or record.architecture, kwargs)
    model, weights = load_model(model_name, checkpoint, use_ema=use_ema, model_kwargs=kwargs, aft_only=False)
    data_config, source = resolve_publish_data_config(model, record, data_config)  # this folder's, not the load's
    if data_config is None:
        warnings.warn(f'publishing {checkpoint} with {source}; give the run record or --input-size / --crop-pct',
                      UserWarning, stacklevel=2)
    model.pretrained_cfg = {**model.pretrained_cfg, **(data_config or {})}
    check_runs_at_data_config(model, 'the data config to publish')
    label_names = label_names or (record.label_names if record else None)
    if label_names is not None and (len(label_names) != model.num_classes
                                    or not all(isinstance(name, str) for name in label_names)):
        raise ValueError(f'--labels: {model.num_classes} names (strings, one per class) are needed, got '
                         f'{len(label_names)}: {str(label_names)[:60]}')
    notes = [*(record.notes if record else [f'{Path(checkpoint).name}: no record of how it was trained']),
             *([training] if training else []), f'preprocessing from {source}']
    run = {'pretrained_cfg': {'tag': repo_id.split('/')[1], 'notes': notes}}  # the run, not the architecture's entry
    staged = atomic_dir(out_dir, force=force) if out_dir else tempfile.TemporaryDirectory(prefix='aft-publish-')
    with staged as folder:
        folder = Path(folder)
        save_for_hf(model, str(folder), model_config={**run, **({'label_names': label_names} if label_names else {})},
                    safe_serialization=True, data_config=data_config)
        config = _strip_client_args(model, folder / 'config.json')
        (folder / 'README.md').write_text(_model_card(
            model, model_name, repo_id, config['pretrained_cfg'], results, datasets, base_model, training,
            data_config_source=source), encoding='utf-8')
        digest = sha256sum(folder / 'model.safetensors')
        url = _upload(folder, repo_id, private) if upload else None
    return {'folder': out_dir and str(out_dir), 'url': url, 'sha256': digest, 'data_config_source': source,
            'weights': weights.split('; data config: ')[0]}


def _upload(folder: Path, repo_id: str, private: bool) -> str:
    """``create_repo`` and ``upload_folder`` as ``push_to_hf_hub`` (its token, never printed); errors name the step."""
    from huggingface_hub import HfApi

    api = HfApi(library_name='aft_vision', library_version=__version__)
    step = f'creating Hub repository {repo_id}'
    try:
        repo_id = api.create_repo(repo_id, private=private, exist_ok=True).repo_id
        step = f'uploading to {repo_id}'
        commit = api.upload_folder(repo_id=repo_id, folder_path=str(folder), commit_message='Add AFT model')
    except Exception as error:  # huggingface_hub raises many types; name the step and the cause
        raise RuntimeError(f'{step} failed: {type(error).__name__}: {error}') from None
    return str(getattr(commit, 'commit_url', commit))
