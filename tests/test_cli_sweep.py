"""Bad input across every ``aft-vision`` subcommand, by class rather than by case (issue 40's sweep).

Each class generates its cases from the parser and a table: out-of-range numbers, missing or unwritable paths, damaged
weights, unknown or non-AFT models, ``--model-kwargs`` that do not parse or build, outputs that exist, contradictory
options, train / val folders that disagree, the Hub offline, usage errors. Every case must end in exit code 2, one line
on stderr, no traceback, and the working folder (holding a file of the user's) exactly as it was. Further down: the
same weights give the same answer by every loading path, ``--force`` replaces only what a command writes, a job that
fails leaves its folder as it was, a resumed study never relabels, and a property test feeds the parser generated
values. ``python -m pytest tests/test_cli_sweep.py -q -n 0`` runs it; ``SWEEP_REPORT=1`` prints the case counts.
"""
import argparse
import collections
import json
import os
import signal
import time
import zlib
from pathlib import Path
from typing import Dict, List

import numpy as np
import pytest
import timm
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from PIL import Image, ImageOps
from timm.models import save_for_hf

from aft_vision.checkpoints import load_weights, save_weights
from aft_vision.cli import build_parser
from aft_vision.cli import main as cli_main
from aft_vision.cli.args import LIMITS, check_args, one_line
from aft_vision.tasks import classify, study

SUBCOMMANDS = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices
RUNS_A_MODEL = ('predict', 'export', 'show-bias', 'show-keys')


@pytest.fixture(scope='module')
def world(tmp_path_factory):
    """The inputs every case draws on (``inputs/``) and a valid command line per subcommand writing under ``out/``."""
    root = tmp_path_factory.mktemp('sweep')
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


@pytest.mark.parametrize('kind, command, extra', CASES, ids=[f'{k}-{c}-{i}' for i, (k, c, _) in enumerate(CASES)])
def test_bad_input_is_one_line_exit_2_and_nothing_written_or_lost(kind, command, extra, world, tmp_path, capsys,
                                                                  monkeypatch):
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
    start = time.perf_counter()
    assert cli_main(argv) == 2, argv
    err = capsys.readouterr().err.strip()
    assert err and '\n' not in err and 'Traceback' not in err, (argv, err)
    assert err.startswith('aft-vision'), err
    assert _snapshot(out) == before, argv
    assert time.perf_counter() - start < 20, argv  # the Hub offline included: seconds, not a minute of retries


def test_the_sweep_covers_every_subcommand_and_class():
    per_command = collections.Counter(command for _, command, _ in CASES)
    per_class = collections.Counter(kind for kind, _, _ in CASES)
    if os.environ.get('SWEEP_REPORT'):
        print(f'\n{len(CASES)} cases; per subcommand {dict(per_command)}; per class {dict(per_class)}')
    assert set(per_command) == set(SUBCOMMANDS) and len(CASES) >= 200


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


# ---------------------------------------------------------------------------------------------------------------------
# Generated inputs by class (issue 48): image modes and EXIF tags, hostile text, odd data folders, interrupts. Each case
# keeps its class's rule: the exit code, one line per result or one line of refusal, no traceback, no raw control
# character printed, nothing changed on disk, and the right answer or a refusal naming the file or folder at fault.
# ---------------------------------------------------------------------------------------------------------------------

# what ImageOps.exif_transpose undoes for each EXIF orientation: the stored pixels of an upright picture so tagged
STORED_AS = {2: Image.Transpose.FLIP_LEFT_RIGHT, 3: Image.Transpose.ROTATE_180, 4: Image.Transpose.FLIP_TOP_BOTTOM,
             5: Image.Transpose.TRANSPOSE, 6: Image.Transpose.ROTATE_90, 7: Image.Transpose.TRANSVERSE,
             8: Image.Transpose.ROTATE_270}
HOSTILE = ('new\nline: 9 0.999', '\x1b[31mred\x1b[0m', 'carriage\rreturn', 'bidi\u202egnp.exe', 'tab\there', 'bell\a')


