"""The layers of jddp's design (LAYERS below: each module imports only its own layer and the ones below it) hold.

Read from the source (every ``import`` statement, also those inside functions), so a lazy import
cannot hide an arrow that runs back up; and checked in fresh processes for the modules that must
not pull JAX in.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests import multiprocess

PACKAGE = multiprocess.ROOT / "jddp"

# Layer of each module, by the longest matching prefix; and what each layer may import.
BOTTOM = (
    "jddp._version",
    "jddp.typing",
    "jddp.exitcodes",
    "jddp.validate",
    "jddp.net",
    "jddp.config",
    "jddp.lines",
    "jddp.envvars",
    "jddp.handoff",
    "jddp.placement",  # the host's inventory and the processes' devices: the launcher's and the runtime's, no JAX
    "jddp.process_start",  # when this process started (goodput's span), read at `import jddp`: no JAX
)
LAYERS = {
    **{name: "bottom" for name in BOTTOM},
    "jddp.runtime": "runtime",
    "jddp.engine": "engine",
    "jddp.data": "data",
    "jddp.checkpoint": "checkpoint",
    "jddp.models": "models",
    "jddp.logs": "fit",
    "jddp.goodput": "fit",  # the ledger fit keeps; `jddp goodput` and the launcher read and mark it (no JAX)
    "jddp.loop": "fit",
    "jddp.run_ids": "fit",
    "jddp.goodput_ledger": "fit",
    "jddp.goodput_accounts": "fit",
    "jddp.fit_loop": "fit",
    "jddp.fit_outputs": "fit",
    "jddp.fit_bar": "fit",
    "jddp.benchmark": "cli",  # the models and worker of `jddp bench`
    "jddp.cli": "cli",
    "jddp.launch": "cli",
    "jddp": "package",  # jddp/__init__.py: lazy re-exports of every layer
}
MAY_IMPORT = {
    "bottom": {"bottom"},
    "runtime": {"bottom", "runtime"},
    "engine": {"bottom", "runtime", "engine"},
    "data": {"bottom", "runtime", "data"},
    "checkpoint": {"bottom", "runtime", "checkpoint"},
    "models": {"bottom", "runtime", "engine", "models"},
    "fit": {"bottom", "runtime", "engine", "data", "checkpoint", "fit"},
    "cli": set(LAYERS.values()),  # the top: `jddp bench` trains; the launcher itself imports no JAX (below)
    "package": set(LAYERS.values()),
}


def layer(module: str) -> str:
    matches = [prefix for prefix in LAYERS if module == prefix or module.startswith(prefix + ".")]
    return LAYERS[max(matches, key=len)]


def module_name(path: Path) -> str:
    parts = path.relative_to(multiprocess.ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def jddp_imports(path: Path) -> set[str]:
    """The jddp modules ``path`` imports (``from jddp.x import y`` counts as ``jddp.x.y`` when y is a module)."""
    found = set()
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "jddp"}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package, up level - 1
                parts = package.split(".")
                base = ".".join([*parts[: len(parts) - node.level + 1], base]).strip(".")
            if base.split(".")[0] != "jddp":
                continue
            for alias in node.names:
                candidate = f"{base}.{alias.name}"
                is_module = (PACKAGE.parent / Path(*candidate.split("."))).with_suffix(".py").exists() or (
                    PACKAGE.parent / Path(*candidate.split(".")) / "__init__.py"
                ).exists()
                found.add(candidate if is_module else base)
    return found


def test_every_module_imports_only_its_layer_and_those_below():
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        me = module_name(path)
        for imported in sorted(jddp_imports(path)):
            if layer(imported) not in MAY_IMPORT[layer(me)]:
                wrong.append(f"{me} ({layer(me)}) imports {imported} ({layer(imported)})")
    assert not wrong, "arrows that break the layers:\n" + "\n".join(wrong)


def import_graph() -> dict[str, set[str]]:
    """Each jddp module and the jddp modules it imports (lazy and ``TYPE_CHECKING`` imports included)."""
    graph = {module_name(path): jddp_imports(path) for path in sorted(PACKAGE.rglob("*.py"))}
    return {module: {m for m in imported if m in graph and m != module} for module, imported in graph.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of ``graph`` with more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_circles():
    """No two jddp modules need each other, also through others, also lazily: a circle means a piece both need
    belongs a floor lower, or the lower one should take an interface (CONTRIBUTING.md, "Where things live")."""
    found = circles(import_graph())
    assert not found, "import circles (move the shared piece down, or invert the arrow):\n" + "\n".join(
        " <-> ".join(c) for c in found
    )


def test_the_circle_check_sees_a_circle():
    """The check itself: two probe modules that import each other (one lazily) are found, and so is a circle of
    three; a chain is not a circle."""
    assert circles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": {"c"}, "c": set()}) == []
    one, two = PACKAGE / "runtime" / "_circle_probe_1.py", PACKAGE / "runtime" / "_circle_probe_2.py"
    one.write_text("from jddp.runtime import _circle_probe_2\n")
    two.write_text("def f():\n    from jddp.runtime import _circle_probe_1\n")
    try:
        with pytest.raises(AssertionError, match=r"jddp.runtime._circle_probe_1 <-> jddp.runtime._circle_probe_2"):
            test_no_import_circles()
    finally:
        one.unlink()
        two.unlink()


def test_the_layer_check_sees_a_wrong_arrow(tmp_path):
    """The check itself: an engine module that imports the checkpoint layer is found."""
    bad = PACKAGE / "engine" / "_layer_probe.py"
    bad.write_text("def f():\n    from jddp.checkpoint import digest\n")
    try:
        with pytest.raises(AssertionError, match=r"jddp.engine._layer_probe \(engine\) imports jddp.checkpoint.digest"):
            test_every_module_imports_only_its_layer_and_those_below()
    finally:
        bad.unlink()


@pytest.mark.multiprocess  # a fresh interpreter each
@pytest.mark.parametrize(
    "module",
    [
        "jddp",
        "jddp.launch",
        "jddp.cli.main",
        "jddp.data",
        "jddp.data.sampler",
        "jddp.config",
        "jddp.net",
        "jddp.placement",
    ],
)
def test_launcher_sampler_and_config_import_no_jax(module):
    code = f"import sys, {module}; print(sorted(m for m in ('jax', 'jaxlib', 'flax', 'orbax') if m in sys.modules))"
    done = subprocess.run(
        [sys.executable, "-c", code], env=multiprocess.environment(), capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", f"importing {module} pulled in {done.stdout.strip()}"


def test_private_jax_apis_are_used_only_in_jax_internals():
    users = [
        str(path.relative_to(multiprocess.ROOT))
        for path in sorted(PACKAGE.rglob("*.py"))
        if re.search(r"\bjax\._src", path.read_text()) and path.name != "jax_internals.py"  # not mpi4jax._src
    ]
    assert not users, f"private JAX APIs used outside jddp/runtime/jax_internals.py: {users}"


def test_names_shared_by_layers_that_may_not_import_each_other_agree():
    """The launcher (no JAX) and the runtime name the same environment variable; config and checkpoint the same
    field metadata key. Each side spells it once; this binds them."""
    from jddp import config
    from jddp.checkpoint import digest
    from jddp.cli import launch
    from jddp.runtime import coordinator, distributed

    assert launch.ENV_STDOUT_FD == distributed.ENV_STDOUT_FD
    assert launch.DEFAULT_PEER_TIMEOUT_S == distributed.DEFAULT_PEER_TIMEOUT_S
    assert launch.ENV_COORDINATOR_HOSTED == distributed.ENV_COORDINATOR_HOSTED
    assert launch.SERVICE_READY.decode() == coordinator.READY
    assert launch.SERVICE_STOP_SIGNAL == coordinator.STOP_SIGNAL
    assert config.FINGERPRINT == digest.FINGERPRINT


def test_contributing_names_every_module_and_its_layer_table_is_the_rule():
    """CONTRIBUTING.md's map names every module of jddp/ by its path (a module added without a place in the map
    fails here), and its layer table says what ``MAY_IMPORT`` enforces."""
    text = (multiprocess.ROOT / "CONTRIBUTING.md").read_text()
    missing = [
        str(path.relative_to(multiprocess.ROOT))
        for path in sorted(PACKAGE.rglob("*.py"))
        if str(path.relative_to(multiprocess.ROOT)) not in text
    ]
    assert not missing, f"CONTRIBUTING.md's map does not name: {missing}"
    rows = dict(re.findall(r"^\| (\w+)[^|]*\| ([^|]+) \|", text, re.M))
    for name, allowed in MAY_IMPORT.items():
        if name in ("package", "cli"):
            continue
        assert {w.strip() for w in rows[name].split(",")} == allowed, (name, rows[name], allowed)
