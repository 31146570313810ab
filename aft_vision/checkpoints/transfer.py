"""ViT -> AFT weight transfer (Sec. 5.3, Table 8 of the AFT paper) from DeiT, DeiT III, DINOv2, CLIP, SigLIP and
EVA-02 (their layouts: ``sources.py``), and a checkpoint's weights taken as timm takes them. Which tensors are copied,
resampled, dropped or started fresh per source and family: docs/weights.md. timm maps other families' weights only
inside each model's checkpoint filter, with no report of what it took."""
import math
import re
from dataclasses import dataclass, field
from typing import Dict, List, Mapping, Optional, Tuple

import torch
from timm.layers import resample_abs_pos_embed
from timm.models import clean_state_dict

from .sources import SourceLayout, block_mlp, infer_layout

__all__ = ['TransferReport', 'transfer_vit_weights', 'select_weights', 'unwrap_state_dict', 'is_vit_state_dict',
           'check_finite']

_QKV = re.compile(r'blocks\.(\d+)\.attn\.qkv\.(weight|bias)$')
_CLASSIFIER = ('head.weight', 'head.bias')
_DROPPED = (  # source keys a model may lack (pattern, why; formatted with the layout), checked in this order
    (r'dist_token|head_dist\.(weight|bias)', 'DeiT distillation token / head: AFT models have none'),
    (r'head\.(weight|bias)', 'the source\'s classifier / projection, trained on its features: the AFT model is a '
                             'backbone (fresh)'),
    ('reg_token', '{layout.reg_tokens} register tokens: AFT models have none (no attention to route through them)'),
    (r'attn_pool\..*', 'attention-pool head (SigLIP\'s MAP): attention, which AFT models do not have; pooled by '
                       'average'),
    ('cls_token|pos_embed', 'AFT-conv has no class token or position embedding (fully convolutional)'))
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
    renamed: Dict[str, str] = field(default_factory=dict)  # target key -> the source tensors it was taken from
    weights: str = ''  # which of the source checkpoint's weights were taken (``select_weights``)
    source: str = ''  # the source's architecture, or 'a state dict'
    assumed: List[str] = field(default_factory=list)  # what the weights alone do not say (``SourceLayout.assumed``)

    def summary(self) -> str:
        """A short human-readable report, one section per outcome."""
        lines = [f'copied {len(self.copied)} tensors, resampled {len(self.resampled)}, partially copied '
                 f'{len(self.partial)}, skipped {len(self.skipped)} source tensors, fresh {len(self.fresh)}']
        carried = dict.fromkeys(re.sub(r'\.(weight|bias|gamma)$', '', key) for key in _collapse(
            dict.fromkeys(self.copied, '')))
        if carried:
            lines.append(f'  copied    {", ".join(carried)}')
        lines += [f'  {title:9s} {key}: {why}' for title, items in (
            ('renamed', self.renamed), ('resampled', self.resampled), ('partial', self.partial),
            ('skipped', self.skipped))
            for key, why in _collapse(items).items()]
        lines += [f'  fresh     {key}' for key in _collapse(dict.fromkeys(self.fresh, ''))]
        lines += [f'  assumed   {what}' for what in self.assumed]
        if self.weights:
            of = f' of {self.source}' if self.source and self.source != 'a state dict' else ''
            lines.append(f'  source    {self.weights}{of}')
        return '\n'.join(lines)


def _collapse(items: Mapping[str, str]) -> Dict[str, str]:
    """``items`` with one entry for every block (``blocks.*.``) and for SigLIP's attention pool (``attn_pool.*``)."""
    folded: Dict[str, str] = {}
    for key, why in items.items():
        key = re.sub(r'^attn_pool\..*', 'attn_pool.*', re.sub(r'^blocks\.\d+\.', 'blocks.*.', key))
        folded.setdefault(key, re.sub(r'blocks\.\d+\.', 'blocks.*.', why))
    return folded


