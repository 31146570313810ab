"""The Hugging Face Hub (``aft_vision.hub``): tags, publishing and loading back, all offline, and a published model
as the standard clients see it.

* Pretrained tags (each a real DeiT repository, none a trained classifier), DeiT weights through the Hub path,
  publishing (dry runs round-tripping through ``local-dir:`` and ``hf-hub:``), failed uploads leaving nothing.
* The main job's published folder (conftest's ``digits_job``) loaded the ways a user would: ``timm.create_model`` with
  ``resolve_data_config({}, model=...)`` and transformers' ``pipeline('image-classification')``, both reproducing the
  job's held-out top-1; publishing from timm ``train.py``'s output folder, the data-config flags, the warning when
  nothing says how the weights were trained, and folders written by earlier versions.
"""
import argparse
import json
import shutil
from pathlib import Path

import huggingface_hub
import pytest
import timm
import torch
import yaml
from safetensors.torch import load_file
from timm.data import create_transform, resolve_data_config
from timm.models import save_for_hf
from torchvision.datasets import ImageFolder

import aft_vision  # noqa: F401  registers the models
from aft_vision.cli import main as cli_main
from aft_vision.hub import publish, read_training_record, source_architecture
from aft_vision.tasks.classify import evaluate

# ---------------------------------------------------------------------------------------------------------------------
# DeiT -> AFT transfer, pretrained tags, publishing and Hub / local-dir loading, all offline.
#
# The Hub is replaced by a cache folder the tests fill themselves (huggingface_hub's own layout); every load below runs
# through timm's and huggingface_hub's real download code with ``HF_HUB_OFFLINE`` set.
# ---------------------------------------------------------------------------------------------------------------------


def random_deit(name, tmp_path, offline_hub):
    """A randomly initialised DeiT saved by timm into the offline Hub under its real repository name."""
    torch.manual_seed(0)
    deit = timm.create_model(name)
    folder = tmp_path / name
    save_for_hf(deit, str(folder), safe_serialization=True)
    offline_hub(deit.pretrained_cfg['hf_hub_id'], folder)
    return load_file(str(folder / 'model.safetensors'))


@pytest.mark.slow  # about 25 s: four DeiT-small-sized models
def test_deit_tag_loads_through_the_hub_path_and_transfers_exactly(tmp_path, offline_hub):
    source = random_deit('deit_small_patch16_224.fb_in1k', tmp_path, offline_hub)
    model = timm.create_model('aft_conv_small.deit_in1k', pretrained=True).eval()
    assert 'deit_small_patch16_224.fb_in1k' in model.pretrained_cfg['hf_hub_id']
    assert model.num_classes == 0  # a backbone, like timm's MAE / DINO tags
    state = model.state_dict()
    fresh_model = timm.create_model('aft_conv_small')
    dim = 384
    for key, tensor in state.items():
        if key.endswith('attn.qkv.weight') or key.endswith('attn.qkv.bias'):
            # values from DeiT; queries and keys start fresh (the paper's transfer)
            num_heads = tensor.shape[0] - 2 * dim
            assert torch.equal(tensor[dim + num_heads:], source[key][2 * dim:])
            if key.endswith('weight'):  # biases start at zero on both sides
                assert not torch.equal(tensor[:dim], source[key][:dim])
        elif '.attn.pos_' in key:
            assert key not in source
            assert tensor.shape == fresh_model.state_dict()[key].shape
        else:
            assert torch.equal(tensor, source[key]), key
    assert 'cls_token' in source and 'pos_embed' in source and 'head.weight' in source
    out = model(torch.randn(2, 3, 224, 224))
    assert out.shape == (2, dim) and torch.isfinite(out).all()
    # timm's own pretrained-loading contract: other input channels and a new head; DeiT's head is never taken
    gray = timm.create_model('aft_conv_small.deit_in1k', pretrained=True, in_chans=1, num_classes=5)
    torch.testing.assert_close(gray.patch_embed.proj.weight, source['patch_embed.proj.weight'].sum(1, keepdim=True))
    assert gray(torch.randn(1, 1, 224, 224)).shape == (1, 5)
    imagenet = timm.create_model('aft_conv_small.deit_in1k', pretrained=True, num_classes=1000)
    assert imagenet.head.weight.shape == source['head.weight'].shape
    assert not torch.equal(imagenet.head.weight, source['head.weight'])


