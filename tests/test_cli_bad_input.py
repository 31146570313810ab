"""Bad input across every ``aft-vision`` subcommand, by class rather than by case.

Each class generates its cases from the parser and a table: out-of-range numbers, missing or unwritable paths, damaged
weights, unknown or non-AFT models, ``--model-kwargs`` that do not parse or build, outputs that exist, contradictory
options, train / val folders that disagree, the Hub offline, usage errors. Every case must end in exit code 2, one line
on stderr, no traceback, no network connection, and the working folder (holding a file of the user's) exactly as it
was. Further down: the
same weights give the same answer by every loading path, ``--force`` replaces only what a command writes, a job that
fails leaves its folder as it was, a resumed study never relabels, and a property test feeds the parser generated
values. Generated inputs by class (image modes and EXIF tags, hostile text, odd data folders, interruptions) are in
``test_cli_inputs.py``.
"""
import argparse
import json
import socket
from pathlib import Path

import pytest
import timm
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image
from timm.models import save_for_hf

from aft_vision.checkpoints import load_weights, save_weights
from aft_vision.cli import build_parser
from aft_vision.cli import main as cli_main
from aft_vision.cli.args import LIMITS, check_args
from aft_vision.tasks import classify, study

SUBCOMMANDS = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices
RUNS_A_MODEL = ('predict', 'export', 'show-bias', 'show-keys')


@pytest.fixture(scope='module')
def world(tmp_path_factory):
    """The inputs every case draws on (``inputs/``) and a valid command line per subcommand writing under ``out/``."""
    root = tmp_path_factory.mktemp('bad-input')
    inputs = root / 'inputs'
    inputs.mkdir()
    model = timm.create_model('aft_conv_test', num_classes=3)
    save_weights(model.state_dict(), inputs / 'w.safetensors')
    Image.new('RGB', (64, 64)).save(inputs / 'img.png')
    (inputs / 'a-file').write_text('not a folder')
    (inputs / 'damaged.safetensors').write_bytes(b'\x10\x00\x00\x00\x00\x00\x00\x00{"a": garbage')
    (inputs / 'damaged.pth').write_bytes(b'PK\x03\x04 truncated zip')
    save_for_hf(model, str(inputs / 'folder'), safe_serialization=True)
    save_for_hf(model, str(inputs / 'broken-folder'), safe_serialization=True)
    (inputs / 'broken-folder' / 'model.safetensors').write_bytes(b'\x00' * 40)
    for split, classes in (('train', 'abc'), ('val', 'abd')):
        for name in classes:
            (inputs / 'mismatch' / split / name).mkdir(parents=True)
    (inputs / 'no-val' / 'train' / 'a').mkdir(parents=True)
    return inputs


def _valid(inputs: Path, out: Path):
    checkpoint, image = str(inputs / 'w.safetensors'), str(inputs / 'img.png')
    return {
        'demo': [],
        'transfer': ['--src', 'deit_tiny_patch16_224', '--model', 'aft_conv_tiny', '--out', str(out / 'o.safetensors')],
        'publish': [checkpoint, '--model', 'aft_conv_test', '--repo-id', 'me/x', '--dry-run',
                    '--out-dir', str(out / 'folder')],
        'bench': ['--quick', '--out-dir', str(out / 'bench')],
        'train': ['--out-dir', str(out / 'run')],
        'study': ['--out-dir', str(out / 'study')],
        'predict': [image, '--model', 'aft_conv_test', '--checkpoint', checkpoint],
        'export': ['--model', 'aft_conv_test', '--checkpoint', checkpoint, '--out', str(out / 'm.onnx')],
        'show-bias': ['--model', 'aft_conv_test', '--checkpoint', checkpoint, '--out', str(out / 'b.png')],
        'show-keys': [image, '--model', 'aft_conv_test', '--checkpoint', checkpoint, '--out', str(out / 'k.png')],
    }


