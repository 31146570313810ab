"""Weight files (safe reading, atomic writing) and the DeiT / ViT -> AFT weight transfer: the ground floor, with
``layers``. May import torch, timm, safetensors and ``aft_vision.plots`` (``save_figure``, re-exported from 0.1.0)."""
from ..plots import save_figure
from .files import atomic_dir, check_output_dir, load_weights, output_dir, save_weights, sha256sum, swap_in, umask_mode
from .transfer import TransferReport, is_vit_state_dict, select_weights, transfer_vit_weights, unwrap_state_dict
