"""The package's layers: which module may import which (docs/architecture.md#rules).

The layer table in docs/architecture.md is the single source of truth: this file parses
it, builds the import graph of the `refusion` package from its source with `ast` (no
module is imported), and checks five rules:

  (a) no import cycle between modules;
  (b) a module imports only modules of its own layer or of lower ones;
  (c) every module of the package falls in some layer;
  (d) no module inside the package imports the top package itself;
  (e) a package that holds a module of a lower layer than its own (the top package, and
      the stages' packages that hold their settings) runs, when imported, no import of a
      higher layer than that module's: every import of the module runs the package.

What counts as an import: `import` and `from ... import` statements anywhere in a module
(module level, inside functions, inside `if TYPE_CHECKING:` blocks), relative ones
resolved; `from P import x` is an import of the submodule `P.x` when there is one, else of
`P`; `importlib.import_module(...)` with a literal name, or an f-string whose literal head
names the package the module is taken from. The parent packages Python runs on the way to
a module are not edges of the graph (a package importing its own submodules would make
every such pair a cycle); rule (e) checks instead that the ones a lower layer passes
through stay light.

`if TYPE_CHECKING:` imports count for (a) to (d), although they never run: they still say
that a module is written against another's names, which is the dependency the layers are
about, and the lazy package `__init__`s declare in exactly such a block where each public
name comes from. A rule that let them through would allow a lower layer typed against a
higher one, and cycles that only readers and the type checker see. Rule (e) is about what
runs, so it counts only imports that run when the package is imported.

The checker functions take a table and a package directory, so the tests below run them
on small packages written to a temporary directory, with planted faults, and check that
each fault is reported exactly, before trusting what they say about the real package.
"""

from __future__ import annotations

import ast
import re
import textwrap
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "architecture.md"
MARKER = "<!-- layer-table -->"


# ---------------------------------------------------------------------------------- the table
@dataclass(frozen=True)
class Layer:
    number: int
    name: str
    prefixes: tuple[str, ...]  # module names; a prefix covers itself and every module below it


@dataclass(frozen=True)
class LayerTable:
    layers: tuple[Layer, ...]  # lowest first
    top: str  # the top package: above every layer, imported by no module inside it

    def layer_of(self, module: str) -> Layer | None:
        """The layer of the longest prefix that covers `module` (None: the top package, or
        no layer covers it). A package's `__init__` is the module named like the package,
        so it falls in the package's own layer, while a submodule listed on its own (a
        package's settings, say) falls in that submodule's layer."""
        if module == self.top:
            return None
        best: tuple[int, Layer] | None = None
        for layer in self.layers:
            for p in layer.prefixes:
                if (module == p or module.startswith(p + ".")) and (best is None or len(p) > best[0]):
                    best = (len(p), layer)
        return best[1] if best else None


def parse_layer_table(markdown: str) -> LayerTable:
    """The markdown table that follows the line `<!-- layer-table -->`: one row per layer,
    `| number | name | prefixes in backticks |`, lowest first, and one row `| top | ... |`
    naming the top package. Raises ValueError when the table is missing or inconsistent."""
    lines = markdown.splitlines()
    try:
        start = next(i for i, line in enumerate(lines) if line.strip() == MARKER)
    except StopIteration:
        raise ValueError(f"no line {MARKER!r} before the layer table") from None
    rows = []
    for line in lines[start + 1 :]:
        line = line.strip()
        if not line:
            if rows:
                break
            continue
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip("|").split("|")])
    layers, tops = [], []
    for cells in rows:
        if len(cells) < 3 or set(cells[0]) <= set("-: "):
            continue  # the separator row, or a malformed row (caught by the checks below)
        names = tuple(re.findall(r"`([A-Za-z_][\w.]*)`", cells[2]))
        if cells[0].isdigit():
            layers.append(Layer(int(cells[0]), cells[1].strip("`* "), names))
        elif cells[0].strip("`* ").lower() == "top":
            tops.append(names)
    if not layers:
        raise ValueError("the layer table has no numbered row")
    numbers = [layer.number for layer in layers]
    if numbers != list(range(1, len(layers) + 1)):
        raise ValueError(f"layers must be numbered 1, 2, ... from the lowest, got {numbers}")
    if len(tops) != 1 or len(tops[0]) != 1:
        raise ValueError("the layer table needs one `top` row naming exactly one package")
    top = tops[0][0]
    seen: dict[str, int] = {}
    for layer in layers:
        if not layer.prefixes:
            raise ValueError(f"layer {layer.number} ({layer.name}) lists no module")
        for p in layer.prefixes:
            if p in seen:
                raise ValueError(f"{p} is in layer {seen[p]} and in layer {layer.number}")
            if not p.startswith(top + "."):
                raise ValueError(f"{p} (layer {layer.number}) is not inside the top package {top}")
            seen[p] = layer.number
    return LayerTable(tuple(layers), top)