def check_finite(state_dict: Mapping[str, torch.Tensor], what: str) -> None:
    """ValueError naming ``what`` and the first tensor of ``state_dict`` that holds NaN or infinity (not meta ones)."""
    bad = next((key for key, tensor in state_dict.items()
                if tensor.is_floating_point() and not tensor.is_meta and not torch.isfinite(tensor).all()), None)
    if bad is not None:
        raise ValueError(f'{what}: weight {bad!r} holds NaN or infinite values: no weights are taken from it')


def select_weights(checkpoint: Mapping, use_ema: bool = True,
                   what: str = 'checkpoint') -> Tuple[Dict[str, torch.Tensor], str]:
    """A checkpoint's tensors as timm's ``load_state_dict`` takes them (EMA first unless ``use_ema`` is False;
    ``clean_state_dict``), and which, in words: timm's reads the file itself (any pickle) and does not say. Refuses
    entries that are not tensors and non-finite tensors (``check_finite``, naming ``what``)."""
    keys = WEIGHT_KEYS if use_ema else WEIGHT_KEYS[len(EMA_KEYS):]
    taken = next((key for key in keys if isinstance(checkpoint.get(key), Mapping)), '')
    state_dict = clean_state_dict(checkpoint[taken] if taken else checkpoint)
    for key, value in state_dict.items():
        if not isinstance(value, torch.Tensor):
            raise ValueError(f'checkpoint entry {key!r} is a {type(value).__name__}, not a tensor: not a state dict')
    check_finite(state_dict, what)
    if taken in EMA_KEYS:
        return state_dict, f"the EMA weights ('{taken}'; use_ema=False / --no-ema for the trained ones)"
    if not taken:
        return state_dict, 'a bare state dict'
    has_ema = any(isinstance(checkpoint.get(key), Mapping) for key in EMA_KEYS)
    why = ', not the EMA ones (use_ema=False)' if has_ema else ' (the checkpoint holds no EMA copy)'
    return state_dict, f"the '{taken}' weights{why}"


def unwrap_state_dict(checkpoint: Mapping, use_ema: bool = True, what: str = 'checkpoint') -> Dict[str, torch.Tensor]:
    """``select_weights``' tensors alone."""
    return select_weights(checkpoint, use_ema, what)[0]


def is_vit_state_dict(state_dict: Mapping[str, torch.Tensor]) -> bool:
    """``attn.qkv`` weights and no AFT position biases."""
    return any(_QKV.match(key) for key in state_dict) and not any('.attn.pos_' in key for key in state_dict)


def _map_pos_embed(pos_embed: torch.Tensor, target: torch.Tensor, num_prefix: int, layout: SourceLayout,
                   report: TransferReport) -> torch.Tensor:
    """The source's (1, prefix + h*w, C) position embedding onto the model's (1, num_prefix + H*W, C): grid rows
    resampled over the source's grid (timm's ``resample_abs_pos_embed``), prefix rows kept, or zero where the source
    gives its class token no position (DeiT III, DINOv2 with registers)."""
    src_prefix, grid = layout.pos_prefix, layout.grid_size
    src_tokens, dst_tokens = pos_embed.shape[1] - src_prefix, target.shape[1] - num_prefix
    if grid is None or grid[0] * grid[1] != src_tokens:  # weights at another size than the architecture's default
        grid = (math.isqrt(src_tokens),) * 2 if math.isqrt(src_tokens) ** 2 == src_tokens else None
    dst_side = math.isqrt(dst_tokens)
    if grid is None or dst_side * dst_side != dst_tokens or src_prefix > 1:
        raise ValueError(f'pos_embed: cannot map source {list(pos_embed.shape)} (grid {grid}, {src_prefix} prefix '
                         f'rows) onto model {list(target.shape)}')
    rows = pos_embed[:, src_prefix:]  # (1, h*w, C)
    if list(grid) != [dst_side, dst_side]:
        rows = resample_abs_pos_embed(rows, [dst_side, dst_side], list(grid), num_prefix_tokens=0)
    notes = []
    if num_prefix and not src_prefix:
        prefix = torch.zeros_like(target[:, :num_prefix])
        notes.append('class-token row zero: the source adds no position to its class token')
    else:
        prefix = pos_embed[:, :src_prefix][:, :num_prefix]
        if src_prefix > num_prefix:
            notes.append('class-token row dropped: the model has no class token')
    mapped = torch.cat([prefix, rows], dim=1)
    if mapped.shape == pos_embed.shape and torch.equal(mapped, pos_embed):
        report.copied.append('pos_embed')
    else:
        report.resampled['pos_embed'] = '; '.join([f'{list(pos_embed.shape)} -> {list(target.shape)}'] + notes)
    return mapped


