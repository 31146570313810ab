"""The main job (``aft-vision train``, conftest's ``digits_job``): it learns, survives the Hub round trip, runs at a
larger size; the Eq. 9 regulariser; two-process DDP on the CPU (the project's trainer always, timm's train.py given a
checkout); the ViT baseline and its checkpoint through the transfer into a fine-tuning run."""
import copy
import csv
import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Dict

import numpy as np
import pytest
import timm
import torch
from PIL import Image

import aft_vision  # noqa: F401  registers the models
from aft_vision.checkpoints import load_weights, unwrap_state_dict
from aft_vision.cli import main as cli_main
from aft_vision.layers import scaled_kernel_size
from aft_vision.tasks.classify import DIGITS_MODEL, ClassifySettings, at_size, check_model_and_sizes
from aft_vision.tasks.regularizers import position_bias_entropy
from aft_vision.tasks.training import evaluate, state_digest, train_loader


pytest.importorskip('sklearn')  # the digits

REPO = Path(__file__).parents[1]
TINY_MODEL = ['patch_size=8', 'embed_dim=32', 'depth=1', 'num_heads=4', 'kernel_size=3']  # --model-kwargs
TINY_KWARGS = {key: int(value) for key, value in (arg.split('=') for arg in TINY_MODEL)}


def above_chance(num_val: int, num_classes: int, sigmas: float = 5.0) -> float:
    """Top-1 (%) that guessing reaches with probability below ~3e-7: chance plus ``sigmas`` binomial deviations."""
    chance = 1 / num_classes
    return 100 * (chance + sigmas * math.sqrt(chance * (1 - chance) / num_val))


def test_main_job_learns_round_trips_and_evaluates_larger(digits_job):
    out, results = digits_job.out, digits_job.results
    val = out / 'data' / 'val'
    num_val = sum(1 for _ in val.rglob('*.png'))  # 20% of each digit's images: 359
    assert results['top1'] > above_chance(num_val, 10)  # 17.9%
    assert results['top1_reloaded'] == results['top1']
    # every figure is what the saved weights score, recomputed here at each size with the windows resampled for it
    assert results['model_kwargs'] == dict(DIGITS_MODEL, **digits_job.model_kwargs, img_size=32, base_img_size=32)
    model = timm.create_model('aft_conv_test', num_classes=10, **results['model_kwargs'])
    model.load_state_dict(load_weights(out / 'model.safetensors'))
    assert evaluate(model, val, 32) == results['top1']
    for size in results['eval_img_sizes']:
        resized = copy.deepcopy(model)
        resized.set_input_size(img_size=size)
        assert resized.blocks[0].attn.kernel_size == scaled_kernel_size(7, size / 32)
        assert evaluate(resized, val, size) == results[f'top1_at_{size}'], size
    # trained at the recipe's sizes, one per step, every one drawn
    assert results['train_img_sizes'] == [24, 32, 40, 48] and results['eval_img_sizes'] == [24, 32, 40, 48, 64]
    assert results['train_batch_sizes'] == [85, 64, 51, 43]  # 64 at 32 px, inversely proportional to the side
    drawn = {size for record in results['history'] for size in record['steps_per_size']}
    assert drawn == {'24', '32', '40', '48'}
    assert results['top1_reloaded_at'] == {'64': results['top1_at_64']}
    assert sum(line.startswith('top-1 at ') for line in digits_job.printed.splitlines()) == 5
    assert sorted(p.name for p in (out / 'hub').iterdir()) == ['README.md', 'config.json', 'model.safetensors']
    config = json.loads((out / 'hub' / 'config.json').read_text())
    assert config['label_names'] == [str(i) for i in range(10)]
    assert (out / 'training_curve.png').read_bytes()[:4] == b'\x89PNG'
    assert 'identical' in digits_job.printed


