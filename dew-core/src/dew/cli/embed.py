"""``dew embed RUN INPUT... OUT.npy``: one vector per input from a representation run's encoder.

INPUTs are ``.npy`` arrays of images (``[N, H, W, C]``, or one image
``[H, W, C]``) or image files (PNG, JPEG, TIFF: grayscale, of 8 or 16 bits,
with or without alpha, reads as one channel, color as three), taken in order. The run's pipeline (a JEPA run's target
encoder, say) turns them into an array ``[N, features]`` saved to OUT.npy.
A run whose model makes samples rather than vectors says to use
``dew generate`` instead.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from dew.errors import DewError

if TYPE_CHECKING:
    import numpy as np
    from PIL import Image

__all__ = ["InputImagesError", "OutputIsInputError", "add_arguments", "read_inputs", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from dew.cli.runs import add_run_argument

    add_run_argument(parser)
    parser.add_argument("inputs", nargs="+", metavar="INPUT", type=Path,
                        help=".npy arrays of images, or image files (PNG, JPEG)")
    parser.add_argument("out", metavar="OUT.npy", type=Path, help="where the vectors are saved")
    parser.add_argument("--step", type=int, default=None, help="a kept step (default newest)")


class InputImagesError(DewError, ValueError):
    """An input of dew embed is not an image file or an array of images, or the images' shapes differ."""


class OutputIsInputError(DewError, ValueError):
    """dew embed's OUT (the last path given) is one of its inputs: the vectors would replace the images."""


def _same_file(a: Path, b: Path) -> bool:
    """Whether a and b name one file (b may not exist yet)."""
    try:
        return a.resolve() == b.resolve() or (a.exists() and b.exists() and a.samefile(b))
    except OSError:
        return False


def output_path(out: Path, inputs: list[Path]) -> Path:
    """Where the vectors go: out, with .npy added when it lacks it; refused when that is an input."""
    target = out if out.suffix == ".npy" else out.with_name(out.name + ".npy")
    clash = next((path for path in inputs if _same_file(path, target)), None)
    if clash is not None:
        raise OutputIsInputError(
            f"OUT {str(target)!r} is the input {str(clash)!r}: the vectors would replace the images they are "
            "made from. The last path given is OUT; add a new path for the vectors after the inputs.")
    return target


def read_inputs(paths: list[Path]) -> np.ndarray:
    """The images paths hold, stacked in order as one array [N, ...]."""
    import numpy as np

    parts = []
    for path in paths:
        if not path.is_file():
            what = "is a directory" if path.is_dir() else "does not exist"
            raise InputImagesError(f"The input {path} {what}; give .npy arrays of images [N, H, W, C] or "
                                   "image files (PNG, JPEG).")
        if path.suffix == ".npy":
            try:
                array = np.load(path, allow_pickle=False)
            # ValueError: pickled or no array (numpy's advice, allow_pickle, would run whatever the file
            # holds); EOFError: an empty file.
            except (ValueError, EOFError):
                raise InputImagesError(f"{path} is not a NumPy array file (np.save writes one); give a .npy "
                                       "of images [N, H, W, C] or image files (PNG, JPEG).") from None
            if array.ndim == 3 and array.shape[-1] not in (1, 3, 4):  # no channel axis: read as one image, it had
                raise InputImagesError(  # its last axis for channels, and the model's refusal named another shape
                    f"{path} holds an array of shape {array.shape}, which is neither one image [H, W, C] (its last "
                    "axis is no 1, 3 or 4 channels) nor a batch [N, H, W, C]; save images [N, H, W, C] (a batch "
                    "of grayscale images [N, H, W] takes a channel axis: array[..., None]).")
            parts.append(array[None] if array.ndim == 3 else array)
            continue
        from PIL import Image, UnidentifiedImageError

        try:
            with Image.open(path) as image:
                pixels = _pixels(image)
        except UnidentifiedImageError:
            raise InputImagesError(f"{path} is not an image Pillow can read; give image files (PNG, JPEG) "
                                   "or a .npy of images.") from None
        parts.append((pixels[..., None] if pixels.ndim == 2 else pixels)[None])
    shapes = {part.shape[1:] for part in parts}
    if len(shapes) > 1:
        raise InputImagesError(f"The inputs hold images of different shapes {sorted(shapes)}; give "
                               "images of one shape.")
    images = np.concatenate(parts)
    if not (np.issubdtype(images.dtype, np.integer) or np.issubdtype(images.dtype, np.floating)):
        raise InputImagesError(f"The inputs hold values of dtype {images.dtype}, not pixels; give images of "
                               "numbers (uint8 pixels, or floats).")
    if np.issubdtype(images.dtype, np.floating) and not np.isfinite(images).all():
        raise InputImagesError("The inputs hold NaN or infinite pixel values, which would make every "
                               "vector NaN; give images of finite values.")
    return images


def _pixels(image: Image.Image) -> np.ndarray:
    """An image file's pixels: grayscale (with or without alpha, 8 or 16 bits, or floats) as one
    channel [H, W], 16 bits scaled to 8; anything else as RGB [H, W, 3] uint8."""
    import numpy as np

    if image.mode.startswith("I;16"):
        return np.round(np.asarray(image, np.float64) / 257).astype(np.uint8)
    if image.mode == "F":
        return np.asarray(image, np.float32)
    gray = image.mode in ("1", "L", "P", "I", "LA", "La", "PA")
    return np.asarray(image.convert("L" if gray else "RGB"))


def run(args: argparse.Namespace) -> int:
    from dew.cli.runs import expected, refused
    from dew.recipes.opening import open_run

    try:
        target = output_path(args.out, args.inputs)
        images = read_inputs(args.inputs)  # before the model loads: a bad input is named at once
        vectors = open_run(args.run, step=args.step).pipeline().embed(images)
        target.parent.mkdir(parents=True, exist_ok=True)
        _save_vectors(target, vectors)
    except Exception as error:
        if not expected(error):
            raise
        return refused("embed", error)
    print(f"Wrote {vectors.shape[0]} embedding(s) of {vectors.shape[1]} features to {target}")
    return 0


def _save_vectors(target: Path, vectors: np.ndarray) -> Path:
    """vectors as the .npy file target, written beside it and renamed into place: a link planted
    at target is replaced, never written through, and a reader never sees half a file."""
    import io

    import numpy as np  # (the module imports it only for its annotations)

    from dew.telemetry.render import write_file

    buffer = io.BytesIO()
    np.save(buffer, vectors)
    return write_file(target, buffer.getvalue())