def _printable(text: str) -> bool:
    return all(c.isprintable() or c == '\n' for c in text)


def _copies(picture: Image.Image, folder: Path, stem: str) -> List[Path]:
    """``picture`` (gray, as the digits are) written in every way a viewer shows it unchanged: other modes and bit
    depths at their full scale, EXIF-rotated or mirrored pixels with the tag that puts them upright, the first frame
    of an animation."""
    gray = np.asarray(picture.convert('L'))
    wide = np.rint(gray.astype(np.float64) * ((2 ** 31 - 1) / 255)).astype(np.int32)
    copies = {'L.png': Image.fromarray(gray), 'I16.png': Image.fromarray(gray.astype(np.uint16) * 257),
              'I32.tif': Image.fromarray(gray.astype(np.int32) * 257), 'I32full.tif': Image.fromarray(wide),
              'F.tif': Image.fromarray(gray.astype(np.float32) / 255), 'P.png': picture.quantize(256),
              'LA.png': picture.convert('LA'), 'RGBA.png': picture.convert('RGBA'), 'CMYK.tif': picture.convert('CMYK')}
    paths = []
    for name, image in copies.items():
        paths.append(folder / f'{stem}-{name}')
        image.save(paths[-1])
    for orientation, stored in STORED_AS.items():
        exif = Image.Exif()
        exif[0x0112] = orientation
        paths.append(folder / f'{stem}-exif{orientation}.png')
        picture.transpose(stored).save(paths[-1], exif=exif)
    paths.append(folder / f'{stem}-animated.gif')
    picture.save(paths[-1], save_all=True, append_images=[ImageOps.invert(picture)], duration=100, loop=0)
    return paths


def test_every_mode_bit_depth_orientation_and_first_frame_gives_the_upright_pictures_answer(digits_job, tmp_path,
                                                                                            capsys):
    pictures = sorted((digits_job.out / 'data' / 'val').rglob('*.png'))[::90][:4]
    argv, expected = [], {}
    for picture in pictures:
        copies = _copies(Image.open(picture), tmp_path, picture.stem)
        argv += [str(picture), *map(str, copies)]
        expected.update({str(copy): str(picture) for copy in copies})
    before = _snapshot(tmp_path)
    assert cli_main(['predict', *argv, '--model', f'local-dir:{digits_job.out / "hub"}', '--json']) == 0
    answers = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [answer['file'] for answer in answers] == argv  # one line per image, in order
    top = {answer['file']: answer['top'] for answer in answers}
    assert all(top[copy] == top[picture] for copy, picture in expected.items()), [
        (copy, top[copy][0], top[picture][0]) for copy, picture in expected.items() if top[copy] != top[picture]]
    assert _snapshot(tmp_path) == before


def _odd_images(folder: Path) -> Dict[str, Path]:
    """Files that are not a readable picture, each under a name a terminal would act on."""
    folder.mkdir()
    odd = {'text': folder / 'notes\x1b[2J.png', 'truncated': folder / 'cut\n.png', 'empty': folder / 'empty\r.jpg',
           'bomb': folder / 'bomb\u202e.png', 'negative': folder / 'negative.tif', 'missing': folder / 'gone\n.png'}
    odd['text'].write_text('not an image')
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (32, 32, 3), np.uint8)).save(folder / 'whole.png')
    odd['truncated'].write_bytes((folder / 'whole.png').read_bytes()[:1000])  # of about 3 kB
    odd['empty'].write_bytes(b'')
    header = b'\x89PNG\r\n\x1a\n'
    ihdr = b'IHDR' + (30000).to_bytes(4, 'big') * 2 + bytes([8, 0, 0, 0, 0])  # 30000 x 30000 gray, no data
    odd['bomb'].write_bytes(header + len(ihdr[4:]).to_bytes(4, 'big') + ihdr + zlib.crc32(ihdr).to_bytes(4, 'big'))
    Image.fromarray(np.full((8, 8), -5, np.int32)).save(odd['negative'])
    (folder / 'whole.png').unlink()
    return odd


