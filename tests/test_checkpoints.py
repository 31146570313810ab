"""Weight files (``aft_vision.checkpoints``): what is read, what is written, what is transferred.

* Reading only safetensors or tensor-only pickles; atomic writes that never clobber silently.
* DeiT / ViT -> AFT transfer, and the weights taken from timm's training checkpoints (plain, EMA, compiled, DDP).
* Every entry point that reads weights refuses bad files clearly and leaves nothing behind.
"""
import argparse
import collections
import hashlib
import os
import random
import stat

import pytest
import timm
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

import aft_vision  # noqa: F401  registers the models
from aft_vision.checkpoints import atomic_dir, load_weights, output_dir, save_weights, swap_in, transfer_vit_weights
from aft_vision.cli import main as cli_main
from aft_vision.hub import load_model

# ---------------------------------------------------------------------------------------------------------------------
# Weight files: only safetensors or tensor-only pickles are read; writes are atomic and never clobber silently.
# ---------------------------------------------------------------------------------------------------------------------


@pytest.fixture
def tensors():
    return {'a.weight': torch.randn(3, 4), 'b.bias': torch.arange(5.0)}


def test_safetensors_round_trip_and_sha256(tmp_path, tensors):
    path = tmp_path / 'w.safetensors'
    digest = save_weights(tensors, path)
    assert digest == hashlib.sha256(path.read_bytes()).hexdigest()
    loaded = load_weights(path)
    assert loaded.keys() == tensors.keys()
    for key in tensors:
        assert torch.equal(loaded[key], tensors[key])


def test_weights_only_pickle_is_read(tmp_path, tensors):
    path = tmp_path / 'w.pth'
    torch.save({'model': tensors}, path)
    assert torch.equal(load_weights(path)['model']['a.weight'], tensors['a.weight'])


def test_timm_train_checkpoint_with_its_arguments_is_read(tmp_path, tensors):
    path = tmp_path / 'last.pth.tar'  # what timm's train.py saves: weights plus its argparse.Namespace
    torch.save({'epoch': 3, 'arch': 'aft_conv_test', 'state_dict': tensors, 'args': argparse.Namespace(lr=0.1)}, path)
    checkpoint = load_weights(path)
    assert checkpoint['args'].lr == 0.1 and torch.equal(checkpoint['state_dict']['b.bias'], tensors['b.bias'])


def test_refuses_to_overwrite_without_force(tmp_path, tensors):
    path = tmp_path / 'w.safetensors'
    path.write_bytes(b'precious')
    with pytest.raises(FileExistsError, match='--force'):
        save_weights(tensors, path)
    assert path.read_bytes() == b'precious'
    save_weights(tensors, path, force=True)
    assert torch.equal(load_file(str(path))['b.bias'], tensors['b.bias'])
    assert sorted(p.name for p in tmp_path.iterdir()) == ['w.safetensors']  # no temporary left behind


def test_pickle_that_runs_code_is_refused_and_never_run(tmp_path, hostile_pickle):
    path = hostile_pickle(tmp_path / 'bad.pth')  # the fixture fails the test if the code in it ran
    with pytest.raises(ValueError, match=r'pickled objects other than tensors \(\w+\.system\)'):
        load_weights(path)


@pytest.mark.parametrize('make, match', [
    (lambda p: p.write_bytes(b''), 'empty'),
    (lambda p: torch.save(collections.OrderedDict(w=torch.ones(2)), p) or p.write_bytes(p.read_bytes()[:40]),
     'truncated or corrupted'),
    (lambda p: p.write_bytes(b'\x00' * 64), 'truncated or corrupted'),
    (lambda p: torch.save([torch.ones(1)], p), 'not a state dict'),
])
def test_bad_pytorch_files_are_refused(tmp_path, make, match):
    path = tmp_path / 'bad.pth'
    make(path)
    with pytest.raises(ValueError, match=match):
        load_weights(path)


