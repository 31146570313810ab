"""Seeing inside AFT models: learned position biases (Figures 1, 3, 6-8) and key maps (Figures 9-12) as NumPy arrays
(``position_bias_maps``, ``position_bias_for_query``, ``key_maps``), drawn by ``plot_*`` with matplotlib (the ``demo``
extra) into a PNG written atomically; ``show_bias`` / ``show_keys`` are ``aft-vision show-bias`` / ``show-keys``."""
import contextlib
import time
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch
from timm.data import create_transform, resolve_data_config
from torch import nn

from ..checkpoints import check_output
from ..hub import load_model, warn_random_weights
from ..images import read_image
from ..layers import AFTConv2d, AFTFull, AFTSimple
from ..models.aft_vit import GridAFTFull
from ..plots import figure, save_figure

__all__ = ['position_bias_maps', 'position_bias_for_query', 'key_maps', 'plot_position_bias', 'plot_key_maps',
           'load_image', 'show_bias', 'show_keys']

PathLike = Union[str, Path]
MIXERS = (AFTConv2d, AFTFull, AFTSimple)


@contextlib.contextmanager
def _eval_mode(model: nn.Module) -> Iterator[nn.Module]:
    """Eval mode and no autograd inside, the model's mode restored after."""
    was_training = model.training
    try:
        with torch.no_grad():
            yield model.eval()
    finally:
        model.train(was_training)


def _mixers(model: nn.Module, kind: Tuple[type, ...] = MIXERS, needed: str = '') -> List[nn.Module]:
    """The layers of ``kind`` in ``model``; ValueError (naming the model's AFT mixers and ``needed``) if none."""
    found = [m for m in model.modules() if isinstance(m, kind)]
    if needed and not found:
        kinds = sorted({type(m).__name__ for m in _mixers(model)})
        raise ValueError(f'{type(model).__name__} (AFT mixers: {", ".join(kinds) or "none"}) has no {needed}')
    return found


def position_bias_maps(model: nn.Module, num_heads: Optional[int] = None) -> np.ndarray:
    """``exp(w) - 1`` of every AFT-conv layer's position bias (Eq. 8), the kernel Eq. 6 convolves: float32
    (layers, heads, s, s), the first ``num_heads`` heads; entry ``[a, b]`` is the key ``(a - s//2, b - s//2)`` from
    the query, 0 the global weight (a fresh model), one-hot layers their argmax bias."""
    layers = _mixers(model, (AFTConv2d,), 'AFT-conv layer: position_bias_for_query shows AFT-full biases, '
                                          'AFT-simple has none')
    if num_heads is not None and num_heads < 1:
        raise ValueError(f'num_heads must be >= 1, got {num_heads}')
    with _eval_mode(model):
        maps = [torch.expm1(getattr(layer, 'selected_bias', layer.position_bias)().float())[:num_heads]
                for layer in layers]  # (h, s, s) each; a one-hot layer's selected offsets
    return torch.stack(maps).cpu().numpy()


def position_bias_for_query(model: nn.Module, query: Optional[Tuple[int, int]] = None) -> np.ndarray:
    """``exp(w[t, :])`` (Eq. 7's ``w = u @ v.T``) of every AFT-full layer for the query patch (row, column), or the
    class token's row for None, over the built patch grid without prefix columns: float32 (layers, H', W')."""
    maps = []
    with _eval_mode(model):
        for layer in _mixers(model, (GridAFTFull,), 'AFT-full layer: position_bias_maps shows AFT-conv biases, '
                                                    'AFT-simple has none'):
            (rows, cols), prefix = layer.grid_size, layer.num_prefix_tokens
            if query is None and not prefix:
                raise ValueError('the model has no class token: pass a query (row, column)')
            if query is not None and not (0 <= query[0] < rows and 0 <= query[1] < cols):
                raise ValueError(f'query {tuple(query)} is off the {rows} x {cols} patch grid')
            t = 0 if query is None else prefix + query[0] * cols + query[1]
            w = layer.position_bias()[t, prefix:].float()  # (H' * W',)
            maps.append(torch.exp(w).view(rows, cols))
    return torch.stack(maps).cpu().numpy()


