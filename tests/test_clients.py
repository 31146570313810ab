"""A published model as the standard clients see it: timm's data config, transformers' pipeline, timm's config reader.

One small AFT-conv is trained for a few epochs on the digits by the main job itself (which publishes it), then its
folder is loaded the ways a user would: ``timm.create_model('local-dir:...')`` with ``resolve_data_config({},
model=...)`` and transformers' ``pipeline('image-classification')``. Both must reproduce the job's own held-out
top-1. Also: publishing from timm ``train.py``'s output folder (``args.yaml``), the flags, the warning when nothing
says how the weights were trained, and folders written by earlier versions.
"""
import argparse
import json
import shutil
from pathlib import Path

import pytest
import timm
import torch
import yaml
from safetensors.torch import load_file
from timm.data import create_transform, resolve_data_config
from torchvision.datasets import ImageFolder

import aft_vision  # noqa: F401  (registers the models)
from aft_vision.cli import main as cli_main
from aft_vision.hub import publish, read_training_record, source_architecture
from aft_vision.train import evaluate

pytest.importorskip('sklearn')

TINY = {'patch_size': 4, 'embed_dim': 32, 'depth': 1, 'num_heads': 4, 'kernel_size': 7, 'mlp_ratio': 2.0}


@pytest.fixture(scope='module')
def job(tmp_path_factory):
    """The main job on a tiny model and budget: its output folder and results (model, hub/, data/, results.json)."""
    out = tmp_path_factory.mktemp('clients') / 'digits'
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # small ops: a second thread only spins against other jobs on a shared CPU
    try:
        kwargs = [f'{key}={value}' for key, value in TINY.items()]
        assert cli_main(['train', '--epochs', '10', '--lr', '1e-2', '--model-kwargs', *kwargs,
                         '--out-dir', str(out)]) == 0
    finally:
        torch.set_num_threads(threads)
    results = json.loads((out / 'results.json').read_text())
    assert results['top1'] > 40.0, results['top1']  # chance is 10% (about 60% here): the client checks mean something
    return out, results


def _timm_client_top1(folder: Path, val: Path) -> float:
    """timm's recipe for a published folder: create_model + resolve_data_config({}, model) + create_transform."""
    model = timm.create_model(f'local-dir:{folder}', pretrained=True).eval()
    config = resolve_data_config({}, model=model)
    dataset = ImageFolder(str(val), transform=create_transform(**config))
    loader = torch.utils.data.DataLoader(dataset, batch_size=128)
    correct = 0
    with torch.no_grad():
        for images, labels in loader:
            correct += (model(images).argmax(-1) == labels).sum().item()
    return 100.0 * correct / len(dataset)


def test_config_json_follows_timms_convention_and_round_trips(job):
    from timm.models._hub import load_model_config_from_path  # the reader behind local-dir: (not exported)

    out, results = job
    config = json.loads((out / 'hub' / 'config.json').read_text())
    # the architecture's own arguments only (img_size: AFT-conv's nominal size, as timm records it)
    assert {key: value for key, value in config['model_args'].items() if key != 'img_size'} == TINY
    assert config['num_classes'] == 10 and config['global_pool'] == 'avg'
    cfg = config['pretrained_cfg']
    assert cfg['input_size'] == [3, 32, 32] and cfg['crop_pct'] == 1.0 and cfg['crop_mode'] == 'center'
    assert 'test_input_size' not in cfg or results['top1_at_48'] >= results['top1']
    assert results['data_config']['input_size'] == [3, 32, 32]

    pretrained_cfg, architecture, model_args = load_model_config_from_path(out / 'hub')
    assert architecture == 'aft_conv_test' and model_args == config['model_args']
    assert tuple(pretrained_cfg['input_size']) == (3, 32, 32) and pretrained_cfg['num_classes'] == 10
    assert pretrained_cfg['label_names'] == [str(i) for i in range(10)]
    rebuilt = timm.create_model(architecture, num_classes=pretrained_cfg['num_classes'], **model_args)
    rebuilt.load_state_dict(load_file(str(out / 'hub' / 'model.safetensors')))  # strict: every tensor fits

    card = (out / 'hub' / 'README.md').read_text()
    assert 'results.json (aft_vision.train)' in card and "pipeline('image-classification'" in card
    assert f"| top1 | {results['top1']} |" in card and '| epochs |' not in card


def test_timm_standard_data_config_reproduces_the_jobs_top1(job):
    out, results = job
    assert results['top1_timm_data_config'] == results['top1']  # the job checks it itself
    top1 = _timm_client_top1(out / 'hub', out / 'data' / 'val')
    assert abs(top1 - results['top1']) <= 1.0, (top1, results['top1'])