def test_data_dir_without_splits_is_a_one_line_error(tmp_path, capsys):
    (tmp_path / 'empty').mkdir()
    assert cli_main(['train', '--data-dir', str(tmp_path / 'empty'), '--out-dir', str(tmp_path / 'o')]) == 2
    assert 'train' in capsys.readouterr().err
    assert cli_main(['train', '--pretrained', '--out-dir', str(tmp_path / 'o')]) == 2
    assert 'aft_conv_test has no pretrained weights' in capsys.readouterr().err


def test_the_data_check_sees_the_classes_torchvisions_imagefolder_labels(tmp_path):
    """A hidden folder is a class to ImageFolder (``.cache`` would take label 0 in train/ only, shifting every label
    against val/): the check counts it too, and refuses splits whose classes differ, naming it."""
    from torchvision.datasets import ImageFolder

    from aft_vision.tasks.training import check_image_folders

    for split, classes in (('train', ('a', 'b', '.cache')), ('val', ('a', 'b'))):
        for name in classes:
            (tmp_path / split / name).mkdir(parents=True)
            Image.new('RGB', (8, 8)).save(tmp_path / split / name / 'x.png')
    with pytest.raises(ValueError, match=r"classes differ \(only in train/: \['\.cache'\]"):
        check_image_folders(tmp_path)
    (tmp_path / 'val' / '.cache').mkdir()
    Image.new('RGB', (8, 8)).save(tmp_path / 'val' / '.cache' / 'x.png')
    assert check_image_folders(tmp_path) == ImageFolder(str(tmp_path / 'train')).classes == ['.cache', 'a', 'b']


def test_entropy_regulariser_matches_a_plain_computation():
    model = timm.create_model('aft_conv_test')
    with torch.no_grad():
        for block in model.blocks:
            block.attn.pos_gamma.normal_()
    expected = 0.0
    for block in model.blocks:
        for head in block.attn.position_bias():
            p = torch.softmax(head.flatten().double(), 0)
            expected += float(-(p * p.log()).sum().detach())
    assert abs(position_bias_entropy(model).item() - expected) < 1e-3
    assert position_bias_entropy(timm.create_model('aft_full_test')).item() == 0.0


def _bias_spread_model(**kwargs) -> torch.nn.Module:
    model = timm.create_model('aft_conv_test', num_classes=3, **kwargs)
    with torch.no_grad():
        for block in model.blocks:
            block.attn.pos_gamma.normal_()
    return model


def test_the_launchers_sparsity_adds_the_weighted_entropy_to_timms_task_only_within_its_run():
    """``python -m aft_vision.run --aft-sparsity W train.py``: timm's task adds W x Eq. 9 within the run only."""
    from timm.task import ClassificationTask

    from aft_vision.run import sparsity_in_timm_tasks

    original = ClassificationTask.forward
    model = _bias_spread_model()
    task = ClassificationTask(model, criterion=torch.nn.CrossEntropyLoss())
    images, target = torch.randn(2, 3, 64, 64), torch.tensor([0, 2])
    plain = task(images, target)['loss']
    with sparsity_in_timm_tasks(0.5):
        hooked = task(images, target)
    assert torch.allclose(hooked['loss'], plain + 0.5 * position_bias_entropy(model))
    assert ClassificationTask.forward is original


def test_timms_task_trains_dynamic_img_size_at_two_sizes_with_the_windows_following_and_no_hook():
    """What timm's ``train.py --train-img-sizes`` does with ``--model-kwargs dynamic_img_size=True``: one step of its
    own task per size, each running the windows resampled for the size (as ``set_input_size`` would resample them) and
    training the one window they are resampled from; timm's task as timm wrote it."""
    from timm.task import ClassificationTask

    original = ClassificationTask.forward
    model = _bias_spread_model(dynamic_img_size=True)
    task = ClassificationTask(model, criterion=torch.nn.CrossEntropyLoss())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    target = torch.tensor([0, 2])
    for size, window in ((64, 5), (96, 7)):
        images = torch.randn(2, 3, size, size)
        resized = copy.deepcopy(model)
        resized.set_input_size(img_size=size)  # the windows for this size, resampled from the model's
        assert resized.blocks[0].attn.kernel_size == window
        before = model.blocks[0].attn.pos_weight.detach().clone()
        optimizer.zero_grad()
        result = task(images, target)
        assert torch.allclose(result['output'], resized(images), atol=1e-5)
        result['loss'].backward()
        optimizer.step()
        grad = model.blocks[0].attn.pos_weight.grad
        assert grad.shape == (8, 5, 5) and grad.abs().sum() > 0  # the model's own 5 x 5 windows train at 96 px too
        assert not torch.equal(model.blocks[0].attn.pos_weight, before)
    assert ClassificationTask.forward is original