def test_no_tag_presents_a_trained_classifier():
    """What ``pretrained=True`` gives: the listed tags are backbones converted from DeiT (``.deit_in1k``, every model in
    DeiT's layout) or from the ViT whose layout the model's name ends with (num_classes=0, no test size); each
    architecture's default is '.untrained', where ``pretrained=True`` fails as timm does for models without weights."""
    listed = timm.list_models('aft_*', pretrained=True)
    architectures = [name for name in timm.list_models('aft_*') if not name.endswith('_test')]
    assert sorted({name.split('.')[0] for name in listed}) == sorted(architectures)  # each with a tag to start from
    sources = ('_deit3', '_dinov2', '_eva02', '_clip', '_clip_quickgelu', '_siglip')
    deit = [name for name in architectures if not name.endswith(sources)]
    assert sorted(name[:-len('.deit_in1k')] for name in listed if name.endswith('.deit_in1k')) == sorted(deit)
    for name in listed:
        cfg = timm.models.get_pretrained_cfg(name)
        assert cfg.has_weights and cfg.num_classes == 0 and cfg.test_input_size is None, name
    for architecture in timm.list_models('aft_*'):
        default = timm.models.get_pretrained_cfg(architecture)
        assert default.tag == 'untrained' and not default.has_weights and default.test_input_size is None
        with pytest.raises(RuntimeError, match=f'No pretrained weights exist for {architecture}'):
            timm.create_model(architecture, pretrained=True, device='meta')


def test_every_tag_names_a_real_deit_repository():
    """Each ``.deit_in1k`` tag must point at a DeiT repository timm itself publishes."""
    tags = [name for name in timm.list_pretrained('aft_*') if name.endswith('.deit_in1k')]
    assert 'aft_conv_small.deit_in1k' in tags and 'aft_conv_base.deit_in1k' in tags
    deit_repos = {
        timm.models.get_pretrained_cfg(name).hf_hub_id: name for name in timm.list_pretrained('deit_*')
    }
    for tag in tags:
        cfg = timm.models.get_pretrained_cfg(tag)
        assert cfg.hf_hub_id in deit_repos, (tag, cfg.hf_hub_id)
        assert 'initialisation for fine-tuning' in cfg.notes[0]


def test_publish_dry_run_round_trips_through_local_dir_and_hf_hub(tmp_path, offline_hub):
    torch.manual_seed(1)
    model = timm.create_model('aft_conv_test', num_classes=5).eval()
    checkpoint = tmp_path / 'trained.safetensors'
    from aft_vision.checkpoints import save_weights
    save_weights(model.state_dict(), checkpoint)
    results = tmp_path / 'results.json'
    results.write_text(json.dumps({'top1': 97.5}))
    folder = tmp_path / 'hub-folder'
    publish(str(checkpoint), 'aft_conv_test', 'someone/aft-test', out_dir=str(folder), dry_run=True,
            label_names=list('abcde'), results_file=str(results), datasets=['MNIST-Digits'],
            base_model='timm/deit_tiny_patch16_224.fb_in1k',
            data_config={'input_size': 64, 'crop_pct': 1.0, 'interpolation': 'bilinear'})
    assert sorted(p.name for p in folder.iterdir()) == ['README.md', 'config.json', 'model.safetensors']
    config = json.loads((folder / 'config.json').read_text())
    assert config['architecture'] == 'aft_conv_test' and config['num_classes'] == 5
    assert not {'num_classes', 'in_chans', 'global_pool'} & set(config.get('model_args', {}))
    cfg = config['pretrained_cfg']
    assert cfg['input_size'] == [3, 64, 64] and cfg['crop_pct'] == 1.0 and cfg['interpolation'] == 'bilinear'
    assert config['label_names'] == list('abcde')
    card = (folder / 'README.md').read_text()
    assert 'library_name: timm' in card and '| top1 | 97.5 |' in card and "hf-hub:someone/aft-test" in card
    # the Hub's metadata as given: dataset ids are case-sensitive (timm's generate_readme lowercases them)
    assert 'datasets:\n- MNIST-Digits\n' in card
    assert 'base_model: timm/deit_tiny_patch16_224.fb_in1k\n' in card

    x = torch.randn(2, 3, 64, 64)
    expected = model(x)
    local = timm.create_model(f'local-dir:{folder}', pretrained=True).eval()
    assert torch.equal(local(x), expected)
    offline_hub('someone/aft-test', folder)
    remote = timm.create_model('hf-hub:someone/aft-test', pretrained=True).eval()
    assert torch.equal(remote(x), expected)


