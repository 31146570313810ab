"""AFT-full and AFT-simple answer timm's ViT calls as timm 1.0.31's ``VisionTransformer`` does: intermediates as a
dict and with prefix tokens, ``is_causal`` (the operators' causal form), ``attn_mask`` (AFT-full: an extra bias;
AFT-simple: refused); and their graphs export as timm's ViT's do (the dynamo ONNX exporter at opset 17, torch.export
with dynamic height and width)."""
import copy

import pytest
import timm
import torch

import aft_reference as ref
import aft_vision  # noqa: F401  registers the models
from deploy_cases import quiet

FAMILIES = ['aft_full_test', 'aft_simple_test']
GRID = dict(img_size=64, patch_size=8)


def build(name, **kwargs):
    torch.manual_seed(0)
    model = timm.create_model(name, **dict(GRID, **kwargs)).eval()
    with torch.no_grad():  # AFT-full's factors drawn, so that every bias entry matters
        for pname, param in model.named_parameters():
            if '.attn.pos_' in pname:
                param.normal_()
    return model


def shapes(tree):
    """The nested structure of ``tree`` with each tensor as its shape."""
    if isinstance(tree, torch.Tensor):
        return tuple(tree.shape)
    if isinstance(tree, dict):
        return {k: shapes(v) for k, v in tree.items()}
    return type(tree)(shapes(v) for v in tree)


@pytest.mark.parametrize('name', FAMILIES)
@pytest.mark.parametrize('kwargs', [dict(output_dict=True), dict(output_dict=True, return_prefix_tokens=True),
                                    dict(output_dict=True, intermediates_only=True), dict(return_prefix_tokens=True),
                                    dict(indices=2, output_fmt='NLC', return_prefix_tokens=True, norm=True)],
                         ids=lambda kw: '-'.join(kw))
def test_forward_intermediates_answers_as_timms_vit(name, kwargs):
    vit = build('test_vit', depth=4, embed_dim=64)  # the AFT test models' trunk, timm's attention
    model = build(name)
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        ours, theirs = model.forward_intermediates(x, **kwargs), vit.forward_intermediates(x, **kwargs)
        assert shapes(ours) == shapes(theirs)
        if kwargs.get('output_dict') and not kwargs.get('intermediates_only'):
            torch.testing.assert_close(ours['image_features'], model.forward_features(x))


@pytest.mark.parametrize('name', FAMILIES)
def test_is_causal_is_the_operators_causal_form(name):
    model = build(name)
    causal = copy.deepcopy(model)
    for blk in causal.blocks:
        blk.attn.causal = True
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        expected = causal(x)
        assert not torch.allclose(expected, model(x))
        torch.testing.assert_close(model(x, is_causal=True), expected, rtol=0, atol=0)
        taps = model.forward_intermediates(x, is_causal=True, intermediates_only=True, output_fmt='NLC')
        torch.testing.assert_close(taps[-1], causal.forward_intermediates(x, intermediates_only=True,
                                                                          output_fmt='NLC')[-1], rtol=0, atol=0)


def test_aft_full_takes_attn_mask_as_a_bias():
    """A boolean (T, T) mask keeps the keys where it is True: the lower triangle gives the causal form (another code
    path: -inf in the bias against the operator's causal sums), a zero float mask changes nothing, one per image is
    refused."""
    model = build('aft_full_test')
    exact = copy.deepcopy(model).double()
    x = torch.randn(2, 3, 64, 64)
    tokens = 1 + 8 * 8
    lower = torch.ones(tokens, tokens, dtype=torch.bool).tril()
    with torch.no_grad():
        ref.assert_model_agrees(model(x, attn_mask=lower), exact(x.double(), is_causal=True),
                                model(x, is_causal=True), label='tril mask')
        torch.testing.assert_close(model(x, attn_mask=torch.zeros(1, 1, tokens, tokens)), model(x), rtol=0, atol=0)
        with pytest.raises(ValueError, match=r'one \(65, 65\) mask for all images.*got shape \[2, 1, 65, 65\]'):
            model(x, attn_mask=torch.zeros(2, 1, tokens, tokens))


def test_aft_simple_refuses_attn_mask_in_one_line():
    model = build('aft_simple_test')
    with pytest.raises(ValueError, match='AFT-simple takes no attn_mask: .*is_causal=True'):
        model(torch.randn(1, 3, 64, 64), attn_mask=torch.ones(65, 65, dtype=torch.bool))


# ---------------------------------------------------------------------------------------------------------------------
# exports, in 2 of the test models' 4 blocks (every block records the same operators)


def agrees(model, graph_output, x, label):
    with torch.no_grad():
        ref.assert_model_agrees(graph_output, copy.deepcopy(model).double()(x.double()), model(x), label=label)


@pytest.mark.parametrize('name', FAMILIES)
def test_dynamo_onnx_export_at_opset_17_runs_in_onnxruntime(name, tmp_path):
    pytest.importorskip('onnxscript')
    ort = pytest.importorskip('onnxruntime')
    model = build(name, depth=2)
    path = str(tmp_path / 'model.onnx')
    with quiet():  # the exporter's warnings and report
        torch.onnx.export(model, (torch.randn(2, 3, 64, 64),), path, dynamo=True, opset_version=17)
    x = torch.randn(2, 3, 64, 64)  # fresh images, the export's batch
    session = ort.InferenceSession(path, providers=['CPUExecutionProvider'])
    got = torch.from_numpy(session.run(None, {session.get_inputs()[0].name: x.numpy()})[0])
    agrees(model, got, x, f'{name} dynamo opset 17')


@pytest.mark.parametrize('name', FAMILIES)
def test_torch_export_with_dynamic_height_and_width_runs_at_every_multiple_of_the_patch(name):
    from torch.export import Dim
    model = build(name, depth=2, dynamic_img_size=True)
    dims = {0: Dim('batch', min=1, max=8), 2: 8 * Dim('grid_h', min=1, max=32), 3: 8 * Dim('grid_w', min=1, max=32)}
    program = torch.export.export(model, (torch.randn(2, 3, 64, 64),), dynamic_shapes={'x': dims})
    for size in [(64, 64), (96, 96), (96, 64), (40, 120)]:
        x = torch.randn(1, 3, *size)
        with torch.no_grad():
            agrees(model, program.module()(x), x, f'{name} torch.export at {size}')
