"""The check a training folder passes first: ``train/`` and ``val/`` ImageFolders with the same classes (torchvision
numbers classes by sorted folder name, so a class missing from one split shifts every label after it), at least two
of them (one class scores 100%), and no link inside a class folder to outside it (another class's images)."""
import os
from pathlib import Path
from typing import List, Optional, Union

__all__ = ['check_image_folders']


def _classes(folder: Path) -> List[str]:
    return sorted(entry.name for entry in folder.iterdir() if entry.is_dir() and not entry.name.startswith('.'))


def check_image_folders(data_dir: Union[str, Path]) -> List[str]:
    """The classes of ``data_dir``'s ``train/`` and ``val/``; FileNotFoundError for a missing split, ValueError
    (naming them) for classes that differ or none."""
    data_dir = Path(data_dir)
    for split in ('train', 'val'):
        if not (data_dir / split).is_dir():
            raise FileNotFoundError(f'--data-dir: {data_dir / split} not found: train/ and val/ ImageFolders needed')
    train, val = _classes(data_dir / 'train'), _classes(data_dir / 'val')
    if len(train) < 2:
        raise ValueError(f'--data-dir: {data_dir / "train"} has {len(train)} class folders ({", ".join(train)}): '
                         'top-1 means something only with at least two classes')
    if train != val:
        only_train, only_val = sorted(set(train) - set(val)), sorted(set(val) - set(train))
        raise ValueError(f'--data-dir: {data_dir}: train/ and val/ classes differ (only in train/: '
                         f'{only_train or "none"}, only in val/: {only_val or "none"}): labels would not match')
    link = next(filter(None, (_link_out(data_dir / split / name) for split in ('train', 'val') for name in train)),
                None)
    if link is not None:
        raise ValueError(f'--data-dir: {link} links to {link.resolve()}, outside its class folder: its images would '
                         'take this class\'s label; copy them in or remove the link')
    return train


def _link_out(class_dir: Path) -> Optional[Path]:
    """The first link under ``class_dir`` to outside it (links inside it lead to what the walk sees anyway)."""
    inside = class_dir.resolve()
    for folder, subfolders, files in os.walk(class_dir):
        for name in subfolders + files:
            entry = Path(folder) / name
            if entry.is_symlink() and not entry.resolve().is_relative_to(inside):
                return entry
    return None
