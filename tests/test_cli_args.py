"""Every option of every ``aft-vision`` subcommand is checked before the subcommand starts: a bad number, size, path
or name ends as one line on stderr naming the option, exit code 2, no traceback, and nothing written."""
import argparse

import pytest
import timm
from PIL import Image

from aft_vision._io import save_weights
from aft_vision.cli import build_parser, main as cli_main
from aft_vision.cli_args import LIMITS, check_args

SUBCOMMANDS = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices


@pytest.fixture
def setup(tmp_path, monkeypatch):
    """Inputs that exist (``inputs/``), an empty output folder (``out/``, also the working directory), and a valid
    command line per subcommand writing only under ``out/``."""
    inputs, out = tmp_path / 'inputs', tmp_path / 'out'
    inputs.mkdir()
    out.mkdir()
    monkeypatch.chdir(out)
    checkpoint = inputs / 'w.safetensors'
    save_weights(timm.create_model('aft_conv_test', num_classes=3).state_dict(), checkpoint)
    image = inputs / 'img.png'
    Image.new('RGB', (64, 64)).save(image)
    (inputs / 'a-file').write_text('not a folder')
    valid = {
        'demo': [],
        'transfer': ['--src', 'deit_tiny_patch16_224', '--model', 'aft_conv_tiny', '--out', str(out / 'o.safetensors')],
        'publish': [str(checkpoint), '--model', 'aft_conv_test', '--repo-id', 'me/x', '--dry-run',
                    '--out-dir', str(out / 'folder')],
        'bench': ['--quick', '--out-dir', str(out / 'bench')],
        'train': ['--out-dir', str(out / 'run')],
        'study': ['--out-dir', str(out / 'study')],
        'predict': [str(image), '--model', 'aft_conv_test', '--checkpoint', str(checkpoint)],
        'export': ['--model', 'aft_conv_test', '--checkpoint', str(checkpoint), '--out', str(out / 'm.onnx')],
        'show-bias': ['--model', 'aft_conv_test', '--out', str(out / 'b.png')],
        'show-keys': [str(image), '--model', 'aft_conv_test', '--out', str(out / 'k.png')],
    }
    return inputs, out, valid


def _refused(argv, option, out, capsys):
    """Exit code 2, one line naming ``option``, no traceback, ``out`` left empty."""
    assert cli_main(argv) == 2, argv
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert '\n' not in err and 'Traceback' not in err and option in err, (argv, err)
    assert err.startswith(f'aft-vision {argv[0]}: error: argument '), err
    assert not list(out.iterdir()), (argv, sorted(p.name for p in out.rglob('*')))


def _numeric_options():
    """(subcommand, option string, dest, nargs) for every int / float option."""
    for command, parser in SUBCOMMANDS.items():
        for action in parser._actions:
            if action.type in (int, float):
                yield command, action.option_strings[0], action.dest, action.type, action.nargs


def _bad_values(dest, kind):
    low, high, open_low = LIMITS[dest]
    values = [] if low is None else [low if open_low else low - 1]
    values += [] if high is None else [high + 1]
    values += ['nan', 'inf'] if kind is float else []
    return [str(kind(v)) if not isinstance(v, str) else v for v in values]


def test_the_valid_command_lines_pass_the_checks(setup):
    """So that each refusal below comes from the one bad value it adds."""
    _, _, valid = setup
    assert set(valid) == set(SUBCOMMANDS)
    for command, argv in valid.items():
        assert check_args(build_parser().parse_args([command, *argv])) is None, command


def test_every_numeric_option_has_limits():
    unchecked = {(command, option) for command, option, dest, *_ in _numeric_options() if dest not in LIMITS}
    assert not unchecked


@pytest.mark.parametrize('command, option, dest, kind, nargs', list(_numeric_options()),
                         ids=lambda v: v if isinstance(v, str) else None)
def test_out_of_range_numbers_are_refused_before_any_work(command, option, dest, kind, nargs, setup, capsys):
    _, out, valid = setup
    bad_values = _bad_values(dest, kind)
    assert bad_values, f'{command} {option} has no value to refuse'
    for bad in bad_values:
        values = [bad] * (2 if nargs == 2 else 1)
        _refused([command, *valid[command], option, *values], option, out, capsys)


