"""The package's layers, checked from the source: no import cycles between files, no import against the layering,
and a router process that never loads torch.

Layers (pdserve/__init__.py says what each holds), lowest first; a module may import its own layer and those below:
  common, v1  <  kernels  <  engine (the modules at pdserve/'s root)  <  kv_transfer
  common, v1  <  cluster
  common, v1, engine  <  serving
  tiers: prefill_service and decode_service (on serving, engine, kernels, kv_transfer, cluster),
         router (on serving, cluster, common only: no torch)
  cli, on everything
Every import counts, also one inside a function: a lazy import is still an edge that can close a cycle.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# Folder -> package name (pyproject's package-dir).
FOLDERS = {"pdserve": "pdserve", "kernels": "pdserve.kernels", "prefill_service": "pdserve.prefill_service",
           "decode_service": "pdserve.decode_service", "kv_transfer": "pdserve.kv_transfer", "router": "pdserve.router"}
SUBPACKAGE_LAYERS = {"common", "v1", "kernels", "kv_transfer", "cluster", "serving", "prefill_service",
                     "decode_service", "router", "cli"}
ALLOWED = {  # layer -> the layers its modules may import
    "common": {"common"},
    "v1": {"v1"},
    "kernels": {"kernels", "common"},
    "engine": {"engine", "kernels", "common"},
    "kv_transfer": {"kv_transfer", "engine", "common"},
    "cluster": {"cluster", "common"},
    "serving": {"serving", "engine", "common", "v1"},
    "prefill_service": {"prefill_service", "serving", "engine", "kernels", "kv_transfer", "cluster", "common", "v1"},
    "decode_service": {"decode_service", "serving", "engine", "kernels", "kv_transfer", "cluster", "common", "v1"},
    "router": {"router", "serving", "cluster", "common", "v1"},
    "cli": SUBPACKAGE_LAYERS | {"engine"},
    "package": {"cli"},  # pdserve/__init__.py, pdserve/__main__.py
}
# Serving modules the router may use: the rest of pdserve.serving drives an engine (torch).
ROUTER_SERVING = {"pdserve.serving", "pdserve.serving.grpc_shell", "pdserve.serving.auth", "pdserve.serving.metrics",
                  "pdserve.serving.rpc_convert"}


def modules() -> dict[str, Path]:
    found = {}
    for folder, package in FOLDERS.items():
        for path in (REPO / folder).rglob("*.py"):
            rel = path.relative_to(REPO / folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            found[".".join([package, *parts])] = path
    return found


MODULES = modules()


def layer(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1 or parts[1] in ("__main__",):
        return "package"
    if parts[1] in SUBPACKAGE_LAYERS:
        return parts[1]
    return "engine"  # a module at pdserve/'s root


def imports(module: str) -> set[str]:
    """Every pdserve module `module` imports, anywhere in the file."""
    path = MODULES[module]
    is_package = path.name == "__init__.py"
    targets = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                here = module.split(".") if is_package else module.split(".")[:-1]
                here = here[: len(here) - (node.level - 1)]
                base = ".".join(here + ([base] if base else []))
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
        else:
            continue
        for name in names:
            while name and name not in MODULES and "." in name:
                name = name.rsplit(".", 1)[0]
            if name in MODULES and name != module:
                targets.add(name)
    return targets


GRAPH = {m: imports(m) for m in MODULES}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, on_stack, stack, found, counter = {}, {}, set(), [], [], [0]
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter[0]
                    counter[0] += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    m = stack.pop()
                    on_stack.discard(m)
                    component.append(m)
                    if m == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_checker_sees_the_package():
    assert {"pdserve.engine", "pdserve.router.server", "pdserve.kernels.moe", "pdserve.cli.serve",
            "pdserve.common.values"} <= set(MODULES)
    assert "pdserve.engine" in GRAPH["pdserve.prefill_service.engine"]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycles():
    assert cycles(GRAPH) == []


def test_every_import_follows_the_layers():
    wrong = [f"{m} ({layer(m)}) imports {t} ({layer(t)})" for m, targets in sorted(GRAPH.items())
             for t in sorted(targets) if layer(t) not in ALLOWED[layer(m)]]
    assert wrong == []


def test_tiers_do_not_import_each_other():
    tiers = ("prefill_service", "decode_service", "router")
    wrong = [f"{m} imports {t}" for m, targets in GRAPH.items() for t in targets
             if layer(m) in tiers and layer(t) in tiers and layer(m) != layer(t)]
    assert wrong == []


def test_the_router_reaches_no_torch_module():
    """Everything the router's modules import, transitively, is torch-free by layer."""
    seen, todo = set(), [m for m in MODULES if layer(m) == "router"]
    while todo:
        m = todo.pop()
        if m not in seen:
            seen.add(m)
            todo += GRAPH[m]
    heavy = sorted(m for m in seen if layer(m) in ("engine", "kernels", "kv_transfer")
                   or (layer(m) == "serving" and m not in ROUTER_SERVING))
    assert heavy == []


def test_only_the_mapped_folders_resolve_under_pdserve():
    code = ("import importlib\n"
            "for name in ('pdserve.tests', 'pdserve.benchmarks', 'pdserve.pdserve', 'pdserve.scripts'):\n"
            "    try:\n"
            "        importlib.import_module(name)\n"
            "    except ImportError:\n"
            "        continue\n"
            "    raise SystemExit(name + ' is importable')\n"
            "import pdserve.kernels, pdserve.router\n")
    run = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr[-2000:]


NO_TORCH_ROUTER = """
import importlib.abc, sys

class NoTorch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError(f"the router process imported {name}")

sys.meta_path.insert(0, NoTorch())
from pdserve.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_a_router_process_serves_without_importing_torch(tmp_path):
    """The real `pdserve router` (gRPC, OpenAI HTTP, metrics, tokenizer) in a process where importing torch fails."""
    script = tmp_path / "router_without_torch.py"
    script.write_text(NO_TORCH_ROUTER)
    proc = subprocess.Popen([sys.executable, str(script), "router", "--port", "0", "--http-port", "0",
                             "--metrics-port", "0", "--model", str(REPO / "models" / "tiny-trained"),
                             "--prefill", "127.0.0.1:9", "--decode", "127.0.0.1:9"], cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(REPO)})
    lines, alive = [], False
    try:
        for line in proc.stderr:
            lines.append(line)
            if "router serving" in line:
                time.sleep(0.5)  # serving: anything imported lazily from here on would fail it too
                alive = proc.poll() is None
                break
        proc.terminate()
        rest, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    output = "".join(lines) + (rest or "")
    assert "router serving" in output and alive, output[-3000:]
    assert "imported torch" not in output, output[-3000:]