@pytest.mark.parametrize('name', ['aft_conv_test', 'aft_full_test', 'aft_simple_test'])
def test_resized_model_records_what_timm_records_and_round_trips(name, tmp_path):
    """``set_input_size`` records image and patch size as timm's own ViT does; the folder ``save_for_hf`` writes, and
    the one ``publish`` writes from the weights, rebuild the resized model with identical outputs."""
    torch.manual_seed(0)
    model = timm.create_model(name, num_classes=5).eval()
    model.set_input_size(img_size=(64, 64), patch_size=(4, 4))
    vit = timm.create_model('test_vit', img_size=64, patch_size=8, num_classes=5)
    vit.set_input_size(img_size=(64, 64), patch_size=(4, 4))
    for resized in (model, vit):  # timm's own test_vit: what timm records
        args = timm.models.get_model_args(resized)
        assert (args['img_size'], args['patch_size']) == ((64, 64), (4, 4)), type(resized).__name__

    x = torch.randn(2, 3, 64, 64)
    expected = model(x)
    save_for_hf(model, str(tmp_path / 'saved'), safe_serialization=True)
    reloaded = timm.create_model(f'local-dir:{tmp_path / "saved"}', pretrained=True).eval()
    assert reloaded.patch_embed.patch_size == (4, 4) and torch.equal(reloaded(x), expected)

    from aft_vision.checkpoints import save_weights
    save_weights(model.state_dict(), tmp_path / 'trained.safetensors')
    publish(str(tmp_path / 'trained.safetensors'), name, 'someone/resized', out_dir=str(tmp_path / 'published'),
            dry_run=True, model_kwargs={'patch_size': 4}, data_config={'input_size': 64})
    published = timm.create_model(f'local-dir:{tmp_path / "published"}', pretrained=True).eval()
    assert torch.equal(published(x), expected)