def _tiny_image_folder(root: Path, classes: int = 3, train: int = 12, val: int = 4) -> Path:
    """Per-class shades of noise as 32 x 32 PNGs: ``root/{train,val}/<class>/*.png``."""
    rng = np.random.default_rng(0)
    for split, count in (('train', train), ('val', val)):
        for label in range(classes):
            folder = root / split / str(label)
            folder.mkdir(parents=True)
            for i in range(count):
                pixels = rng.normal(60 + 70 * label, 30, (32, 32, 3)).clip(0, 255).astype(np.uint8)
                Image.fromarray(pixels).save(folder / f'{i}.png')
    return root


def _torchrun(*args: str, env=None, timeout: int = 300) -> subprocess.CompletedProcess:
    command = [sys.executable, '-m', 'torch.distributed.run', '--standalone', '--nproc_per_node=2', *args]
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, 'OMP_NUM_THREADS': '1', **(env or {})})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


@pytest.mark.slow
def test_ddp_two_processes_end_with_identical_weights(tmp_path):
    data = _tiny_image_folder(tmp_path / 'data')
    out = tmp_path / 'out'
    done = _torchrun('-m', 'aft_vision.train', '--data-dir', str(data), '--epochs', '2', '--batch-size', '4',
                     '--model-kwargs', *TINY_MODEL, '--out-dir', str(out), '--sparsity-weight', '0.001')
    assert 'final weights identical on every rank; the same size at every step on every rank' in done.stdout
    results = json.loads((out / 'results.json').read_text())
    assert results['world_size'] == 2
    assert len(set(results['rank_size_schedule_sha256'])) == 1  # each rank drew its own, the same
    assert len({size for record in results['history'] for size in record['steps_per_size']}) > 1
    rank0, rank1 = results['rank_state_sha256']
    assert rank0 == rank1 == state_digest(load_weights(out / 'model.safetensors'))
    torch.manual_seed(0)  # the trainer's seed: the weights both ranks started from
    initial = timm.create_model('aft_conv_test', num_classes=3, **TINY_KWARGS)
    assert state_digest(initial.state_dict()) != rank0  # they trained
    assert results['top1_reloaded'] == results['top1']


@pytest.mark.skipif(not os.environ.get('AFT_TIMM_SCRIPTS'),
                    reason='set AFT_TIMM_SCRIPTS to a timm checkout (the folder holding train.py and validate.py)')
