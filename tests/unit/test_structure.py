"""The shape of the tree: import directions, no pickle, a cheap ``import tqstream``."""

from __future__ import annotations

import ast
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "tqstream"
CONTRACTS = {
    "tqstream.errors",
    "tqstream.config",
    "tqstream.types",
    "tqstream.staleness",
    "tqstream.protocol.messages",
}


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
    return out


def _module(path: Path) -> str:
    rel = path.relative_to(ROOT.parent).with_suffix("")
    return ".".join(p for p in rel.parts if p != "__init__")


MODULES = {_module(p): _imports(p) for p in ROOT.rglob("*.py")}


PICKLES_ITS_OWN_FILES = {"tqstream.controller.durable"}
"""The controller's journal snapshot: a file it wrote itself, read back by an unpickler that
builds tqstream's classes and plain containers only (``durable._Unpickler``); none on the wire."""


@pytest.mark.parametrize("name", sorted(MODULES))
def test_no_pickle_anywhere(name: str) -> None:
    banned = {"pickle", "cloudpickle", "dill", "marshal", "shelve"}
    if name in PICKLES_ITS_OWN_FILES:
        banned -= {"pickle"}
    assert not {i.split(".")[0] for i in MODULES[name]} & banned


@pytest.mark.parametrize("name", sorted(CONTRACTS))
def test_contracts_import_no_implementation(name: str) -> None:
    tq = {i for i in MODULES[name] if i.startswith("tqstream")}
    assert tq <= CONTRACTS, f"{name} imports {tq - CONTRACTS}"


def test_the_controller_is_small_rooms() -> None:
    """No controller file over 600 lines, the median one at most 250: each table's owner fits in
    a reader's head (docs/architecture.md)."""
    sizes = sorted(
        len(p.read_text().splitlines())
        for p in (ROOT / "controller").rglob("*.py")
        if p.read_text().strip()
    )
    assert sizes[-1] <= 600, sizes
    assert statistics.median(sizes) <= 250, sizes


def test_controller_and_storage_never_import_each_other() -> None:
    for name, imports in MODULES.items():
        if name.startswith("tqstream.controller"):
            assert not any(i.startswith("tqstream.storage") for i in imports), name
        if name.startswith("tqstream.storage"):
            assert not any(i.startswith("tqstream.controller") for i in imports), name


def test_pure_state_modules_do_no_io() -> None:
    pure = [
        "tqstream.controller.views",
        "tqstream.controller.budget",
        "tqstream.controller.partition",
        "tqstream.controller.placement",
        "tqstream.controller.snapshot",
        "tqstream.controller.state",
        "tqstream.storage.columns",
    ]
    for name in pure:
        io = {i for i in MODULES[name] if i.split(".")[0] in {"zmq", "asyncio", "socket", "time"}}
        assert not io, f"{name} imports {io}"


def test_the_servers_never_load_rich() -> None:
    """rich draws ``tqstream status`` and the demo's view; the servers do not draw."""
    for name, imports in MODULES.items():
        if name.startswith(("tqstream.controller", "tqstream.storage", "tqstream.protocol")):
            assert not any(i.split(".")[0] == "rich" for i in imports), name


def test_import_is_cheap() -> None:
    code = (
        "import sys, tqstream; heavy = {'torch', 'zmq', 'ray', 'vllm', 'tensordict', "
        "'pyarrow'} & set(sys.modules); print(sorted(heavy))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_public_names_resolve() -> None:
    import tqstream

    assert tqstream.__all__ == sorted(tqstream.__all__)
    for name in tqstream.__all__:
        assert getattr(tqstream, name) is not None


def test_the_reference_pipeline_is_at_the_edge() -> None:
    # tqstream.cli dispatches ``tqstream demo`` to it (imported when that command runs)
    for name, imports in MODULES.items():
        if not name.startswith(("tqstream.reference", "tqstream.adapters", "tqstream.cli")):
            assert not any(i.startswith("tqstream.reference") for i in imports), name


def test_only_the_ray_deployment_imports_ray() -> None:
    """Ray is an optional extra: only ``tqstream.ray`` imports it, and nothing else in the tree
    imports ``tqstream.ray`` but the modules that start or find a job's cluster as Ray actors for
    TransferQueue's API, NeMo-RL and verl's fully-async queue (all import Ray only when they run
    with it)."""
    allowed = (
        "tqstream.ray",
        "tqstream.compat.transfer_queue.deploy",
        "tqstream.adapters.nemo_rl.deploy",
        "tqstream.adapters.verl.queue",
    )
    for name, imports in MODULES.items():
        if name.startswith(allowed):
            continue
        ray = {i for i in imports if i.split(".")[0] == "ray" or i.startswith("tqstream.ray")}
        assert not ray, f"{name} imports {ray}"


def test_the_compatibility_layers_are_at_the_edge() -> None:
    for name, imports in MODULES.items():
        if not name.startswith(("tqstream.compat", "tqstream.adapters")):
            assert not any(i.startswith("tqstream.compat") for i in imports), name


def _cycles() -> list[list[str]]:
    """Import cycles among tqstream's modules (a module importing a package counts as importing
    its ``__init__``; imports under TYPE_CHECKING count too)."""
    graph = {n: {i for i in imps if i in MODULES and i != n} for n, imps in MODULES.items()}
    found, state, stack = [], dict.fromkeys(graph, 0), []

    def visit(n: str) -> None:
        state[n] = 1
        stack.append(n)
        for m in sorted(graph[n]):
            if state[m] == 1:
                found.append([*stack[stack.index(m) :], m])
            elif state[m] == 0:
                visit(m)
        stack.pop()
        state[n] = 2

    for n in sorted(graph):
        if state[n] == 0:
            visit(n)
    return found


def test_no_import_cycles() -> None:
    assert not _cycles()