def _numbers():
    """Every int / float option of every subcommand with each value its limits refuse."""
    for command, parser in SUBCOMMANDS.items():
        for action in parser._actions:
            if action.type not in (int, float):
                continue
            low, high, open_low = LIMITS[action.dest]
            values = ([] if low is None else [low if open_low else low - 1]) + ([] if high is None else [high + 1])
            values = [str(action.type(v)) for v in values] + (['nan', 'inf'] if action.type is float else [])
            values += ['x']  # not a number at all
            for value in values:
                yield 'numbers', command, [action.option_strings[0], *[value] * (2 if action.nargs == 2 else 1)]


MODEL_COMMANDS = ('predict', 'export', 'show-bias', 'show-keys', 'transfer', 'train', 'publish')
KWARGS_COMMANDS = ('predict', 'export', 'show-bias', 'show-keys', 'transfer', 'train', 'publish')
OUT_FILE = {'transfer': 'o.safetensors', 'export': 'm.onnx', 'show-bias': 'b.png', 'show-keys': 'k.png'}
OUT_DIR = {'publish': 'folder', 'bench': 'bench', 'train': 'run'}

TABLE = [
    # missing files and folders
    *[('paths', c, ['--checkpoint', '{i}/missing.safetensors']) for c in RUNS_A_MODEL],
    ('paths', 'predict', ['{i}/missing.png']), ('paths', 'show-keys', ['{i}/missing.png']),
    ('paths', 'publish', ['--labels', '{i}/missing.txt']), ('paths', 'publish', ['--results', '{i}/missing.json']),
    ('paths', 'transfer', ['--src', '{i}/missing.pth']), ('paths', 'train', ['--init-from', '{i}/missing.pth']),
    ('paths', 'train', ['--data-dir', '{i}/missing']), ('paths', 'train', ['--data-dir', '{i}/no-val']),
    *[('paths', c, ['--model', 'local-dir:{i}/missing']) for c in RUNS_A_MODEL + ('publish',)],
    *[('paths', c, ['--out-dir', '{i}/a-file']) for c in ('train', 'bench', 'publish', 'study')],
    *[('paths', c, ['--out-dir', '{i}/a-file/below']) for c in ('train', 'bench', 'publish', 'study')],
    *[('paths', c, ['--out', '{i}/a-file/below' + Path(f).suffix]) for c, f in OUT_FILE.items()],
    ('paths', 'export', ['--int8', '--calibration', '{i}/missing']),
    # damaged weights, by every path that reads them
    *[('damaged', c, ['--checkpoint', '{i}/damaged.safetensors']) for c in RUNS_A_MODEL],
    *[('damaged', c, ['--checkpoint', '{i}/damaged.pth']) for c in RUNS_A_MODEL],
    *[('damaged', c, ['--model', 'local-dir:{i}/broken-folder', '--checkpoint', None]) for c in RUNS_A_MODEL],
    ('damaged', 'train', ['--model', 'local-dir:{i}/broken-folder', '--pretrained']),
    ('damaged', 'train', ['--init-from', '{i}/damaged.safetensors']),
    ('damaged', 'train', ['--init-from', '{i}/damaged.pth']),
    ('damaged', 'transfer', ['--src', '{i}/damaged.safetensors']),
    ('damaged', 'transfer', ['--src', '{i}/damaged.pth']),
    ('damaged', 'publish', ['{i}/damaged.safetensors']), ('damaged', 'publish', ['{i}/damaged.pth']),
    ('damaged', 'train', ['--init-from', '{i}/w.safetensors', '--model-kwargs', 'embed_dim=48']),  # does not fit
    # unknown, mistyped, untagged or non-AFT models
    *[('models', c, ['--model', m]) for c in MODEL_COMMANDS for m in ('aft_conv_tset', 'aft_conv_test.nope')],
    *[('models', c, ['--model', 'resnet18']) for c in RUNS_A_MODEL + ('transfer',)],
    *[('models', c, ['--model', 'aft_conv_small', '--pretrained', '--checkpoint', None])
      for c in ('export', 'show-bias', 'show-keys', 'train')],  # no weights under the tag
    ('models', 'bench', ['--models', 'aft_conv_tinyy']), ('models', 'transfer', ['--src', 'not_a_timm_model']),
    ('models', 'study', ['--baseline', 'vit_tinyy']),
    # --model-kwargs that do not parse or do not build
    *[('kwargs', c, ['--model-kwargs', k]) for c in KWARGS_COMMANDS
      for k in ('patch_size', '=4', 'patch_size=0', 'foo=1', 'embed_dim=-8')],
    # outputs that exist: refused without --force, the user's file untouched
    *[('exists', c, ['EXISTS']) for c in list(OUT_FILE) + list(OUT_DIR)],
    # contradictory options
    ('contradictions', 'bench', ['--models', 'aft_conv_tiny']), ('contradictions', 'bench', ['--resolutions', '32']),
    ('contradictions', 'bench', ['--readme']), ('contradictions', 'bench', ['--repeats', '3']),
    ('contradictions', 'bench', ['--compile', '--runtime', 'onnxruntime']),
    ('contradictions', 'export', ['--int8']), ('contradictions', 'export', ['--calibration', 'digits']),
    ('contradictions', 'train', ['--pretrained', '--init-from', '{i}/w.safetensors']),
    *[('contradictions', c, ['--pretrained']) for c in RUNS_A_MODEL],  # --checkpoint and --pretrained
    ('contradictions', 'train', ['--task', 'segment', '--data-dir', '{i}/mismatch']),
    # data: train / val classes that disagree
    ('data', 'train', ['--data-dir', '{i}/mismatch']),
    ('data', 'train', ['--data-dir', '{i}/mismatch', '--model', 'vit_tiny_patch16_224']),
    # the Hub offline: one line, fast
    *[('hub', c, ['--model', 'hf-hub:aft-vision/not-cached', '--checkpoint', None]) for c in RUNS_A_MODEL],
    ('hub', 'train', ['--model', 'hf-hub:aft-vision/not-cached', '--pretrained']),
    ('hub', 'publish', ['--model', 'hf-hub:aft-vision/not-cached']),
    # usage errors
    *[('usage', c, ['--no-such-option']) for c in SUBCOMMANDS],
    *[('usage', c, ['--out-dir']) for c in ('train', 'bench', 'publish', 'study')],
    *[('usage', c, ['--model']) for c in MODEL_COMMANDS],
]
CASES = list(_numbers()) + TABLE


