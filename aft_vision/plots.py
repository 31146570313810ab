"""Figures: matplotlib ``Figure`` objects made outside pyplot (``figure``: no backend switched, nothing global left
open), written the way every other output is, through ``checkpoints.files.atomic_file``."""
import os
from typing import Union

from .checkpoints.files import atomic_file

__all__ = ['figure', 'save_figure']


def figure(width: float, height: float, layout: str = 'tight'):
    """A matplotlib Figure of ``width`` x ``height`` inches, laid out by ``layout`` as it is drawn; ImportError naming
    the ``demo`` extra if matplotlib is missing."""
    try:
        from matplotlib.figure import Figure
    except ImportError as e:
        raise ImportError('plotting needs matplotlib: pip install "aft-vision[demo]" (or pip install matplotlib)') \
            from e
    return Figure(figsize=(width, height), layout=layout)


def save_figure(fig, path: Union[str, os.PathLike], dpi: int = 110, force: bool = True) -> None:
    """Save ``fig`` as PNG through a temporary sibling; an existing ``path`` is refused unless ``force``."""
    with atomic_file(path, force=force) as temp:
        fig.savefig(temp, dpi=dpi, format='png')
