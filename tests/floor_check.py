"""Run by tests/test_dependency_floors.py with the declared minimum timm, huggingface_hub and safetensors first on
``sys.path``: import the package, build a model, run it, publish it (dry run), reload the folder through timm, load a
``.deit_in1k`` tag through huggingface_hub's download code, and touch the upload and safetensors APIs the package uses.

Usage: ``python floor_check.py FOLDER``, with ``HF_HUB_OFFLINE=1`` and the Hub cache at ``FOLDER/cache``. Prints the
versions it ran on as JSON, then ``ok``.
"""
import json
import sys
from pathlib import Path

import huggingface_hub
import safetensors
import timm
import torch
from huggingface_hub import HfApi
from huggingface_hub.hf_api import RepoUrl

import aft_vision
from aft_vision.checkpoints import load_weights, save_weights
from aft_vision.hub import publish

print(json.dumps({m.__name__: [m.__version__, m.__file__] for m in (timm, huggingface_hub, safetensors)}))
root = Path(sys.argv[1])
torch.manual_seed(0)
model = timm.create_model('aft_conv_test', num_classes=3).eval()
x = torch.randn(2, 3, 64, 64)
with torch.no_grad():
    out = model(x)
assert out.shape == (2, 3) and torch.isfinite(out).all()
save_weights(model.state_dict(), root / 'w.safetensors')
publish(str(root / 'w.safetensors'), 'aft_conv_test', 'me/aft', out_dir=str(root / 'hub'), dry_run=True,
        data_config={'input_size': 64, 'crop_pct': 0.95})
reloaded = timm.create_model(f'local-dir:{root / "hub"}', pretrained=True).eval()
with torch.no_grad():
    assert torch.equal(reloaded(x), out)

# a .deit_in1k tag: a random DeiT placed in the offline cache under its real repository name
deit = timm.create_model('deit_tiny_patch16_224')
repo = root / 'cache' / 'models--timm--deit_tiny_patch16_224.fb_in1k'
timm.models.save_for_hf(deit, str(repo / 'snapshots' / ('a' * 40)), safe_serialization=True)
(repo / 'refs').mkdir()
(repo / 'refs' / 'main').write_text('a' * 40)
backbone = timm.create_model('aft_conv_tiny.deit_in1k', pretrained=True, num_classes=5)
assert torch.equal(backbone.blocks[0].mlp.fc1.weight, deit.blocks[0].mlp.fc1.weight)

# the upload path's client, and what its create_repo returns (publish reads .repo_id)
HfApi(library_name='aft_vision', library_version=aft_vision.__version__)
assert RepoUrl('https://huggingface.co/me/aft').repo_id == 'me/aft'
# a damaged safetensors file: safetensors' own error, turned into a ValueError
(root / 'bad.safetensors').write_bytes((root / 'w.safetensors').read_bytes()[:100])
try:
    load_weights(root / 'bad.safetensors')
except ValueError as error:
    assert 'not a readable safetensors file' in str(error), error
else:
    raise AssertionError('a truncated safetensors file was read')
print('ok')
