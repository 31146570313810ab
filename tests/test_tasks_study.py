"""``aft-vision study`` at a one-epoch, one-seed budget: the machinery (records, tables, plots, resuming, refusals),
not its outcome."""
import copy
import dataclasses
import json

import numpy as np
import pytest
import timm

import aft_vision  # noqa: F401  registers the models
from aft_vision.checkpoints import load_weights
from aft_vision.cli import main as cli_main
from aft_vision.tasks import study
from aft_vision.tasks.classify import at_size
from aft_vision.tasks.study import StudySettings, plan_runs, run_study
from aft_vision.tasks.training import evaluate


datasets = pytest.importorskip('sklearn.datasets')  # the digits
load_digits = datasets.load_digits


# One epoch, one seed, 16 px (a 4 x 4 token map at patch 4), batches of 16: the smallest budget that runs every part.
TINY = StudySettings(epochs=1, seeds=1, img_size=16, eval_img_size=24, eval_img_sizes=(16, 24),
                     train_img_sizes=(16, 24), batch_size=16)
DIGITS_PER_CLASS = 20  # of the 1797: 16 per class to train on (10 steps of 16), 4 held out


def few_digits():
    """scikit-learn's digits, the first ``DIGITS_PER_CLASS`` of each class (what ``write_digits`` writes)."""
    data = load_digits()
    kept = np.concatenate([np.flatnonzero(data.target == label)[:DIGITS_PER_CLASS] for label in range(10)])
    return pytest.importorskip('sklearn.utils').Bunch(images=data.images[kept], target=data.target[kept])


