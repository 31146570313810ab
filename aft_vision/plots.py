"""Figures: matplotlib output written the way every other output is, through ``checkpoints.files.atomic_file``."""
import os
from typing import Union

from .checkpoints.files import atomic_file

__all__ = ['save_figure']


def save_figure(fig, path: Union[str, os.PathLike], dpi: int = 110, force: bool = True) -> None:
    """Save a matplotlib figure as PNG through a temporary sibling, then close it."""
    import matplotlib.pyplot as plt

    try:
        fig.tight_layout()
        with atomic_file(path, force=force) as temp:
            fig.savefig(temp, dpi=dpi, format='png')
    finally:
        plt.close(fig)
