"""pdserve: prefill/decode disaggregated serving for DeepSeek-V3-family models.

Layers, lowest first (a module imports only its own layer or lower ones; tests/test_layers.py checks it):
  pdserve.common        torch-free value types, registry, block hashes, tokenizer: every layer may import it
  pdserve.kernels       every operation the model calls, behind backend registries (folder kernels/)
  pdserve.<engine>      the model and the single-process engine: config, model, weights, kv_cache, scheduler, engine
  pdserve.kv_transfer   moving latent KV between workers (folder kv_transfer/)
  pdserve.cluster       shared cluster state: prefix ownership store, worker registry (Redis)
  pdserve.serving       the serving kit: gRPC shell, auth, metrics, proto conversion, the engine thread
  pdserve.prefill_service, pdserve.decode_service, pdserve.router   the tiers (folders of the same names)
  pdserve.cli           the `pdserve` command
"""

import importlib.abc as _abc
import importlib.util as _util
import os as _os
import sys as _sys

__version__ = "0.1.0"

# NOTE: the top-level folders kernels/, router/, ... are installed as pdserve.kernels, pdserve.router, ...
# (package-dir in pyproject.toml). Run from a source checkout (tests, the GPU machine) the same names must resolve
# without installing: a finder maps exactly these names to their folders, so nothing else in the checkout (tests/,
# benchmarks/, pdserve/ itself) becomes importable as pdserve.<name>.
_FOLDERS = ("kernels", "prefill_service", "decode_service", "kv_transfer", "router")
_root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))


class _CheckoutFolders(_abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        package, _, name = fullname.partition(".")
        if package != __name__ or name not in _FOLDERS:
            return None
        folder = _os.path.join(_root, name)
        return _util.spec_from_file_location(fullname, _os.path.join(folder, "__init__.py"),
                                             submodule_search_locations=[folder])


if _os.path.isfile(_os.path.join(_root, "pyproject.toml")) and _os.path.isdir(_os.path.join(_root, "kernels")):
    if not any(isinstance(f, _CheckoutFolders) for f in _sys.meta_path):
        _sys.meta_path.insert(0, _CheckoutFolders())
