"""The command line (``aft_vision.cli``) and the entry points users name.

* Every option of every subcommand is checked before the subcommand starts (one line, exit 2).
* ``aft-vision predict`` on real image files, a broken one among them.
* ``python -m aft_vision.run SCRIPT ARGS`` runs the script with the AFT models registered.
* timm ``train.py``'s ``--device-modules aft_vision`` registers the models; ``python -m aft_vision.run --aft-sparsity
  W`` adds the regulariser to timm's task while the script runs.
"""
import argparse
import subprocess
import sys

import numpy as np
import pytest
import timm
import torch
from PIL import Image
from timm.models import save_for_hf

from aft_vision.checkpoints import save_weights
from aft_vision.cli import build_parser
from aft_vision.cli import main as cli_main
from aft_vision.cli.args import LIMITS, check_args
from aft_vision.cli.predict import predict
from aft_vision.hub import publish

# ---------------------------------------------------------------------------------------------------------------------
# Every option of every ``aft-vision`` subcommand is checked before the subcommand starts: a bad number, size, path or
# name ends as one line on stderr naming the option, exit code 2, no traceback, and nothing written.
# ---------------------------------------------------------------------------------------------------------------------


SUBCOMMANDS = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices


@pytest.fixture
def setup(tmp_path, monkeypatch, offline_hub):
    """Inputs that exist (``inputs/``), an empty output folder (``out/``, also the working directory), and a valid
    command line per subcommand writing only under ``out/`` (transfer's source in the offline Hub cache)."""
    inputs, out = tmp_path / 'inputs', tmp_path / 'out'
    inputs.mkdir()
    out.mkdir()
    (inputs / 'deit').mkdir()
    (inputs / 'deit' / 'model.safetensors').write_bytes(b'')  # only looked for: the checks download nothing
    offline_hub('timm/deit_tiny_patch16_224.fb_in1k', inputs / 'deit')
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
    kept = target / 'mine.txt' if command == 'publish' else target
    kept.parent.mkdir(exist_ok=True)
    kept.write_bytes(b'keep')
    assert cli_main([command, *valid[command]]) == 2
    err = capsys.readouterr().err.strip()
    assert '\n' not in err and 'exists; pass --force' in err
    assert sorted(p.name for p in out.iterdir()) == [target.name]
    assert kept.read_bytes() == b'keep'


