"""The one image reader of every command and job (``read_image``): a file as its viewer shows it, as 8-bit RGB, where
PIL's ``convert('RGB')`` alone ignores EXIF orientation and clips 16- and 32-bit pixels (docs/weights.md)."""
import os
import warnings
from typing import Union

import numpy as np
from PIL import ExifTags, Image, ImageOps, UnidentifiedImageError

__all__ = ['read_image']

# A 32-bit file does not say which scale its values use: the first of these that holds its brightest pixel.
FULL_SCALES = {'F': (1.0, 255.0, 65535.0), 'I': (255.0, 65535.0, 2.0 ** 31 - 1)}


def _upright(image: Image.Image) -> Image.Image:
    """``image`` loaded and upright. Pillow 12+ turns a TIFF upright itself as it loads, and garbles L, P, CMYK and
    I;16 ones with orientation 5-8 so (their size is swapped before the pixels are read): such a TIFF is read as
    stored, then turned as every other format is, by ``ImageOps.exif_transpose``."""
    orientation = image.getexif().get(ExifTags.Base.Orientation, 1)
    if image.format == 'TIFF' and orientation in range(2, 9) and hasattr(image, '_tile_size'):
        image.tag_v2.pop(ExifTags.Base.Orientation, None)  # so that the loader leaves it as stored
        image.getexif().pop(ExifTags.Base.Orientation, None)
        image._size = image._tile_size  # the stored size (Pillow swapped it for orientations 5-8)
        image.load()
        image.getexif()[ExifTags.Base.Orientation] = orientation  # back, for exif_transpose
    return ImageOps.exif_transpose(image)


def _wide_to_rgb(image: Image.Image, path) -> Image.Image:
    """I;16*, I or F pixels over their full scale (16 bits: 65535; 32 bits: ``FULL_SCALES``), as 8-bit RGB."""
    pixels = np.asarray(image, dtype=np.float64)  # (H, W)
    if not np.isfinite(pixels).all() or pixels.min(initial=0) < 0:
        raise ValueError(f'{path}: pixel values outside [0, inf) (from {pixels.min()} to {pixels.max()})')
    scales = (65535.0,) if image.mode.startswith('I;16') else FULL_SCALES[image.mode]
    scale = next((s for s in scales if pixels.max(initial=0) <= s), scales[-1])
    return Image.fromarray(np.rint(pixels * (255 / scale)).astype(np.uint8)).convert('RGB')


def read_image(path: Union[str, os.PathLike]) -> Image.Image:
    """The image of ``path`` upright (EXIF orientation), its first frame, as RGB from every PIL mode by its full
    range (1, L, P, LA, RGBA, CMYK, I;16, I, F, ...). ValueError in one line starting with the file's name for what is
    not an image, is damaged, or is over PIL's decompression-bomb limit; FileNotFoundError if missing."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter('ignore', Image.DecompressionBombWarning)  # up to PIL's limit: read, no warning
            with Image.open(path) as image:
                image = _upright(image)  # a loaded copy
                if image.mode in ('I', 'F') or image.mode.startswith('I;16'):
                    return _wide_to_rgb(image, path)
                transparent = image.mode == 'P' and 'transparency' in image.info  # PIL warns unless through RGBA
                return (image.convert('RGBA') if transparent else image).convert('RGB')
    except FileNotFoundError:
        raise FileNotFoundError(f'{path}: no such file') from None
    except Image.DecompressionBombError as error:
        size = str(error).split(',')[0]  # 'Image size (N pixels) exceeds limit of M pixels'
        raise ValueError(f'{path}: refused, a possible decompression bomb: {size} (PIL.Image.MAX_IMAGE_PIXELS)') \
            from None
    except UnidentifiedImageError:
        raise ValueError(f'{path}: not an image (no format PIL reads)') from None
    except (OSError, ValueError, SyntaxError, TypeError, KeyError, IndexError, EOFError) as error:
        # truncated, unreadable EXIF, a mode with no RGB conversion, out-of-range pixels
        detail = (str(error).strip().splitlines() or [type(error).__name__])[0]
        raise ValueError(detail if detail.startswith(f'{path}:') else f'{path}: cannot be read ({detail})') from None
