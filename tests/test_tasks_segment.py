"""The dense job (``aft-vision train --task segment``) on a reduced budget: it learns beyond what any predictor blind
to the image can reach, its figures are what its saved weights score, and it runs at a size it never trained at; the
digit scenes it composes; its options checked before it starts."""
import json
import math

import pytest
import torch

import aft_vision  # noqa: F401  registers the models
from aft_vision.checkpoints import load_weights
from aft_vision.cli import main as cli_main
from aft_vision.tasks.scenes import INK, NUM_CLASSES, Scenes, digit_split, make_scenes


pytest.importorskip('sklearn')  # the digits


def blind_miou_bound(scenes: Scenes, log_inv_delta: float = 16.0) -> float:
    """An mIoU that no predictor independent of the images exceeds, except with probability ~exp(-16) ~ 1e-7.

    IoU_c <= recall_c (intersection over the class's pixels). Background: recall <= 1. Digits: every class is placed
    by the same random positions, so for a blind predictor the expected recalls of the ten digit classes sum to at most
    1 (at each pixel it predicts at most one class). Each recall_c is a pixel-weighted mean of per-digit recalls in
    [0, 1] over the class's n_c held-out digits, taken as independent: by Hoeffding the sum of the ten recalls exceeds
    its mean by more than sqrt(log(1/delta) / 2 * sum_c sum_i (a_i / A_c)^2) with probability below delta (a_i a
    digit's ink pixels, A_c its class's). So mIoU <= (1 + 1 + that margin) / 11."""
    weights = []
    for masks, boxes, labels in zip(scenes.masks, scenes.boxes, scenes.labels):
        for (x0, y0, x1, y1), label in zip(boxes.int().tolist(), labels.tolist()):
            weights.append((label, (masks[y0:y1, x0:x1] == label).sum().item()))
    squares = 0.0
    for c in range(1, NUM_CLASSES):
        areas = torch.tensor([a for label, a in weights if label == c], dtype=torch.float64)
        squares += ((areas / areas.sum()) ** 2).sum().item()
    return (2 + math.sqrt(log_inv_delta / 2 * squares)) / NUM_CLASSES


@pytest.mark.slow
def test_segment_job_learns_and_segments_a_larger_size(tmp_path, capsys, one_thread):
    pytest.importorskip('segmentation_models_pytorch')
    from aft_vision.tasks.segment import build_dpt, confusion, mean_iou

    out = tmp_path / 'segment'
    # 4 epochs of batch 8 over 512 scenes at lr 4e-3 (256 steps, ~35 s on one thread) instead of the job's 10 of
    # batch 32 over 1024; 3 epochs, or batch 4, stay below the bounds
    assert cli_main(['train', '--task', 'segment', '--epochs', '4', '--batch-size', '8', '--scenes', '512',
                     '--lr', '4e-3', '--out-dir', str(out)]) == 0
    results = json.loads((out / 'results.json').read_text())
    digits = digit_split()['val']
    held_out = make_scenes(digits, 128, 64, seed=1)  # the job's held-out scenes (a quarter as many, seed 0 + 1)
    larger = make_scenes(digits, 128, 96, seed=2)
    bound = blind_miou_bound(held_out)  # 0.33 for its ~350 digits; this run reached 0.47 here (0.52 at seed 1)
    assert results['miou'] > bound, (results['miou'], bound)
    bound_large = blind_miou_bound(larger)  # more digits, a tighter bound: 0.28; 0.37 here (0.48 at seed 1)
    assert results['miou_at_96'] > bound_large, (results['miou_at_96'], bound_large)
    # the figures are what the saved weights score, recomputed here at each size
    model = build_dpt('aft_conv_test', {})
    model.load_state_dict(load_weights(out / 'model.safetensors'))
    counts, counts_large = confusion(model, held_out), confusion(model, larger)
    assert counts.tolist() == results['confusion'] and mean_iou(counts) == results['miou']
    assert counts_large.sum() == 128 * 96 * 96 and mean_iou(counts_large) == results['miou_at_96']
    assert len(results['history']) == 4 and all(math.isfinite(h['loss']) for h in results['history'])
    assert (out / 'training_curve.png').read_bytes()[:4] == b'\x89PNG'
    assert 'held-out mIoU' in capsys.readouterr().out


def test_scenes_label_ink_and_box_it():
    digits = digit_split()
    assert len(digits['train'][0]) + len(digits['val'][0]) == 1797
    scenes = make_scenes(digits['val'], 8, 64, seed=3)
    assert scenes.images.shape == (8, 3, 64, 64) and scenes.masks.shape == (8, 64, 64)
    assert 0 <= scenes.images.min() and scenes.images.max() <= 1
    for image, mask, boxes, labels in zip(scenes.images, scenes.masks, scenes.boxes, scenes.labels):
        assert len(boxes) == len(labels) >= 1
        covered = torch.zeros_like(mask, dtype=torch.bool)
        for (x0, y0, x1, y1), label in zip(boxes.int().tolist(), labels.tolist()):
            inside = mask[y0:y1, x0:x1]
            assert (inside == label).any(dim=0).all() and (inside == label).any(dim=1).all()  # the box is tight
            covered[y0:y1, x0:x1] |= inside == label
        assert torch.equal(covered, mask > 0)  # every labelled pixel is a digit's ink, inside that digit's box
        labelled = image[0][mask > 0]
        assert labelled.mean() > image[0][mask == 0].mean() + INK / 2  # ink is brighter than the background
    again = make_scenes(digits['val'], 8, 64, seed=3)
    assert torch.equal(again.images, scenes.images) and torch.equal(again.masks, scenes.masks)


@pytest.mark.parametrize('argv,expected', [
    (['--data-dir', '.'], '--data-dir'),  # options the task does not use
    (['--pretrained'], '--pretrained'),
    (['--sparsity-weight', '0.1'], '--sparsity-weight'),
    (['--init-from', 'weights.safetensors'], '--init-from'),
    (['--scenes', '0'], '--scenes'),
    (['--img-size', '72'], 'multiples of 32'),  # models and sizes
    (['--eval-img-size', '100'], 'not a multiple of the patch size'),
    (['--model', 'aft_full_test'], 'needs an AFT-conv model'),
])
def test_segment_options_models_and_sizes_refused_before_anything_runs(tmp_path, capsys, argv, expected):
    out = tmp_path / 'out'
    assert cli_main(['train', '--task', 'segment', *argv, '--out-dir', str(out)]) == 2
    err = capsys.readouterr().err
    assert expected in err and err.count('\n') == 1 and not out.exists()
