"""Weight files (safe reading, atomic writing) and the DeiT / ViT -> AFT weight transfer: the ground floor, with
``layers``. May import torch, timm and safetensors (``save_figure`` moved to ``aft_vision.plots``, which writes
through ``files.atomic_file``)."""
from .files import (atomic_dir, atomic_file, check_output_dir, load_weights, output_dir, save_weights, sha256sum,
                    swap_in, umask_mode)
from .transfer import TransferReport, is_vit_state_dict, select_weights, transfer_vit_weights, unwrap_state_dict
