"""Generated training-size cases, each held to the rule that the job reports what ran: a training size whose batch no
epoch can fill is refused before the first step (one line naming it, nothing written); every size option out of range is
refused before anything is written, in every family; the result line has no empty field, whatever the evaluation sizes;
what results.json, the card and the line say is what the steps drew."""
import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import aft_vision  # noqa: F401  registers the models
from aft_vision.cli import main as cli_main
from aft_vision.tasks.classify import ClassifySettings, check_model_and_sizes, report

TINY_MODEL = ['patch_size=8', 'embed_dim=32', 'depth=1', 'num_heads=4', 'kernel_size=3']  # --model-kwargs
TINY_KWARGS = dict(patch_size=8, embed_dim=32, depth=1, mlp_ratio=2.)  # any family
NUM_TRAIN = 18  # 3 classes x 6 images


@pytest.fixture(scope='module')
def data(tmp_path_factory) -> Path:
    """Per-class shades of noise as 32 x 32 PNGs: ``train/`` 6 per class, ``val/`` 2."""
    root = tmp_path_factory.mktemp('tiny')
    rng = np.random.default_rng(0)
    for split, count in (('train', NUM_TRAIN // 3), ('val', 2)):
        for label in range(3):
            (root / split / str(label)).mkdir(parents=True)
            for i in range(count):
                pixels = rng.normal(60 + 70 * label, 30, (32, 32, 3)).clip(0, 255).astype(np.uint8)
                Image.fromarray(pixels).save(root / split / str(label) / f'{i}.png')
    return root


def train(data: Path, out: Path, capsys, *args: str):
    """``aft-vision train`` on the tiny folder: exit code, stdout, stderr (one line and nothing written if refused)."""
    before = sorted(data.rglob('*'))
    code = cli_main(['train', '--data-dir', str(data), '--out-dir', str(out), '--model-kwargs', *TINY_MODEL,
                     '--epochs', '1', *args])
    printed = capsys.readouterr()
    assert 'Traceback' not in printed.err and sorted(data.rglob('*')) == before  # the data folder is not the job's
    if code:
        assert code == 2 and len(printed.err.strip().splitlines()) == 1, printed.err
        assert not out.exists()  # nothing written, no staging folder left
    return code, printed.out, printed.err


# ---------------------------------------------------------------------------------------------------------------------
# Sizes no epoch can draw (their batch exceeds the training images): refused before training, each named with its batch.
# ---------------------------------------------------------------------------------------------------------------------
UNDRAWABLE = [  # training sizes, their batch sizes, the sizes never drawn
    ([16, 24], [4, 50], [24]),
    ([16, 24], [50, 4], [16]),
    ([16, 24, 32], [4, 19, 100], [24, 32]),
    ([16, 24], [18, 19], [24]),
    ([24, 32], [4, 5000], [32]),  # a batch of 5000 never fits
]


@pytest.mark.parametrize('sizes, batches, never', UNDRAWABLE)
def test_a_size_never_drawn_is_refused_before_training(sizes, batches, never, data, tmp_path, capsys):
    code, printed, err = train(data, tmp_path / 'out', capsys, '--train-img-sizes', *map(str, sizes),
                               '--train-batch-sizes', *map(str, batches))
    assert code == 2 and 'epoch' not in printed  # no step ran
    named = re.findall(r'(\d+) px \(batches of (\d+)\)', err)
    assert named == [(str(size), str(batches[sizes.index(size)])) for size in never], err
    assert f'can never be drawn from {NUM_TRAIN} training images per process' in err


@pytest.mark.parametrize('sizes, batches, schedule', [
    ([16], [19], 'constant'), ([16, 24], [19, 19], 'constant'), ([16, 24], [50, 60], 'progressive'),
    ([16, 24], [19, 30], 'progressive')])
def test_no_batch_that_fits_is_one_line(sizes, batches, schedule, data, tmp_path, capsys):
    code, _, err = train(data, tmp_path / 'out', capsys, '--train-img-sizes', *map(str, sizes),
                         '--train-batch-sizes', *map(str, batches), '--train-size-schedule', schedule)
    assert code == 2 and ('No full scheduled batch fits the sampler' in err or 'can never be drawn' in err), err


# ---------------------------------------------------------------------------------------------------------------------
# Size options out of range, refused before anything is written, in every family (the API; the CLI's parser refuses
# them earlier).
# ---------------------------------------------------------------------------------------------------------------------
OUT_OF_RANGE = [  # settings, what the refusal says
    (dict(base_img_size=-64), 'Expected a positive base_img_size, got -64.'),
    (dict(base_img_size=0), 'Expected a positive base_img_size, got 0.'),
    (dict(img_size=0), 'Expected a positive image size (H, W), got (0, 0).'),
    (dict(img_size=-32), 'Expected a positive image size (H, W), got (-32, -32).'),
    (dict(train_img_sizes=[-8, 32]), '--train-img-sizes -8: expected a positive size, got -8'),
    (dict(train_img_sizes=[0]), '--train-img-sizes 0: expected a positive size, got 0'),
    (dict(eval_img_sizes=[32, -16]), '--eval-img-sizes -16: expected a positive size, got -16'),
    (dict(eval_img_sizes=[0]), '--eval-img-sizes 0: expected a positive size, got 0'),
]


@pytest.mark.parametrize('settings, message', OUT_OF_RANGE)
@pytest.mark.parametrize('model', ['aft_conv_test', 'aft_full_test', 'aft_simple_test'])
def test_size_options_out_of_range_are_one_line(model, settings, message):
    if model != 'aft_conv_test' and 'base_img_size' in settings:
        message = f'--resize-mode / --base-img-size: {model} is not an AFT-conv model'
    if model != 'aft_conv_test' and len(settings.get('train_img_sizes', ())) > 1:  # sizes it cannot take at all
        message = f'--train-img-sizes: {model} takes only 32x32 px images'
    with pytest.raises(ValueError) as error:
        check_model_and_sizes(ClassifySettings(model=model, **settings), dict(TINY_KWARGS))
    assert message in str(error.value) and '\n' not in str(error.value)


# ---------------------------------------------------------------------------------------------------------------------
# The result line: no empty field whatever the evaluation sizes.
# ---------------------------------------------------------------------------------------------------------------------
def fake_results(img_size, eval_sizes, train_sizes):
    top1_at = {size: 90.0 + i for i, size in enumerate(eval_sizes)}
    largest = max(eval_sizes)
    return {'top1': top1_at.get(img_size, 95.0), **{f'top1_at_{s}': v for s, v in top1_at.items()},
            'eval_img_sizes': list(eval_sizes), 'train_img_sizes': list(train_sizes),
            'top1_reloaded': 95.0, 'top1_reloaded_at': {str(largest): top1_at[largest]}, 'top1_timm_data_config': 95.0,
            'top1_timm_test_data_config': 95.0, 'world_size': 1, 'weights_sha256': '0' * 64, 'wall_seconds': 1.0}


@pytest.mark.parametrize('img_size, eval_sizes, train_sizes', [
    (32, [32], [32]), (32, [32], [24, 32]), (32, [32, 64], [32]), (32, [24, 32, 40], [24, 32, 40]),
    (32, [64], [32]), (48, [48], [48]),
])
def test_the_result_line_has_no_empty_field(img_size, eval_sizes, train_sizes, capsys):
    settings = ClassifySettings(img_size=img_size, eval_img_sizes=eval_sizes)
    results = fake_results(img_size, eval_sizes, train_sizes)
    report(settings, results, Path('data'), Path('hub'), {'input_size': (3, img_size, img_size), 'crop_pct': 1.0})
    line = next(line for line in capsys.readouterr().out.splitlines() if ', trained at ' in line)
    assert not re.search(r'% at px|at px|; ;|\(\)|//|% at \d*px; %', line), line
    assert f'trained at {"/".join(map(str, train_sizes))} px' in line
    others = [size for size in eval_sizes if size != img_size]
    assert (f'at {"/".join(map(str, others))}px;' in line) == bool(others)


# ---------------------------------------------------------------------------------------------------------------------
# End to end: what results.json, the card and the line say is what the steps drew.
# ---------------------------------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize('sizes, batches, eval_sizes', [
    (['32'], ['6'], ['32']), (['16', '24'], ['4', '4'], ['32']),
    (['16', '24', '32', '40', '48'], ['6'] * 5, ['32']),  # three steps: two sizes at least never drawn
])
def test_the_report_says_the_sizes_drawn(sizes, batches, eval_sizes, data, tmp_path, capsys, one_thread):
    out = tmp_path / 'out'
    code, printed, _ = train(data, out, capsys, '--img-size', '32', '--train-img-sizes', *sizes,
                             '--train-batch-sizes', *batches, '--eval-img-sizes', *eval_sizes)
    assert code == 0
    results = json.loads((out / 'results.json').read_text())
    drawn = sorted({int(size) for record in results['history'] for size in record['steps_per_size']})
    assert results['train_img_sizes'] == drawn and set(drawn) <= {int(size) for size in sizes}
    assert len(drawn) == len(sizes) or len(sizes) > NUM_TRAIN // 6  # all drawn, or more sizes than steps
    said = '/'.join(map(str, drawn))
    assert f'at {said} px (one size per step' in (out / 'hub' / 'README.md').read_text()
    line = next(line for line in printed.splitlines() if ', trained at ' in line)
    assert f'trained at {said} px' in line and not re.search(r'% at px|at px', line)
    assert torch.isfinite(torch.tensor(results['history'][-1]['loss']))
