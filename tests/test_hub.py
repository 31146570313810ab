"""DeiT -> AFT transfer, pretrained tags, publishing and Hub / local-dir loading, all offline.

The Hub is replaced by a cache folder the tests fill themselves (huggingface_hub's own layout); every load below runs
through timm's and huggingface_hub's real download code with ``HF_HUB_OFFLINE`` set.
"""
import json

import huggingface_hub
import pytest
import timm
import torch
from safetensors.torch import load_file
from timm.models import save_for_hf

import aft_vision  # noqa: F401  (registers the models)
from aft_vision.cli import main as cli_main
from aft_vision.hub import model_from_checkpoint, publish
from aft_vision.transfer import transfer_vit_weights


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
    """What ``pretrained=True`` gives: the listed tags are DeiT backbones (num_classes=0, no test size); each
    architecture's default is '.untrained', where ``pretrained=True`` fails as timm does for models without weights."""
    listed = timm.list_models('aft_*', pretrained=True)
    assert len(listed) == 16 and all(name.endswith('.deit_in1k') for name in listed)
    for name in listed:
        cfg = timm.models.get_pretrained_cfg(name)
        assert cfg.has_weights and cfg.num_classes == 0 and cfg.test_input_size is None, name
    for architecture in timm.list_models('aft_*'):
        default = timm.models.get_pretrained_cfg(architecture)
        assert default.tag == 'untrained' and not default.has_weights and default.test_input_size is None
        with pytest.raises(RuntimeError, match=f'No pretrained weights exist for {architecture}'):
            timm.create_model(architecture, pretrained=True, device='meta')


def test_transfer_report_names_everything(tmp_path):
    deit = timm.create_model('deit_tiny_patch16_224')
    model = timm.create_model('aft_full_tiny', num_classes=10)
    state_dict, report = transfer_vit_weights({'model': deit.state_dict()}, model)  # DeiT release layout
    model.load_state_dict(state_dict)
    source_keys = set(deit.state_dict())
    accounted = set(report.copied) | set(report.resampled) | {k.split('[')[0] for k in report.skipped}
    assert accounted == source_keys
    assert set(report.skipped) == {'head.weight', 'head.bias'}  # 1000 vs 10 classes
    assert {k.rsplit('.', 1)[-1] for k in report.fresh} == {'pos_u', 'pos_v', 'weight', 'bias'}
    assert all(k.startswith('head.') or '.attn.pos_' in k for k in report.fresh)
    for key in report.copied:
        assert torch.equal(model.state_dict()[key], deit.state_dict()[key])


def test_transfer_resamples_pos_embed_for_aft_full_at_384():
    deit = timm.create_model('deit_tiny_patch16_224')
    model = timm.create_model('aft_full_tiny', img_size=384)
    state_dict, report = transfer_vit_weights(deit.state_dict(), model)
    assert report.resampled['pos_embed'] == '[1, 197, 192] -> [1, 577, 192]'
    assert torch.equal(state_dict['pos_embed'][:, 0], deit.pos_embed[:, 0])  # class-token position kept
    model.load_state_dict(state_dict)
    assert torch.isfinite(model(torch.randn(1, 3, 384, 384))).all()


@pytest.mark.parametrize('source, match', [
    (lambda: timm.create_model('deit_small_patch16_224').state_dict(), 'width mismatch at patch_embed.proj.weight'),
    (lambda: timm.create_model('deit_tiny_patch16_224', depth=6).state_dict(), 'depth mismatch'),
    (lambda: timm.create_model('resnet18').state_dict(), 'not a ViT / DeiT checkpoint'),
])
def test_transfer_rejects_what_does_not_fit(source, match):
    with pytest.raises(ValueError, match=match):
        transfer_vit_weights(source(), timm.create_model('aft_conv_tiny'))


def test_every_tag_names_a_real_deit_repository():
    """Each ``.deit_in1k`` tag must point at a DeiT repository timm itself publishes."""
    tags = [name for name in timm.list_pretrained('aft_*')]
    assert 'aft_conv_small.deit_in1k' in tags and 'aft_conv_base_25_h32.deit_in1k' in tags
    deit_repos = {
        timm.models.get_pretrained_cfg(name).hf_hub_id: name for name in timm.list_pretrained('deit_*')
    }
    for tag in tags:
        cfg = timm.models.get_pretrained_cfg(tag)
        assert cfg.hf_hub_id in deit_repos, (tag, cfg.hf_hub_id)
        assert 'initialisation for fine-tuning' in cfg.notes[0]


