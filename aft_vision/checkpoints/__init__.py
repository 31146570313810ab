"""Weight files (safe reading, atomic writing) and the DeiT / ViT -> AFT weight transfer: the ground floor, with
``layers``. May import torch, timm, safetensors and nothing else of aft_vision."""
from .files import atomic_dir, load_weights, save_figure, save_weights, sha256sum
from .transfer import TransferReport, is_vit_state_dict, select_weights, transfer_vit_weights, unwrap_state_dict