def key_maps(model: nn.Module, image: torch.Tensor, num_maps: Optional[int] = None) -> np.ndarray:
    """The keys (before ``exp``) each AFT layer's ``qkv`` gives one image (C, H, W) or (1, C, H, W) in an eval
    forward: float32 (layers, maps, H', W'), the first ``num_maps`` heads (AFT-conv) or key channels (AFT-full /
    simple, prefix tokens left out)."""
    if image.dim() == 3:
        image = image.unsqueeze(0)
    if image.dim() != 4 or image.shape[0] != 1:
        raise ValueError(f'expected one image (C, H, W) or (1, C, H, W), got shape {list(image.shape)}')
    if num_maps is not None and num_maps < 1:
        raise ValueError(f'num_maps must be >= 1, got {num_maps}')
    layers = _mixers(model, needed='AFT layer')
    captured: List[Tuple[nn.Module, torch.Tensor]] = []  # (layer, its qkv output) in the order they run
    handles = [layer.qkv.register_forward_hook(lambda module, inputs, qkv, layer=layer: captured.append((layer, qkv)))
               for layer in layers]
    try:
        with _eval_mode(model):
            param = next(model.parameters())
            model(image.to(device=param.device, dtype=param.dtype))
    finally:
        for handle in handles:
            handle.remove()
    maps = []
    for layer, qkv in captured:
        if isinstance(layer, AFTConv2d):  # q (C), k (h), v (C) on a (1, H', W', .) map
            keys = qkv[0, ..., layer.dim:layer.dim + layer.num_heads]  # (H', W', h)
        else:  # q, k, v (C each) on (1, prefix + H' * W', .) tokens
            rows, cols = model.patch_embed.dynamic_feat_size(tuple(image.shape[-2:]))
            keys = qkv[0, -rows * cols:, layer.dim:2 * layer.dim].reshape(rows, cols, -1)  # (H', W', C)
        maps.append(keys[..., :num_maps].float().permute(2, 0, 1))  # (maps, H', W')
    return torch.stack(maps).cpu().numpy()


def load_image(path: PathLike, model: nn.Module, img_size: Optional[int] = None) -> Tuple[torch.Tensor, np.ndarray]:
    """An image (``images.read_image``) through timm's eval transform for ``model`` (at ``img_size`` if given): the
    input (1, C, H, W) and the crop the model sees, (H, W, 3) RGB in [0, 1]."""
    args = {} if img_size is None else {'input_size': (3, img_size, img_size)}
    config = resolve_data_config(args, model=model)
    tensor = create_transform(**config)(read_image(path)).unsqueeze(0)  # (1, 3, H, W)
    mean, std = (torch.tensor(config[key]).view(3, 1, 1) for key in ('mean', 'std'))
    shown = (tensor[0] * std + mean).clamp(0, 1).permute(1, 2, 0).numpy()  # (H, W, 3)
    return tensor, shown


# ----------------------------------------------------------------------------------------------------- plotting


def _check_out(path: PathLike, force: bool) -> Path:
    path = Path(path)
    if path.suffix.lower() != '.png':
        raise ValueError(f'output must be a .png file, got {path}')
    check_output(path, force)
    return path


def _min_to_max(layer: np.ndarray):
    """A colour scale over ``layer``'s values."""
    from matplotlib.colors import Normalize

    return Normalize(float(layer.min()), float(layer.max()))


def _draw_grid(maps: np.ndarray, cmap: str, col_label: str = '', norm_of_row: Callable = _min_to_max,
               image: Optional[np.ndarray] = None, **imshow_kwargs) -> Tuple[object, List[list]]:
    """A figure of ``maps[layer, col]`` as a grid of 0.9-inch panels (layer rows, ``col_label`` columns), one
    colour scale (``norm_of_row``) and bar per row, under ``image`` in a top band if given; returns it and the
    panels."""
    num_rows, num_cols = maps.shape[:2]
    top = int(image is not None)
    fig = figure(0.9 * num_cols + 1.2, 0.9 * num_rows + 2.0 * top + 0.8, 'constrained')
    ratios = [2.2] * top + [1.0] * num_rows
    spec = fig.add_gridspec(len(ratios), num_cols + 1, height_ratios=ratios, width_ratios=[1.0] * num_cols + [0.08])
    fig.get_layout_engine().set(w_pad=0.01, h_pad=0.01, wspace=0.02, hspace=0.02)
    panels = [[fig.add_subplot(spec[top + r, c]) for c in range(num_cols)] for r in range(num_rows)]
    for r, row in enumerate(panels):
        norm = norm_of_row(maps[r])
        for c, ax in enumerate(row):
            shown = ax.imshow(maps[r, c], cmap=cmap, norm=norm, interpolation='nearest', **imshow_kwargs)
            ax.set(xticks=[], yticks=[])
            if c == 0:
                ax.set_ylabel(f'layer {r + 1}', fontsize=8)
            if r == 0 and col_label:
                ax.set_title(f'{col_label} {c + 1}', fontsize=8)
        fig.colorbar(shown, cax=fig.add_subplot(spec[top + r, num_cols])).ax.tick_params(labelsize=6)
    if top:
        band = fig.add_subplot(spec[0, :num_cols])
        band.imshow(image)
        band.set_axis_off()
        band.set_title('input', fontsize=8)
    return fig, panels