@pytest.mark.parametrize('kind', ['text', 'truncated', 'empty', 'bomb', 'negative', 'missing'])
def test_what_is_not_a_picture_is_refused_in_one_line_naming_the_file(kind, world, tmp_path, capsys):
    from aft_vision.images import read_image

    odd = _odd_images(tmp_path / 'odd')[kind]
    with pytest.raises((ValueError, FileNotFoundError)) as refused:
        read_image(odd)
    assert str(refused.value).startswith(f'{odd}:') and '\n' not in str(refused.value).replace(str(odd), '')
    model = _valid(world, tmp_path)['predict'][1:]
    before = _snapshot(tmp_path)
    assert cli_main(['predict', str(odd), str(world / 'img.png'), *model]) == 0  # skipped beside a good image
    out, err = capsys.readouterr()
    skipped = [line for line in err.splitlines() if 'skipped' in line]
    assert _printable(out + err) and len(out.splitlines()) == 1 and len(skipped) == 1
    assert skipped[0].startswith(f'aft-vision: skipped {one_line(odd)}: '), skipped
    assert cli_main(['predict', str(odd), str(world / 'img.png'), *model, '--json']) == 0
    out, err = capsys.readouterr()
    answers = [json.loads(line) for line in out.splitlines()]
    assert _printable(out + err) and len(answers) == 2 and 'top' in answers[1]
    assert answers[0]['file'] == str(odd) and answers[0]['error'].startswith(f'{odd}:')
    assert cli_main(['predict', str(odd), *model]) == 2  # alone: the command fails, naming it
    err = capsys.readouterr().err
    assert _printable(err) and err.splitlines()[-1].startswith('aft-vision: error: no image could be read (')
    assert one_line(odd) in err.splitlines()[-1] and 'Traceback' not in err
    assert _snapshot(tmp_path) == before


@pytest.mark.parametrize('as_json', [False, True])
def test_hostile_file_names_and_labels_are_printed_as_data_one_line_per_image(as_json, tmp_path, capsys):
    save_for_hf(timm.create_model('aft_conv_test', num_classes=len(HOSTILE)), str(tmp_path / 'hub'),
                model_config={'label_names': list(HOSTILE)}, safe_serialization=True)
    images = []
    for i, name in enumerate(HOSTILE):
        images.append(str(tmp_path / f'{name}.png'))
        Image.new('RGB', (40, 40), (40 * i, 90, 200)).save(images[-1])
    before = _snapshot(tmp_path)
    code = cli_main(['predict', *images, '--model', f'local-dir:{tmp_path / "hub"}', '--topk', str(len(HOSTILE)),
                     *(['--json'] if as_json else [])])
    out, err = capsys.readouterr()
    assert _printable(out + err) and 'Traceback' not in err and _snapshot(tmp_path) == before
    if code == 2:  # label names a loader may refuse: then in one line, naming them
        assert err.count('\n') == 1 and 'label' in err, err
        return
    assert code == 0 and len(out.splitlines()) == len(images), out
    for line, image in zip(out.splitlines(), images):
        if as_json:
            answer = json.loads(line)
            assert answer['file'] == image and {top['label'] for top in answer['top']} == set(HOSTILE)
        else:
            assert line.startswith(f'{one_line(Path(image).name)}: ')
            assert all(f'{one_line(label)} 0.' in line for label in HOSTILE), line


def _folders(root: Path, layout: Dict[str, List[str]], images: int = 3) -> Path:
    """An ImageFolder: for each split its class folders, each with ``images`` small PNGs of its own shade."""
    for split, classes in layout.items():
        for label, name in enumerate(classes):
            (root / split / name).mkdir(parents=True)
            for i in range(images):
                Image.new('RGB', (32, 32), (60 * label, 20 * i, 0)).save(root / split / name / f'{i}.png')
    return root


