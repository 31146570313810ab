"""The transfer from the ViTs people start from (DeiT III, DINOv2 with and without registers, CLIP with GELU and
QuickGELU, SigLIP, EVA-02) into AFT-conv and AFT-full: each source built by timm at a tiny size with random weights,
its layout read from timm's model, every carried tensor bit-equal, the carried MLP / LayerScale / pre-norm computing
the source's function, the converted model running at two sizes, and one-line refusals naming the key."""
import warnings

import pytest
import timm
import torch
from safetensors.torch import load_file, save_file

import aft_vision  # noqa: F401  registers the models
from aft_vision.checkpoints import transfer_vit_weights
from aft_vision.checkpoints.sources import infer_layout, read_layout
from aft_vision.cli import main as cli_main

# timm name -> patch size; each is built with embed_dim=64, depth=2, num_heads=2 at 4 x 4 patches
SOURCES = {'deit3_small_patch16_224': 16, 'vit_small_patch14_dinov2': 14, 'vit_small_patch14_reg4_dinov2': 14,
           'vit_base_patch16_clip_224': 16, 'vit_base_patch16_clip_quickgelu_224': 16,
           'vit_base_patch16_siglip_224': 16, 'eva02_small_patch14_224': 14}
FAMILIES = {'conv': 'aft_conv_test', 'vit': 'aft_full_test'}


def tiny_source(name):
    torch.manual_seed(0)
    return timm.create_model(name, pretrained=False, img_size=SOURCES[name] * 4, embed_dim=64, depth=2,
                             num_heads=2).eval()


def converted(name, family, source):
    layout = read_layout(source, name)
    kwargs = dict(layout.model_args(family), depth=2, num_classes=0)
    if family == 'vit':
        kwargs['img_size'] = SOURCES[name] * 3  # another grid than the source's: the position embedding resampled
    model = timm.create_model(FAMILIES[family], **kwargs).eval()
    state_dict, report = transfer_vit_weights(source.state_dict(), model, layout=layout)
    model.load_state_dict(state_dict)
    return model, report, layout


@pytest.mark.parametrize('family', FAMILIES)
@pytest.mark.parametrize('name', SOURCES)
def test_every_source_converts_with_its_tensors_bit_equal(name, family):
    source = tiny_source(name)
    model, report, layout = converted(name, family, source)
    src, dst = source.state_dict(), model.state_dict()
    accounted = {k.split('[')[0] for k in report.skipped} | set(report.resampled)
    for key in report.copied:
        if key.endswith('attn.qkv.bias') and key in report.renamed:  # EVA's q / v biases, one q / k / v bias here
            block = key[:-len('attn.qkv.bias')]
            q, v = src[f'{block}attn.q_bias'], src[f'{block}attn.v_bias']
            assert torch.equal(dst[key], torch.cat([q, torch.zeros_like(q), v]))
        else:
            src_key = report.renamed.get(key, key).split(' ')[0]
            assert torch.equal(dst[key], src[src_key]), key
            accounted.add(src_key)
    dim = source.embed_dim
    for key in report.partial:  # AFT-conv's values: the source's value rows, bit for bit
        if key in report.renamed:
            src_values = src[key.replace('qkv.bias', 'v_bias')]
        else:
            src_values = src[key][2 * dim:]
        assert torch.equal(dst[key][-dim:], src_values), key
        accounted.add(key)
    accounted |= {k for k in src if k.endswith(('attn.q_bias', 'attn.v_bias'))}  # checked above
    assert accounted >= set(src), set(src) - accounted  # every source tensor carried, resampled or dropped with why
    assert all(why for why in report.skipped.values())
    for size in (SOURCES[name] * 3, SOURCES[name] * 5):
        if family == 'vit':
            model.set_input_size(img_size=size)
        out = model(torch.randn(2, 3, size, size))
        assert out.shape == (2, 64) and torch.isfinite(out).all()
    unseen = ('act_layer', 'norm_eps')  # the keys show all but the activation and CLIP's LayerNorm epsilon
    inferred = {k: v for k, v in infer_layout(src).model_args(family).items() if k not in unseen}
    assert inferred == {k: v for k, v in layout.model_args(family).items() if k not in unseen}