@pytest.mark.parametrize('extra, words', [
    (['--img-size', '30'], '--img-size 30: input size 30x30 is not a multiple of the patch size 4x4'),
    (['--model', 'aft_full_test', '--model-kwargs', 'img_size=64'],  # built for 32 px unless img_size is named
     '--img-size 32: input size 32x32 does not match the 64x64'),
])
def test_train_checks_the_model_and_sizes_before_writing_the_data_set(extra, words, setup, capsys):
    """What only the model knows (its arguments, patch size, fixed input size), checked on a meta-device copy."""
    _, out, valid = setup
    assert cli_main(['train', *valid['train'], *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith('aft-vision: error:') and '\n' not in err and words in err, err
    assert not list(out.iterdir())


# ---------------------------------------------------------------------------------------------------------------------
# ``aft-vision predict`` on real image files, a broken one among them, with published label names.
# ---------------------------------------------------------------------------------------------------------------------


def _images(folder):
    rng = np.random.default_rng(0)
    paths = []
    for i, size in enumerate([(64, 64), (90, 50)]):
        path = folder / f'img{i}.png'
        Image.fromarray(rng.integers(0, 255, (*size, 3), dtype=np.uint8)).save(path)
        paths.append(str(path))
    broken = folder / 'broken.jpg'
    broken.write_bytes(b'\xff\xd8\xff\xe0 not really a jpeg')
    text = folder / 'notes.txt'
    text.write_text('hello')
    return paths, [str(broken), str(text), str(folder / 'missing.png')]


def test_predict_reports_broken_files_and_classifies_the_rest(tmp_path, capsys):
    torch.manual_seed(0)
    model = timm.create_model('aft_conv_test', num_classes=3)
    checkpoint = tmp_path / 'w.safetensors'
    save_weights(model.state_dict(), checkpoint)
    good, bad = _images(tmp_path)
    assert cli_main(['predict', *good, *bad, '--model', 'aft_conv_test', '--checkpoint', str(checkpoint),
                     '--img-size', '96', '--topk', '2']) == 0
    captured = capsys.readouterr()
    assert all(f'skipped {path}' in captured.err for path in bad)
    assert 'img0.png:' in captured.out and 'img1.png:' in captured.out
    out = predict(model.eval(), good, img_size=96, topk=3)
    expected = model.eval()(torch.stack([timm.data.create_transform(**timm.data.resolve_data_config(
        {'input_size': (3, 96, 96)}, model=model))(Image.open(good[0]).convert('RGB'))])).softmax(-1)[0]
    assert [p for _, p, _ in out['results'][good[0]]] == sorted(expected.tolist(), reverse=True)


def test_predict_uses_published_label_names(tmp_path, capsys):
    model = timm.create_model('aft_conv_test', num_classes=2)
    checkpoint = tmp_path / 'w.safetensors'
    save_weights(model.state_dict(), checkpoint)
    publish(str(checkpoint), 'aft_conv_test', 'me/x', out_dir=str(tmp_path / 'hub'), dry_run=True,
            label_names=['cat', 'dog'])
    good, _ = _images(tmp_path)
    assert cli_main(['predict', good[0], '--model', f'local-dir:{tmp_path / "hub"}']) == 0
    line = capsys.readouterr().out
    assert 'cat' in line and 'dog' in line


def test_no_readable_image_is_an_error(tmp_path, capsys):
    _, bad = _images(tmp_path)
    checkpoint = tmp_path / 'w.safetensors'
    save_weights(timm.create_model('aft_conv_test', num_classes=3).state_dict(), checkpoint)
    assert cli_main(['predict', *bad, '--model', 'aft_conv_test', '--checkpoint', str(checkpoint)]) == 2
    assert 'no image could be read' in capsys.readouterr().err


@pytest.mark.parametrize('model, pretrained, why', [
    ('aft_conv_small', True, 'aft_conv_small has no pretrained weights (tag .untrained)'),
    ('aft_conv_small.deit_in1k', True, 'aft_conv_small.deit_in1k has no trained classifier'),
    ('aft_conv_small.dinov2_lvd142m', True, 'aft_conv_small.dinov2_lvd142m has no trained classifier'),  # deprecated
    ('backbone-folder', False, 'has no classifier (num_classes=0)'),
])
def test_predict_refuses_weights_without_a_trained_classifier(model, pretrained, why, tmp_path, capsys):
    """No weights, a backbone tag (main's deprecated ones too) or a headless folder: one line saying what to do,
    nothing downloaded."""
    good, _ = _images(tmp_path)
    if model == 'backbone-folder':
        save_for_hf(timm.create_model('aft_conv_test', num_classes=0), str(tmp_path / 'hub'), safe_serialization=True)
        model = f'local-dir:{tmp_path / "hub"}'
    assert cli_main(['predict', good[0], '--model', model, *(['--pretrained'] if pretrained else [])]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert err.startswith('aft-vision: error:') and '\n' not in err and why in err and not captured.out
    assert 'fine-tune it first' in err and 'aft-vision train --model aft_conv_' in err or 'ARCHITECTURE' in err


def test_checkpoint_of_a_resized_architecture_with_model_kwargs(tmp_path, capsys):
    model = timm.create_model('aft_conv_test', num_classes=4, patch_size=8, embed_dim=32)
    checkpoint = tmp_path / 'w.safetensors'
    save_weights(model.state_dict(), checkpoint)
    good, _ = _images(tmp_path)
    assert cli_main(['predict', good[0], '--model', 'aft_conv_test', '--checkpoint', str(checkpoint)]) == 2
    assert 'does not fit' in capsys.readouterr().err
    assert cli_main(['predict', good[0], '--model', 'aft_conv_test', '--checkpoint', str(checkpoint),
                     '--model-kwargs', 'patch_size=8', 'embed_dim=32', '--img-size', '40']) == 0
    assert capsys.readouterr().out.count(',') == 3  # four classes, top-4


# ---------------------------------------------------------------------------------------------------------------------
# ``python -m aft_vision.run SCRIPT ARGS``: the script runs as __main__ with its arguments and sees the AFT models.
# ---------------------------------------------------------------------------------------------------------------------


SCRIPT = '''
import sys
import timm

if __name__ == '__main__':
    name, size = sys.argv[1], int(sys.argv[2])
    model = timm.create_model(name).eval()
    shape = tuple(model(__import__('torch').randn(1, 3, size, size)).shape)
    line = f"ok {name} {shape} {sys.argv[0].endswith('s.py')}"
    print(line)
'''


def test_runs_a_script_that_relies_on_the_registry(tmp_path):
    script = tmp_path / 's.py'
    script.write_text(SCRIPT)
    done = subprocess.run([sys.executable, '-m', 'aft_vision.run', str(script), 'aft_conv_test', '64'],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert 'ok aft_conv_test (1, 1000) True' in done.stdout  # timm alone knows no AFT model: see the hook's test


@pytest.mark.slow
def test_runs_under_torchrun(tmp_path):
    """Both ranks run the script with the models registered. Each writes its line to a file of its own: the ranks
    share one stdout, where their prints can interleave."""
    script = tmp_path / 's.py'
    write_own_file = "    rank = __import__('os').environ['RANK']\n" \
                     "    __import__('pathlib').Path(sys.argv[0]).with_name(f'rank{rank}.txt').write_text(line)\n"
    script.write_text(SCRIPT + write_own_file)
    done = subprocess.run([sys.executable, '-m', 'torch.distributed.run', '--standalone', '--nproc_per_node=2',
                           '-m', 'aft_vision.run', str(script), 'aft_conv_test', '64'],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    for rank in (0, 1):
        assert (tmp_path / f'rank{rank}.txt').read_text() == 'ok aft_conv_test (1, 1000) True', f'rank {rank}'


def test_missing_script_is_a_one_line_error(tmp_path, capsys):
    """What ``python -m aft_vision.run`` exits with (``raise SystemExit(main())``), called here in this process."""
    from aft_vision.run import main as run_main

    assert run_main([str(tmp_path / 'nope.py')]) == 2
    captured = capsys.readouterr()
    assert captured.err == f'aft_vision.run: error: script not found: {tmp_path / "nope.py"}\n' and not captured.out


SPARSITY_SCRIPT = """
import torch, timm
from timm.task import ClassificationTask
from aft_vision.tasks.regularizers import position_bias_entropy
model = timm.create_model('aft_conv_test', num_classes=3)
task = ClassificationTask(model, criterion=torch.nn.CrossEntropyLoss())
images, target = torch.randn(2, 3, 32, 32), torch.tensor([0, 2])
extra = task(images, target)['loss'] - torch.nn.functional.cross_entropy(model(images), target)
print(round(float(extra / position_bias_entropy(model)), 6))
"""


def test_device_modules_aft_vision_registers_the_models_and_the_launcher_adds_the_sparsity_term(tmp_path):
    """timm ``train.py --device-modules aft_vision`` imports the package by name: in a fresh process, where timm alone
    knows no AFT model, that registers them and leaves timm's task as it is. ``python -m aft_vision.run --aft-sparsity
    0.25 SCRIPT`` makes timm's task add 0.25 x the Eq. 9 entropy while SCRIPT runs."""
    code = ("import importlib, timm; from timm.task import ClassificationTask; forward = ClassificationTask.forward\n"
            "print(timm.is_model('aft_conv_test')); importlib.import_module('aft_vision')\n"
            "print(timm.is_model('aft_conv_test'), ClassificationTask.forward is forward)")
    done = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines() == ['False', 'True True']
    script = tmp_path / 'sparse.py'
    script.write_text(SPARSITY_SCRIPT)
    for launcher, weight in ((['-m', 'aft_vision.run', '--aft-sparsity', '0.25'], '0.25'),
                             (['-m', 'aft_vision.run'], '0.0')):
        done = subprocess.run([sys.executable, *launcher, str(script)], capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        assert done.stdout.split() == [weight]


@pytest.mark.parametrize('value', [[], ['x'], ['-1'], ['nan']])
def test_a_bad_sparsity_weight_is_a_one_line_error(value, tmp_path, capsys):
    from aft_vision.run import main as run_main

    assert run_main(['--aft-sparsity', *value, str(tmp_path / 'nope.py')]) == 2
    err = capsys.readouterr().err
    assert err.startswith('aft_vision.run: error: --aft-sparsity takes a weight >= 0') and err.count('\n') == 1
