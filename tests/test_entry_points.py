"""Every entry point that reads weights refuses bad files clearly and leaves nothing behind; CLI errors are one line."""
import os
import random

import pytest
import timm
import torch
from safetensors import SafetensorError

import aft_vision  # noqa: F401
from aft_vision._io import save_weights
from aft_vision.cli import main as cli_main


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
