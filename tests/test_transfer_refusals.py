"""Generated hostile transfer sources, each held to the transfer's rule: as strict as timm's loading. A non-finite
tensor of any kind is refused naming it; a tensor the model takes from a ViT that the source lacks is refused by name
(only the classifier and what AFT adds start fresh); a patch size, width, depth or family mismatch is named as such;
what the weights alone do not say (activation, norm epsilon) is printed as assumed; a file is read by what it holds, not
by its suffix. From the command line: one line on stderr, no traceback, nothing written. Sources are tiny timm ViTs with
random weights (64 wide, 2 blocks, 16-px patches, 64 px)."""
import functools
import re

import pytest
import timm
import torch
from safetensors.torch import save_file

import aft_vision  # noqa: F401  registers the models
from aft_vision.checkpoints import transfer_vit_weights
from aft_vision.cli import main as cli_main

TINY = dict(img_size=64, embed_dim=64, depth=2, num_heads=2)
FAMILIES = {'conv': 'aft_conv_test', 'vit': 'aft_full_test'}
MODEL_KWARGS = dict(patch_size=16, mlp_ratio=4., depth=2, num_classes=0)


@functools.lru_cache(maxsize=None)
def _source(name: str = 'deit_small_patch16_224', **kwargs) -> dict:
    torch.manual_seed(0)
    return timm.create_model(name, pretrained=False, **dict(TINY, **kwargs)).state_dict()


def source(name: str = 'deit_small_patch16_224', **kwargs) -> dict:
    """A fresh copy of a tiny source's state dict (each test edits its own)."""
    return {key: value.clone() for key, value in _source(name, **kwargs).items()}


def model(family: str, **kwargs) -> torch.nn.Module:
    return timm.create_model(FAMILIES[family], **dict(MODEL_KWARGS, **kwargs))


def refusal(state_dict: dict, target: torch.nn.Module, **kwargs) -> str:
    with pytest.raises(ValueError) as error:
        transfer_vit_weights(state_dict, target, **kwargs)
    text = str(error.value)
    assert '\n' not in text, text  # one line
    return text


def run_cli(args, tmp_path, capsys):
    """``aft-vision transfer ARGS --out tmp/out.safetensors``: exit code, stdout, stderr; nothing else written."""
    out = tmp_path / 'out.safetensors'
    before = set(tmp_path.iterdir())
    code = cli_main(['transfer', *args, '--model', 'aft_conv_test', '--out', str(out)])
    printed = capsys.readouterr()
    assert 'Traceback' not in printed.err
    if code:
        assert code == 2 and len(printed.err.strip().splitlines()) == 1, printed.err
        assert set(tmp_path.iterdir()) == before  # nothing written, no temporary left
    else:
        assert set(tmp_path.iterdir()) == before | {out}
    return code, printed.out, printed.err


# ---------------------------------------------------------------------------------------------------------------------
# Non-finite tensors: every kind of tensor of a DeiT, NaN, +inf or -inf in one entry, refused naming the tensor.
# ---------------------------------------------------------------------------------------------------------------------
KINDS = sorted({re.sub(r'^blocks\.\d+\.', 'blocks.1.', key) for key in _source()})


@pytest.mark.parametrize('value', [float('nan'), float('inf'), float('-inf')], ids=['nan', 'inf', '-inf'])
@pytest.mark.parametrize('key', KINDS)
def test_non_finite_source_tensor_is_refused_naming_it(key, value):
    state_dict = source()
    state_dict[key].view(-1)[-1] = value
    text = refusal(state_dict, model('conv'))
    assert f"'{key}' holds NaN or infinite values" in text


@pytest.mark.parametrize('key', ['blocks.0.attn.qkv.weight', 'head.bias', 'pos_embed'])
def test_non_finite_source_is_refused_by_the_cli_and_the_training_loaders(key, tmp_path, capsys):
    state_dict = source()
    state_dict[key].view(-1)[0] = float('nan')
    path = tmp_path / 'nan.safetensors'
    save_file(state_dict, str(path))
    code, _, err = run_cli(['--src', str(path), '--model-kwargs', 'depth=2'], tmp_path, capsys)
    assert code == 2 and f"'{key}' holds NaN" in err
    with pytest.raises(ValueError, match=re.escape(f"'{key}' holds NaN")):  # --init-from takes the same decision
        aft_vision.models.fit_checkpoint(state_dict, model('conv'))


