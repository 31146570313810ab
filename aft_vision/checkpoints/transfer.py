"""DeiT / ViT -> AFT weight transfer (Sec. 5.3, Table 8 of the AFT paper), and a checkpoint's weights taken as timm
takes them. Which tensors are copied, resampled or started fresh per family: docs/weights.md. timm maps other
families' weights only inside each model's checkpoint filter, with no report of what it took."""
import math
import re
from dataclasses import dataclass, field
from typing import Dict, List, Mapping, Tuple

import torch
from timm.layers import resample_abs_pos_embed
from timm.models import clean_state_dict

__all__ = ['TransferReport', 'transfer_vit_weights', 'select_weights', 'unwrap_state_dict', 'is_vit_state_dict']

_QKV = re.compile(r'blocks\.(\d+)\.attn\.qkv\.(weight|bias)$')
_DISTILLATION = ('dist_token', 'head_dist.weight', 'head_dist.bias')
_CLASSIFIER = ('head.weight', 'head.bias')
# the entries of a training checkpoint that hold weights, in the order timm's load_state_dict takes them
EMA_KEYS = ('state_dict_ema', 'model_ema')
WEIGHT_KEYS = EMA_KEYS + ('state_dict', 'model')


@dataclass
class TransferReport:
    """What a transfer did, tensor by tensor (target names unless said otherwise)."""
    copied: List[str] = field(default_factory=list)
    resampled: Dict[str, str] = field(default_factory=dict)
    partial: Dict[str, str] = field(default_factory=dict)
    skipped: Dict[str, str] = field(default_factory=dict)  # source key -> reason
    fresh: List[str] = field(default_factory=list)
    weights: str = ''  # which of the source checkpoint's weights were taken (``select_weights``)

    def summary(self) -> str:
        """A short human-readable report, one section per outcome."""
        lines = [f'copied {len(self.copied)} tensors, resampled {len(self.resampled)}, partially copied '
                 f'{len(self.partial)}, skipped {len(self.skipped)} source tensors, fresh {len(self.fresh)}']
        lines += [f'  {title:9s} {key}: {why}' for title, items in (
            ('resampled', self.resampled), ('partial', self.partial), ('skipped', self.skipped))
            for key, why in _collapse(items).items()]
        lines += [f'  fresh     {key}' for key in _collapse(dict.fromkeys(self.fresh, ''))]
        if self.weights:
            lines.append(f'  source    {self.weights}')
        return '\n'.join(lines)


def _collapse(items: Mapping[str, str]) -> Dict[str, str]:
    folded: Dict[str, str] = {}
    for key, why in items.items():
        folded.setdefault(re.sub(r'^blocks\.\d+\.', 'blocks.*.', key), re.sub(r'blocks\.\d+\.', 'blocks.*.', why))
    return folded


def select_weights(checkpoint: Mapping, use_ema: bool = True) -> Tuple[Dict[str, torch.Tensor], str]:
    """A checkpoint's tensors as timm's ``load_state_dict`` takes them (EMA first unless ``use_ema`` is False;
    ``clean_state_dict``), and which, in words: timm's reads the file itself (any pickle) and does not say."""
    keys = WEIGHT_KEYS if use_ema else WEIGHT_KEYS[len(EMA_KEYS):]
    taken = next((key for key in keys if isinstance(checkpoint.get(key), Mapping)), '')
    state_dict = clean_state_dict(checkpoint[taken] if taken else checkpoint)
    for key, value in state_dict.items():
        if not isinstance(value, torch.Tensor):
            raise ValueError(f'checkpoint entry {key!r} is a {type(value).__name__}, not a tensor: not a state dict')
    if taken in EMA_KEYS:
        return state_dict, f"the EMA weights ('{taken}'; use_ema=False / --no-ema for the trained ones)"
    if not taken:
        return state_dict, 'a bare state dict'
    has_ema = any(isinstance(checkpoint.get(key), Mapping) for key in EMA_KEYS)
    why = ', not the EMA ones (use_ema=False)' if has_ema else ' (the checkpoint holds no EMA copy)'
    return state_dict, f"the '{taken}' weights{why}"


def unwrap_state_dict(checkpoint: Mapping, use_ema: bool = True) -> Dict[str, torch.Tensor]:
    """``select_weights``' tensors alone."""
    return select_weights(checkpoint, use_ema)[0]


def is_vit_state_dict(state_dict: Mapping[str, torch.Tensor]) -> bool:
    """``attn.qkv`` weights and no AFT position biases."""
    return any(_QKV.match(key) for key in state_dict) and not any('.attn.pos_' in key for key in state_dict)


def _num_blocks(keys) -> int:
    indices = [int(m.group(1)) for m in (re.match(r'blocks\.(\d+)\.', key) for key in keys) if m]
    return max(indices) + 1 if indices else 0


