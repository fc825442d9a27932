"""The package's layout keeps the architecture: no import circles, a light ``import replicate``,
modules of a readable size."""

import ast
import pathlib
import subprocess
import sys

import networkx as nx

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "replicate"
#: A module longer than this should be split by what it does.
MAX_LINES = 520


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def import_graph() -> nx.DiGraph:
    """Module -> the replicate modules it imports, at module level or inside functions."""
    modules = _modules()

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph = nx.DiGraph()
    for module, path in modules.items():
        graph.add_node(module)
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                targets = [f"{node.module}.{a.name}" for a in node.names]
            for target in targets:
                found = resolve(target) if target.startswith("replicate") else None
                if found and found != module:
                    graph.add_edge(module, found)
    return graph


def test_no_import_circles_even_through_imports_inside_functions():
    cycles = list(nx.simple_cycles(import_graph()))
    assert not cycles, "import circles: " + "; ".join(" -> ".join(c + c[:1]) for c in cycles[:5])


def test_the_analysis_does_not_import_the_passes_the_checks_or_the_runtime():
    graph = import_graph()
    for module in graph:
        if module.startswith(("replicate.graph", "replicate.batchflow")):
            bad = [m for m in nx.descendants(graph, module)
                   if m.startswith(("replicate.passes", "replicate.check", "replicate.runtime",
                                    "replicate.cli", "replicate.viz", "replicate.api"))]
            assert not bad, f"{module} reaches {bad}"


def _loaded(statement: str) -> set[str]:
    code = f"import sys\n{statement}\nprint('\\n'.join(m for m in sys.modules if m.startswith('replicate')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                         check=True)
    return set(out.stdout.split())


def test_import_replicate_loads_no_runtime_and_no_pictures():
    loaded = _loaded("import replicate")
    assert loaded == {"replicate", "replicate.errors"}


def test_the_transform_loads_no_runtime_no_pictures_and_no_command_line():
    loaded = _loaded("import replicate\nreplicate.transform")
    assert "replicate.api" in loaded and "replicate.passes.pipeline" in loaded
    assert not {m for m in loaded if m.startswith(("replicate.runtime", "replicate.viz",
                                                   "replicate.cli", "replicate.between"))}


def test_no_module_is_longer_than_a_reader_can_hold():
    long = {m: n for m, p in _modules().items() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"split these by what they do: {long}"


def test_the_public_between_module_names_the_op_the_pass_makes():
    """A worker runs ``replicate.between.BROADCAST_OP`` after a restore: it must name the node
    the between pass makes (the layout change once rewrote it as a module path)."""
    from replicate import between
    from replicate.passes import between as between_pass

    assert between.BROADCAST_OP == between_pass.BROADCAST_OP == "replicate/between/broadcast"


def test_dir_of_the_package_shows_its_public_names_not_its_helpers():
    names = _loaded_dir()
    assert {"transform", "Options", "ReplicateError", "StepFeeder"} <= names
    assert not names & {"annotations", "importlib", "_os"}


def _loaded_dir() -> set[str]:
    code = "import replicate\nprint('\\n'.join(dir(replicate)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    return set(out.stdout.split())