# ---------------------------------------------------------------------------- the import graph
@dataclass(frozen=True)
class Import:
    target: str  # the module imported (dotted name)
    line: int
    at_import: bool = (
        True  # runs when the importing module is imported (not in a function, not for TYPE_CHECKING)
    )


def package_modules(package_dir: Path) -> dict[str, Path]:
    """Every module of the package at `package_dir`, by dotted name (a package's
    `__init__.py` is named like the package)."""
    modules = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = list(path.relative_to(package_dir.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def _resolve(name: str, modules: dict[str, Path]) -> str:
    """`name` itself when it is a module; else the longest module that holds it (an
    attribute path); else `name` as written (a module that does not exist: it still has a
    layer by its prefix)."""
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in modules:
            return ".".join(parts[:n])
    return name


def _literal_head(node: ast.expr) -> str | None:
    """The module name a call's first argument gives: a string literal whole, or the literal
    head of an f-string up to its last dot (the package the module is taken from)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr) and node.values and isinstance(node.values[0], ast.Constant):
        head = str(node.values[0].value)
        return head.rsplit(".", 1)[0] if "." in head else None
    return None


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _walk(node: ast.AST, at_import: bool = True):
    """Every node below `node`, each with whether it runs when the module is imported:
    not in a function's body (nor, close enough, its defaults), not under `if TYPE_CHECKING:`."""
    for child in ast.iter_child_nodes(node):
        in_function = isinstance(node, ast.Lambda) or (
            isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and child not in node.decorator_list
        )
        for_types = isinstance(node, ast.If) and _is_type_checking(node.test) and child in node.body
        runs = at_import and not in_function and not for_types
        yield child, runs
        yield from _walk(child, runs)


def module_imports(module: str, path: Path, modules: dict[str, Path], top: str) -> list[Import]:
    """The modules of the package that `module` imports, anywhere in its source."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]

    def inside(name: str) -> bool:
        return name == top or name.startswith(top + ".")

    found: list[Import] = []
    for node, at_import in _walk(tree):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                if node.level - 1 > len(package) - 1:
                    raise ValueError(f"{path}:{node.lineno}: relative import beyond the top package")
                base = package[: len(package) - (node.level - 1)]
                where = ".".join(base + ([node.module] if node.module else []))
            else:
                where = node.module or ""
            if inside(where):
                for a in node.names:
                    sub = f"{where}.{a.name}"
                    targets.append(sub if a.name != "*" and sub in modules else where)
        elif isinstance(node, ast.Call) and node.args:
            f = node.func
            called = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
            if called == "import_module":
                head = _literal_head(node.args[0])
                if head is not None:
                    targets = [head]
        for t in targets:
            if inside(t):
                t = _resolve(t, modules)
                if t != module:
                    found.append(Import(t, node.lineno, at_import))
    return found


def import_graph(package_dir: Path, top: str) -> dict[str, list[Import]]:
    """module -> the package's modules it imports, in line order: the first import of each
    module that runs when the importing module is imported, and the first that does not."""
    modules = package_modules(package_dir)
    graph = {}
    for name, path in modules.items():
        first: dict[tuple[str, bool], Import] = {}
        for imp in sorted(module_imports(name, path, modules, top), key=lambda i: i.line):
            first.setdefault((imp.target, imp.at_import), imp)
        graph[name] = list(first.values())
    return graph


# ------------------------------------------------------------------------------------ the rules
def _edges(graph: dict[str, list[Import]], top: str) -> dict[str, list[str]]:
    """module -> the modules of the graph it imports; imports of the top package are left
    out (rule (d) reports them: every one would also close a cycle through the top
    package, which imports the public names)."""
    return {
        m: sorted({i.target for i in imps if i.target in graph and i.target != top})
        for m, imps in graph.items()
    }


def find_cycles(graph: dict[str, list[Import]], top: str) -> list[list[str]]:
    """The groups of modules that import each other in a circle (the strongly connected
    components of more than one module, found with Tarjan's algorithm), each sorted by
    name, the groups in order of their first module."""
    edges = _edges(graph, top)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []
    for root in sorted(edges):
        if root in index:
            continue
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        work = [(root, iter(edges[root]))]
        while work:  # depth first, without recursion
            v, successors = work[-1]
            w = next(successors, None)
            if w is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    group = []
                    while True:
                        x = stack.pop()
                        on_stack.discard(x)
                        group.append(x)
                        if x == v:
                            break
                    if len(group) > 1:
                        groups.append(sorted(group))
            elif w not in index:
                index[w] = low[w] = len(index)
                stack.append(w)
                on_stack.add(w)
                work.append((w, iter(edges[w])))
            elif w in on_stack:
                low[v] = min(low[v], index[w])
    return sorted(groups)


def shortest_cycle(graph: dict[str, list[Import]], top: str, group: list[str]) -> list[str]:
    """A cycle through the group's first module, with the fewest imports, as a path that
    starts and ends at that module (for the report: which imports to cut)."""
    edges, members, start = _edges(graph, top), set(group), group[0]
    came_from: dict[str, str] = {}
    queue = deque([start])
    while queue:
        v = queue.popleft()
        if start in edges[v]:
            path = [start, v]
            while path[-1] != start:
                path.append(came_from[path[-1]])
            return path[::-1]
        for w in edges[v]:
            if w in members and w != start and w not in came_from:
                came_from[w] = v
                queue.append(w)
    raise ValueError(f"{group} is not a cycle")


@dataclass(frozen=True)
class Violation:
    module: str
    layer: int
    imported: str
    imported_layer: int
    line: int

    def __str__(self) -> str:
        return (
            f"{self.module} (layer {self.layer}) imports {self.imported} (layer {self.imported_layer}) "
            f"at line {self.line}"
        )


def layer_violations(graph: dict[str, list[Import]], table: LayerTable) -> list[Violation]:
    """Every import of a module in a higher layer than the importer's. The top package may
    import anything; imports of it and modules without a layer are rules (d) and (c)."""
    out = []
    for module, imps in sorted(graph.items()):
        mine = table.layer_of(module)
        if mine is None:
            continue
        for imp in imps:
            theirs = table.layer_of(imp.target)
            if theirs is not None and theirs.number > mine.number:
                out.append(Violation(module, mine.number, imp.target, theirs.number, imp.line))
    return out


def unlayered(graph: dict[str, list[Import]], table: LayerTable) -> list[str]:
    """Modules of the package (and modules imported from it) that no layer covers."""
    names = set(graph) | {i.target for imps in graph.values() for i in imps}
    return sorted(m for m in names if m != table.top and table.layer_of(m) is None)


def top_imports(graph: dict[str, list[Import]], table: LayerTable) -> list[tuple[str, int]]:
    """(module, line) for every module inside that imports the top package itself."""
    return [
        (m, i.line)
        for m, imps in sorted(graph.items())
        if m != table.top
        for i in imps
        if i.target == table.top
    ]


def heavy_packages(graph: dict[str, list[Import]], table: LayerTable) -> list[str]:
    """Rule (e). A package that holds a module of a lower layer than its own (the top
    package holds them all; `refusion.decode` holds the decode settings) is run by every
    import of that module, so what it imports when it runs must be of that lower layer or
    below: in practice, it names its submodules lazily. One line per offending import."""
    out = []
    for package, imps in sorted(graph.items()):
        below = [table.layer_of(m) for m in graph if m.startswith(package + ".")]
        lows = [la.number for la in below if la is not None]
        if not lows:
            continue
        own = table.layer_of(package)
        low = min(lows)
        if own is not None and own.number <= low:
            continue
        for imp in imps:
            theirs = table.layer_of(imp.target)
            if imp.at_import and theirs is not None and theirs.number > low:
                where = "the top package" if own is None else f"layer {own.number}"
                out.append(
                    f"{package} ({where}) holds a module of layer {low} but imports {imp.target} "
                    f"(layer {theirs.number}) when it runs, at line {imp.line}"
                )
    return out


def _report(title: str, items: list) -> str:
    return f"{title} ({len(items)}):\n" + "\n".join(f"  {x}" for x in items)


# ------------------------------------------------------------------------- the checker, on toys
TOY_TABLE = """
Some prose the parser skips.

<!-- layer-table -->
| layer | name | modules |
|---|---|---|
| 1 | base | `toy.base`, `toy.sub.config` |
| 2 | mid | `toy.mid`, `toy.sub` |
| 3 | high | `toy.high` |
| top | package | `toy` (itself only) |

More prose.
"""


def src(text: str) -> str:
    """Source written indented in this file, as a module holds it (line 1 first)."""
    return textwrap.dedent(text).lstrip("\n")


def write_package(root: Path, files: dict[str, str]) -> Path:
    """Write a package under `root` from {relative path: source}; returns its directory."""
    for rel, source in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(source)
    return root / next(iter(files)).split("/")[0]


def clean_toy() -> dict[str, str]:
    """A toy package that keeps every rule, with each kind of import statement."""
    return {
        "toy/__init__.py": src("""
            from typing import TYPE_CHECKING
            if TYPE_CHECKING:
                from .high import run
        """),
        "toy/base.py": "import json\n",
        "toy/mid.py": src("""
            from . import base
            from .base import json
            import toy.sub.config
        """),
        "toy/sub/__init__.py": "from .config import X\n",
        "toy/sub/config.py": "from ..base import json\nX = 1\n",
        "toy/sub/worker.py": src("""
            def work():
                from .. import mid
                import importlib
                return importlib.import_module("toy.base")
        """),
        "toy/high.py": src("""
            from toy.mid import base
            from .sub import worker

            def run():
                import importlib
                return importlib.import_module(f"toy.sub.{'worker'}")
        """),
    }


@dataclass
class Findings:
    graph: dict[str, list[Import]]
    cycles: list[list[str]]
    violations: list[str]
    missing: list[str]
    tops: list[tuple[str, int]]
    heavy: list[str]

    def faults(self) -> dict[str, list]:
        """Every rule's findings, by rule name; empty lists where a rule holds."""
        return {
            "cycles": self.cycles,
            "violations": self.violations,
            "missing": self.missing,
            "tops": self.tops,
            "heavy": self.heavy,
        }


def check(package_dir: Path, table: LayerTable) -> Findings:
    graph = import_graph(package_dir, table.top)
    return Findings(
        graph,
        find_cycles(graph, table.top),
        [str(v) for v in layer_violations(graph, table)],
        unlayered(graph, table),
        top_imports(graph, table),
        heavy_packages(graph, table),
    )


def only(findings: Findings, **expected) -> None:
    """The findings are `expected` (rule name -> findings) and nothing else."""
    assert findings.faults() == {k: expected.get(k, []) for k in findings.faults()}


def test_the_toy_table_parses():
    table = parse_layer_table(TOY_TABLE)
    assert table.top == "toy"
    assert [(la.number, la.name, la.prefixes) for la in table.layers] == [
        (1, "base", ("toy.base", "toy.sub.config")),
        (2, "mid", ("toy.mid", "toy.sub")),
        (3, "high", ("toy.high",)),
    ]
    # the longest prefix wins: a package's settings module sits below the package, whose
    # __init__ is in the package's layer
    assert table.layer_of("toy.sub.config").number == 1
    assert table.layer_of("toy.sub").number == 2 and table.layer_of("toy.sub.worker").number == 2
    assert table.layer_of("toy.subway") is None and table.layer_of("toy") is None


@pytest.mark.parametrize(
    "bad, why",
    [
        (TOY_TABLE.replace(MARKER, ""), "no line"),
        (TOY_TABLE.replace("| 3 | high", "| 4 | high"), "numbered"),
        (TOY_TABLE.replace("`toy.high`", "`toy.mid`"), "in layer 2 and in layer 3"),
        (TOY_TABLE.replace("| top | package | `toy` (itself only) |\n", ""), "top"),
        (TOY_TABLE.replace("`toy.high`", "`other.high`"), "not inside the top package"),
    ],
)
def test_a_broken_table_is_refused(bad, why):
    with pytest.raises(ValueError, match=why):
        parse_layer_table(bad)


def test_the_clean_toy_passes_and_its_imports_are_all_seen(tmp_path):
    found = check(write_package(tmp_path, clean_toy()), parse_layer_table(TOY_TABLE))
    only(found)
    edges = {m: sorted((i.target, i.at_import) for i in imps) for m, imps in found.graph.items()}
    assert edges == {
        "toy": [("toy.high", False)],  # a TYPE_CHECKING import counts, and does not run
        "toy.base": [],
        "toy.mid": [("toy.base", True), ("toy.sub.config", True)],  # `from . import base`: the submodule
        "toy.sub": [("toy.sub.config", True)],
        "toy.sub.config": [("toy.base", True)],
        "toy.sub.worker": [
            ("toy.base", False),
            ("toy.mid", False),
        ],  # in a function; `from .. import mid`; import_module
        "toy.high": [
            ("toy.mid", True),
            ("toy.sub", False),
            ("toy.sub.worker", True),
        ],  # f-string: the package
    }


def test_a_planted_cycle_is_reported_exactly(tmp_path):
    files = clean_toy()
    files["toy/mid.py"] += "from .sub import X\n"  # mid -> sub (X is no submodule: the package)
    files["toy/sub/__init__.py"] += "def late():\n    from .worker import work\n"  # sub -> worker (-> mid)
    found = check(write_package(tmp_path, files), parse_layer_table(TOY_TABLE))
    only(found, cycles=[["toy.mid", "toy.sub", "toy.sub.worker"]])
    assert shortest_cycle(found.graph, "toy", found.cycles[0]) == [
        "toy.mid",
        "toy.sub",
        "toy.sub.worker",
        "toy.mid",
    ]


def test_separate_cycles_are_reported_one_group_each(tmp_path):
    files = {
        "toy/__init__.py": "",
        "toy/base.py": "",
        "toy/mid.py": "from .high import a\n",
        "toy/high.py": "from .mid import b\nfrom .high2 import c\n",
        "toy/high2.py": "from .high import d\n",
    }
    graph = import_graph(write_package(tmp_path, files), "toy")
    assert find_cycles(graph, "toy") == [["toy.high", "toy.high2", "toy.mid"]]
    assert shortest_cycle(graph, "toy", ["toy.high", "toy.high2", "toy.mid"]) == [
        "toy.high",
        "toy.high2",
        "toy.high",
    ]
    files["toy/base.py"] = "from . import base2\n"
    files["toy/base2.py"] = "from .base import e\n"
    graph = import_graph(write_package(tmp_path, files), "toy")
    assert find_cycles(graph, "toy") == [["toy.base", "toy.base2"], ["toy.high", "toy.high2", "toy.mid"]]


def test_a_planted_upward_import_is_reported_exactly(tmp_path):
    files = clean_toy()
    files["toy/high.py"] = "def run():\n    pass\n"  # a leaf, so that the planted import closes no cycle
    files["toy/sub/config.py"] += "\ndef helper():\n    from ..high import run\n    return run\n"
    found = check(write_package(tmp_path, files), parse_layer_table(TOY_TABLE))
    only(found, violations=["toy.sub.config (layer 1) imports toy.high (layer 3) at line 5"])


def test_an_upward_import_for_type_checking_counts(tmp_path):
    files = clean_toy()
    files["toy/base.py"] = (
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from toy.sub.worker import work\n"
    )
    found = check(write_package(tmp_path, files), parse_layer_table(TOY_TABLE))
    assert found.violations == ["toy.base (layer 1) imports toy.sub.worker (layer 2) at line 3"]


def test_an_import_of_the_top_package_is_reported(tmp_path):
    files = clean_toy()
    files["toy/mid.py"] += "import toy\n"
    files["toy/sub/worker.py"] += "\nfrom .. import __version__\n"
    found = check(write_package(tmp_path, files), parse_layer_table(TOY_TABLE))
    only(found, tops=[("toy.mid", 4), ("toy.sub.worker", 6)])  # and no cycle through the top package


def test_a_module_outside_every_layer_is_reported(tmp_path):
    files = clean_toy()
    files["toy/extra/__init__.py"] = ""
    files["toy/extra/tool.py"] = "from ..base import json\n"
    only(
        check(write_package(tmp_path, files), parse_layer_table(TOY_TABLE)),
        missing=["toy.extra", "toy.extra.tool"],
    )


def test_a_package_that_runs_higher_imports_on_the_way_down_is_reported(tmp_path):
    files = clean_toy()
    files["toy/sub/__init__.py"] += "from .worker import work\n"  # run by every import of toy.sub.config
    files["toy/__init__.py"] += "from .mid import base\n"  # run by every import of anything
    found = check(write_package(tmp_path, files), parse_layer_table(TOY_TABLE))
    only(
        found,
        heavy=[
            "toy (the top package) holds a module of layer 1 but imports toy.mid (layer 2) "
            "when it runs, at line 4",
            "toy.sub (layer 2) holds a module of layer 1 but imports toy.sub.worker (layer 2) "
            "when it runs, at line 2",
        ],
    )


# ---------------------------------------------------------------------------- the real package
@pytest.fixture(scope="module")
def table() -> LayerTable:
    return parse_layer_table(DOC.read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def graph(table) -> dict[str, list[Import]]:
    return import_graph(REPO / table.top, table.top)


def test_the_documented_table_parses(table):
    assert table.top == "refusion"
    # a stage's settings sit below the stage's package, which holds them
    assert table.layer_of("refusion.decode.config").number < table.layer_of("refusion.decode").number
    assert table.layer_of("refusion.decode.engine") == table.layer_of("refusion.decode")


def test_the_graph_sees_the_package(graph):
    """The checks below are only as good as the graph: it must hold the package's modules
    and their known imports."""
    assert len(graph) > 50
    assert "refusion.model.kv_cache" in {i.target for i in graph["refusion.decode.refusion"]}
    assert "refusion.decode.config" in {i.target for i in graph["refusion.decode.recommended"]}


def test_no_import_cycle(graph, table):
    groups = find_cycles(graph, table.top)
    lines = [f"{', '.join(g)}; e.g. {' -> '.join(shortest_cycle(graph, table.top, g))}" for g in groups]
    assert not groups, _report("groups of modules that import each other in a circle", lines)


def test_imports_go_down_the_layers(graph, table):
    violations = layer_violations(graph, table)
    assert not violations, _report("imports of a higher layer", violations)


def test_every_module_has_a_layer(graph, table):
    missing = unlayered(graph, table)
    assert not missing, _report("modules in no layer of docs/architecture.md", missing)


def test_nothing_inside_imports_the_top_package(graph, table):
    tops = top_imports(graph, table)
    assert not tops, _report(f"imports of the top package {table.top}", [f"{m} at line {n}" for m, n in tops])


def test_packages_on_the_way_to_a_lower_layer_stay_light(graph, table):
    heavy = heavy_packages(graph, table)
    assert not heavy, _report("packages that run imports of a higher layer than a module they hold", heavy)