def _resample_pos_embed(pos_embed: torch.Tensor, target: torch.Tensor, num_prefix: int) -> torch.Tensor:
    # (1, prefix + h*w, C) over a square source grid -> the target's token count
    src_tokens, dst_tokens = pos_embed.shape[1] - num_prefix, target.shape[1] - num_prefix
    src_side, dst_side = math.isqrt(src_tokens), math.isqrt(dst_tokens)
    if src_side * src_side != src_tokens or dst_side * dst_side != dst_tokens:
        raise ValueError(f'pos_embed: cannot resample a non-square grid, source {list(pos_embed.shape)} '
                         f'-> model {list(target.shape)}')
    return resample_abs_pos_embed(pos_embed, [dst_side, dst_side], [src_side, src_side], num_prefix_tokens=num_prefix)


def _map_qkv(key: str, source: torch.Tensor, target: torch.Tensor, values_only: bool,
             report: TransferReport) -> torch.Tensor:
    """ViT's (3C, ...) q/k/v projection onto an AFT one: whole, or only the values (AFT-conv, as in the paper)."""
    dim = source.shape[0] // 3
    num_heads = target.shape[0] - 2 * dim
    fits = source.shape[0] == 3 * dim and num_heads >= 1 and source.shape[1:] == target.shape[1:]
    if not fits or (not values_only and source.shape != target.shape):
        raise ValueError(f'{key}: source shape {list(source.shape)} does not map onto model shape '
                         f'{list(target.shape)} (expected a ViT (3C, ...) projection of the same width)')
    if not values_only:
        report.copied.append(key)
        return source
    mapped = target.clone()
    mapped[dim + num_heads:] = source[2 * dim:]  # values; queries and keys start fresh
    report.partial[key] = f'value rows {dim + num_heads}:{2 * dim + num_heads} <- source rows {2 * dim}:{3 * dim}'
    report.skipped[f'{key}[0:{2 * dim}]'] = 'query and key rows: AFT-conv starts them fresh, as in the paper'
    return mapped


def transfer_vit_weights(state_dict: Mapping[str, torch.Tensor], model: torch.nn.Module,
                         use_ema: bool = True) -> Tuple[Dict[str, torch.Tensor], TransferReport]:
    """A complete state dict for ``model`` from a DeiT / ViT one, and the report; ValueError naming what misfits."""
    source, weights = select_weights(state_dict, use_ema)
    target = model.state_dict()
    for required in ('patch_embed.proj.weight', 'blocks.0.attn.qkv.weight'):
        if required not in source:
            raise ValueError(f'not a ViT / DeiT checkpoint: key {required!r} is missing '
                             f'(found e.g. {sorted(source)[:5]})')
    src_depth, dst_depth = _num_blocks(source), _num_blocks(target)
    if src_depth != dst_depth:
        raise ValueError(f'depth mismatch: the checkpoint has {src_depth} blocks (blocks.0-{src_depth - 1}), '
                         f'the model {dst_depth}')
    src_patch, dst_patch = source['patch_embed.proj.weight'], target['patch_embed.proj.weight']
    if src_patch.shape[0] != dst_patch.shape[0] or src_patch.shape[2:] != dst_patch.shape[2:]:
        raise ValueError(f'width mismatch at patch_embed.proj.weight: checkpoint {list(src_patch.shape)}, '
                         f'model {list(dst_patch.shape)}')
    report = TransferReport(weights=weights)
    mapped = dict(target)
    num_prefix = getattr(model, 'num_prefix_tokens', 1)
    values_only = any(key.endswith('.attn.pos_weight') for key in target)  # AFT-conv
    for key, tensor in source.items():
        if key in _DISTILLATION:
            report.skipped[key] = 'DeiT distillation token / head: AFT models have none'
        elif key in _CLASSIFIER:
            report.skipped[key] = 'DeiT classifier, trained on DeiT features: the AFT model is a backbone (head fresh)'
        elif key not in target:
            if key in ('cls_token', 'pos_embed'):
                report.skipped[key] = 'AFT-conv has no class token or position embedding (fully convolutional)'
                continue
            raise ValueError(f'not a ViT / DeiT layout this model accepts: checkpoint key {key!r} '
                             f'{list(tensor.shape)} has no counterpart in {type(model).__name__}')
        elif _QKV.match(key):
            mapped[key] = _map_qkv(key, tensor, target[key], values_only, report)
        elif key == 'pos_embed' and tensor.shape != target[key].shape:
            mapped[key] = _resample_pos_embed(tensor, target[key], num_prefix)
            report.resampled[key] = f'{list(tensor.shape)} -> {list(target[key].shape)}'
        elif key == 'patch_embed.proj.weight' and tensor.shape != target[key].shape:
            # other input channels: kept as they are for timm's loader, which adapts them (``first_conv``)
            mapped[key] = tensor
            report.partial[key] = (f'{tensor.shape[1]} input channels kept for the loader to adapt to '
                                   f'{target[key].shape[1]}')
        elif tensor.shape != target[key].shape:
            raise ValueError(f'shape mismatch at {key!r}: checkpoint {list(tensor.shape)}, '
                             f'model {list(target[key].shape)}')
        else:
            mapped[key] = tensor
            report.copied.append(key)
    written = set(report.copied) | set(report.resampled) | set(report.partial)
    report.fresh = [key for key in target if key not in written]
    for key in written:
        mapped[key] = mapped[key].to(dtype=target[key].dtype)
    return mapped, report
