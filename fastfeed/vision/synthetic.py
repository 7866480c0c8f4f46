"""Generate image datasets for benchmarks and tests: natural-looking JPEGs, not noise.

Noise compresses badly and decodes unlike photographs; these images are smooth gradients with
overlapping shapes, a blur and mild grain, which JPEG-compresses like real photos do.
"""

from __future__ import annotations

import random
from pathlib import Path

from PIL import Image, ImageDraw, ImageFilter

from fastfeed.progress import progress

__all__ = ["make_image", "make_imagefolder", "make_yolo"]


def make_image(rng: random.Random, width: int, height: int) -> Image.Image:
    """One synthetic photo-like RGB image."""
    top = tuple(rng.randrange(256) for _ in range(3))
    bottom = tuple(rng.randrange(256) for _ in range(3))
    gradient = Image.linear_gradient("L").resize((width, height))
    image = Image.composite(Image.new("RGB", (width, height), top),
                            Image.new("RGB", (width, height), bottom), gradient)
    draw = ImageDraw.Draw(image)
    for _ in range(rng.randrange(4, 12)):
        x0, y0 = rng.randrange(width), rng.randrange(height)
        x1 = min(width, x0 + rng.randrange(20, max(21, width // 2)))
        y1 = min(height, y0 + rng.randrange(20, max(21, height // 2)))
        fill = tuple(rng.randrange(256) for _ in range(3))
        (draw.ellipse if rng.random() < 0.5 else draw.rectangle)((x0, y0, x1, y1), fill=fill)
    image = image.filter(ImageFilter.GaussianBlur(rng.uniform(1.0, 3.0)))
    grain = Image.effect_noise((width, height), rng.uniform(8, 20)).convert("RGB")
    return Image.blend(image, grain, 0.08)


def _size(rng: random.Random) -> tuple[int, int]:
    width = int(min(800, max(200, rng.gauss(500, 60))))
    height = int(min(600, max(150, rng.gauss(375, 50))))
    return width, height


def make_imagefolder(root: str | Path, images: int = 1000, classes: int = 10,
                     quality: int = 90, seed: int = 0) -> Path:
    """An ImageNet-like folder ``root/class_XXX/img_XXXXX.jpg`` (about 500×375, JPEG q90)."""
    root = Path(root)
    rng = random.Random(seed)
    for i in progress(range(images), total=images, desc=f"images -> {root}"):
        folder = root / f"class_{i % classes:03d}"
        folder.mkdir(parents=True, exist_ok=True)
        make_image(rng, *_size(rng)).save(folder / f"img_{i:05d}.jpg", quality=quality)
    return root


def make_yolo(root: str | Path, images: int = 200, classes: int = 8, quality: int = 90,
              seed: int = 0, widths: tuple[int, int] = (480, 1280)) -> Path:
    """A YOLO-format set ``root/images/*.jpg`` + ``root/labels/*.txt`` (0–6 boxes each;
    about one image in ten has no label file, as background images do). Widths are drawn
    from ``widths``, heights from three quarters of that range."""
    root = Path(root)
    (root / "images").mkdir(parents=True, exist_ok=True)
    (root / "labels").mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    for i in progress(range(images), total=images, desc=f"detection -> {root}"):
        width = int(rng.uniform(*widths))
        height = int(rng.uniform(0.75 * widths[0], 0.75 * widths[1]))
        make_image(rng, width, height).save(root / "images" / f"{i:05d}.jpg", quality=quality)
        if rng.random() < 0.1:
            continue
        rows = []
        for _ in range(rng.randrange(0, 7)):
            w, h = rng.uniform(0.05, 0.5), rng.uniform(0.05, 0.5)
            cx, cy = rng.uniform(w / 2, 1 - w / 2), rng.uniform(h / 2, 1 - h / 2)
            rows.append(f"{rng.randrange(classes)} {cx:.6f} {cy:.6f} {w:.6f} {h:.6f}")
        (root / "labels" / f"{i:05d}.txt").write_text("\n".join(rows) + ("\n" if rows else ""))
    return root