# ---------------------------------------------------------------------------------------------------------------------
# Missing tensors: every source tensor left out in turn, for AFT-conv and AFT-full. What the model takes from a ViT is
# refused by name; what it does not take (the classifier; AFT-conv: class token and position embedding) converts.
# ---------------------------------------------------------------------------------------------------------------------
NOT_TAKEN = {'conv': ('head.', 'cls_token', 'pos_embed'), 'vit': ('head.',)}


@pytest.mark.parametrize('family', FAMILIES)
@pytest.mark.parametrize('key', sorted(_source()))
def test_a_tensor_the_model_takes_and_the_source_lacks_is_refused_by_name(key, family):
    state_dict = source()
    del state_dict[key]
    target = model(family)
    if key.startswith(NOT_TAKEN[family]):
        mapped, report = transfer_vit_weights(state_dict, target)
        target.load_state_dict(mapped)
        assert all(k.startswith('head.') or '.attn.pos_' in k for k in report.fresh)  # fresh by design only
        return
    text = refusal(state_dict, target)
    assert key in text and ('refused rather than left random' in text or 'is missing' in text), text


def test_the_report_lists_fresh_only_what_aft_adds():
    _, report = transfer_vit_weights(source(), model('conv'))
    assert {re.sub(r'^blocks\.\d+\.', '', key) for key in report.fresh} == {
        'attn.pos_weight', 'attn.pos_gamma', 'attn.pos_beta'}
    assert 'fresh     blocks.*.attn.pos_weight' in report.summary()


# ---------------------------------------------------------------------------------------------------------------------
# Mismatches named for what they are, with the argument that fits.
# ---------------------------------------------------------------------------------------------------------------------
MISMATCHES = [  # source arguments, model arguments, what the refusal says
    (dict(patch_size=8), {}, 'patch size mismatch at patch_embed.proj.weight: (8, 8) in the checkpoint, (16, 16) in '
                             'the model: build it with patch_size=(8, 8)'),
    ({}, dict(patch_size=8), 'patch size mismatch at patch_embed.proj.weight: (16, 16) in the checkpoint, (8, 8)'),
    ({}, dict(embed_dim=32), 'width mismatch at patch_embed.proj.weight: 64 in the checkpoint, 32 in the model: '
                             'build it with embed_dim=64'),
    (dict(embed_dim=128), {}, 'width mismatch at patch_embed.proj.weight: 128 in the checkpoint, 64'),
    ({}, dict(depth=3), 'depth mismatch: the checkpoint has 2 blocks (blocks.0-1), the model 3: build it with depth=2'),
    (dict(depth=1), {}, 'depth mismatch: the checkpoint has 1 blocks'),
    ({}, dict(init_values=1e-5), 'the checkpoint lacks blocks.0.ls1.gamma, blocks.0.ls2.gamma, blocks.1.ls1.gamma and '
                                 '1 more'),
    ({}, dict(pre_norm=True), "checkpoint key 'patch_embed.proj.bias' [64] has no counterpart"),  # CLIP's has none
]


@pytest.mark.parametrize('family', FAMILIES)
@pytest.mark.parametrize('source_args, model_args, message', MISMATCHES)
def test_mismatches_are_named_for_what_they_are(source_args, model_args, message, family):
    assert message in refusal(source(**source_args), model(family, **model_args))


FAMILY_MISMATCHES = [  # the file's architecture, --src-model, what differs
    ('deit_small_patch16_224', 'vit_small_patch14_dinov2', 'patch size: (16, 16) in the checkpoint, (14, 14) in'),
    ('deit_small_patch16_224', 'vit_base_patch16_clip_224', 'norm_pre: False in the checkpoint, True in'),
    ('deit_small_patch16_224', 'deit3_small_patch16_224', 'LayerScale: False in the checkpoint, True in'),
    ('deit_small_patch16_224', 'vit_base_patch16_siglip_224', 'class token: True in the checkpoint, False in'),
    ('vit_base_patch16_clip_224', 'deit_small_patch16_224', 'norm_pre: True in the checkpoint, False in'),
    ('deit3_small_patch16_224', 'vit_small_patch16_224', 'LayerScale: True in the checkpoint, False in'),
]


