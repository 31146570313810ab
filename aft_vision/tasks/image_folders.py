"""The check a training folder passes first: ``train/`` and ``val/`` ImageFolders with the same classes (torchvision
numbers classes by sorted folder name, so a class missing from one split shifts every label after it)."""
from pathlib import Path
from typing import List, Union

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
    if not train:
        raise ValueError(f'--data-dir: {data_dir / "train"} has no class folders')
    if train != val:
        only_train, only_val = sorted(set(train) - set(val)), sorted(set(val) - set(train))
        raise ValueError(f'--data-dir: train/ and val/ classes differ (only in train/: {only_train or "none"}, only '
                         f'in val/: {only_val or "none"}): labels would not match')
    return train