@pytest.mark.parametrize('corrupt', [lambda b: b[:len(b) // 2], lambda b: b'\xff' * 16 + b[16:]])
def test_bad_safetensors_are_refused(tmp_path, tensors, corrupt):
    path = tmp_path / 'w.safetensors'
    save_weights(tensors, path)
    path.write_bytes(corrupt(path.read_bytes()))
    with pytest.raises(ValueError, match='not a readable safetensors file'):
        load_weights(path)


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match='nope.safetensors'):
        load_weights(tmp_path / 'nope.safetensors')


def test_atomic_dir_leaves_nothing_on_failure_and_keeps_the_old_folder(tmp_path):
    target = tmp_path / 'out'
    with atomic_dir(target) as staging:
        (staging / 'a.txt').write_text('first')
    with pytest.raises(RuntimeError):
        with atomic_dir(target, force=True) as staging:
            (staging / 'a.txt').write_text('half')
            raise RuntimeError('upload failed')
    assert (target / 'a.txt').read_text() == 'first'
    assert sorted(p.name for p in tmp_path.iterdir()) == ['out']
    with pytest.raises(FileExistsError):
        with atomic_dir(target):
            pass
    with atomic_dir(target, force=True) as staging:
        (staging / 'b.txt').write_text('second')
        (staging / 'a.txt').write_text('replaced')
    assert {p.name: p.read_text() for p in target.iterdir()} == {'a.txt': 'replaced', 'b.txt': 'second'}
    (target / 'mine.txt').write_text('the user\'s')  # force replaces only what the block writes
    with atomic_dir(target, force=True) as staging:
        (staging / 'a.txt').write_text('third')
    assert {p.name: p.read_text() for p in target.iterdir()} == {
        'a.txt': 'third', 'b.txt': 'second', 'mine.txt': 'the user\'s'}
    assert sorted(p.name for p in tmp_path.iterdir()) == ['out']


def test_swap_in_puts_everything_back_when_a_move_fails(tmp_path, monkeypatch):
    target, staging = tmp_path / 'out', tmp_path / 'staging'
    for folder in (target, staging):
        folder.mkdir()
        for name in ('a', 'b', 'c'):
            (folder / name).write_text(f'{folder.name} {name}')
    real_replace, calls = os.replace, []

    def failing_replace(src, dst):  # the fifth move (setting the third old entry aside) fails
        calls.append(dst)
        if len(calls) == 5:
            raise OSError('disk full')
        real_replace(src, dst)

    monkeypatch.setattr(os, 'replace', failing_replace)
    with pytest.raises(OSError, match='disk full'):
        swap_in(staging, target)
    monkeypatch.setattr(os, 'replace', real_replace)
    assert {p.name: p.read_text() for p in target.iterdir()} == {n: f'out {n}' for n in 'abc'}
    assert sorted(p.name for p in tmp_path.iterdir()) == ['out']


def test_written_files_and_folders_get_the_users_umask(tmp_path):
    old = os.umask(0o022)
    try:
        with atomic_dir(tmp_path / 'folder') as staging:
            (staging / 'a.txt').write_text('x')
        save_weights({'w': torch.zeros(1)}, tmp_path / 'w.safetensors')
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / 'folder').stat().st_mode) == 0o755
    assert stat.S_IMODE((tmp_path / 'folder' / 'a.txt').stat().st_mode) == 0o644
    assert stat.S_IMODE((tmp_path / 'w.safetensors').stat().st_mode) == 0o644


