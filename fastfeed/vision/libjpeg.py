"""Whether the JPEG window decoder (``fastfeed._jpeg``) may run here, and against which libjpeg.

The extension is compiled against libjpeg's headers, whose structs differ between libjpeg
versions (6.2, 7, 8): built with one version's headers and run against another's library, it
would crash the processes that decode. Where ``setup.py`` found a static ``libjpeg.a`` beside the
headers it links that, and they cannot disagree; otherwise the extension asks the library at
import (``_jpeg.library()``), libjpeg refuses the mismatch, and the window decoder is left out:
Pillow decodes, after one warning for the whole process tree.
"""

from __future__ import annotations

import importlib
import os
import warnings
from typing import Any

__all__ = ["describe", "window_decoder"]

# Set once the warning was given: worker processes (spawned ones import this module again)
# refuse the decoder silently.
_WARNED = "FASTFEED_JPEG_REFUSED_WARNED"


def _load() -> tuple[Any, str | None, dict[str, Any]]:
    """``(module or None, why it is not used or None, what it says of its library)``."""
    try:
        module = importlib.import_module("fastfeed._jpeg")
    except ModuleNotFoundError:  # built without libjpeg's headers
        return None, None, {}
    except ImportError as error:  # built, but this libjpeg lacks what it calls
        return None, f"fastfeed._jpeg does not load ({error})", {}
    found = module.library()
    if found["refused"]:
        return None, (f"fastfeed._jpeg was built with the headers of libjpeg "
                      f"{found['headers']} and runs against another libjpeg "
                      f"({found['refused']})"), found
    return module, None, found


_module, _refused, _library = _load()
if _refused is not None and not os.environ.get(_WARNED):
    os.environ[_WARNED] = "1"
    warnings.warn(f"{_refused}: JPEG windows are decoded with Pillow. Rebuild fastfeed where "
                  "libjpeg's headers match its library (setup.py links the libjpeg.a installed "
                  "with them).", RuntimeWarning, stacklevel=2)


def window_decoder() -> Any:
    """``fastfeed._jpeg`` where it runs against the libjpeg it was built for, else ``None``."""
    return _module


def describe() -> str:
    """What ``fastfeed info`` says of the window decoder."""
    if _refused is not None:
        return f"refused: {_refused}: Pillow draft mode"
    if _module is None:
        return "not built: Pillow draft mode"
    turbo = f"libjpeg-turbo {_library['turbo']}" if _library["turbo"] else "libjpeg"
    how = ("linked into the module" if _library["linked"] == "static"
           else "the system's, checked at import")
    return f"{turbo} (fastfeed._jpeg, libjpeg API {_library['headers']}, {how})"