def _odd_data(kind: str, root: Path) -> Path:
    """A data folder of ``kind`` (``ODD_DATA``); returns the path the refusal must name."""
    two = {'train': ['a', 'b'], 'val': ['a', 'b']}
    if kind == 'one class':
        return _folders(root, {'train': ['a'], 'val': ['a']}) / 'train'
    if kind == 'hostile class names':
        return _folders(root, {'train': ['a\x1b[2J', 'b'], 'val': ['a\x1b[2J', 'c\n']})
    _folders(root, two)
    if kind == 'file link out':
        (root / 'train' / 'a' / 'x.png').symlink_to(root / 'train' / 'b' / '0.png')
        return root / 'train' / 'a' / 'x.png'
    if kind == 'folder link out':
        (root / 'val' / 'b' / 'more').symlink_to(root / 'train' / 'a', target_is_directory=True)
        return root / 'val' / 'b' / 'more'
    if kind == 'not an image':
        (root / 'train' / 'b' / 'notes\n.png').write_text('text')
        return root / 'train' / 'b' / 'notes\n.png'
    assert kind == 'empty class'
    for image in (root / 'train' / 'b').iterdir():
        image.unlink()
    return root / 'train'


ODD_DATA = ('one class', 'hostile class names', 'file link out', 'folder link out', 'not an image', 'empty class')
TINY_RUN = ['--epochs', '1', '--batch-size', '4', '--eval-img-sizes', '32', '--model-kwargs', 'patch_size=8',
            'embed_dim=16', 'depth=1', 'num_heads=2', 'kernel_size=3']


@pytest.mark.parametrize('kind', ODD_DATA)
def test_odd_data_folders_are_refused_in_one_line_naming_them(kind, tmp_path, capsys, one_thread):
    named = _odd_data(kind, tmp_path / 'data')
    before = _snapshot(tmp_path)
    assert cli_main(['train', '--data-dir', str(tmp_path / 'data'), '--out-dir', str(tmp_path / 'run'), *TINY_RUN]) == 2
    err = capsys.readouterr().err
    assert err.count('\n') == 1 and _printable(err) and 'Traceback' not in err, err
    assert one_line(named) in err, (named, err)
    assert _snapshot(tmp_path) == before


def test_a_digits_folder_left_in_out_dir_is_reused_only_if_it_is_the_digits_and_said_so(tmp_path, capsys):
    pytest.importorskip('sklearn')
    from aft_vision.tasks.training import write_digits

    data = write_digits(tmp_path / 'data')
    assert len(list(data.rglob('*.png'))) == 1797 and not capsys.readouterr().out
    assert write_digits(data) == data and 'reusing the digits' in capsys.readouterr().out
    for image in (data / 'train' / '3').iterdir():  # a class emptied: no longer the digits
        image.unlink()
    before = _snapshot(tmp_path)
    with pytest.raises(ValueError, match='is not the digits data set'):
        write_digits(data)
    assert _snapshot(tmp_path) == before


@pytest.mark.parametrize('stop', [signal.SIGINT, signal.SIGTERM])
def test_a_stopped_train_ends_in_one_line_with_the_earlier_run_back_in_place(stop, tmp_path, monkeypatch, capsys,
                                                                             one_thread):
    """Ctrl-C or SIGTERM (here sent by the job to itself as it plots): exit 128 + the signal, one line, and the folder
    as it was, nothing hidden left in it."""
    _folders(tmp_path / 'data', {'train': ['a', 'b'], 'val': ['a', 'b']})
    run = tmp_path / 'run'
    (run / 'hub').mkdir(parents=True)
    (run / 'hub' / 'config.json').write_text('{"earlier": true}')
    (run / 'model.safetensors').write_bytes(b'earlier weights')
    (run / 'notes.txt').write_text('mine')
    before = _snapshot(tmp_path)
    monkeypatch.setattr(classify, 'plot_curves', lambda *args: os.kill(os.getpid(), stop))
    argv = ['train', '--data-dir', str(tmp_path / 'data'), '--out-dir', str(run), '--force', *TINY_RUN]
    assert cli_main(argv) == 128 + stop
    err = capsys.readouterr().err
    assert err.count('\n') == 1 and f'stopped by {stop.name}' in err and 'Traceback' not in err, err
    assert _snapshot(tmp_path) == before
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the handlers given back