def plot_position_bias(maps: np.ndarray, path: PathLike, title: Optional[str] = None,
                       query: Optional[Tuple[int, int]] = None, log_scale: bool = False, force: bool = False,
                       dpi: int = 110) -> Path:
    """Draw position-bias maps into the .png ``path`` (refused if it exists unless ``force``); returns it. (layers,
    heads, s, s) maps: layers as rows, heads as columns, one colour scale per layer centred on 0 (linear within +-0.1
    and logarithmic beyond with ``log_scale``). (layers, H, W) maps: a panel per layer, ``query`` (row, column)
    marked."""
    from matplotlib.colors import Normalize, SymLogNorm

    path = _check_out(path, force)
    maps = np.asarray(maps, dtype=np.float32)
    if maps.ndim == 4:
        num_layers, size = maps.shape[0], maps.shape[-1]

        def norm(layer: np.ndarray):  # centred on 0; a layer all 0 takes any scale
            limit = float(np.abs(layer).max()) or 1.0
            return SymLogNorm(0.1, vmin=-limit, vmax=limit, base=10) if log_scale and limit > 0.1 else Normalize(
                -limit, limit)
        fig, panels = _draw_grid(maps, 'RdBu_r', 'head', norm, extent=(-size / 2, size / 2, size / 2, -size / 2))
        bottom_left, radius = panels[-1][0], size // 2
        bottom_left.set(xticks=[-radius, 0, radius], yticks=[-radius, 0, radius])
        bottom_left.tick_params(labelsize=6)
        bottom_left.set_xlabel('key column offset', fontsize=7)
        bottom_left.set_ylabel(f'layer {num_layers}\nkey row offset', fontsize=7)
        title = title or f'exp(w) - 1 per layer (rows) and head (columns), {size} x {size} offsets'
    elif maps.ndim == 3:  # a panel per layer, four to a row, each with its own colour bar
        num_layers = maps.shape[0]
        num_cols = min(num_layers, 4)
        fig = figure(2.6 * num_cols, 2.3 * -(-num_layers // num_cols) + 0.6, 'constrained')
        spec = fig.add_gridspec(-(-num_layers // num_cols), num_cols)
        for layer in range(num_layers):
            ax = fig.add_subplot(spec[layer // num_cols, layer % num_cols])
            image = ax.imshow(maps[layer], cmap='viridis', interpolation='nearest')
            if query is not None:
                ax.plot(query[1], query[0], marker='x', color='red', markersize=6)
            ax.set_title(f'layer {layer + 1}', fontsize=8)
            ax.set_xlabel('key column', fontsize=7)
            ax.set_ylabel('key row', fontsize=7)
            ax.tick_params(labelsize=6)
            fig.colorbar(image, ax=ax, fraction=0.046, pad=0.04).ax.tick_params(labelsize=6)
        where = 'the class token' if query is None else f'query {tuple(query)} (x)'
        title = title or f'exp(w) for {where} over the patch grid, per layer'
    else:
        raise ValueError(f'expected (layers, heads, s, s) or (layers, H, W) maps, got shape {list(maps.shape)}')
    fig.suptitle(title, fontsize=9, wrap=True)
    save_figure(fig, path, dpi, force)  # refused again if the file appeared while the figure was drawn
    return path


def plot_key_maps(keys: np.ndarray, path: PathLike, image: Optional[np.ndarray] = None, title: Optional[str] = None,
                  map_label: str = 'head', force: bool = False, dpi: int = 110) -> Path:
    """Draw (layers, maps, H, W) key maps, layers as rows and ``map_label`` columns, one colour scale per layer, under
    ``image`` (H, W, 3) if given, into the .png ``path`` (refused if it exists unless ``force``); returns it."""
    path = _check_out(path, force)
    keys = np.asarray(keys, dtype=np.float32)
    if keys.ndim != 4:
        raise ValueError(f'expected (layers, maps, H, W) keys, got shape {list(keys.shape)}')
    fig, _ = _draw_grid(keys, 'viridis', map_label, image=image)
    grid = f'{keys.shape[2]} x {keys.shape[3]}'
    fig.suptitle(title or f'keys per layer (rows) and {map_label} (columns) over the {grid} patch grid', fontsize=9)
    save_figure(fig, path, dpi, force)
    return path


# ------------------------------------------------------------------------------------------------ the jobs


def _load(out: PathLike, force: bool, model: str, checkpoint: Optional[PathLike], pretrained: bool, use_ema: bool,
          model_kwargs: Optional[Dict], image: Optional[PathLike] = None) -> Tuple[nn.Module, str]:
    """Check first that matplotlib is present (``plots.figure``), ``out`` writable and ``image`` there; then
    ``hub.load_model``'s model and weights."""
    figure(1, 1)
    _check_out(out, force)
    if image is not None and not Path(image).is_file():
        raise FileNotFoundError(f'image not found: {image}')
    return load_model(model, None if checkpoint is None else str(checkpoint), pretrained, use_ema, model_kwargs)


def show_bias(model: str, out: PathLike, checkpoint: Optional[PathLike] = None, pretrained: bool = False,
              use_ema: bool = True, model_kwargs: Optional[Dict] = None, heads: int = 16,
              query: Optional[Sequence[int]] = None, log_scale: bool = False, force: bool = False,
              dpi: int = 110) -> np.ndarray:
    """``aft-vision show-bias``: load the model (``hub.load_model``), draw its position biases to ``out`` (AFT-conv:
    the first ``heads`` heads; AFT-full: for ``query``, by default the grid centre); returns the maps."""
    start = time.perf_counter()
    name, (model, weights) = model, _load(out, force, model, checkpoint, pretrained, use_ema, model_kwargs)
    full = _mixers(model, (GridAFTFull,))
    if _mixers(model, (AFTConv2d,)):
        maps = position_bias_maps(model, num_heads=heads)
        plot_position_bias(maps, out, log_scale=log_scale, force=force, dpi=dpi,
                           title=f'{name}: exp(w) - 1, layers (rows) x heads (columns)')
        what = 'AFT-conv exp(w) - 1'
    elif full:
        query = tuple(query or (full[0].grid_size[0] // 2, full[0].grid_size[1] // 2))
        maps = position_bias_for_query(model, query)
        plot_position_bias(maps, out, query=query, force=force, dpi=dpi,
                           title=f'{name}: exp(w) for query {query} over the patch grid, per layer')
        what = f'AFT-full exp(w) for query {query}'
    else:
        raise ValueError(f'{name} has no position bias (AFT-simple); show-keys works on it')
    print(f'wrote {out}: {what}, array {list(maps.shape)} (layers, ...); {time.perf_counter() - start:.1f} s')
    warn_random_weights(name, weights)
    return maps


def show_keys(image: PathLike, model: str, out: PathLike, checkpoint: Optional[PathLike] = None,
              pretrained: bool = False, use_ema: bool = True, model_kwargs: Optional[Dict] = None, heads: int = 16,
              img_size: Optional[int] = None, force: bool = False, dpi: int = 110) -> np.ndarray:
    """``aft-vision show-keys``: load the model and the image (at ``img_size`` if given), draw the first ``heads``
    heads' (or key channels') maps to ``out``; returns the key maps."""
    start = time.perf_counter()
    name, (model, weights) = model, _load(out, force, model, checkpoint, pretrained, use_ema, model_kwargs, image)
    tensor, shown = load_image(image, model, img_size)
    keys = key_maps(model, tensor, num_maps=heads)
    label = 'head' if _mixers(model, (AFTConv2d,)) else 'channel'
    plot_key_maps(keys, out, image=shown, map_label=label, force=force, dpi=dpi,
                  title=f'{name}: keys of {Path(image).name}, layers (rows) x {label}s (columns)')
    print(f'wrote {out}: keys {list(keys.shape)} (layers, {label}s, H, W); {time.perf_counter() - start:.1f} s')
    warn_random_weights(name, weights)
    return keys