def _canonical(source: Dict[str, torch.Tensor], layout: SourceLayout,
               report: TransferReport) -> Dict[str, torch.Tensor]:
    """EVA's names as timm's ViT names them: LayerScale ``gamma_1`` / ``gamma_2`` as ``ls1`` / ``ls2``, the q / v
    biases as one q / k / v bias (k zero: EVA has none), ``fc_norm`` as the final ``norm`` (before the pooling here)."""
    mapped: Dict[str, torch.Tensor] = {}
    for key, tensor in source.items():
        new = re.sub(r'^(blocks\.\d+\.)gamma_([12])$', r'\1ls\2.gamma', key)
        new = re.sub(r'^fc_norm\.', 'norm.', new) if layout.fc_norm else new
        if key.endswith('.attn.v_bias'):
            continue  # taken with the q bias
        if key.endswith('.attn.q_bias'):
            v_key, new = key.replace('q_bias', 'v_bias'), key.replace('q_bias', 'qkv.bias')
            if v_key not in source:
                raise ValueError(f'{key}: an EVA q bias without its v bias (key {v_key})')
            tensor = torch.cat([tensor, torch.zeros_like(tensor), source[v_key]])  # (3C,)
            report.renamed[new] = f'{key}, zeros (no key bias), {v_key}'
        elif new != key:
            after = ' (after the pooling there; before it here)' if new.startswith('norm.') else ''
            report.renamed[new] = key + after
        mapped[new] = tensor
    return mapped


def _skip_reason(key: str, layout: SourceLayout) -> str:
    """Why a source tensor with no counterpart in the model is dropped; '' where it must not be dropped."""
    return next((why.format(layout=layout) for pattern, why in _DROPPED if re.fullmatch(pattern, key)), '')


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