EXACT_MODES = ('L', 'LA', 'RGB', 'RGBA', 'CMYK', 'I;16', 'I', 'F')  # modes that hold an 8-bit gray picture unchanged
WIDE = {'I;16': lambda gray: gray.astype(np.uint16) * 257, 'F': lambda gray: gray.astype(np.float32) / 255,
        'I': lambda gray: np.rint(gray * ((2 ** 31 - 1) / 255)).astype(np.int32)}  # full 16 bits, [0, 1], 31 bits


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(mode=st.sampled_from(('1', 'P', 'PA', 'YCbCr', 'HSV') + EXACT_MODES), fmt=st.sampled_from(('png', 'tif', 'gif')),
       size=st.tuples(st.integers(1, 24), st.integers(1, 24)), orientation=st.integers(1, 8), seed=st.integers(0, 99))
def test_generated_images_read_upright_as_rgb_at_full_scale(mode, fmt, size, orientation, seed, tmp_path):
    """A random gray picture in a random mode, format and EXIF orientation: ``read_image`` gives it upright as RGB, and
    exactly for the modes that hold it; or a one-line ValueError naming the file. Never another exception."""
    from aft_vision.images import read_image

    gray = np.random.default_rng(seed).integers(0, 256, size[::-1], dtype=np.uint8)  # (H, W)
    upright = Image.fromarray(gray).convert('RGB')
    # GIF holds no EXIF; Pillow 13 applies a TIFF's orientation itself as it loads, and garbles one-band images so
    orientation = orientation if fmt == 'png' else 1
    stored = upright.transpose(STORED_AS[orientation]) if orientation > 1 else upright
    pixels = np.asarray(stored.convert('L'))
    image = Image.fromarray(WIDE[mode](pixels)) if mode in WIDE else stored.convert(mode)
    exif = Image.Exif()
    exif[0x0112] = orientation
    path = tmp_path / f'{mode}-{orientation}.{fmt}'
    try:
        image.save(path, exif=exif)
        assume(Image.open(path).mode in (mode, 'I;16B') or mode not in EXACT_MODES)  # the format kept the mode
    except (OSError, ValueError, KeyError, TypeError):
        assume(False)  # a format that cannot hold the mode
    try:
        read = read_image(path)
    except ValueError as error:
        assert str(error).startswith(f'{path}:') and '\n' not in str(error)
        return
    assert read.mode == 'RGB' and read.size == upright.size, (read.mode, read.size, upright.size)
    if mode in EXACT_MODES:
        assert np.array_equal(np.asarray(read.convert('L')), gray), mode


@pytest.mark.parametrize('field, value', [('label_names', ['a']), ('label_names', 'abc'),
                                          ('label_names', [['a'], 'b', 'c']), ('interpolation', 'bogus'),
                                          ('input_size', [3, 33, 33])])
def test_predict_names_the_config_field_it_cannot_use(field, value, tmp_path, capsys):
    """An edited published folder: one line naming the folder and the field (or showing it), not a traceback or "no
    image could be read"."""
    folder = tmp_path / 'hub'
    save_for_hf(timm.create_model('aft_conv_test', num_classes=3), str(folder), safe_serialization=True)
    config = json.loads((folder / 'config.json').read_text())
    (config if field == 'label_names' else config['pretrained_cfg'])[field] = value
    (folder / 'config.json').write_text(json.dumps(config))
    Image.new('RGB', (40, 40)).save(tmp_path / 'img.png')
    before = _snapshot(tmp_path)
    assert cli_main(['predict', str(tmp_path / 'img.png'), '--model', f'local-dir:{folder}']) == 2
    err = capsys.readouterr().err
    assert err.count('\n') == 1 and 'Traceback' not in err and 'no image could be read' not in err, err
    assert (field in err or str(value[-1]) in err) and str(folder) in err, err
    assert _snapshot(tmp_path) == before