def test_output_dir_refuses_checks_and_restores(tmp_path):
    out = tmp_path / 'run'
    out.mkdir()
    (out / 'model.safetensors').write_text('old weights')
    (out / 'notes.txt').write_text('mine')
    with pytest.raises(FileExistsError, match='pass --force'):
        with output_dir(out, writes=['model.safetensors']):
            pass
    with pytest.raises(RuntimeError):  # a job that fails after writing: the folder as it was
        with output_dir(out, force=True, writes=['model.safetensors', 'hub']) as folder:
            (folder / 'model.safetensors').write_text('half new')
            (folder / 'hub').mkdir()
            raise RuntimeError('the state does not fit')
    assert {p.name: p.read_text() for p in out.iterdir()} == {'model.safetensors': 'old weights', 'notes.txt': 'mine'}
    with output_dir(out, force=True, writes=['model.safetensors']) as folder:
        (folder / 'model.safetensors').write_text('new weights')
    assert {p.name: p.read_text() for p in out.iterdir()} == {'model.safetensors': 'new weights', 'notes.txt': 'mine'}
    with pytest.raises(RuntimeError):  # a folder the job created is gone again
        with output_dir(tmp_path / 'fresh', writes=['a']) as folder:
            (folder / 'a').write_text('x')
            raise RuntimeError
    assert sorted(p.name for p in tmp_path.iterdir()) == ['run']


# ---------------------------------------------------------------------------------------------------------------------
# DeiT / ViT -> AFT transfer (checkpoints.transfer) and the weights taken from training checkpoints.
# ---------------------------------------------------------------------------------------------------------------------


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
    (lambda: timm.create_model('resnet18').state_dict(), 'not a ViT-family checkpoint'),
])
def test_transfer_rejects_what_does_not_fit(source, match):
    with pytest.raises(ValueError, match=match):
        transfer_vit_weights(source(), timm.create_model('aft_conv_tiny'))


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
        model, weights = load_model('aft_conv_test', str(path), use_ema=use_ema)
        timm_state = timm.models.load_state_dict(str(path), use_ema=use_ema)
        assert model.state_dict().keys() == timm_state.keys()
        for key, tensor in model.state_dict().items():
            assert torch.equal(tensor, expected.state_dict()[key]) and torch.equal(tensor, timm_state[key]), key
        assert ('EMA weights' in weights) == (kind == 'ema' and use_ema), weights
        assert ('not the EMA ones' in weights) == (kind == 'ema' and not use_ema), weights
    with pytest.raises(ValueError, match='a checkpoint or pretrained, not both'):
        load_model('aft_conv_test', str(path), pretrained=True)
    overlay = timm.create_model(  # timm's loader, then the filter
        'aft_conv_test', pretrained=True, pretrained_cfg_overlay=dict(file=str(path)))
    in_memory = timm.create_model(  # the filter alone
        'aft_conv_test', pretrained=True, pretrained_cfg_overlay=dict(state_dict=torch.load(path)))
    expected = ema if kind == 'ema' else trained
    for loaded in (overlay, in_memory):
        assert all(torch.equal(v, expected.state_dict()[k]) for k, v in loaded.state_dict().items())


TINY_FULL = dict(patch_size=4, embed_dim=32, depth=2)  # AFT-full / a ViT, 32 channels; grid from img_size
TINY_CONV = dict(patch_size=4, embed_dim=32, depth=2, num_heads=4)