def test_publish_refuses_bad_inputs_and_leaves_nothing(tmp_path):
    checkpoint = tmp_path / 'bad.safetensors'
    checkpoint.write_bytes(b'not a safetensors file at all')
    folder = tmp_path / 'out'
    with pytest.raises(ValueError, match='not a readable safetensors file'):
        publish(str(checkpoint), 'aft_conv_test', 'me/x', out_dir=str(folder), dry_run=True)
    wrong = tmp_path / 'wrong.safetensors'
    from aft_vision.checkpoints import save_weights
    save_weights(timm.create_model('aft_full_test').state_dict(), wrong)
    with pytest.raises(ValueError, match='does not fit aft_conv_test'):
        publish(str(wrong), 'aft_conv_test', 'me/x', out_dir=str(folder), dry_run=True)
    with pytest.raises(ValueError, match="org/name"):
        publish(str(wrong), 'aft_full_test', 'no-slash', out_dir=str(folder), dry_run=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ['bad.safetensors', 'wrong.safetensors']


def test_failed_upload_says_what_failed_and_leaves_nothing(tmp_path, monkeypatch):
    from aft_vision.checkpoints import save_weights
    checkpoint = tmp_path / 'w.safetensors'
    save_weights(timm.create_model('aft_conv_test').state_dict(), checkpoint)
    monkeypatch.setenv('HF_TOKEN', 'hf_secret_never_printed')

    def refuse(self, *args, **kwargs):
        raise ConnectionError('Hub unreachable')

    monkeypatch.setattr(huggingface_hub.HfApi, 'create_repo', refuse)
    with pytest.raises(RuntimeError, match='creating Hub repository me/x failed: ConnectionError') as error:
        publish(str(checkpoint), 'aft_conv_test', 'me/x', data_config={'input_size': 64}, upload=True)
    assert 'hf_secret' not in str(error.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ['w.safetensors']


def test_source_architecture_reads_a_folder_or_hub_repo_and_names_a_missing_config(tmp_path, offline_hub):
    from aft_vision.hub import source_architecture

    assert source_architecture('aft_conv_small.deit_in1k', {'kernel_size': 3}) == ('aft_conv_small', {'kernel_size': 3})
    assert source_architecture('aft_full_base.clip_openai') == ('aft_full_base_clip_quickgelu', {})  # main's tag
    folder = tmp_path / 'published'
    folder.mkdir()
    (folder / 'config.json').write_text(json.dumps({  # the layout timm's save_config_for_hf writes
        'architecture': 'aft_conv_test', 'num_classes': 10, 'pretrained_cfg': {
            'input_size': [3, 32, 32], 'crop_pct': 1.0, 'interpolation': 'bicubic', 'mean': [0.5] * 3,
            'std': [0.5] * 3},
        'model_args': {'patch_size': 4, 'num_classes': 10, 'kernel_size': 15}}))
    assert source_architecture(f'local-dir:{folder}', {'kernel_size': 3}) == (
        'aft_conv_test', {'patch_size': 4, 'kernel_size': 3})  # the class count comes from the checkpoint's head
    offline_hub('me/published', folder)
    assert source_architecture('hf-hub:me/published') == ('aft_conv_test', {'patch_size': 4, 'kernel_size': 15})
    with pytest.raises(FileNotFoundError, match='no config.json'):
        source_architecture(f'local-dir:{tmp_path}')


# ---------------------------------------------------------------------------------------------------------------------
# A published model as the standard clients see it: timm's data config, transformers' pipeline, timm's config reader.
#
# One small AFT-conv, trained for a few epochs on the digits by the main job itself (conftest's ``digits_job``, which
# publishes it): its folder is loaded the ways a user would: ``timm.create_model('local-dir:...')`` with
# ``resolve_data_config({}, model=...)`` and transformers' ``pipeline('image-classification')``. Both must reproduce
# the job's own held-out top-1. Also: publishing from timm ``train.py``'s output folder (``args.yaml``), the flags, the
# warning when nothing says how the weights were trained, and folders written by earlier versions.
# ---------------------------------------------------------------------------------------------------------------------


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


def test_config_json_follows_timms_convention_and_round_trips(digits_job):
    from timm.models._hub import load_model_config_from_path  # the reader behind local-dir: (not exported)

    out, results = digits_job.out, digits_job.results
    config = json.loads((out / 'hub' / 'config.json').read_text())
    # the architecture's own arguments only, and the sizes that rebuild its windows (img_size: the nominal size, as
    # timm records it; base_img_size: the size its windows are given for)
    args = config['model_args']
    assert {key: value for key, value in args.items() if key != 'img_size'} == dict(digits_job.model_kwargs,
                                                                                    base_img_size=32)
    assert args['img_size'] in (32, [32, 32])
    assert config['num_classes'] == 10 and config['global_pool'] == 'avg'
    cfg = config['pretrained_cfg']
    assert cfg['input_size'] == [3, 32, 32] and cfg['crop_pct'] == 1.0 and cfg['crop_mode'] == 'center'
    assert 'test_input_size' not in cfg or results['top1_at_48'] >= results['top1']
    assert results['data_config']['input_size'] == [3, 32, 32]
    # the run, not the architecture's untrained entry: its tag, the sizes it trained at, how, where its preprocessing
    sizes = ', '.join(map(str, results['train_img_sizes']))
    assert cfg['tag'] == 'digits-demo' and cfg['notes'][0] == f'trained by aft_vision.train at {sizes} px'
    assert 'AdamW' in cfg['notes'][1] and 'results.json' in cfg['notes'][2] and 'untrained' not in json.dumps(cfg)

    pretrained_cfg, architecture, model_args = load_model_config_from_path(out / 'hub')
    assert architecture == 'aft_conv_test' and model_args == config['model_args']
    assert tuple(pretrained_cfg['input_size']) == (3, 32, 32) and pretrained_cfg['num_classes'] == 10
    assert pretrained_cfg['label_names'] == [str(i) for i in range(10)]
    rebuilt = timm.create_model(architecture, num_classes=pretrained_cfg['num_classes'], **model_args)
    rebuilt.load_state_dict(load_file(str(out / 'hub' / 'model.safetensors')))  # strict: every tensor fits

    card = (out / 'hub' / 'README.md').read_text()
    assert 'results.json (aft_vision.train)' in card and "pipeline('image-classification'" in card
    assert f"| top1 | {results['top1']} |" in card and '| epochs |' not in card


def test_timm_standard_data_config_reproduces_the_jobs_top1(digits_job):
    out, results = digits_job.out, digits_job.results
    assert results['top1_timm_data_config'] == results['top1']  # the digits_job checks it itself
    top1 = _timm_client_top1(out / 'hub', out / 'data' / 'val')
    assert abs(top1 - results['top1']) <= 1.0, (top1, results['top1'])


def test_transformers_pipeline_reproduces_the_jobs_top1(digits_job, monkeypatch):
    monkeypatch.setenv('HF_HUB_OFFLINE', '1')
    transformers = pytest.importorskip('transformers', reason='transformers is the test extra for the pipeline client '
                                                              '(pip install -e .[test])')
    out, results = digits_job.out, digits_job.results
    classifier = transformers.pipeline('image-classification', model=str(out / 'hub'))
    assert type(classifier.model).__name__ == 'TimmWrapperForImageClassification'
    assert tuple(classifier.image_processor.data_config['input_size']) == (3, 32, 32)
    val = ImageFolder(str(out / 'data' / 'val'))
    predictions = classifier([path for path, _ in val.samples], top_k=1, batch_size=64)
    correct = sum(int(p[0]['label'] == val.classes[label]) for p, (_, label) in zip(predictions, val.samples))
    top1 = 100.0 * correct / len(val.samples)
    assert abs(top1 - results['top1']) <= 1.0, (top1, results['top1'])


def _timm_train_output(digits_job, tmp_path: Path, **args) -> Path:
    """A timm train.py output folder: args.yaml (yaml.safe_dump of vars(args)) beside model_best.pth.tar."""
    out = digits_job.out
    run = tmp_path / 'train-20260101-000000-aft_conv_test-32'
    run.mkdir()
    defaults = dict(model='aft_conv_test', num_classes=10, img_size=None, input_size=None, in_chans=None,
                    crop_pct=None, mean=None, std=None, interpolation='',
                    model_kwargs=dict(digits_job.model_kwargs), epochs=4)
    timm_args = {**defaults, **args}
    (run / 'args.yaml').write_text(yaml.safe_dump(timm_args, default_flow_style=False))
    state_dict = load_file(str(out / 'model.safetensors'))
    torch.save({'epoch': 3, 'arch': 'aft_conv_test', 'state_dict': state_dict, 'args': argparse.Namespace(**timm_args),
                'metric': 0.0}, run / 'model_best.pth.tar')
    return run


def test_publish_reads_timm_train_py_args_yaml(digits_job, tmp_path, capsys):
    out, results = digits_job.out, digits_job.results
    run = _timm_train_output(digits_job, tmp_path, img_size=32, crop_pct=1.0)
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
    run = _timm_train_output(digits_job, bare, input_size=[3, 32, 32], interpolation='bilinear')
    record = read_training_record(str(run / 'model_best.pth.tar'))
    assert record.architecture == 'aft_conv_test' and record.model_kwargs == digits_job.model_kwargs
    publish(str(run / 'model_best.pth.tar'), None, 'me/digits', out_dir=str(bare / 'hub'), dry_run=True)
    cfg = json.loads((bare / 'hub' / 'config.json').read_text())['pretrained_cfg']
    default = timm.models.get_pretrained_cfg('aft_conv_test')
    assert cfg['input_size'] == [3, 32, 32] and cfg['interpolation'] == 'bilinear'
    assert cfg['crop_pct'] == default.crop_pct and 'test_input_size' not in cfg

    # only the checkpoint was kept: train.py's arguments inside it
    (run / 'args.yaml').unlink()
    assert 'inside' in read_training_record(str(run / 'model_best.pth.tar')).source


def test_without_a_record_the_default_config_is_published_and_said(digits_job, tmp_path, capsys):
    out = digits_job.out
    checkpoint = tmp_path / 'weights.safetensors'
    shutil.copy(out / 'model.safetensors', checkpoint)
    folder = tmp_path / 'hub'
    args = ['publish', str(checkpoint), '--model', 'aft_conv_test', '--repo-id', 'me/digits', '--dry-run',
            '--out-dir', str(folder), '--model-kwargs', *[f'{k}={v}' for k, v in digits_job.model_kwargs.items()]]
    assert cli_main(args) == 0
    captured = capsys.readouterr()
    assert 'warning: publishing' in captured.err and 'default config of aft_conv_test' in captured.err
    cfg = json.loads((folder / 'config.json').read_text())['pretrained_cfg']
    default = timm.models.get_pretrained_cfg('aft_conv_test')
    assert tuple(cfg['input_size']) == default.input_size and cfg['crop_pct'] == default.crop_pct
    assert 'not measured with these weights' in (folder / 'README.md').read_text()
    with pytest.warns(UserWarning, match='default config of aft_conv_test'):
        publish(str(checkpoint), 'aft_conv_test', 'me/x', out_dir=str(tmp_path / 'api'), dry_run=True,
                model_kwargs=digits_job.model_kwargs)

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
def test_bad_data_config_flags_are_one_line_errors_and_write_nothing(digits_job, tmp_path, capsys, flags, message):
    out = digits_job.out
    folder = tmp_path / 'hub'
    assert cli_main(['publish', str(out / 'model.safetensors'), '--repo-id', 'me/x', '--dry-run',
                     '--out-dir', str(folder), *flags]) == 2
    assert message in capsys.readouterr().err
    assert not folder.exists()


def test_publish_without_an_architecture_says_so(tmp_path, capsys):
    checkpoint = tmp_path / 'w.safetensors'
    from aft_vision.checkpoints import save_weights
    save_weights(timm.create_model('aft_conv_test').state_dict(), checkpoint)
    assert cli_main(['publish', str(checkpoint), '--repo-id', 'me/x', '--dry-run', '--out-dir',
                     str(tmp_path / 'o')]) == 2
    assert 'name the architecture' in capsys.readouterr().err


def test_folders_written_by_earlier_versions_still_load(digits_job, tmp_path):
    out, results = digits_job.out, digits_job.results
    old = tmp_path / 'old'
    shutil.copytree(out / 'hub', old)
    config = json.loads((old / 'config.json').read_text())
    # earlier versions: timm's save_for_hf as it came, client arguments inside model_args, the default input size
    config['model_args'] = {**digits_job.model_kwargs, 'num_classes': 10, 'in_chans': 3, 'global_pool': 'avg',
                            'img_size': [64, 64]}
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


def test_the_main_jobs_results_give_its_data_config_and_metrics_alone_no_record(tmp_path):
    checkpoint = tmp_path / 'model.safetensors'
    checkpoint.write_bytes(b'')  # not read: the record is beside it
    (tmp_path / 'results.json').write_text(json.dumps({
        'top1': 98.05, 'architecture': 'aft_conv_test', 'model_kwargs': {'patch_size': 4}, 'train_img_sizes': [24, 32],
        'data_config': {'input_size': [3, 32, 32], 'crop_pct': 1.0, 'top1': 98.05}}))
    record = read_training_record(str(checkpoint))
    assert record.data_config == {'input_size': [3, 32, 32], 'crop_pct': 1.0}
    assert record.architecture == 'aft_conv_test' and record.model_kwargs == {'patch_size': 4}
    assert record.notes == ['trained by aft_vision.train at 24, 32 px']
    # the unreleased format without data_config (its img_size then meant crop_pct 1.0) is no record: nothing assumed
    (tmp_path / 'results.json').write_text(json.dumps({'top1': 98.05, 'architecture': 'aft_conv_test', 'img_size': 32}))
    assert read_training_record(str(checkpoint)) is None
    (tmp_path / 'results.json').write_text('{"top1": 98.05}')  # metrics only: no record
    assert read_training_record(str(checkpoint)) is None
    (tmp_path / 'args.yaml').write_text('model: [unclosed')
    with pytest.raises(ValueError, match='cannot read timm train.py arguments'):
        read_training_record(str(checkpoint))