@pytest.mark.parametrize('name', SOURCES)
def test_carried_parts_compute_the_sources_function(name):
    """The MLP (activation, SwiGLU's gate order), LayerScale and pre-norm of the converted block give the source's
    outputs on the same tokens: what is carried carries function, not only numbers."""
    source = tiny_source(name)
    model, _, _ = converted(name, 'vit', source)
    x = torch.randn(2, 5, 64)
    src_block, block = source.blocks[1], model.blocks[1]
    src_ls2 = getattr(src_block, 'ls2', None) or (lambda y: y)
    with torch.no_grad():
        assert torch.equal(block.ls2(block.mlp(block.norm2(x))), src_ls2(src_block.mlp(src_block.norm2(x))))
        assert torch.equal(model.norm_pre(x), source.norm_pre(x))
        if hasattr(src_block, 'ls1'):
            assert torch.equal(block.ls1(x), src_block.ls1(x))


def test_refusals_name_the_key():
    source = tiny_source('deit3_small_patch16_224')
    plain = timm.create_model('aft_conv_test', patch_size=16, mlp_ratio=4., depth=2)  # no LayerScale
    with pytest.raises(ValueError, match=r"'blocks.0.ls1.gamma' \[64\] has no counterpart .*init_values"):
        transfer_vit_weights(source.state_dict(), plain)
    clip = tiny_source('vit_base_patch16_clip_quickgelu_224')
    gelu = timm.create_model('aft_full_test', patch_size=16, mlp_ratio=4., depth=2, pre_norm=True)
    with pytest.raises(ValueError, match="uses quick_gelu, the model GELU: build it with act_layer='quick_gelu'"):
        transfer_vit_weights(clip.state_dict(), gelu, layout=read_layout(clip))
    wide = timm.create_model('aft_conv_test', patch_size=16, embed_dim=128, mlp_ratio=4., depth=2, init_values=1e-5)
    with pytest.raises(ValueError, match='width mismatch at patch_embed.proj.weight'):
        transfer_vit_weights(source.state_dict(), wide)
    hybrid = timm.create_model('vit_tiny_r_s16_p8_224', pretrained=False, depth=1, img_size=64)
    with pytest.raises(ValueError, match="hybrid CNN stem \\(key 'patch_embed.backbone'\\)"):
        read_layout(hybrid)
    with pytest.raises(ValueError, match="hybrid CNN stem \\(key 'patch_embed.backbone.conv.weight'\\)"):
        transfer_vit_weights(hybrid.state_dict(), plain)  # the keys alone say it too
    eva_base = timm.create_model('eva02_base_patch14_224', pretrained=False, depth=1, embed_dim=64, num_heads=2)
    with pytest.raises(ValueError, match="SwiGLU \\(key 'blocks.0.mlp.fc1_g.weight'\\)"):
        read_layout(eva_base)


def test_cli_reads_a_files_layout_from_src_model(tmp_path, capsys):
    source = tiny_source('vit_base_patch16_clip_quickgelu_224')
    path = tmp_path / 'clip.safetensors'
    save_file(source.state_dict(), str(path))
    out = tmp_path / 'aft.safetensors'
    args = ['transfer', '--src', str(path), '--model', 'aft_full_test', '--out', str(out), '--model-kwargs', 'depth=2']
    assert cli_main(args + ['--src-model', 'vit_base_patch16_clip_quickgelu_224']) == 0
    printed = capsys.readouterr().out
    assert 'act_layer=quick_gelu' in printed and 'norm_eps=1e-05' in printed and 'norm_pre' in printed
    model = timm.create_model('aft_full_test', patch_size=16, mlp_ratio=4., pre_norm=True, act_layer='quick_gelu',
                              norm_eps=1e-5, depth=2, num_classes=0)
    model.load_state_dict(load_file(str(out)))  # the printed arguments rebuild the written model
    assert torch.equal(model.norm_pre.weight, source.norm_pre.weight)
    assert cli_main(args + ['--force']) == 0  # without --src-model: GELU assumed, and said
    assert 'assumed   MLP activation GELU' in capsys.readouterr().out