@pytest.fixture(scope='module')
def finished_study(tmp_path_factory):
    """A study run once at the tiny budget on ``few_digits``; returns its folder and what ``run_study`` returned.
    The study's data set stays ``few_digits`` until the module ends (a second call checks the folder against it)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(datasets, 'load_digits', few_digits)
        try:
            out = tmp_path_factory.mktemp('study')
            summary = run_study(TINY, out)
        finally:
            torch.set_num_threads(threads)
        yield out, summary


def test_plan_covers_every_part_once_and_trains_the_baseline_before_the_transfers():
    settings = StudySettings(epochs=6, seeds=2)
    runs = plan_runs(settings)
    ids = [run.id for run in runs]
    assert len(ids) == len(set(ids))
    assert settings.fine_tune_epochs == 2
    for seed in range(2):
        baseline = ids.index(f'vit-random-e6-s{seed}')
        for key in ('aft_conv', 'aft_full'):
            assert ids.index(f'{key}-vit-e2-s{seed}') > baseline
            assert f'{key}-random-e2-s{seed}' in ids and f'{key}-random-e6-s{seed}' in ids
            # transfer_ls: from the ViT with LayerScale and pre-norm, trained first, into both families built alike
            assert ids.index(f'{key}_ls-vit_ls-e2-s{seed}') > ids.index(f'vit_ls-random-e6-s{seed}')
            assert f'{key}_ls-random-e2-s{seed}' in ids
        for kernel, heads in ((3, 64), (5, 64), (7, 64), (5, 1), (5, 4)):
            assert f'aft_conv_k{kernel}_h{heads}-random-e6-s{seed}' in ids
        for key in ('vit', 'aft_full', 'aft_simple', 'aft_conv'):  # resolution: the families at several sizes too
            assert f'{key}_ms-random-e6-s{seed}' in ids
    # families, transfer's short runs, transfer_ls (its ViT and short runs), window and heads (k5 h64 shared), sizes
    assert len(ids) == 2 * (4 + 4 + 5 + 5 + 4)
    only = [run.id for run in plan_runs(StudySettings(epochs=6, seeds=1, parts=('window',)))]
    assert only == [i for i in ids if i.startswith('aft_conv_k') and i.endswith('s0')]


def test_study_writes_a_record_per_run_the_tables_and_the_plots(finished_study):
    out, summary = finished_study
    ids = [run.id for run in plan_runs(TINY)]
    assert summary['trained'] == ids and summary['skipped'] == []
    for run_id in ids:
        record = json.loads((out / 'runs' / f'{run_id}.json').read_text())
        assert record['id'] == run_id and len(record['history']) == record['epochs'] == 1
        assert 0 <= record['top1'] <= 100 and 0 <= record['top1_large'] <= 100
        assert record['params'] > 0 and record['macs'] > 0
    # a record says what its saved weights score, at both sizes
    record = json.loads((out / 'runs' / 'vit-random-e1-s0.json').read_text())
    model = timm.create_model(record['config']['model'], num_classes=10, **record['model_kwargs'])
    model.load_state_dict(load_weights(out / 'runs' / 'vit-random-e1-s0.safetensors'))
    val = out / 'data' / 'val'
    assert evaluate(model, val, 16) == record['top1']
    assert evaluate(at_size(model, 24), val, 24) == record['top1_large']
    # the transferred runs name their source and what the transfer did
    transferred = json.loads((out / 'runs' / 'aft_conv-vit-e1-s0.json').read_text())
    assert transferred['init_from'] == 'vit-random-e1-s0.safetensors'
    assert 'partially copied' in transferred['transfer'] and 'fresh     blocks.*.attn.pos_weight' in \
        transferred['transfer']
    table = (out / 'study.md').read_text()
    for title in ('## Families at equal size', '## Transfer from the ViT baseline', '## AFT-conv: window and heads',
                  '## Resolution: one set of weights at every size', '## Transfer from a ViT with LayerScale'):
        assert title in table
    assert len(summary['tables']['families']) == 4 and len(summary['tables']['window']) == 5
    assert len(summary['tables']['transfer']) == 1 + 2 * 2  # ViT; AFT-conv, AFT-full from ViT and random (1 == 1/3)
    rows = [line for line in table.splitlines() if line.startswith('| ') and ' ± ' in line]
    # resolution: ViT, AFT-full, AFT-simple resampled; AFT-conv keep, window, patch; each trained at 1 and 2 sizes
    assert len(summary['tables']['resolution']) == 2 * (3 + 3)
    assert len(rows) == 4 + 5 + 5 + 5 + 12
    # transfer_ls: the models hold the ViT's LayerScale and pre-norm; the head start is the first epochs' difference
    transferred = json.loads((out / 'runs' / 'aft_full_ls-vit_ls-e1-s0.json').read_text())
    control = json.loads((out / 'runs' / 'aft_full_ls-random-e1-s0.json').read_text())
    assert transferred['model_kwargs']['init_values'] == 0.1 and transferred['model_kwargs']['pre_norm'] is True
    assert 'blocks.*.ls1' in transferred['transfer'] and 'norm_pre' in transferred['transfer']
    row = next(r for r in summary['tables']['transfer_ls'] if r['key'] == 'aft_full_ls' and r['start'] == 'vit_ls')
    assert row['head_start'] == [transferred['history'][0]['val_top1'] - control['history'][0]['val_top1']]
    # the record's figures at every size are what its weights score, rebuilt for each size in each mode
    record = json.loads((out / 'runs' / 'aft_conv_ms-random-e1-s0.json').read_text())
    assert record['model_kwargs']['resize_mode'] == 'window'
    assert {size for r in record['history'] for size in r['steps_per_size']} == {'16', '24'}
    model = timm.create_model('aft_conv_test', num_classes=10, **record['model_kwargs'])
    model.load_state_dict(load_weights(out / 'runs' / 'aft_conv_ms-random-e1-s0.safetensors'))
    for mode in ('keep', 'window', 'patch'):
        resized = copy.deepcopy(model)
        resized.set_input_size(img_size=24, resize_mode=mode)
        assert evaluate(resized, val, 24) == record['top1_at'][mode]['24'], mode
    for name in ('families.png', 'transfer.png', 'transfer_ls.png', 'window.png', 'resolution.png'):
        assert (out / 'plots' / name).read_bytes()[:4] == b'\x89PNG'
    assert json.loads((out / 'study.json').read_text())['tables'] == summary['tables']
    assert not list(out.rglob('.*'))  # every temporary file (a hidden sibling) renamed into place


def test_second_call_skips_finished_runs(finished_study, monkeypatch):
    out, first = finished_study
    stamps = {path: path.stat().st_mtime_ns for path in (out / 'runs').iterdir()}

    def no_training(*args, **kwargs):
        raise AssertionError('a finished run was trained again')

    monkeypatch.setattr(study, 'train', no_training)
    again = run_study(TINY, out)
    assert again['trained'] == [] and again['skipped'] == first['trained']
    assert again['tables'] == first['tables']
    assert {path: path.stat().st_mtime_ns for path in (out / 'runs').iterdir()} == stamps
    with pytest.raises(ValueError, match='another --out-dir'):  # a record of another recipe is not reused (one
        run_study(dataclasses.replace(TINY, lr=1e-3, parts=('families',)), out)  # part: fewer models to check first)


@pytest.mark.parametrize('args, message', [
    (['--baseline', 'vit_tiny_patch16_22'], "--baseline: unknown model 'vit_tiny_patch16_22'; did you mean"),
    (['--img-size', '30'], '--img-size 30: 30 px is not a multiple of the patch size 4x4'),
    (['--eval-img-size', '50'], '--eval-img-size 50: 50 px is not a multiple of the patch size 4x4'),
    (['--seeds', '0'], '--seeds: must be >= 1, got 0'),
    (['--parts', 'families', 'tables'], '--parts: tables: choose from families, transfer, transfer_ls, window'),
])
def test_bad_configuration_is_one_line_and_writes_nothing(tmp_path, capsys, args, message):
    out = tmp_path / 'study'
    assert cli_main(['study', *args, '--out-dir', str(out)]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count('\n') == 1
    assert not out.exists()