def test_transformers_pipeline_reproduces_the_jobs_top1(job, monkeypatch):
    monkeypatch.setenv('HF_HUB_OFFLINE', '1')
    transformers = pytest.importorskip('transformers', reason='transformers is the test extra for the pipeline client '
                                                              '(pip install -e .[test])')
    out, results = job
    classifier = transformers.pipeline('image-classification', model=str(out / 'hub'))
    assert type(classifier.model).__name__ == 'TimmWrapperForImageClassification'
    assert tuple(classifier.image_processor.data_config['input_size']) == (3, 32, 32)
    val = ImageFolder(str(out / 'data' / 'val'))
    predictions = classifier([path for path, _ in val.samples], top_k=1, batch_size=64)
    correct = sum(int(p[0]['label'] == val.classes[label]) for p, (_, label) in zip(predictions, val.samples))
    top1 = 100.0 * correct / len(val.samples)
    assert abs(top1 - results['top1']) <= 1.0, (top1, results['top1'])


def _timm_train_output(job, tmp_path: Path, **args) -> Path:
    """A timm train.py output folder: args.yaml (yaml.safe_dump of vars(args)) beside model_best.pth.tar."""
    out, _ = job
    run = tmp_path / 'train-20260101-000000-aft_conv_test-32'
    run.mkdir()
    defaults = dict(model='aft_conv_test', num_classes=10, img_size=None, input_size=None, in_chans=None,
                    crop_pct=None, mean=None, std=None, interpolation='', model_kwargs=dict(TINY), epochs=4)
    timm_args = {**defaults, **args}
    (run / 'args.yaml').write_text(yaml.safe_dump(timm_args, default_flow_style=False))
    state_dict = load_file(str(out / 'model.safetensors'))
    torch.save({'epoch': 3, 'arch': 'aft_conv_test', 'state_dict': state_dict, 'args': argparse.Namespace(**timm_args),
                'metric': 0.0}, run / 'model_best.pth.tar')
    return run


def test_publish_reads_timm_train_py_args_yaml(job, tmp_path, capsys):
    out, results = job
    run = _timm_train_output(job, tmp_path, img_size=32, crop_pct=1.0)
    folder = tmp_path / 'hub'
    assert cli_main(['publish', str(run / 'model_best.pth.tar'), '--repo-id', 'me/digits', '--dry-run',
                     '--out-dir', str(folder)]) == 0  # the architecture and its arguments from args.yaml too
    captured = capsys.readouterr()
    assert 'args.yaml (timm train.py)' in captured.out and 'warning' not in captured.err
    config = json.loads((folder / 'config.json').read_text())
    assert not {'num_classes', 'in_chans', 'global_pool'} & set(config['model_args'])
    assert config['model_args']['patch_size'] == 4 and config['pretrained_cfg']['input_size'] == [3, 32, 32]
    assert config['pretrained_cfg']['crop_pct'] == 1.0
    top1 = _timm_client_top1(folder, out / 'data' / 'val')
    assert abs(top1 - results['top1']) <= 1.0, (top1, results['top1'])

    # train.py left crop_pct unset: it evaluated with the architecture's default crop, and so does the folder
    bare = tmp_path / 'bare'
    bare.mkdir()
    run = _timm_train_output(job, bare, input_size=[3, 32, 32], interpolation='bilinear')
    record = read_training_record(str(run / 'model_best.pth.tar'))
    assert record.architecture == 'aft_conv_test' and record.model_kwargs == TINY
    publish(str(run / 'model_best.pth.tar'), None, 'me/digits', out_dir=str(bare / 'hub'), dry_run=True)
    cfg = json.loads((bare / 'hub' / 'config.json').read_text())['pretrained_cfg']
    default = timm.models.get_pretrained_cfg('aft_conv_test')
    assert cfg['input_size'] == [3, 32, 32] and cfg['interpolation'] == 'bilinear'
    assert cfg['crop_pct'] == default.crop_pct and 'test_input_size' not in cfg

    # only the checkpoint was kept: train.py's arguments inside it
    (run / 'args.yaml').unlink()
    assert 'inside' in read_training_record(str(run / 'model_best.pth.tar')).source


def test_without_a_record_the_default_config_is_published_and_said(job, tmp_path, capsys):
    out, _ = job
    checkpoint = tmp_path / 'weights.safetensors'
    shutil.copy(out / 'model.safetensors', checkpoint)
    folder = tmp_path / 'hub'
    args = ['publish', str(checkpoint), '--model', 'aft_conv_test', '--repo-id', 'me/digits', '--dry-run',
            '--out-dir', str(folder), '--model-kwargs', *[f'{k}={v}' for k, v in TINY.items()]]
    assert cli_main(args) == 0
    captured = capsys.readouterr()
    assert 'warning: publishing' in captured.err and 'default config of aft_conv_test' in captured.err
    cfg = json.loads((folder / 'config.json').read_text())['pretrained_cfg']
    default = timm.models.get_pretrained_cfg('aft_conv_test')
    assert tuple(cfg['input_size']) == default.input_size and cfg['crop_pct'] == default.crop_pct
    assert 'not measured with these weights' in (folder / 'README.md').read_text()
    with pytest.warns(UserWarning, match='default config of aft_conv_test'):
        publish(str(checkpoint), 'aft_conv_test', 'me/x', out_dir=str(tmp_path / 'api'), dry_run=True,
                model_kwargs=TINY)

    # the flags say it instead; the rest stays the architecture's and the card says which is which
    assert cli_main(args + ['--force', '--input-size', '32', '--crop-pct', '1', '--test-input-size', '3', '48',
                            '48']) == 0
    captured = capsys.readouterr()
    assert 'warning' not in captured.err and 'from the command line' in captured.out
    cfg = json.loads((folder / 'config.json').read_text())['pretrained_cfg']
    assert cfg['input_size'] == [3, 32, 32] and cfg['crop_pct'] == 1.0 and cfg['test_input_size'] == [3, 48, 48]