@pytest.mark.parametrize('command, extra, option', [
    ('train', ['--epochs', '0'], '--epochs'),  # timm's scheduler would assert, after the digits were written
    ('train', ['--data-dir', 'missing'], '--data-dir'),
    ('train', ['--out-dir', '{inputs}/a-file'], '--out-dir'),
    ('train', ['--model', 'aft_conv_tset'], '--model'),
    ('train', ['--model', 'aft_conv_small.nope'], '--model'),
    ('train', ['--device', 'nope'], '--device'),
    ('demo', ['--device', 'nope'], '--device'),
    ('bench', ['--models', 'aft_conv_tinyy'], '--models'),
    ('bench', ['--out-dir', '{inputs}/a-file'], '--out-dir'),
    ('transfer', ['--src', 'missing.pth'], '--src'),
    ('transfer', ['--src', 'not_a_timm_model'], '--src'),
    ('transfer', ['--out', 'o.pth'], '--out'),
    ('transfer', ['--model', 'aft_conv_smal'], '--model'),
    ('publish', ['--labels', 'missing.txt'], '--labels'),
    ('publish', ['--results', 'missing.json'], '--results'),
    ('publish', ['--model', 'nope'], '--model'),
    ('publish', ['--model', 'local-dir:missing'], '--model'),
    ('publish', ['--interpolation', 'cubic'], '--interpolation'),
    ('publish', ['--crop-mode', 'middle'], '--crop-mode'),
    ('predict', ['--checkpoint', 'missing.safetensors'], '--checkpoint'),
    ('predict', ['--model', 'nope'], '--model'),
    ('show-bias', ['--out', 'b.jpg'], '--out'),
    ('show-bias', ['--checkpoint', 'missing.pth'], '--checkpoint'),
    ('show-keys', ['--model', 'aft_conv_tset'], '--model'),
    ('show-bias', ['--pretrained'], '--pretrained'),  # aft_conv_test has no weights
    ('train', ['--pretrained'], '--pretrained'),
])
def test_bad_paths_and_names_are_refused_before_any_work(command, extra, option, setup, capsys):
    inputs, out, valid = setup
    _refused([command, *valid[command], *[e.format(inputs=inputs) for e in extra]], option, out, capsys)


@pytest.mark.parametrize('command, argv, option', [
    ('publish', lambda i: ['{missing}', '--repo-id', 'me/x', '--dry-run', '--out-dir', 'f'], 'checkpoint'),
    ('show-keys', lambda i: ['{missing}', '--model', 'aft_conv_test', '--out', 'k.png'], 'image'),
])
def test_missing_positional_files_are_refused(command, argv, option, setup, capsys):
    inputs, out, _ = setup
    args = [a.format(missing=inputs / 'missing.png') for a in argv(inputs)]
    _refused([command, *args], option, out, capsys)


@pytest.mark.parametrize('command', ['transfer', 'show-bias', 'publish'])
def test_existing_outputs_are_not_replaced_without_force(command, setup, capsys):
    _, out, valid = setup
    target = out / {'transfer': 'o.safetensors', 'show-bias': 'b.png', 'publish': 'folder'}[command]
    target.mkdir() if command == 'publish' else target.write_bytes(b'keep')
    assert cli_main([command, *valid[command]]) == 2
    err = capsys.readouterr().err.strip()
    assert '\n' not in err and 'exists; pass --force' in err
    assert sorted(p.name for p in out.iterdir()) == [target.name]
    assert command == 'publish' or target.read_bytes() == b'keep'


@pytest.mark.parametrize('extra, words', [
    (['--img-size', '30'], '--img-size 30: input size 30x30 is not a multiple of the patch size 4x4'),
    (['--model', 'aft_full_test', '--model-kwargs', 'img_size=64'],  # built for 32 px unless img_size is named
     '--img-size 32: input size 32x32 does not match the 64x64'),
    (['--model-kwargs', 'foo=1'], "unexpected keyword argument 'foo'"),
])
def test_train_checks_the_model_and_sizes_before_writing_the_data_set(extra, words, setup, capsys):
    """What only the model knows (its arguments, patch size, fixed input size), checked on a meta-device copy."""
    _, out, valid = setup
    assert cli_main(['train', *valid['train'], *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith('aft-vision: error:') and '\n' not in err and words in err, err
    assert not list(out.iterdir())
