"""Weight files (safe reading, atomic writing: every file the package writes goes through ``files``) and the DeiT /
ViT -> AFT weight transfer: the ground floor, with ``layers``. May import torch, timm and safetensors."""
from .files import (WRITTEN, atomic_dir, atomic_file, atomic_files, check_output, check_output_dir, load_weights,
                    output_dir, save_weights, sha256sum, swap_in)
from .transfer import TransferReport, is_vit_state_dict, select_weights, transfer_vit_weights, unwrap_state_dict