@pytest.mark.parametrize('source, source_kwargs, target, target_kwargs, fits', [
    ('aft_conv_small', dict(TINY_CONV, kernel_size=3), 'aft_conv_small', dict(TINY_CONV, kernel_size=5), True),
    ('aft_conv_small', dict(TINY_CONV, kernel_size=3), 'aft_conv_small', dict(TINY_CONV, patch_size=8), True),
    ('aft_full_tiny', dict(TINY_FULL, img_size=32), 'aft_full_tiny', dict(TINY_FULL, img_size=48), True),
    ('vit_tiny_patch16_224', dict(TINY_FULL, img_size=32, num_heads=2), 'aft_conv_small', TINY_CONV, True),
    ('vit_tiny_patch16_224', dict(TINY_FULL, img_size=32, num_heads=2), 'aft_full_tiny', dict(TINY_FULL, img_size=48),
     True),
    ('vit_tiny_patch16_224', dict(TINY_FULL, img_size=32, num_heads=2), 'aft_conv_small', dict(TINY_CONV, embed_dim=48),
     False),
    ('aft_conv_small', TINY_CONV, 'aft_conv_small', dict(TINY_CONV, depth=3), False),
    ('aft_full_tiny', dict(TINY_FULL, img_size=32), 'aft_conv_small', TINY_CONV, False),
])
def test_init_weights_check_and_trainer_take_one_decision(source, source_kwargs, target, target_kwargs, fits,
                                                          tmp_path):
    """``--init-from``'s check before training (on the meta device) and the trainer's load take the same decision
    (``models.fit_checkpoint``): what the check accepts loads strictly, what it refuses does not."""
    from aft_vision.hub import check_init_weights
    from aft_vision.models import fit_checkpoint

    torch.manual_seed(0)
    weights = timm.create_model(source, num_classes=3, **source_kwargs).state_dict()
    save_weights(weights, tmp_path / 'w.safetensors')
    model = timm.create_model(target, num_classes=3, **target_kwargs)
    try:
        model.load_state_dict(fit_checkpoint(weights, model, log=lambda text: None))
        loaded = True
    except (ValueError, RuntimeError):
        loaded = False
    try:
        check_init_weights(str(tmp_path / 'w.safetensors'), target, target_kwargs, 3)
        checked = True
    except ValueError as error:
        assert str(tmp_path / 'w.safetensors') in str(error) and '\n' not in str(error)
        checked = False
    assert loaded == checked == fits
    if loaded:  # the MLPs and norms are the source's, whatever was resampled or mapped around them
        for key in ('blocks.0.mlp.fc1.weight', 'blocks.1.norm2.weight', 'norm.bias'):
            assert torch.equal(model.state_dict()[key], weights[key]), key


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


# ---------------------------------------------------------------------------------------------------------------------
# Every entry point that reads weights refuses bad files clearly and leaves nothing behind; CLI errors are one line.
# ---------------------------------------------------------------------------------------------------------------------


def _write_bad(kind, folder, hostile_pickle):
    """A weight file of the given badness for ``aft_conv_test`` (``hostile_pickle``: conftest.py's fixture)."""
    good = timm.create_model('aft_conv_test').state_dict()
    if kind == 'pickled':  # the model's weights plus an object whose unpickling calls os.system
        path = hostile_pickle(folder / 'bad.pth', model=good)
    elif kind == 'truncated':
        path = folder / 'bad.safetensors'
        save_weights(good, path)
        path.write_bytes(path.read_bytes()[:1000])
    elif kind == 'corrupted':
        path = folder / 'bad.pth'
        torch.save(good, path)
        data = bytearray(path.read_bytes())
        data[100:400] = random.Random(0).randbytes(300)  # inside the pickle of the tensor names
        path.write_bytes(bytes(data))
    elif kind == 'wrong-architecture':
        path = folder / 'bad.safetensors'
        save_weights(timm.create_model('aft_full_test').state_dict(), path)
    else:  # oversized: a checkpoint of a wider model than the one asked for
        path = folder / 'bad.safetensors'
        save_weights(timm.create_model('aft_conv_test', embed_dim=128, num_heads=8).state_dict(), path)
    return path


KINDS = ['pickled', 'truncated', 'corrupted', 'wrong-architecture', 'oversized']


