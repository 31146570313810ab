"""What users hold keeps loading and answering the same: Hub folders (timm's ``save_for_hf``), checkpoints and the
config.json of backbone tags, written by main before each family became timm's ``VisionTransformer`` (9faf505 for the
ViT families, a091e03 for AFT-conv; ``tests/fixtures/saved_by_main``, made by its ``make.py``). A folder holds main's
config.json, its state dict's keys and shapes and its answers; the weights, drawn from those shapes by a fixed seed,
are written here as main published them."""
import importlib.util
import json
import shutil
from pathlib import Path

import pytest
import timm
import torch
from safetensors.torch import save_file

import aft_vision  # noqa: F401  registers the models

SAVED = Path(__file__).parents[1] / 'fixtures' / 'saved_by_main'
_spec = importlib.util.spec_from_file_location('saved_by_main_make', SAVED / 'make.py')
make = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(make)
# Hub folder -> (model name, its arguments as make.py built and resized it)
FOLDERS = {
    'aft_full_test': ('aft_full_test', make.BUILT_AS), 'aft_simple_test': ('aft_simple_test', make.BUILT_AS),
    'aft_conv_test': ('aft_conv_test', make.BUILT_AS),
    'aft_conv_test_onehot_96': ('aft_conv_test', dict(
        make.BUILT_AS, mixer_layer='aft_conv_onehot', mixer_kwargs={'tau': 0.7}, img_size=96, base_img_size=64)),
}


def published(name: str, where: Path):
    """Main's Hub folder ``name`` in ``where``: its config.json and the weights it was saved with, under main's keys;
    its images and main's answers for them."""
    saved, folder = SAVED / name, where / name
    folder.mkdir()
    shutil.copy(saved / 'config.json', folder / 'config.json')
    state = make.seeded_state(json.loads((saved / 'shapes.json').read_text()))
    save_file(state, str(folder / 'model.safetensors'))
    answers = {k: torch.tensor(v) for k, v in json.loads((saved / 'answers.json').read_text()).items()}
    side = FOLDERS[name][1].get('img_size', 64)
    return folder, state, make.seeded_images(side), answers


def assert_same_answer(got: torch.Tensor, saved: torch.Tensor):
    """Within float32 rounding of the logits' scale: the same operations, maybe in another order."""
    assert got.shape == saved.shape
    torch.testing.assert_close(got, saved, rtol=0, atol=1e-5 * float(saved.abs().max()))


@pytest.mark.parametrize('name', FOLDERS)
def test_a_hub_folder_saved_by_main_loads_and_answers_the_same(name, tmp_path):
    folder, saved, images, answers = published(name, tmp_path)
    model = timm.create_model(f'local-dir:{folder}', pretrained=True).eval()
    state = model.state_dict()
    assert state.keys() == saved.keys() and all(torch.equal(state[k], v) for k, v in saved.items())
    with torch.no_grad():
        assert_same_answer(model(images['images']), answers['images'])
    dynamic = timm.create_model(f'local-dir:{folder}', pretrained=True, dynamic_img_size=True).eval()
    with torch.no_grad():  # position embedding and AFT-full's u, v resampled to an 10 x 6 grid per call
        assert_same_answer(dynamic(images['images_80x48']), answers['images_80x48'])
        if 'images_112x72' in answers:  # AFT-conv's windows resampled for a 14 x 9 grid per call
            assert_same_answer(dynamic(images['images_112x72']), answers['images_112x72'])


@pytest.mark.parametrize('folder_name', FOLDERS)
def test_a_checkpoint_saved_by_main_loads_through_the_filter_and_answers_the_same(folder_name, tmp_path):
    folder, _, images, answers = published(folder_name, tmp_path)
    name, args = FOLDERS[folder_name]
    overlay = dict(file=str(folder / 'model.safetensors'), num_classes=10)
    model = timm.create_model(name, pretrained=True, **args, pretrained_cfg_overlay=overlay).eval()
    with torch.no_grad():
        assert_same_answer(model(images['images']), answers['images'])


@pytest.mark.parametrize('tag, name', [('aft_full_small.dinov2_lvd142m', 'aft_full_small_patch14_dinov2'),
                                       ('aft_full_base.clip_openai', 'aft_full_base_clip_quickgelu')])
def test_a_backbone_config_saved_by_main_rebuilds_its_architecture(tag, name):
    """config.json of a backbone tag (patch 14 and LayerScale; CLIP's pre-norm, epsilon and quick GELU) rebuilds the
    model main built: every state-dict key and shape; the name that holds that layout now builds the same."""
    folder = SAVED / tag
    model = timm.create_model(f'local-dir:{folder}', device='meta')
    shapes = json.loads((folder / 'shapes.json').read_text())
    assert {k: list(v.shape) for k, v in model.state_dict().items()} == shapes
    named = timm.create_model(name, device='meta', num_classes=0)
    assert {k: list(v.shape) for k, v in named.state_dict().items()} == shapes
    assert repr(named) == repr(model)