# ---------------------------------------------------------------------------------------------------------------------
# Backbone tags: the source's own Hub files converted on load, offline (a Hub cache the test fills itself).
# ---------------------------------------------------------------------------------------------------------------------
BACKBONE_TAGS = [t for t in timm.list_pretrained('aft_*') if not t.endswith('.deit_in1k')]
# the backbone tags of today's main ('size.tag', the model built to the source's layout by the tag), and their names now
DEPRECATED = {
    'aft_conv_small.deit3_in1k': 'aft_conv_small_deit3.fb_in1k',
    'aft_conv_small.dinov2_lvd142m': 'aft_conv_small_patch14_dinov2.lvd142m',
    'aft_conv_small.dinov2_reg4_lvd142m': 'aft_conv_small_patch14_dinov2.reg4_lvd142m',
    'aft_conv_small.eva02_mim_in22k': 'aft_conv_small_patch14_eva02.mim_in22k',
    'aft_conv_base.clip_laion2b': 'aft_conv_base_clip.laion2b',
    'aft_conv_base.clip_openai': 'aft_conv_base_clip_quickgelu.openai',
    'aft_full_small.deit3_in1k': 'aft_full_small_deit3.fb_in1k',
    'aft_full_small.dinov2_lvd142m': 'aft_full_small_patch14_dinov2.lvd142m',
    'aft_full_small.dinov2_reg4_lvd142m': 'aft_full_small_patch14_dinov2.reg4_lvd142m',
    'aft_full_small.eva02_mim_in22k': 'aft_full_small_patch14_eva02.mim_in22k',
    'aft_full_base.clip_laion2b': 'aft_full_base_clip.laion2b',
    'aft_full_base.clip_openai': 'aft_full_base_clip_quickgelu.openai',
    'aft_full_base.siglip_webli': 'aft_full_base_siglip.webli',
}


def structure(model):
    """What makes an architecture: modules (with their sizes, epsilons, activations), tensors and pooling."""
    return repr(model), [(k, tuple(v.shape)) for k, v in model.state_dict().items()], getattr(model, 'global_pool', 0)


def in_layout(base, source, **kwargs):
    """What today's main built for a backbone tag: the DeiT-layout model ``base`` with the source's layout arguments."""
    family = 'conv' if base.startswith('aft_conv') else 'vit'
    layout = read_layout(timm.create_model(source.split('.')[0], pretrained=False, device='meta'))
    return timm.create_model(base, device='meta', **layout.model_args(family), **kwargs)


