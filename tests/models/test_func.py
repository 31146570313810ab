"""torch.func on the model families, as on timm's ViT: ``functional_call``, ``grad``, ``vmap(grad)`` (per-sample
gradients) and ``jacrev`` equal plain autograd (the model's own backward, one image at a time), in float64 where
rounding alone separates the plain forms a transform takes from the autograd Functions (1e-10 relative allowed). Then
the client that needs it: Opacus's ``GradSampleModule``, which computes the per-sample gradients of the layers it does
not know (AFT-conv's and AFT-full's mixers, timm's LayerNorm, the position parameters) by torch.func."""
import pytest
import torch
import torch.nn.functional as F

from aft_vision.layers import convert_to_onehot
from models_common import create

SIZE = 32  # a 4 x 4 patch grid (patch 8): AFT-conv's 5 x 5 window covers part of it
MODELS = {
    'aft_conv_test[dense]': ('aft_conv_test', {'mixer_kwargs': {'method': 'dense'}}),
    'aft_conv_test[conv]': ('aft_conv_test', {'mixer_kwargs': {'method': 'conv'}}),
    'aft_conv_test[auto]': ('aft_conv_test', {'mixer_kwargs': {'method': 'auto'}}),
    'aft_conv_test[tuned]': ('aft_conv_test', {'mixer_kwargs': {'method': 'tuned'}}),  # recorded choice, else table
    'aft_conv_test[onehot]': ('aft_conv_test', {}),  # converted to the one-hot mixer, in eval: the indexing form
    'aft_full_test': ('aft_full_test', {}),
    'aft_simple_test': ('aft_simple_test', {}),
}


def tiny(key, trained_like):
    """The family's test model in float64 at ``SIZE`` pixels, two blocks, three classes, in eval mode; AFT-conv's
    position biases as after training (at initialisation they are constant per head)."""
    name, model_kwargs = MODELS.get(key, (key, {}))
    model = trained_like(create(name, img_size=SIZE, depth=2, num_classes=3, **model_kwargs).double())
    return convert_to_onehot(model).eval() if key.endswith('[onehot]') else model


def assert_close64(got, want, scale, label):
    """Float64 results rounding apart: 1e-10 of the entry, or of ``scale`` (the largest gradient entry), as
    entries near 0 are what is left of terms that cancel."""
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10 * scale, msg=label)


def largest(tensors):
    return max(t.abs().max().item() for t in tensors)


@pytest.mark.parametrize('key', list(MODELS))
def test_torch_func_transforms_match_autograd(key, one_thread, trained_like):
    model = tiny(key, trained_like)
    images = torch.randn(3, 3, SIZE, SIZE, dtype=torch.float64)
    labels = torch.tensor([0, 2, 1])
    params = {name: p.detach() for name, p in model.named_parameters()}

    def loss(params, images, labels):
        return F.cross_entropy(torch.func.functional_call(model, params, (images,)), labels)

    def sample_loss(params, image, label):
        return loss(params, image[None], label[None])

    logits = torch.func.functional_call(model, params, (images,))
    batch = torch.func.grad(loss)(params, images, labels)
    per_sample = torch.func.vmap(torch.func.grad(sample_loss), in_dims=(None, 0, 0))(params, images, labels)
    jacobian = torch.func.jacrev(lambda image: torch.func.functional_call(model, params, (image,)))(images[:1])

    assert_close64(logits, model(images).detach(), largest([logits]), f'{key} functional_call')
    model.zero_grad()
    F.cross_entropy(model(images), labels).backward()
    scale = largest(p.grad for p in model.parameters())
    for name, p in model.named_parameters():
        assert_close64(batch[name], p.grad, scale, f'{key} grad {name}')
    for b in range(3):
        model.zero_grad()
        F.cross_entropy(model(images[b:b + 1]), labels[b:b + 1]).backward()
        for name, p in model.named_parameters():
            assert_close64(per_sample[name][b], p.grad, scale, f'{key} per-sample grad {name}[{b}]')
    rows = torch.autograd.functional.jacobian(model, images[:1])  # (1, 3) logits of (1, 3, H, W) pixels
    assert_close64(jacobian, rows, largest([rows]), f'{key} jacrev')


@pytest.mark.parametrize('name', ['aft_conv_test', 'aft_conv_test[tuned]', 'aft_full_test'])
def test_opacus_per_sample_gradients_equal_one_image_batches(name, one_thread, trained_like):
    """Two SGD steps under ``GradSampleModule``: each step's ``grad_sample`` equals the gradients of one-image
    batches of the same weights (a copy updated alike), and the summed loss's gradient is their sum."""
    opacus = pytest.importorskip('opacus')
    torch.manual_seed(0)
    model = tiny(name, trained_like).train()
    twin = tiny(name, trained_like).train()
    twin.load_state_dict(model.state_dict())
    private = opacus.GradSampleModule(model, loss_reduction='sum')  # sum: grad_sample is each image's own gradient
    optimizer, twin_optimizer = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (private, twin))
    for step in range(2):
        images = torch.randn(3, 3, SIZE, SIZE, dtype=torch.float64)
        labels = torch.tensor([0, 2, 1])
        private.zero_grad(set_to_none=True)
        F.cross_entropy(private(images), labels, reduction='sum').backward()
        scale = largest(p.grad for p in model.parameters())
        for b in range(3):
            twin.zero_grad()
            F.cross_entropy(twin(images[b:b + 1]), labels[b:b + 1], reduction='sum').backward()
            for (param_name, p), one in zip(model.named_parameters(), twin.parameters()):
                assert_close64(p.grad_sample[b], one.grad, scale, f'{name} step {step} {param_name}[{b}]')
        for param_name, p in model.named_parameters():
            assert_close64(p.grad_sample.sum(0), p.grad, scale, f'{name} step {step} {param_name}: sum of samples')
        optimizer.step()
        twin.zero_grad()
        F.cross_entropy(twin(images), labels, reduction='sum').backward()
        twin_optimizer.step()
