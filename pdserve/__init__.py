"""pdserve: prefill/decode disaggregated serving for DeepSeek-V3-family models."""

import os as _os

__version__ = "0.1.0"

# NOTE: the top-level folders kernels/, router/, ... are installed as pdserve.kernels, pdserve.router, ...
# (see package-dir in pyproject.toml). Run from a source checkout (tests, the GPU machine), the same names
# must resolve without installing, so the checkout root is added to this package's search path when it is
# recognisably our checkout.
_root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if _os.path.isfile(_os.path.join(_root, "pyproject.toml")) and _os.path.isdir(_os.path.join(_root, "kernels")):
    __path__.append(_root)  # type: ignore[name-defined]