# what timm's own loader raises for each (torch / safetensors / load_state_dict errors, unchanged by aft_vision)
OVERLAY_ERRORS = {
    'pickled': (RuntimeError, r'Unsupported globals?: \w+\.system'),  # weights_only=True refuses os.system
    'truncated': (SafetensorError, 'Error while deserializing header'),
    'corrupted': (UnicodeDecodeError, "codec can't decode byte"),  # the pickle of the tensor names is damaged
    'wrong-architecture': (RuntimeError, 'Missing key\\(s\\) in state_dict: "blocks.0.attn.pos_weight"'),
    'oversized': (RuntimeError, 'size mismatch for patch_embed.proj.weight'),
}
# what the CLI says for each, through aft_vision's readers (transfer: the DeiT transfer; publish: load_checkpoint_into)
CLI_ERRORS = {
    'pickled': ('refused to load', 'holds pickled objects other than tensors'),
    'truncated': ('is not a readable safetensors file', 'invalid header length'),
    'corrupted': ('is truncated or corrupted and cannot be read as a PyTorch file',),
    'wrong-architecture': {'transfer': ("checkpoint key 'blocks.0.attn.pos_u'", 'has no counterpart'),
                           'publish': ('does not fit aft_conv_test', "missing ['blocks.0.attn.pos_beta'")},
    'oversized': {'transfer': ('width mismatch at patch_embed.proj.weight',),
                  'publish': ('does not fit aft_conv_test', 'has shape [128], the model expects [64]')},
}


@pytest.mark.parametrize('kind', KINDS)
def test_create_model_with_a_file_overlay_refuses(kind, tmp_path, hostile_pickle):
    path = _write_bad(kind, tmp_path, hostile_pickle)
    error_type, message = OVERLAY_ERRORS[kind]
    with pytest.raises(error_type, match=message):
        timm.create_model('aft_conv_test', pretrained=True, pretrained_cfg_overlay=dict(file=str(path)))


@pytest.mark.parametrize('kind', KINDS)
@pytest.mark.parametrize('command', ['transfer', 'publish'])
def test_cli_refuses_bad_weight_files_with_one_line(kind, command, tmp_path, capsys, hostile_pickle):
    path = _write_bad(kind, tmp_path, hostile_pickle)
    if command == 'transfer':
        args = ['transfer', '--src', str(path), '--model', 'aft_conv_test', '--out', str(tmp_path / 'o.safetensors')]
    else:
        args = ['publish', str(path), '--model', 'aft_conv_test', '--repo-id', 'me/x', '--dry-run',
                '--out-dir', str(tmp_path / 'folder')]
    assert cli_main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith('aft-vision: error:') and '\n' not in err and 'Traceback' not in err
    expected = CLI_ERRORS[kind][command] if isinstance(CLI_ERRORS[kind], dict) else CLI_ERRORS[kind]
    assert all(words in err for words in expected), err
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]  # no partial output


@pytest.mark.parametrize('args, words', [
    (['transfer', '--src', 'deit_tiny_patch16_224', '--model', 'aft_conv_smal', '--out', 'o.safetensors'],
     'did you mean aft_conv_small'),
    (['transfer', '--src', 'missing.pth', '--model', 'aft_conv_test', '--out', 'o.safetensors'], 'not found'),
    (['transfer', '--src', 'x.pth', '--model', 'aft_conv_test', '--out', 'o.pth'], '.safetensors'),
    (['bench', '--models', 'aft_conv_tinyy', '--resolutions', '64'], 'unknown model'),
    (['demo', '--device', 'nope'], '--device'),
])
def test_cli_user_errors_are_one_line(args, words, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert cli_main(args) == 2
    err = capsys.readouterr().err.strip()
    assert words in err and '\n' not in err


def test_publish_to_an_unwritable_folder_is_one_line(tmp_path, capsys):
    if os.geteuid() == 0:
        target = '/proc/aft-vision-cannot-write-here'  # root may write anywhere else
    else:
        locked = tmp_path / 'locked'
        locked.mkdir(mode=0o500)
        target = str(locked / 'out')
    checkpoint = tmp_path / 'w.safetensors'
    save_weights(timm.create_model('aft_conv_test').state_dict(), checkpoint)
    args = ['publish', str(checkpoint), '--model', 'aft_conv_test', '--repo-id', 'me/x', '--dry-run',
            '--out-dir', target]
    assert cli_main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith('aft-vision: error:') and '\n' not in err
