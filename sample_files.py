"""Where a run's sample records live on disk: samples.jsonl, its rotated generation samples.old.jsonl, and the images
the records name, one file per distinct image under sample_images/, named by content hash. runlog.py writes them,
board.py reads them; this module needs nothing heavier than Pillow, so the board starts at once."""
from __future__ import annotations

import hashlib
import io
import re
from pathlib import Path

from PIL import Image

SAMPLE_FILES = ("samples.old.jsonl", "samples.jsonl")  # oldest first: rotate's two generations
IMAGES_DIR = "sample_images"
IMAGE_REFERENCE = re.compile(rf'"{IMAGES_DIR}/([0-9a-f]{{16}}\.[a-z]+)"')  # an image path inside a JSON line
IMAGE_PATH = re.compile(rf"{IMAGES_DIR}/[0-9a-f]{{16}}\.[a-z]+")  # what a record may name (fullmatch)


def image_name(data: bytes) -> str:
    """An image's file name: its content's sha256 (16 hex digits) and its format's suffix."""
    kind = Image.open(io.BytesIO(data)).format or "bin"
    return f"{hashlib.sha256(data).hexdigest()[:16]}.{kind.lower()}"


def rotate(output_dir: Path) -> None:
    """samples.jsonl becomes samples.old.jsonl (replacing the one before), and the images that no kept record names
    are removed: a run keeps at most two generations of sample records."""
    output_dir = Path(output_dir)
    (output_dir / "samples.jsonl").replace(output_dir / "samples.old.jsonl")
    named = set()
    with open(output_dir / "samples.old.jsonl") as f:
        for line in f:
            named.update(IMAGE_REFERENCE.findall(line))
    images = output_dir / IMAGES_DIR
    for path in images.iterdir() if images.is_dir() else []:
        if path.name not in named:
            path.unlink()