@pytest.mark.parametrize('file_arch, src_model, message', FAMILY_MISMATCHES)
def test_src_model_of_another_family_is_named_a_family_mismatch(file_arch, src_model, message, tmp_path, capsys):
    path = tmp_path / 'src.safetensors'
    save_file(source(file_arch), str(path))
    code, _, err = run_cli(['--src', str(path), '--src-model', src_model, '--model-kwargs', 'depth=2'], tmp_path,
                           capsys)
    assert code == 2 and f'family mismatch: the checkpoint is no {src_model} ({message} {src_model}' in err


@pytest.mark.parametrize('kwargs, message', [
    ('patch_size=8', 'patch size mismatch'), ('embed_dim=32', 'width mismatch'),
    ('depth=3', 'depth mismatch'), ('init_values=0.1', 'the checkpoint lacks blocks.0.ls1.gamma'),
])
def test_cli_names_the_mismatch_in_one_line(kwargs, message, tmp_path, capsys):
    path = tmp_path / 'deit.safetensors'
    save_file(source(), str(path))
    code, _, err = run_cli(['--src', str(path), '--model-kwargs', 'depth=2', *kwargs.split()], tmp_path, capsys)
    assert code == 2 and message in err


# ---------------------------------------------------------------------------------------------------------------------
# What the weights do not say: norm epsilon and activation, read from --src-model or printed as assumed.
# ---------------------------------------------------------------------------------------------------------------------
EPS_CASES = [  # the file's architecture, --src-model, the epsilon built, the lines printed as assumed
    ('deit_small_patch16_224', None, 1e-6, ['MLP activation GELU', 'LayerNorm epsilon 1e-06']),
    ('vit_base_patch16_clip_224', None, 1e-5, ['MLP activation GELU', 'LayerNorm epsilon 1e-05 (CLIP']),
    ('deit3_small_patch16_224', None, 1e-6, ['MLP activation GELU', 'LayerNorm epsilon 1e-06']),
    ('vit_base_patch16_clip_224', 'vit_base_patch16_clip_224', 1e-5, []),
    ('vit_base_patch16_clip_quickgelu_224', 'vit_base_patch16_clip_quickgelu_224', 1e-5, []),
    ('deit_small_patch16_224', 'deit_small_patch16_224', 1e-6, []),
    ('vit_small_patch16_224', 'vit_small_patch16_224', 1e-6, []),
]


@pytest.mark.parametrize('file_arch, src_model, eps, assumed', EPS_CASES)
def test_norm_eps_and_activation_are_read_or_printed_as_assumed(file_arch, src_model, eps, assumed, tmp_path,
                                                                capsys):
    path = tmp_path / 'src.safetensors'
    save_file(source(file_arch), str(path))
    args = ['--src', str(path), '--model-kwargs', 'depth=2'] + (['--src-model', src_model] if src_model else [])
    code, printed, _ = run_cli(args, tmp_path, capsys)
    assert code == 0
    lines = [line.split('assumed', 1)[1].strip() for line in printed.splitlines() if line.startswith('  assumed ')]
    assert len(lines) == len(assumed) and all(line.startswith(a) for line, a in zip(lines, assumed)), printed
    built = 'norm_eps=1e-05' in printed
    assert built == (eps == 1e-5)


# ---------------------------------------------------------------------------------------------------------------------
# Files read by what they hold: safetensors under any name; a pickle named .safetensors refused in one line.
# ---------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize('name', ['deit.pth', 'deit.bin', 'deit.pt', 'deit.ckpt', 'deit', 'deit.safetensors'])
def test_safetensors_under_any_suffix_converts(name, tmp_path, capsys):
    path = tmp_path / name
    save_file(source(), str(path))
    code, printed, _ = run_cli(['--src', str(path), '--model-kwargs', 'depth=2'], tmp_path, capsys)
    assert code == 0 and 'wrote' in printed


@pytest.mark.parametrize('name', ['deit.safetensors', 'deit.pth'])
def test_a_torch_pickle_converts_as_pth_and_is_refused_as_safetensors(name, tmp_path, capsys):
    path = tmp_path / name
    torch.save(source(), path)
    code, _, err = run_cli(['--src', str(path), '--model-kwargs', 'depth=2'], tmp_path, capsys)
    assert code == (2 if name.endswith('.safetensors') else 0)
    assert not code or 'is not a readable safetensors file' in err
