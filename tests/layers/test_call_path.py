"""One mixer call reads like SDPA's: the layer, the operator (check and plan once, then compute) and one form file.

Counted as a reader would follow it: the distinct functions of the package a second call enters (the first builds
what a layer caches), by ``sys.setprofile`` over the package's frames, under either device policy. The test prints the
counts (``pytest -s``), so any reader can rerun them."""
import collections
import os
import sys

import pytest
import timm
import torch

import aft_vision
from aft_vision.layers import AFTFull, AFTSimple, device_policy

PACKAGE = os.path.dirname(aft_vision.__file__)


def walk(layer, x, policy):
    """The package functions (file, name) that ``layer(x)``'s second call enters under ``policy``, in order."""
    seen = collections.OrderedDict()

    def profile(frame, event, arg):
        if event == 'call' and frame.f_code.co_filename.startswith(PACKAGE):
            seen[(os.path.relpath(frame.f_code.co_filename, PACKAGE), frame.f_code.co_name)] = None

    with device_policy(policy):
        layer(x)
        sys.setprofile(profile)
        try:
            layer(x)
        finally:
            sys.setprofile(None)
    return list(seen)


LAYERS = {  # (layer, input, most functions, most files): aft_conv_test's first block at 32 px, as timm builds it
    'AFTConv2d': (lambda: timm.create_model('aft_conv_test').blocks[0].attn, (2, 4, 4, 64), 10, 3),
    'AFTFull': (lambda: AFTFull(64, 16), (2, 16, 64), 8, 3),
    'AFTSimple': (lambda: AFTSimple(64), (2, 16, 64), 8, 3),
}


@pytest.mark.parametrize('policy', ['cpu', 'cuda'])
@pytest.mark.parametrize('name', list(LAYERS))
def test_a_mixer_call_is_a_short_path(name, policy):
    build, shape, most_functions, most_files = LAYERS[name]
    torch.manual_seed(0)
    path = walk(build(), torch.randn(shape), policy)
    files = sorted({file for file, _ in path})
    report = f"{name} ({policy}): {len(path)} functions in {len(files)} files: " + ', '.join(
        f'{file}:{function}' for file, function in path)
    print(report)
    assert len(path) <= most_functions and len(files) <= most_files, report