def _snapshot(folder: Path):
    return {str(p.relative_to(folder)): (p.read_bytes() if p.is_file() else None) for p in sorted(folder.rglob('*'))}


def _argv(command, extra, inputs, out):
    """The valid command line with ``extra`` applied: an option given twice takes the later value; ``None`` after an
    option removes it (and its value) from the valid line; ``EXISTS`` makes the command's output exist."""
    argv = _valid(inputs, out)[command]
    extra = [e.replace('{i}', str(inputs)) if isinstance(e, str) else e for e in extra]
    for option, value in zip(extra, extra[1:]):
        if value is None and option in argv:
            index = argv.index(option)
            del argv[index:index + 2]
    return argv + [e for e in extra if e is not None and e != 'EXISTS']


@pytest.fixture
def connections(monkeypatch):
    """The network addresses a connection is attempted to (Unix sockets aside); each attempt is refused."""
    attempted = []
    connect = socket.socket.connect

    def refuse(sock, address):
        if sock.family not in (socket.AF_INET, socket.AF_INET6):
            return connect(sock, address)
        attempted.append(address)
        raise ConnectionRefusedError(f'no network in this test: {address}')

    monkeypatch.setattr(socket.socket, 'connect', refuse)
    return attempted


@pytest.mark.parametrize('kind, command, extra', CASES, ids=[f'{k}-{c}-{i}' for i, (k, c, _) in enumerate(CASES)])
def test_bad_input_is_one_line_exit_2_and_nothing_written_or_lost(kind, command, extra, world, tmp_path, capsys,
                                                                  monkeypatch, connections):
    out = tmp_path / 'out'
    out.mkdir()
    monkeypatch.chdir(out)
    monkeypatch.setenv('HF_HUB_OFFLINE', '1')
    import huggingface_hub.constants
    monkeypatch.setattr(huggingface_hub.constants, 'HF_HUB_OFFLINE', True)
    monkeypatch.setattr(huggingface_hub.constants, 'HF_HUB_CACHE', str(tmp_path / 'empty-cache'))
    (out / 'mine.txt').write_text('the user\'s')
    if 'EXISTS' in extra:
        target = out / (OUT_FILE.get(command) or OUT_DIR[command])
        target.write_bytes(b'keep') if command in OUT_FILE else (target.mkdir(), (target / 'keep').write_text('x'))
    before = _snapshot(out)
    argv = [command, *_argv(command, extra, world, out)]
    assert cli_main(argv) == 2, argv
    err = capsys.readouterr().err.strip()
    assert err and '\n' not in err and 'Traceback' not in err, (argv, err)
    assert err.startswith('aft-vision'), err
    assert _snapshot(out) == before, argv
    assert connections == [], argv  # the Hub offline is answered from the cache: no connection, so no retries


