"""Figures: matplotlib output written the way every other output is, through a temporary sibling."""
import os
from pathlib import Path
from typing import Union

__all__ = ['save_figure']


def save_figure(fig, path: Union[str, os.PathLike], dpi: int = 110) -> None:
    """Save a matplotlib figure as PNG through a temporary sibling, then close it."""
    import matplotlib.pyplot as plt

    path = Path(path)
    temp = path.with_name(f'.{path.name}.tmp.png')
    try:
        fig.tight_layout()
        fig.savefig(temp, dpi=dpi)
        os.replace(temp, path)
    finally:
        plt.close(fig)
        temp.unlink(missing_ok=True)