def test_timm_train_py_under_torchrun_resumes_then_validate_py_at_a_larger_size(tmp_path):
    # the scripts alone: beside a checkout's timm/ package they would import it instead of the installed timm
    scripts = tmp_path / 'timm_scripts'
    scripts.mkdir()
    for name in ('train.py', 'validate.py'):
        shutil.copy(Path(os.environ['AFT_TIMM_SCRIPTS']) / name, scripts / name)
    data = _tiny_image_folder(tmp_path / 'data')
    # Test-only shim: timm 1.0.31's train.py hands DDP device_ids=[cpu], which PyTorch rejects for CPU modules; drop
    # them there, and let each rank write its final weights so that the ranks can be compared.
    (tmp_path / 'rank_dump.py').write_text(f"""
import atexit, os
import torch
from safetensors.torch import save_file
from timm.task import ClassificationTask

_prepare = ClassificationTask.prepare_distributed

def prepare_distributed(self, device_ids=None, **kwargs):
    if device_ids and all(torch.device(d).type == 'cpu' for d in device_ids):
        device_ids = None
    _prepare(self, device_ids=device_ids, **kwargs)
    path = os.path.join({str(tmp_path)!r}, 'rank%s.safetensors' % os.environ['RANK'])
    module = self.trainable_module.module
    atexit.register(lambda: save_file({{k: v.contiguous() for k, v in module.state_dict().items()}}, path))
    return self

ClassificationTask.prepare_distributed = prepare_distributed
""")
    recipe = REPO / 'models' / 'aft_conv_tiny.yaml'  # DeiT's recipe: EMA, mixup / cutmix, erasing, repeated aug
    common = ['-c', str(recipe), '--data-dir', str(data), '--val-split', 'val', '--device-modules', 'rank_dump',
              '--model', 'aft_conv_test', '--model-kwargs', *TINY_MODEL,
              '--num-classes', '3', '--img-size', '32', '-b', '6', '--epochs', '2', '--warmup-epochs', '1',
              '--aa', '', '--device', 'cpu', '--no-prefetcher', '--workers', '0', '--layer-decay', '0.75',
              '--grad-checkpointing', '--amp', '--amp-dtype', 'bfloat16', '--output', str(tmp_path / 'runs')]
    env = {'PYTHONPATH': os.pathsep.join([str(tmp_path), os.environ.get('PYTHONPATH', '')])}
    sparse_train = ['-m', 'aft_vision.run', '--aft-sparsity', '0.01', str(scripts / 'train.py')]
    _torchrun(*sparse_train, *common, '--experiment', 'first', env=env)
    epoch_one = tmp_path / 'runs' / 'first' / 'checkpoint-0.pth.tar'
    assert epoch_one.is_file()
    # --resume from the end of epoch 1 runs epoch 2 again and must reach the same state on both ranks
    resumed_run = _torchrun(*sparse_train, *common, '--experiment', 'resumed', '--resume', str(epoch_one), env=env)
    assert 'Restoring optimizer state' in resumed_run.stdout + resumed_run.stderr
    rank0, rank1 = (load_weights(tmp_path / f'rank{r}.safetensors') for r in (0, 1))
    assert state_digest(rank0) == state_digest(rank1)
    resumed = unwrap_state_dict(load_weights(tmp_path / 'runs' / 'resumed' / 'last.pth.tar'))  # timm's, weights-only
    assert state_digest(resumed) == state_digest(rank0)

    results = tmp_path / 'validate.csv'
    done = subprocess.run([sys.executable, '-m', 'aft_vision.run', str(scripts / 'validate.py'),
                           '--data-dir', str(data), '--split', 'val', '--model', 'aft_conv_test',
                           '--model-kwargs', *TINY_MODEL, '--num-classes', '3', '--checkpoint',
                           str(tmp_path / 'runs' / 'resumed' / 'last.pth.tar'), '--img-size', '48', '--device', 'cpu',
                           '--no-prefetcher', '--workers', '0', '--results-file', str(results)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    validated = next(csv.DictReader(results.open()))
    assert validated['model'] == 'aft_conv_test' and validated['img_size'] == '48'
    # validate.py's figure is what the checkpoint scores with timm's eval transform at 48, recomputed here
    model = timm.create_model('aft_conv_test', num_classes=3, **TINY_KWARGS)
    model.load_state_dict(resumed)
    config = timm.data.resolve_data_config({'input_size': (3, 48, 48)}, model=model)
    assert float(validated['top1']) == pytest.approx(evaluate(model, data / 'val', data_config=config), abs=1e-3)


@pytest.mark.skipif(not os.environ.get('AFT_TIMM_SCRIPTS'),
                    reason='set AFT_TIMM_SCRIPTS to a timm checkout (the folder holding train.py and validate.py)')
def test_timm_train_py_draws_several_sizes_with_the_windows_following(tmp_path):
    """timm's ``--train-img-sizes`` on an AFT-conv with ``--model-kwargs dynamic_img_size=True`` (``--device-modules
    aft_vision`` only registers the models): every size drawn, and the checkpoint is the model as built (its windows
    given for 32 px), whatever sizes it trained at."""
    shutil.copy(Path(os.environ['AFT_TIMM_SCRIPTS']) / 'train.py', tmp_path / 'train.py')
    data = _tiny_image_folder(tmp_path / 'data')
    done = subprocess.run(
        [sys.executable, str(tmp_path / 'train.py'), '--data-dir', str(data), '--val-split', 'val',
         '--device-modules', 'aft_vision', '--model', 'aft_conv_test', '--model-kwargs', *TINY_MODEL,
         'img_size=32', 'dynamic_img_size=True',
         '--num-classes', '3', '--img-size', '32', '--train-img-sizes', '24', '32', '40', '-b', '4',
         '--epochs', '1', '--device', 'cpu', '--no-prefetcher', '--workers', '0', '--hflip', '0',
         '--output', str(tmp_path / 'runs'), '--experiment', 'sizes'],
        capture_output=True, text=True, timeout=300, env={**os.environ, 'OMP_NUM_THREADS': '1'})
    assert done.returncode == 0, done.stderr[-3000:]
    assert 'Using scheduled training resolutions [24, 32, 40]' in done.stdout + done.stderr
    trained = unwrap_state_dict(load_weights(tmp_path / 'runs' / 'sizes' / 'last.pth.tar'))
    model = timm.create_model('aft_conv_test', num_classes=3, img_size=32, **TINY_KWARGS)
    model.load_state_dict(trained)  # strict: the 3 x 3 windows as built


def test_fine_tune_a_published_folder_into_the_onehot_variant(tmp_path, one_thread):
    data = _tiny_image_folder(tmp_path / 'data')
    dense, sparse = tmp_path / 'dense', tmp_path / 'sparse'
    assert cli_main(['train', '--data-dir', str(data), '--epochs', '1', '--batch-size', '4',
                     '--model-kwargs', *TINY_MODEL, '--out-dir', str(dense)]) == 0
    assert cli_main(['train', '--data-dir', str(data), '--epochs', '1', '--batch-size', '4', '--lr', '1e-5',
                     '--model', f'local-dir:{dense / "hub"}', '--pretrained',
                     '--model-kwargs', 'mixer_layer=aft_conv_onehot', '--out-dir', str(sparse)]) == 0
    before, after = load_weights(dense / 'model.safetensors'), load_weights(sparse / 'model.safetensors')
    assert before.keys() == after.keys()
    assert max((after[k] - before[k]).abs().max().item() for k in before) < 1e-3  # started from the dense weights
    config = json.loads((sparse / 'hub' / 'config.json').read_text())
    assert config['architecture'] == 'aft_conv_test'
    assert config['model_args']['mixer_layer'] == 'aft_conv_onehot' and config['model_args']['patch_size'] == 8
    reloaded = timm.create_model(f'local-dir:{sparse / "hub"}', pretrained=True)
    assert type(reloaded.blocks[0].attn).__name__ == 'AFTConv2dOneHot'


# TINY_MODEL's trunk (aft_conv_test's MLP ratio 2) as timm's ViT
VIT_BASELINE = ['patch_size=8', 'embed_dim=32', 'depth=1', 'num_heads=2', 'mlp_ratio=2']


def _checked(model: str, kwargs: Dict, **settings) -> Dict:
    return check_model_and_sizes(ClassifySettings(model=model, **settings), dict(kwargs))


def test_models_are_built_for_the_training_size_and_train_at_the_recipes_sizes():
    trunk = dict(patch_size=4, embed_dim=64, depth=4, mlp_ratio=2.)
    vit = dict(trunk, num_heads=2)
    assert _checked('vit_tiny_patch16_224', vit) == (dict(vit, img_size=32), [32])  # tied to one size
    assert _checked('aft_full_test', trunk) == (dict(trunk, img_size=32), [32])
    # any size: the recipe's sizes, 0.75-1.5x in whole patches
    assert _checked('vit_tiny_patch16_224', dict(vit, dynamic_img_size=True), img_size=64) == (
        dict(vit, dynamic_img_size=True, img_size=64), [48, 64, 80, 96])
    # AFT-conv: built for the training size, its windows given for it unless --base-img-size says otherwise
    assert _checked('aft_conv_test', DIGITS_MODEL) == (dict(DIGITS_MODEL, img_size=32, base_img_size=32),
                                                       [24, 32, 40, 48])
    assert _checked('aft_conv_test', DIGITS_MODEL, resize_mode='keep', base_img_size=36, train_img_sizes=[32]) == (
        dict(DIGITS_MODEL, img_size=32, base_img_size=36, resize_mode='keep'), [32])
    with pytest.raises(ValueError, match='--img-size 30: 30 px is not a multiple of the patch size 4x4'):
        _checked('vit_tiny_patch16_224', vit, img_size=30)


@pytest.mark.parametrize('settings, message', [
    (dict(train_img_sizes=[24, 30]), '--train-img-sizes 30: input size 30x30 is not a multiple of the patch size'),
    (dict(train_img_sizes=[]), '--train-img-sizes: give at least one size'),
    (dict(eval_img_sizes=[]), '--eval-img-sizes: give at least one size'),
    (dict(eval_img_sizes=[2]), '--eval-img-sizes 2: input size 2x2 is smaller than one 4x4 patch'),
    (dict(train_img_sizes=[24, 32], train_batch_sizes=[8]), '--train-batch-sizes: give one batch size per training'),
    (dict(train_size_schedule='random'), "--train-size-schedule: choose one of constant, progressive, got 'random'"),
    (dict(train_size_schedule='progressive', train_img_sizes=[32]), '--train-size-schedule progressive: give at least'),
    (dict(resize_mode='patch', eval_img_sizes=[36]), "--eval-img-sizes 36: resize_mode='patch': 36x36 px would need"),
    (dict(resize_mode='stretch'), "unknown resize_mode 'stretch'"),
    (dict(model='aft_full_test', train_img_sizes=[24, 32]), '--train-img-sizes: aft_full_test takes only 32x32 px'),
    (dict(model='aft_full_test', resize_mode='window'), '--resize-mode / --base-img-size: aft_full_test is not an'),
])
def test_bad_sizes_and_modes_are_one_line(settings, message):
    model = settings.pop('model', 'aft_conv_test')
    kwargs = DIGITS_MODEL if model == 'aft_conv_test' else dict(patch_size=4, embed_dim=64, depth=4, mlp_ratio=2.)
    with pytest.raises(ValueError, match=re.escape(message)):
        _checked(model, kwargs, **settings)


def test_train_loader_draws_one_size_per_step_and_every_rank_the_same(tmp_path):
    """timm's scheduled loader: every batch at one size with its batch size, every size drawn, and the sequence of
    sizes fixed by the seed alone (what each rank under torchrun computes for itself)."""
    data = _tiny_image_folder(tmp_path / 'data', train=20)
    model = timm.create_model('aft_conv_test', num_classes=3, **TINY_KWARGS)
    batch_of = {16: 4, 24: 3, 32: 2}
    sequences = []
    for rank_seed in (0, 1):  # another rank: another draw of the images, the same sizes
        torch.manual_seed(rank_seed)
        loader = train_loader(data / 'train', model, list(batch_of), list(batch_of.values()), 'constant', 2, seed=7)
        sizes = []
        for epoch in range(2):
            loader.batch_sampler.set_epoch(epoch)
            for images, labels in loader:
                assert images.shape[-2:] == (images.shape[-1],) * 2 and len(images) == batch_of[images.shape[-1]]
                sizes.append(images.shape[-1])
        sequences.append(sizes)
    assert set(sequences[0]) == set(batch_of) and sequences[0] == sequences[1]


def test_vit_baseline_trains_and_its_checkpoint_transfers_into_a_fine_tuning_run(tmp_path, one_thread):
    data = _tiny_image_folder(tmp_path / 'data')
    vit_out, aft_out = tmp_path / 'vit', tmp_path / 'aft'
    assert cli_main(['train', '--data-dir', str(data), '--epochs', '1', '--batch-size', '4',
                     '--model', 'vit_tiny_patch16_224', '--model-kwargs', *VIT_BASELINE,
                     '--out-dir', str(vit_out)]) == 0
    results = json.loads((vit_out / 'results.json').read_text())
    assert results['model_kwargs']['img_size'] == 32  # built for the training size
    vit = timm.create_model('vit_tiny_patch16_224', num_classes=3, **results['model_kwargs'])
    vit_weights = load_weights(vit_out / 'model.safetensors')
    vit.load_state_dict(vit_weights)
    assert evaluate(at_size(vit, 48), data / 'val', 48) == results['top1_at_48']  # evaluated at 48 px, rebuilt
    assert 'test_input_size' not in results['data_config']  # a client could not run the model at 48 px as it is

    assert cli_main(['train', '--data-dir', str(data), '--epochs', '1', '--batch-size', '4', '--lr', '1e-6',
                     '--model-kwargs', *TINY_MODEL, '--init-from', str(vit_out / 'model.safetensors'),
                     '--out-dir', str(aft_out)]) == 0
    tuned = load_weights(aft_out / 'model.safetensors')
    dim, heads = TINY_KWARGS['embed_dim'], TINY_KWARGS['num_heads']
    qkv, vit_qkv = tuned['blocks.0.attn.qkv.weight'], vit_weights['blocks.0.attn.qkv.weight']
    near = dict(atol=1e-4, rtol=0)  # nine AdamW steps at lr 1e-6 from the ViT's weights
    assert torch.allclose(qkv[dim + heads:], vit_qkv[2 * dim:], **near)  # the values, from the ViT's
    assert not torch.allclose(qkv[:dim], vit_qkv[:dim], **near)  # queries fresh, as in the paper
    for key in ('patch_embed.proj.weight', 'blocks.0.mlp.fc1.weight', 'blocks.0.attn.proj.weight', 'norm.weight'):
        assert torch.allclose(tuned[key], vit_weights[key], **near), key
    assert tuned['head.weight'].shape == (3, dim)
    # the copied tensors compute what they computed in the ViT: same patch tokens, same MLP
    aft = timm.create_model('aft_conv_test', num_classes=3, **TINY_KWARGS).eval()
    aft.load_state_dict(tuned)
    images = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        tokens = vit.patch_embed(images)  # (B, H * W, C)
        assert torch.allclose(aft.patch_embed(images).flatten(1, 2), tokens, atol=1e-3)  # (B, H, W, C)
        assert torch.allclose(aft.blocks[0].mlp(tokens), vit.blocks[0].mlp(tokens), atol=1e-3)
    # the same checkpoint through the transfer command: the values in place, the rest as the model made them
    assert cli_main(['transfer', '--src', str(vit_out / 'model.safetensors'), '--model', 'aft_conv_test',
                     '--model-kwargs', *TINY_MODEL, '--num-classes', '3',
                     '--out', str(tmp_path / 'aft.safetensors')]) == 0
    assert torch.equal(load_weights(tmp_path / 'aft.safetensors')['blocks.0.attn.qkv.weight'][dim + heads:],
                       vit_qkv[2 * dim:])
    assert cli_main(['train', '--data-dir', str(data), '--init-from', str(tmp_path / 'none.safetensors'),
                     '--out-dir', str(tmp_path / 'bad')]) == 2
