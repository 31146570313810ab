"""The YAML recipes in models/: every model is registered and, given timm's train.py, every key is one of its args."""
import os
import runpy
from pathlib import Path

import pytest
import timm
import yaml

import aft_vision  # noqa: F401

RECIPES = sorted((Path(__file__).parents[1] / 'models').glob('*.yaml'))


def test_there_is_a_recipe_per_table7_model_and_table8():
    names = {yaml.safe_load(p.read_text())['model'] for p in RECIPES}
    assert names == {'aft_full_tiny', 'aft_full_small', 'aft_conv_tiny_11_h32', 'aft_conv_tiny_11',
                     'aft_conv_small_11_h16', 'aft_conv_small_11', 'aft_conv_small_15', 'aft_conv_base_25_h32'}


@pytest.mark.parametrize('recipe', RECIPES, ids=lambda p: p.stem)
def test_recipe_models_are_registered_and_follow_the_deit_recipe(recipe):
    config = yaml.safe_load(recipe.read_text())
    assert timm.is_model(config['model'])
    recipe = (config['opt'], config['lr_base'], config['lr_base_size'], config['weight_decay'])
    assert recipe == ('adamw', 5e-4, 512, 0.05)
    assert config['lr_base_scale'] == 'linear' and config['warmup_epochs'] == 5 and config['smoothing'] == 0.1


@pytest.mark.skipif('AFT_TIMM_SCRIPTS' not in os.environ, reason='set AFT_TIMM_SCRIPTS to a timm checkout')
@pytest.mark.parametrize('recipe', RECIPES, ids=lambda p: p.stem)
def test_every_key_is_a_train_py_argument(recipe):
    namespace = runpy.run_path(str(Path(os.environ['AFT_TIMM_SCRIPTS']) / 'train.py'), run_name='not_main')
    dests = {action.dest for action in namespace['parser']._actions}
    assert set(yaml.safe_load(recipe.read_text())) <= dests
