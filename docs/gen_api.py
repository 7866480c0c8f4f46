"""Generate docs/api.md from the docstrings of fastfeed's public API.

    python docs/gen_api.py          # rewrite docs/api.md
    python docs/gen_api.py --check  # exit 1 if docs/api.md is out of date (used by the tests)
"""

from __future__ import annotations

import argparse
import inspect
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import fastfeed  # noqa: E402
from fastfeed import transforms, ultralytics, vision  # noqa: E402
from fastfeed.ultralytics import gpu_augment, pixel_ops  # noqa: E402

SECTIONS = [
    ("fastfeed", [fastfeed.FastLoader, fastfeed.LoaderStats, fastfeed.worker_info]),
    ("fastfeed.transforms", [getattr(transforms, n) for n in (
        "Compose", "Normalize", "ChannelsLast", "RandomHorizontalFlip", "RandomErasing",
        "BatchTransform")]),
    ("fastfeed.vision", [getattr(vision, n) for n in (
        "accelerate", "batch_tail", "image_loader", "ImageFolder", "YoloDataset",
        "ImageCollate", "YoloCollate", "DecodeError", "decode_resized_crop", "parse_labels",
        "roi_decoder_available")]),
    ("fastfeed.ultralytics", [ultralytics.patch, ultralytics.unpatch, ultralytics.is_patched,
                              ultralytics.InfiniteFastLoader]),
    ("fastfeed.ultralytics.gpu_augment", [gpu_augment.PixelOps, gpu_augment.unsupported_reason,
                                          gpu_augment.defer_pixel_ops]),
    ("fastfeed.ultralytics.pixel_ops", [pixel_ops.warp_affine, pixel_ops.warp_regions,
                                        pixel_ops.source_region, pixel_ops.hsv_lookup,
                                        pixel_ops.bgr_to_hsv, pixel_ops.hsv_to_bgr]),
]
METHODS = {fastfeed.FastLoader: ["state_dict", "load_state_dict", "stats"],
           fastfeed.LoaderStats: ["summary", "postfix"],
           ultralytics.InfiniteFastLoader: ["reset", "close"]}


def signature(obj: object) -> str:
    try:
        return str(inspect.signature(obj))  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return ""


def render() -> str:
    lines = ["# API reference", "",
             "Generated from the docstrings by `python docs/gen_api.py`; do not edit by hand.", ""]
    for module, objects in SECTIONS:
        lines += [f"## `{module}`", ""]
        for obj in objects:
            name = obj.__name__  # type: ignore[attr-defined]
            kind = "class" if inspect.isclass(obj) else "function"
            lines += [f"### {kind} `{module}.{name}`", "", "```python",
                      f"{name}{signature(obj)}", "```", "",
                      inspect.cleandoc(obj.__doc__ or "(no docstring)"), ""]
            for method in METHODS.get(obj, []):  # type: ignore[call-overload]
                member = getattr(obj, method)
                lines += [f"#### `{name}.{method}{signature(member)}`", "",
                          inspect.cleandoc(member.__doc__ or ""), ""]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args()
    target = ROOT / "docs" / "api.md"
    text = render()
    if args.check:
        if not target.exists() or target.read_text() != text:
            print("docs/api.md is out of date: run python docs/gen_api.py", file=sys.stderr)
            return 1
        return 0
    target.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
