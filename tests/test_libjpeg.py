"""fastfeed._jpeg runs only against the libjpeg its headers describe.

A GPU machine built it with libjpeg 6.2's headers and ran it against libjpeg.so.8: the workers
that decoded died of SIGSEGV. Here the mismatch is simulated the other way round: the module is
compiled with headers that claim the API of another libjpeg version than this machine's, and
linked against this machine's library, as that build was.
"""

import shutil
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

import pytest

import fastfeed
from fastfeed.vision.libjpeg import describe

ROOT = Path(__file__).resolve().parents[1]


def _headers() -> Path | None:
    return next((d for d in (Path("/usr/include"), Path("/usr/local/include"))
                 if (d / "jpeglib.h").exists()), None)


def test_a_library_next_to_its_headers_is_linked_in():
    # setup.py links the libjpeg.a installed with the headers: no mismatch is then possible.
    archive = Path("/usr/lib", sysconfig.get_config_var("MULTIARCH") or "", "libjpeg.a")
    if _headers() != Path("/usr/include") or not archive.exists():
        pytest.skip("no static libjpeg.a beside the headers in /usr/include here")
    from fastfeed import _jpeg

    found = _jpeg.library()
    assert found["linked"] == "static" and found["refused"] == "", found
    assert "linked into the module" in describe()


@pytest.fixture(scope="module")
def mismatched(tmp_path_factory):
    """A copy of the fastfeed package whose _jpeg was compiled with the headers of another
    libjpeg API than the library it links: ``(package folder, headers' API, library's API)``."""
    pybind11 = pytest.importorskip("pybind11")
    headers = _headers()
    compiler = shutil.which("g++") or shutil.which("c++")
    if headers is None or compiler is None:
        pytest.skip("needs libjpeg's headers and a C++ compiler")
    from fastfeed import _jpeg

    library = _jpeg.library()["headers"]  # this machine's headers and library agree
    claimed = 80 if library == 62 else 62
    tmp = tmp_path_factory.mktemp("mismatch")
    fake = tmp / "include"
    fake.mkdir()
    shutil.copy(headers / "jpeglib.h", fake)  # so that its "jconfig.h" is the one below
    (fake / "jconfig.h").write_text(textwrap.dedent(f"""\
        #include_next <jconfig.h>
        #undef JPEG_LIB_VERSION
        #define JPEG_LIB_VERSION {claimed}
        """))
    package = tmp / "site" / "fastfeed"
    shutil.copytree(Path(fastfeed.__file__).parent, package,
                    ignore=shutil.ignore_patterns("_jpeg.*", "__pycache__"))
    module = package / f"_jpeg{sysconfig.get_config_var('EXT_SUFFIX')}"
    subprocess.run([compiler, "-shared", "-fPIC", "-std=c++17", "-O0", f"-I{fake}",
                    f"-I{pybind11.get_include()}", f"-I{sysconfig.get_paths()['include']}",
                    str(ROOT / "csrc" / "jpeg_crop.cpp"), "-o", str(module), "-ljpeg"],
                   check=True, capture_output=True)
    (tmp / "site" / "crops.py").write_text(textwrap.dedent("""\
        import io

        import numpy as np
        from PIL import Image
        from torch.utils.data import Dataset

        from fastfeed.vision.window_decode import decode_resized_crop


        class Crops(Dataset):
            def __init__(self, use_roi):
                self.use_roi = use_roi

            def __len__(self):
                return 6

            def __getitem__(self, i):
                pixels = np.random.default_rng(i).integers(0, 256, (96, 128, 3), np.uint8)
                encoded = io.BytesIO()
                Image.fromarray(pixels).save(encoded, "JPEG")
                return decode_resized_crop(encoded.getvalue(), lambda w, h: (8, 4, 96, 80),
                                           (24, 20), use_roi=self.use_roi)
        """))
    return tmp / "site", claimed, library


def test_a_build_for_another_libjpeg_is_refused_with_one_warning_in_every_worker(mismatched):
    site, claimed, library = mismatched
    script = textwrap.dedent("""\
        import torch
        from crops import Crops

        from fastfeed import FastLoader
        from fastfeed.vision.window_decode import roi_decoder_available
        from fastfeed.vision.libjpeg import describe

        assert not roi_decoder_available()
        print(describe())
        want = torch.stack([Crops(use_roi=False)[i] for i in range(6)])
        for context in ("fork", "spawn"):
            loader = FastLoader(Crops(use_roi=True), batch_size=3, num_workers=2,
                                multiprocessing_context=context)
            assert torch.equal(torch.cat(list(loader)), want), context
        print("same pixels as Pillow's")
        """)
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         cwd=site, env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"},
                         timeout=240)
    assert run.returncode == 0, run.stderr  # a crash of a worker is a failure of the loader
    assert f"library is {library}, caller expects {claimed}" in run.stdout
    assert run.stdout.startswith("refused:") and "same pixels as Pillow's" in run.stdout
    assert run.stderr.count("runs against another libjpeg") == 1, run.stderr