def transfer_vit_weights(state_dict: Mapping[str, torch.Tensor], model: torch.nn.Module, use_ema: bool = True,
                         layout: Optional[SourceLayout] = None) -> Tuple[Dict[str, torch.Tensor], TransferReport]:
    """A complete state dict for ``model`` from a ViT-family one (DeiT / DeiT III, DINOv2, CLIP, SigLIP, EVA-02), and
    the report; ValueError naming what misfits. ``layout``: the source's, read from its timm model
    (``sources.read_layout``), checked against the keys; None infers it from them, the activation and norm epsilon
    assumed (``report.assumed``). Refuses non-finite tensors and any tensor the model takes from a ViT that the source
    lacks (only the classifier and what AFT adds start fresh)."""
    source, weights = select_weights(state_dict, use_ema)
    found = infer_layout(source)
    layout = _check_family(layout, found) if layout else found
    target = model.state_dict()
    report = TransferReport(weights=weights, source=layout.name, assumed=[
        f'{what}: the weights do not say (--src-model reads it)' for what in layout.assumed])
    _check_structure(layout, model)
    source = _canonical(source, layout, report)
    src_depth, dst_depth = found.depth, len(getattr(model, 'blocks', ()))
    if src_depth != dst_depth:
        raise ValueError(f'depth mismatch: the checkpoint has {src_depth} blocks (blocks.0-{src_depth - 1}), '
                         f'the model {dst_depth}: build it with depth={src_depth}')
    src_kernel, dst_kernel = (sd['patch_embed.proj.weight'].shape for sd in (source, target))  # (C, in_chans, p, p)
    for what, arg, src, dst in (('width', 'embed_dim', src_kernel[0], dst_kernel[0]),
                                ('patch size', 'patch_size', tuple(src_kernel[2:]), tuple(dst_kernel[2:]))):
        if src != dst:
            raise ValueError(f'{what} mismatch at patch_embed.proj.weight: {src} in the checkpoint, {dst} in the '
                             f'model: build it with {arg}={src}')
    mapped = dict(target)
    num_prefix = getattr(model, 'num_prefix_tokens', 1)
    values_only = any(key.endswith('.attn.pos_weight') for key in target)  # AFT-conv
    for key, tensor in source.items():
        if key not in target or key in _CLASSIFIER:
            why = _skip_reason(key, layout)
            if not why:
                raise ValueError(f'not a ViT layout this model accepts: checkpoint key {key!r} {list(tensor.shape)} '
                                 f'has no counterpart in {type(model).__name__}{_hint(key)}')
            report.skipped[key] = why
        elif _QKV.match(key):
            mapped[key] = _map_qkv(key, tensor, target[key], values_only, report)
        elif key == 'pos_embed':
            mapped[key] = _map_pos_embed(tensor, target[key], num_prefix, layout, report)
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
    if layout.rotary:
        report.skipped['rope'] = 'rotary positions (no tensors): the AFT position biases start fresh in their place'
    written = set(report.copied) | set(report.resampled) | set(report.partial)
    report.fresh = [key for key in target if key not in written]
    missing = [key for key in report.fresh if not (key.startswith('head.') or '.attn.pos_' in key or (
        key == 'pos_embed' and layout.rotary))]  # fresh by design: the classifier, AFT's biases; rotary positions
    if missing:
        more = f' and {len(missing) - 3} more' if len(missing) > 3 else ''
        raise ValueError(f'the checkpoint lacks {", ".join(missing[:3])}{more}, which {type(model).__name__} takes '
                         f'from a ViT: refused rather than left random')
    for key in written:
        mapped[key] = mapped[key].to(dtype=target[key].dtype)
    return mapped, report


def _check_family(layout: SourceLayout, found: SourceLayout) -> SourceLayout:
    """``layout`` (of a named architecture) if the checkpoint's keys (``found``) show its structure; else ValueError
    naming what differs (width and depth may: a checkpoint of another size of the family)."""
    for what, attr in (('patch size', 'patch_size'), ('class token', 'class_token'), ('register tokens', 'reg_tokens'),
                       ('LayerScale', 'layer_scale'), ('norm_pre', 'pre_norm'), ('MLP', 'mlp_layer')):
        if getattr(layout, attr) != getattr(found, attr):
            raise ValueError(f'family mismatch: the checkpoint is no {layout.name} ({what}: {getattr(found, attr)} in '
                             f'the checkpoint, {getattr(layout, attr)} in {layout.name}; is it the weights\' source?)')
    return layout


def _hint(key: str) -> str:
    """What to build the AFT model with for a source key it lacks."""
    for part, arg in (('.ls1.', 'init_values=1e-5 (LayerScale)'), ('.ls2.', 'init_values=1e-5 (LayerScale)'),
                      ('norm_pre.', 'pre_norm=True'), ('cls_token', 'class_token=True')):
        if part in key:
            return f': build it with {arg}'
    return ''


def _check_structure(layout: SourceLayout, model: torch.nn.Module) -> None:
    """ValueError where the model's blocks compute another function than the source's in what no key shows: the
    MLP's activation and kind."""
    blocks = getattr(model, 'blocks', None)
    if not blocks:
        return
    kind, act, _ = block_mlp(blocks[0], type(model).__name__)
    if kind != layout.mlp_layer:
        raise ValueError(f'blocks.0.mlp: the source ({layout.name}) has a {layout.mlp_layer!r} MLP, the model a '
                         f'{kind!r} one: build it with mlp_layer={layout.mlp_layer!r}')
    if layout.act_layer is not None and act != layout.act_layer:
        raise ValueError(f'blocks.0.mlp.act: the source ({layout.name}) uses {layout.act_layer}, the model '
                         f'{type(blocks[0].mlp.act).__name__}: build it with act_layer={layout.act_layer!r}')