def test_cli_transfer_writes_safetensors_once(tmp_path, capsys):
    deit_file = tmp_path / 'deit.pth'
    torch.save({'model': timm.create_model('deit_tiny_patch16_224').state_dict()}, deit_file)
    out = tmp_path / 'aft.safetensors'
    args = ['transfer', '--src', str(deit_file), '--model', 'aft_conv_tiny', '--out', str(out)]
    assert cli_main(args) == 0
    printed = capsys.readouterr().out
    assert 'sha256' in printed and 'partial' in printed and 'fresh' in printed
    before = out.read_bytes()
    assert cli_main(args) == 2  # refuses to overwrite
    assert '--force' in capsys.readouterr().err
    assert out.read_bytes() == before
    assert cli_main(args + ['--force']) == 0


def test_publish_dry_run_round_trips_through_local_dir_and_hf_hub(tmp_path, offline_hub):
    torch.manual_seed(1)
    model = timm.create_model('aft_conv_test', num_classes=5).eval()
    checkpoint = tmp_path / 'trained.safetensors'
    from aft_vision._io import save_weights
    save_weights(model.state_dict(), checkpoint)
    results = tmp_path / 'results.json'
    results.write_text(json.dumps({'top1': 97.5}))
    folder = tmp_path / 'hub-folder'
    publish(str(checkpoint), 'aft_conv_test', 'someone/aft-test', out_dir=str(folder), dry_run=True,
            label_names=list('abcde'), results_file=str(results), datasets=['digits'],
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

    from aft_vision._io import save_weights
    save_weights(model.state_dict(), tmp_path / 'trained.safetensors')
    publish(str(tmp_path / 'trained.safetensors'), name, 'someone/resized', out_dir=str(tmp_path / 'published'),
            dry_run=True, model_kwargs={'patch_size': 4}, data_config={'input_size': 64})
    published = timm.create_model(f'local-dir:{tmp_path / "published"}', pretrained=True).eval()
    assert torch.equal(published(x), expected)


CHECKPOINT_KINDS = ['bare', 'plain', 'ema', 'compiled', 'ddp', 'compiled-ddp']


def training_checkpoint(kind, trained, ema):
    """A checkpoint as each trainer writes it: bare weights, ``{'state_dict'}`` (timm train.py without EMA), with
    ``state_dict_ema``, and the weights of a ``torch.compile`` model (``_orig_mod.``), a data-parallel one
    (``module.``; DataParallel names them as DDP does) and a compiled data-parallel one."""
    wrapped = {'compiled': torch.compile(trained), 'ddp': torch.nn.DataParallel(trained),
               'compiled-ddp': torch.compile(torch.nn.DataParallel(trained))}.get(kind, trained)
    state_dict = wrapped.state_dict()
    if kind == 'bare':
        return state_dict
    checkpoint = {'epoch': 3, 'arch': 'aft_conv_test', 'state_dict': state_dict}
    if kind == 'ema':
        checkpoint['state_dict_ema'] = ema.state_dict()
    return checkpoint


@pytest.mark.parametrize('kind', CHECKPOINT_KINDS)
def test_training_checkpoints_load_as_timm_loads_them(kind, tmp_path):
    """Every kind of training checkpoint loads (EMA weights first, wrapper prefixes stripped), the same tensors
    timm's own ``load_state_dict`` takes from the file, and ``use_ema=False`` takes the trained weights."""
    torch.manual_seed(0)
    trained = timm.create_model('aft_conv_test').eval()
    ema = timm.create_model('aft_conv_test').eval()  # other random weights
    path = tmp_path / 'checkpoint.pth.tar'
    torch.save(training_checkpoint(kind, trained, ema), path)
    for use_ema in (True, False):
        expected = ema if kind == 'ema' and use_ema else trained
        model, weights = model_from_checkpoint('aft_conv_test', str(path), use_ema=use_ema)
        timm_state = timm.models.load_state_dict(str(path), use_ema=use_ema)
        assert model.state_dict().keys() == timm_state.keys()
        for key, tensor in model.state_dict().items():
            assert torch.equal(tensor, expected.state_dict()[key]) and torch.equal(tensor, timm_state[key]), key
        assert ('EMA weights' in weights) == (kind == 'ema' and use_ema), weights
        assert ('not the EMA ones' in weights) == (kind == 'ema' and not use_ema), weights
    overlay = timm.create_model(  # timm's loader, then the filter
        'aft_conv_test', pretrained=True, pretrained_cfg_overlay=dict(file=str(path)))
    in_memory = timm.create_model(  # the filter alone
        'aft_conv_test', pretrained=True, pretrained_cfg_overlay=dict(state_dict=torch.load(path)))
    expected = ema if kind == 'ema' else trained
    for loaded in (overlay, in_memory):
        assert all(torch.equal(v, expected.state_dict()[k]) for k, v in loaded.state_dict().items())


def test_publish_and_transfer_say_which_weights_they_took(tmp_path, capsys):
    torch.manual_seed(0)
    trained = timm.create_model('aft_conv_test', num_classes=5).eval()
    ema = timm.create_model('aft_conv_test', num_classes=5).eval()
    path = tmp_path / 'checkpoint.pth.tar'
    torch.save(training_checkpoint('ema', trained, ema), path)
    x = torch.randn(2, 3, 64, 64)
    for flags, expected in (([], ema), (['--no-ema'], trained)):
        folder = tmp_path / f'published{len(flags)}'
        assert cli_main(['publish', str(path), '--model', 'aft_conv_test', '--repo-id', 'me/aft', '--dry-run',
                         '--out-dir', str(folder), '--input-size', '64', *flags]) == 0
        printed = capsys.readouterr().out
        assert ("weights: the EMA weights ('state_dict_ema'" in printed) == (not flags), printed
        published = timm.create_model(f'local-dir:{folder}', pretrained=True).eval()
        assert torch.equal(published(x), expected(x))

    torch.manual_seed(1)
    deit, deit_ema = (timm.create_model('deit_tiny_patch16_224') for _ in range(2))
    deit_file = tmp_path / 'deit.pth'
    torch.save({'model': deit.state_dict(), 'model_ema': deit_ema.state_dict()}, deit_file)
    for flags, source in (([], deit_ema), (['--no-ema'], deit)):
        out = tmp_path / f'aft{len(flags)}.safetensors'
        assert cli_main(['transfer', '--src', str(deit_file), '--model', 'aft_full_tiny', '--out', str(out),
                         *flags]) == 0
        assert ("source    the EMA weights ('model_ema'" in capsys.readouterr().out) == (not flags)
        key = 'blocks.0.mlp.fc1.weight'
        assert torch.equal(load_file(str(out))[key], source.state_dict()[key])


def test_publish_refuses_bad_inputs_and_leaves_nothing(tmp_path):
    checkpoint = tmp_path / 'bad.safetensors'
    checkpoint.write_bytes(b'not a safetensors file at all')
    folder = tmp_path / 'out'
    with pytest.raises(ValueError, match='not a readable safetensors file'):
        publish(str(checkpoint), 'aft_conv_test', 'me/x', out_dir=str(folder), dry_run=True)
    wrong = tmp_path / 'wrong.safetensors'
    from aft_vision._io import save_weights
    save_weights(timm.create_model('aft_full_test').state_dict(), wrong)
    with pytest.raises(ValueError, match='does not fit aft_conv_test'):
        publish(str(wrong), 'aft_conv_test', 'me/x', out_dir=str(folder), dry_run=True)
    with pytest.raises(ValueError, match="org/name"):
        publish(str(wrong), 'aft_full_test', 'no-slash', out_dir=str(folder), dry_run=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ['bad.safetensors', 'wrong.safetensors']


def test_failed_upload_says_what_failed_and_leaves_nothing(tmp_path, monkeypatch):
    from aft_vision._io import save_weights
    checkpoint = tmp_path / 'w.safetensors'
    save_weights(timm.create_model('aft_conv_test').state_dict(), checkpoint)
    monkeypatch.setenv('HF_TOKEN', 'hf_secret_never_printed')

    def refuse(self, *args, **kwargs):
        raise ConnectionError('Hub unreachable')

    monkeypatch.setattr(huggingface_hub.HfApi, 'create_repo', refuse)
    with pytest.raises(RuntimeError, match='creating Hub repository me/x failed: ConnectionError') as error:
        publish(str(checkpoint), 'aft_conv_test', 'me/x', data_config={'input_size': 64})
    assert 'hf_secret' not in str(error.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ['w.safetensors']


def test_source_architecture_reads_a_folder_or_hub_repo_and_names_a_missing_config(tmp_path, offline_hub):
    from aft_vision.hub import source_architecture

    assert source_architecture('aft_conv_small.deit_in1k', {'kernel_size': 3}) == ('aft_conv_small', {'kernel_size': 3})
    folder = tmp_path / 'published'
    folder.mkdir()
    (folder / 'config.json').write_text(json.dumps({  # the layout timm's save_config_for_hf writes
        'architecture': 'aft_conv_test', 'num_classes': 10, 'pretrained_cfg': {'input_size': [3, 32, 32]},
        'model_args': {'patch_size': 4, 'num_classes': 10, 'kernel_size': 15}}))
    assert source_architecture(f'local-dir:{folder}', {'kernel_size': 3}) == (
        'aft_conv_test', {'patch_size': 4, 'kernel_size': 3})  # the class count comes from the checkpoint's head
    offline_hub('me/published', folder)
    assert source_architecture('hf-hub:me/published') == ('aft_conv_test', {'patch_size': 4, 'kernel_size': 15})
    with pytest.raises(FileNotFoundError, match='no config.json'):
        source_architecture(f'local-dir:{tmp_path}')
