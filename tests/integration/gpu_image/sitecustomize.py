"""Makes this Python import as the GPU machine's would, for plugserve and the wheels that
benchmarks/gpu/check.sh brings there.

Loaded at start-up by every process whose PYTHONPATH holds this folder (the server's
processes, in test_gpu_wheel_set.py) when PLUGSERVE_GPU_WHEELS (requirements-offline.txt)
and PLUGSERVE_GPU_IMAGE (image-packages.txt) name the two lists. An import made by our
own code or by a distribution of the wheel set fails, as it would there, when no
distribution of either list provides the module. Imports made by the image's own
packages are left alone: the image is consistent with itself at its own versions, which
are not this environment's. PLUGSERVE_GPU_EXTRA: more distributions, comma-separated,
counted as present (the model package a test serves).
"""

from __future__ import annotations

import importlib.abc
import importlib.metadata
import os
import re
import sys

OWN = ("plugserve", "plugserve_plugins", "tests")


def _normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def listed(path: str) -> set[str]:
    names = set()
    with open(path) as f:
        for line in f:
            line = line.split("#", 1)[0].strip()
            if line:
                names.add(_normalized(re.split(r"[=<>!~\[; ]", line, maxsplit=1)[0]))
    return names


class GpuMachineImports(importlib.abc.MetaPathFinder):
    def __init__(self, wheels: set[str], image: set[str], extra: set[str]) -> None:
        self.wheels = wheels
        self.available = wheels | image | extra
        self.providers = {
            module: {_normalized(d) for d in dists}
            for module, dists in importlib.metadata.packages_distributions().items()
        }

    def _importer(self) -> str:
        """Top-level module name of the code asking for the import."""
        frame = sys._getframe(2)
        while frame is not None and (
            frame.f_code.co_filename.startswith("<frozen")
            or "importlib" in frame.f_code.co_filename
        ):
            frame = frame.f_back
        return "" if frame is None else str(frame.f_globals.get("__name__", "")).partition(".")[0]

    def _checked(self, importer: str) -> bool:
        return importer in OWN or bool(self.providers.get(importer, set()) & self.wheels)

    def find_spec(self, fullname, path=None, target=None):
        top = fullname.partition(".")[0]
        dists = self.providers.get(top)
        if not dists or top in sys.stdlib_module_names or top in OWN:
            return None
        if dists & self.available or any(d.startswith("plugserve") for d in dists):
            return None
        if not self._checked(self._importer()):
            return None
        raise ModuleNotFoundError(f"No module named {fullname!r} (not on the GPU machine)")


if os.environ.get("PLUGSERVE_GPU_WHEELS") and os.environ.get("PLUGSERVE_GPU_IMAGE"):
    sys.meta_path.insert(
        0,
        GpuMachineImports(
            listed(os.environ["PLUGSERVE_GPU_WHEELS"]),
            listed(os.environ["PLUGSERVE_GPU_IMAGE"]),
            {_normalized(n) for n in os.environ.get("PLUGSERVE_GPU_EXTRA", "").split(",") if n},
        ),
    )