# ---------------------------------------------------------------------------------------------------------------------
# One rule for random weights; the same answer by every loading path.
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize('command', RUNS_A_MODEL)
def test_a_bare_name_runs_with_random_weights_and_says_so(command, world, tmp_path, capsys):
    argv = [a for a in _valid(world, tmp_path)[command]]
    del argv[argv.index('--checkpoint'):argv.index('--checkpoint') + 2]
    assert cli_main([command, *argv]) == 0
    err = capsys.readouterr().err
    assert 'warning: aft_conv_test has random weights' in err


def test_a_checkpoint_and_its_published_folder_give_the_same_answer(digits_job, capsys):
    """``--checkpoint RUN/model.safetensors`` reads the run record beside it as ``publish`` does: the same model, the
    same preprocessing, the same probabilities as ``local-dir:RUN/hub``, with no --model-kwargs."""
    images = sorted((digits_job.out / 'data' / 'val').rglob('*.png'))[::60][:6]
    answers = []
    for source in (['--model', 'aft_conv_test', '--checkpoint', str(digits_job.out / 'model.safetensors')],
                   ['--model', f'local-dir:{digits_job.out / "hub"}']):
        assert cli_main(['predict', *map(str, images), *source, '--topk', '3']) == 0
        answers.append(capsys.readouterr().out)
    assert answers[0] == answers[1] and answers[0].count('\n') == len(images)


# ---------------------------------------------------------------------------------------------------------------------
# --force replaces only what a command writes; a job that fails leaves its folder as it was; a study never relabels.
# ---------------------------------------------------------------------------------------------------------------------


def test_publish_force_into_a_run_folder_keeps_the_run(world, tmp_path, capsys):
    run = tmp_path / 'run'
    (run / 'data' / 'val').mkdir(parents=True)
    (run / 'results.json').write_text('{"top1": 1}')
    (run / 'data' / 'val' / '0.png').write_bytes(b'png')
    checkpoint = run / 'model.safetensors'
    checkpoint.write_bytes((world / 'w.safetensors').read_bytes())
    kept = _snapshot(run)
    argv = ['publish', str(checkpoint), '--model', 'aft_conv_test', '--repo-id', 'me/x', '--dry-run', '--out-dir',
            str(run)]
    assert cli_main(argv) == 2 and 'pass --force' in capsys.readouterr().err
    assert cli_main(argv + ['--force']) == 0
    after = _snapshot(run)
    assert all(after[name] == content for name, content in kept.items() if name != 'model.safetensors')
    assert {'config.json', 'README.md'} <= set(after)  # what publish writes; model.safetensors the same tensors:
    assert load_weights(checkpoint).keys() == load_weights(world / 'w.safetensors').keys()