@pytest.mark.parametrize('flags, message', [
    (['--crop-pct', '1.5'], 'argument --crop-pct: must be > 0 and <= 1, got 1.5'),
    (['--input-size', '1', '32', '32'], 'has 1 channels, the model takes 3'),
    (['--interpolation', 'cubic'], "argument --interpolation: invalid choice: 'cubic'"),
    (['--std', '0'], 'argument --std: must be > 0, got 0.0'),
])
def test_bad_data_config_flags_are_one_line_errors_and_write_nothing(job, tmp_path, capsys, flags, message):
    out, _ = job
    folder = tmp_path / 'hub'
    assert cli_main(['publish', str(out / 'model.safetensors'), '--repo-id', 'me/x', '--dry-run',
                     '--out-dir', str(folder), *flags]) == 2
    assert message in capsys.readouterr().err
    assert not folder.exists()


def test_publish_without_an_architecture_says_so(tmp_path, capsys):
    checkpoint = tmp_path / 'w.safetensors'
    from aft_vision._io import save_weights
    save_weights(timm.create_model('aft_conv_test').state_dict(), checkpoint)
    assert cli_main(['publish', str(checkpoint), '--repo-id', 'me/x', '--dry-run', '--out-dir',
                     str(tmp_path / 'o')]) == 2
    assert 'name the architecture' in capsys.readouterr().err


def test_folders_written_by_earlier_versions_still_load(job, tmp_path):
    out, results = job
    old = tmp_path / 'old'
    shutil.copytree(out / 'hub', old)
    config = json.loads((old / 'config.json').read_text())
    # earlier versions: timm's save_for_hf as it came, client arguments inside model_args, the default input size
    config['model_args'] = {**TINY, 'num_classes': 10, 'in_chans': 3, 'global_pool': 'avg', 'img_size': [64, 64]}
    config['pretrained_cfg'].update(input_size=[3, 64, 64], crop_pct=0.95)
    (old / 'config.json').write_text(json.dumps(config, indent=2))
    model = timm.create_model(f'local-dir:{old}', pretrained=True).eval()
    new = timm.create_model(f'local-dir:{out / "hub"}', pretrained=True).eval()
    x = torch.randn(2, 3, 32, 32)
    assert torch.equal(model(x), new(x))
    assert evaluate(model, out / 'data' / 'val', 32) == results['top1']
    architecture, kwargs = source_architecture(f'local-dir:{old}')
    assert architecture == 'aft_conv_test' and 'num_classes' not in kwargs and kwargs['patch_size'] == 4

    # republished for the other clients: the architecture from the old folder, the preprocessing from the flags
    new_folder = tmp_path / 'republished'
    assert cli_main(['publish', str(old / 'model.safetensors'), '--model', f'local-dir:{old}', '--repo-id', 'me/x',
                     '--dry-run', '--out-dir', str(new_folder), '--input-size', '32', '--crop-pct', '1']) == 0
    config = json.loads((new_folder / 'config.json').read_text())
    assert config['architecture'] == 'aft_conv_test' and 'num_classes' not in config['model_args']
    assert _timm_client_top1(new_folder, out / 'data' / 'val') == results['top1']


def test_results_of_earlier_main_jobs_give_their_evaluation_size(tmp_path):
    checkpoint = tmp_path / 'model.safetensors'
    checkpoint.write_bytes(b'')  # not read: the record is beside it
    (tmp_path / 'results.json').write_text(json.dumps({
        'top1': 98.05, 'top1_at_48': 88.3, 'architecture': 'aft_conv_test', 'model_kwargs': {'patch_size': 4},
        'img_size': 32, 'eval_img_size': 48}))
    record = read_training_record(str(checkpoint))
    assert record.data_config == {'input_size': (3, 32, 32), 'crop_pct': 1.0}
    assert record.architecture == 'aft_conv_test' and record.model_kwargs == {'patch_size': 4}
    (tmp_path / 'results.json').write_text('{"top1": 98.05}')  # metrics only: no record
    assert read_training_record(str(checkpoint)) is None
    (tmp_path / 'args.yaml').write_text('model: [unclosed')
    with pytest.raises(ValueError, match='cannot read timm train.py arguments'):
        read_training_record(str(checkpoint))