def test_every_backbone_tag_builds_its_sources_layout_with_its_preprocessing():
    assert len(BACKBONE_TAGS) == 14
    for tag in BACKBONE_TAGS:
        cfg = timm.models.get_pretrained_cfg(tag)
        source = cfg.notes[0].split(' ')[0]
        src_cfg = timm.models.get_pretrained_cfg(source)
        assert cfg.hf_hub_id == src_cfg.hf_hub_id and (cfg.mean, cfg.std) == (src_cfg.mean, src_cfg.std), tag
        assert cfg.num_classes == 0 and 'initialisation for fine-tuning' in cfg.notes[0]
        architecture = tag.split('.')[0]
        model = timm.create_model(architecture, device='meta', num_classes=0)  # the name alone, as config.json has it
        assert structure(model) == structure(timm.create_model(tag, device='meta')), tag  # the tag chooses weights only
        base = '_'.join(architecture.split('_')[:3])  # aft_conv_small, aft_full_base: DeiT's layout
        assert structure(model) == structure(in_layout(base, source, num_classes=0)), tag
        if cfg.pool_size:
            patch = model.patch_embed.patch_size
            assert cfg.pool_size == tuple(s // p for s, p in zip(cfg.input_size[1:], patch)), tag


@pytest.mark.parametrize('old', DEPRECATED)
def test_a_backbone_tag_of_main_builds_its_architecture_under_its_name_now(old):
    """Each backbone tag that built another architecture than its name's is deprecated: built (with timm's warning
    naming the current name) as main built it, under the name and tag that hold that layout."""
    current = DEPRECATED[old]
    assert old not in timm.list_pretrained('aft_*') and current in timm.list_pretrained('aft_*')
    with pytest.warns(UserWarning, match=f'deprecated model name {old} to current {current}'):
        model = timm.create_model(old, device='meta', num_classes=5)
    source = timm.models.get_pretrained_cfg(current).notes[0].split(' ')[0]
    assert structure(model) == structure(in_layout(old.split('.')[0], source, num_classes=5))
    assert (model.pretrained_cfg['architecture'], model.pretrained_cfg['tag']) == tuple(current.split('.'))


@pytest.mark.parametrize('tag', ['aft_conv_small_patch14_dinov2.reg4_lvd142m', 'aft_full_small_patch14_eva02.mim_in22k',
                                 'aft_conv_small.dinov2_reg4_lvd142m'])
def test_backbone_tag_loads_its_sources_hub_file(tag, tmp_path, offline_hub):
    """The tag's source weights, converted on load; a deprecated tag of main loads its current tag's."""
    source_name = timm.models.get_pretrained_cfg(DEPRECATED.get(tag, tag)).notes[0].split(' ')[0]
    torch.manual_seed(0)
    source = timm.create_model(source_name, pretrained=False).eval()
    folder = tmp_path / 'source'
    timm.models.save_for_hf(source, str(folder), safe_serialization=True)
    offline_hub(source.pretrained_cfg['hf_hub_id'], folder)
    with warnings.catch_warnings():
        warnings.filterwarnings('ignore', 'Mapping deprecated model name')
        model = timm.create_model(tag, pretrained=True).eval()
    state = model.state_dict()
    for key in ('blocks.3.mlp.fc1.weight', 'blocks.3.norm2.bias', 'patch_embed.proj.weight'):
        assert torch.equal(state[key], source.state_dict()[key]), key
    if 'dinov2' in tag:
        assert torch.equal(state['blocks.5.ls2.gamma'], source.blocks[5].ls2.gamma)
    else:  # EVA-02: q / v biases into one, fc_norm as the final norm
        assert torch.equal(state['norm.weight'], source.fc_norm.weight)
        assert torch.equal(state['blocks.0.attn.qkv.bias'][-384:], source.blocks[0].attn.v_bias)
    size = model.pretrained_cfg['input_size'][-1]
    out = model(torch.randn(1, 3, size, size))
    assert out.shape == (1, 384) and torch.isfinite(out).all()


def test_hf_hub_source_through_the_command(tmp_path, offline_hub, capsys):
    """An ``hf-hub:`` source (timm's save_for_hf layout, offline): its layout read from the model timm rebuilds from
    config.json. The command's ``run`` is called directly: ``cli/args.py`` still refuses an ``hf-hub:`` --src."""
    import argparse
    from aft_vision.cli import transfer as transfer_command

    source = tiny_source('vit_small_patch14_reg4_dinov2')
    folder = tmp_path / 'repo'
    timm.models.save_for_hf(source, str(folder), safe_serialization=True,
                            model_args=dict(img_size=56, embed_dim=64, depth=2, num_heads=2))
    offline_hub('me/tiny-dinov2', folder)
    out = tmp_path / 'aft.safetensors'
    args = argparse.Namespace(src='hf-hub:me/tiny-dinov2', src_model=None, model='aft_conv_test', out=str(out),
                              model_kwargs={'depth': 2}, num_classes=0, force=False, use_ema=True)
    assert transfer_command.run(args) == 0
    printed = capsys.readouterr().out
    assert 'patch_size=14' in printed and 'init_values=1e-05' in printed and 'reg_token: 4 register tokens' in printed
    converted_weights = load_file(str(out))
    for key in ('blocks.1.ls2.gamma', 'blocks.1.mlp.fc2.weight', 'patch_embed.proj.weight'):
        assert torch.equal(converted_weights[key], source.state_dict()[key]), key


@pytest.mark.parametrize('mlp_layer', ['mlp', 'swiglu_packed'])
def test_new_block_arguments_record_in_the_channel_first_layout(mlp_layer):
    """AFT-conv with LayerScale, pre-norm, QuickGELU, CLIP's epsilon (and EVA's MLP) records the same function in the
    NCHW layout exported graphs use as it runs eagerly."""
    from aft_vision.models.aft_conv import export_layout

    torch.manual_seed(0)
    model = timm.create_model('aft_conv_test', init_values=0.1, pre_norm=True, act_layer='quick_gelu', norm_eps=1e-5,
                              mlp_layer=mlp_layer).eval()
    assert model.norm_pre.eps == model.blocks[0].norm1.eps == 1e-5 and model.patch_embed.proj.bias is None
    images = torch.randn(2, 3, 64, 64)
    with torch.no_grad(), export_layout(model, 'NCHW'):
        traced = torch.jit.trace(model, images)
        torch.testing.assert_close(traced(images), model(images), rtol=1e-4, atol=1e-5)