def test_train_into_a_folder_with_force_replaces_only_its_outputs_and_a_failure_restores_them(tmp_path, monkeypatch,
                                                                                              one_thread):
    data = tmp_path / 'data'
    for split in ('train', 'val'):
        for label in range(2):
            (data / split / str(label)).mkdir(parents=True)
            for i in range(4):
                Image.new('RGB', (32, 32), (120 * label, 0, 0)).save(data / split / str(label) / f'{i}.png')
    run = tmp_path / 'run'
    run.mkdir()
    (run / 'notes.txt').write_text('mine')
    (run / 'model.safetensors').write_bytes(b'old weights')
    tiny = ['--data-dir', str(data), '--epochs', '1', '--batch-size', '4', '--out-dir', str(run),
            '--model-kwargs', 'patch_size=8', 'embed_dim=16', 'depth=1', 'num_heads=2', 'kernel_size=3']
    assert cli_main(['train', *tiny]) == 2  # exists, no --force: refused before training
    before = _snapshot(run)
    monkeypatch.setattr(classify, 'plot_curves', lambda *a: (_ for _ in ()).throw(RuntimeError('disk full')))
    assert cli_main(['train', *tiny, '--force']) == 2  # fails after training: the folder as it was
    assert _snapshot(run) == before
    monkeypatch.undo()
    assert cli_main(['train', *tiny, '--force']) == 0
    assert (run / 'notes.txt').read_text() == 'mine' and (run / 'model.safetensors').read_bytes() != b'old weights'
    assert {'results.json', 'hub'} <= {p.name for p in run.iterdir()}


def test_a_resumed_study_with_another_baseline_refuses_to_relabel(tmp_path, capsys):
    old = study.StudySettings(parts=('transfer',), seeds=1, epochs=3)
    vit_run = next(run for run in study.plan_runs(old) if run.config.key == 'vit')
    runs = tmp_path / 'study' / 'runs'
    runs.mkdir(parents=True)
    record = {'id': vit_run.id, 'config': json.loads(json.dumps(vars(vit_run.config))), 'recipe': old.recipe()}
    (runs / f'{vit_run.id}.json').write_text(json.dumps(record))
    before = _snapshot(tmp_path)
    assert cli_main(['study', '--parts', 'transfer', '--seeds', '1', '--epochs', '3', '--baseline',
                     'vit_small_patch16_224', '--out-dir', str(tmp_path / 'study')]) == 2
    err = capsys.readouterr().err.strip()
    assert '\n' not in err and 'vit_small_patch16_224' in err and 'another --out-dir' in err
    assert _snapshot(tmp_path) == before


# ---------------------------------------------------------------------------------------------------------------------
# The parser fed generated values: a namespace and a verdict, or a usage error; never an exception.
# ---------------------------------------------------------------------------------------------------------------------


def _option_values():
    values = st.one_of(st.text(max_size=12), st.integers(-10 ** 6, 10 ** 6).map(str),
                       st.floats(allow_nan=True, allow_infinity=True).map(str), st.just('patch_size'),
                       st.just('a=b=c'), st.just('-1'))
    options = [(command, action.option_strings[0], action.nargs)
               for command, parser in SUBCOMMANDS.items() for action in parser._actions
               if action.option_strings and action.nargs != 0 and action.option_strings[0] != '--help']
    return st.tuples(st.sampled_from(options), st.lists(values, min_size=1, max_size=3))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=_option_values())
def test_generated_option_values_parse_or_are_refused_in_one_line(case, world, capsys):
    (command, option, _), values = case
    out = world.parent / 'generated'
    argv = [command, *_valid(world, out)[command], option, *values]
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as error:
        assert error.code == 2
        err = capsys.readouterr().err.strip()
        assert '\n' not in err and 'Traceback' not in err, err
        return
    problem = check_args(args)
    assert problem is None or ('\n' not in problem and problem.startswith(('-', 'image', 'checkpoint'))), problem
    assert not out.exists()
