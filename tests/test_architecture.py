"""The package's layering, read from the source with ``ast``: which module may import which.

Layers, lowest first:

* the runtime core: every module not named below (spec, plans, families, source, cache, tiers, ...);
* the integrations: ``adalncache.integrations`` and its public alias ``adalncache.diffusers``;
* the command-line shells (``adalncache.cli``, ``adalncache.commands``, ``adalncache.__main__``) and
  the tools (``adalncache.tools``: tiny models, demo, measurements, and the ``bench`` package).

A module may import its own layer and the layers below it, never one above: a serving process
then never loads the benchmark, the tiny-model builders or argparse code, and the core never
depends on diffusers' integration. No import cycle anywhere in the package either, so every
module can be read, tested and changed with only what is below it in mind. Every import counts,
also one inside a function (it runs when called) or under ``if TYPE_CHECKING:`` (it still ties the
two modules' designs together). One dependency of the core on the integration is declared instead
of imported: a family whose projection input from a checkpoint needs the model's own modules names
that function in its registry entry (``Family.model_embed``), and a test here checks it resolves.

Inside two packages the same scan checks one more rule each: a module of the benchmark's sections
(``tools.bench``) imports only the benchmark's shared modules, never another module of sections;
and the integration's family-neutral modules never import a family's module.

The strings are scanned too: no model is named in the family-neutral core (outside ``families/``
and the two table formats that are one family's), the core spells no CLI flag and no word of the
integration, and the flags the integration still spells only shrink. The package stays within its
line and module budget, and the tools are not fought (no formatter opt-out; a handful of type
ignores, each with its error code and a comment saying why).
"""

from __future__ import annotations

import ast
import re
import tokenize
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import pytest

PACKAGE = "adalncache"
SRC = Path(__file__).resolve().parents[1] / "src" / PACKAGE

CLI = {"adalncache.cli", "adalncache.commands", "adalncache.fit", "adalncache.__main__"}


@dataclass(frozen=True)
class Edge:
    """``source`` imports ``target`` at ``path:line``."""

    source: str
    target: str
    path: str
    line: int

    def __str__(self) -> str:
        return f"{self.source} -> {self.target} ({self.path}:{self.line})"


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules(root: Path = SRC) -> dict[str, Path]:
    """Every module and package of the tree at ``root``, by dotted name."""
    return {_module_name(path, root): path for path in sorted(root.rglob("*.py"))}


def _resolve(name: str, imported: str | None, known: set[str]) -> str | None:
    """The module an import binds: ``pkg.name`` when ``name`` is a submodule, else ``pkg`` (if ours)."""
    if imported is not None and f"{name}.{imported}" in known:
        return f"{name}.{imported}"
    while name and name not in known:  # ``import adalncache.x.y`` of an attribute: its module
        name = name.rpartition(".")[0]
    return name or None


def import_edges(root: Path = SRC) -> list[Edge]:
    """Every import from one module of the package to another, wherever it stands in the file."""
    found = modules(root)
    known = set(found)
    edges: list[Edge] = []
    for source, path in found.items():
        is_package = path.name == "__init__.py"
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            targets: list[str | None] = []
            if isinstance(node, ast.Import):
                targets = [_resolve(alias.name, None, known) for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = source.split(".") if is_package else source.split(".")[:-1]
                    base = base[: len(base) - (node.level - 1)]
                    name = ".".join([*base, node.module] if node.module else base)
                else:
                    name = node.module or ""
                targets = [_resolve(name, alias.name, known) for alias in node.names]
            for target in targets:
                if target is not None and target != source and target.split(".")[0] == PACKAGE:
                    edges.append(Edge(source, target, str(path.relative_to(root.parent.parent)), node.lineno))
    return list(dict.fromkeys(edges))  # one edge per import statement and target


def layer(module: str) -> int:
    """0: runtime core, 1: integrations, 2: command line and tools."""
    if module in CLI or module == "adalncache.tools" or module.startswith("adalncache.tools."):
        return 2
    if module == "adalncache.diffusers" or module.startswith("adalncache.integrations"):
        return 1
    return 0


LAYER_NAMES = {0: "the runtime core", 1: "the integrations", 2: "the command line and tools"}


def upward_imports(edges: Iterable[Edge]) -> list[str]:
    return [
        f"{edge}: {LAYER_NAMES[layer(edge.source)]} must not import {LAYER_NAMES[layer(edge.target)]}"
        for edge in edges
        if layer(edge.target) > layer(edge.source)
    ]


def cycles(edges: Iterable[Edge]) -> list[list[Edge]]:
    """The import cycles: for each strongly connected group of modules, the imports inside it."""
    edges = list(edges)
    graph: dict[str, set[str]] = {}
    for edge in edges:
        graph.setdefault(edge.source, set()).add(edge.target)
        graph.setdefault(edge.target, set())
    # Tarjan's algorithm, iterative (no recursion limit on a deep graph).
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[set[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                group = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.add(member)
                    if member == node:
                        break
                if len(group) > 1:
                    groups.append(group)
    return [[e for e in edges if e.source in group and e.target in group] for group in groups]


# ---------------------------------------------------------------------------------------------
# the package's own graph


def test_the_graph_is_read() -> None:
    """The scan sees imports of every kind (module level, relative, deferred), or the rules below prove nothing."""
    pairs = {(edge.source, edge.target) for edge in import_edges()}
    assert ("adalncache.cache", "adalncache.plans") in pairs  # from .plans import ...
    assert ("adalncache.tiers.store", "adalncache.spec") in pairs  # from ..spec import ...
    assert ("adalncache.tools.demo", "adalncache.tools.tiny") in pairs  # inside a function
    assert ("adalncache.commands", "adalncache.offline") in pairs
    assert ("adalncache.plans", "adalncache.families.minimax_h3") in pairs


def test_no_layer_imports_a_layer_above_it() -> None:
    problems = upward_imports(import_edges())
    assert not problems, "imports against the layering:\n" + "\n".join(problems)


def test_no_import_cycles() -> None:
    found = cycles(import_edges())
    lines = []
    for group in found:
        members = sorted({e.source for e in group})
        lines.append(f"cycle among {', '.join(members)}:")
        lines.extend(f"  {edge}" for edge in group)
    assert not found, "import cycles (break each by moving what both sides need below them):\n" + "\n".join(lines)


#: The benchmark's shared modules; every other module of ``tools.bench`` holds sections of one kind.
BENCH = "adalncache.tools.bench"
BENCH_SHARED = {f"{BENCH}.{name}" for name in ("workload", "primitives")}
BENCH_DRIVERS = {BENCH}


def test_bench_sections_import_only_the_shared_modules() -> None:
    """A module of the benchmark's sections is read on its own: it imports the shared modules, never another
    module of sections."""
    found = modules()
    sections = {name for name in found if name.startswith(f"{BENCH}.")} - BENCH_SHARED - BENCH_DRIVERS
    assert {f"{BENCH}.passes", f"{BENCH}.models"} <= sections  # the scan sees the package
    problems = [
        str(edge)
        for edge in import_edges()
        if (edge.target in sections and edge.source not in BENCH_DRIVERS)
        or (edge.source in BENCH_SHARED and edge.target.startswith(f"{BENCH}.") and edge.target not in BENCH_SHARED)
    ]
    assert not problems, "benchmark sections imported by another section or by a shared module:\n" + "\n".join(problems)


#: The integration's modules that know nothing of a model family: they never import a family's module
#: (they reach the family through ``registry`` and the ``DiffusersFamily`` interface).
INTEGRATION = "adalncache.integrations.diffusers"
FAMILY_NEUTRAL = {
    f"{INTEGRATION}.{name}"
    for name in (
        "compat",
        "family",
        "sources",
        "quantized",
        "parking",
        "hooks",
        "signature",
        "request",
        "handle",
    )
}


def test_a_declared_model_embed_resolves_in_the_integration() -> None:
    """``Family.model_embed`` names a function of the integration layer that exists (not an import: the
    core loads it by name when a command asks, so a rename there must show here)."""
    import importlib

    from adalncache import families

    declared = [f.model_embed for f in families.FAMILIES.values() if f.model_embed]
    assert declared
    for name in declared:
        module, _, function = name.partition(":")
        assert layer(module) == 1 and callable(getattr(importlib.import_module(module), function)), name


#: The integration's family modules (one per family, beside its family seam).
FAMILY_MODULE_NAMES = ("minimax_h3", "qwen_image", "adaln_zero")


def test_the_family_neutral_integration_modules_know_no_family() -> None:
    found = modules()
    assert set(found) >= FAMILY_NEUTRAL and f"{INTEGRATION}.minimax_h3" in found
    problems = [
        str(e)
        for e in import_edges()
        if e.source in FAMILY_NEUTRAL and e.target in {f"{INTEGRATION}.{name}" for name in FAMILY_MODULE_NAMES}
    ]
    assert not problems, "family-neutral modules importing a family's module:\n" + "\n".join(problems)


# ---------------------------------------------------------------------------------------------
# no model's name below the family modules

#: Names that belong to a model family: MiniMax-H3's package and class names, module paths, checkpoint
#: names and request kinds; Qwen-Image's modules and keying input; the AdaLayerNormZero family's classes
#: and the look-alikes the registry refuses.
MODEL_NAMES = re.compile(
    r"minimax|adaln_proj|final_layer|proj_in|proj_out|fl2va|ref2va|t2va"
    r"|qwen|img_mod|txt_mod|time_text_embed|additional_t_cond"
    r"|adaln_zero|hunyuan|aura_?flow|\bbria|\bovis|longcat|\bmotif|\bflux|\bmochi|hidream|kandinsky",
    re.IGNORECASE,
)

#: MiniMax-H3's own modules outside ``families/``: the two table formats that are its alone, SGLang's
#: sidecar (its model variants and schedule flags) and vLLM-Omni's (its modes, schedule contract and
#: manifest).
FAMILY_MODULES = {"adalncache.formats.sglang", "adalncache.formats.vllm_omni"}

#: The public MiniMax-H3 names the core keeps (docs/api.md), each where it has always been
#: importable from, and the family module each comes from: ``ModulationSpec.minimax_h3`` and
#: ``adalncache.plans.minimax_h3_plans``.
ALLOWED = {"adalncache.spec": {"minimax_h3"}, "adalncache.plans": {"minimax_h3_plans", "minimax_h3"}}


def _names_in(tree: ast.AST) -> Iterable[tuple[int, str]]:
    """Every string constant (docstrings and f-string parts included) and identifier, with its line."""
    for node in ast.walk(tree):
        line = getattr(node, "lineno", 0)
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            yield line, node.value
        elif isinstance(node, ast.Name):
            yield line, node.id
        elif isinstance(node, ast.Attribute):
            yield line, node.attr
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            yield line, node.name
        elif isinstance(node, ast.arg):
            yield line, node.arg
        elif isinstance(node, ast.alias):
            yield line, node.name
            if node.asname:
                yield line, node.asname
        elif isinstance(node, ast.ImportFrom) and node.module:
            yield line, node.module


def model_names_below_families(root: Path = SRC) -> list[str]:
    """Where a runtime-core module outside the family modules names a model (``module:line: text``)."""
    found = []
    for module, path in modules(root).items():
        if layer(module) != 0 or module in FAMILY_MODULES or module.split(".")[:2] == [PACKAGE, "families"]:
            continue
        allowed = ALLOWED.get(module, set())
        for line, text in _names_in(ast.parse(path.read_text(), filename=str(path))):
            for match in MODEL_NAMES.finditer(text):
                word = re.match(r"\w*", text[match.start() :])
                if word is not None and word.group(0) in allowed:
                    continue
                found.append(f"{module}:{line}: {text[max(0, match.start() - 30) : match.end() + 30]!r}")
    return found


def test_no_model_name_below_the_family_modules() -> None:
    """The core knows served layers, plans and key layouts; what is a model's lives in its family module."""
    found = model_names_below_families()
    assert not found, "model names in the family-neutral core (move them to adalncache/families/):\n" + "\n".join(found)


def test_the_name_scan_finds_names_in_strings_and_identifiers(tmp_path: Path) -> None:
    root = _tree(
        tmp_path,
        {
            "__init__.py": "",
            "a.py": '"""Serves MiniMax-H3."""\n',
            "b.py": "def f(adaln_proj):\n    return adaln_proj\n",
            "c.py": 'X = f"{1}t2va"\n',
            "d.py": 'PATH = "transformer_blocks.0.img_mod.1"  # improvised, provisional\n',
            "families/__init__.py": "",
            "families/m.py": 'NAME = "minimax-h3"\n',
            "integrations/x.py": 'NAME = "minimax-h3"\n',
        },
    )
    found = model_names_below_families(root)
    assert {entry.split(":")[0] for entry in found} == {"adalncache.a", "adalncache.b", "adalncache.c", "adalncache.d"}


# ---------------------------------------------------------------------------------------------
# the core speaks only for itself: no CLI flag, no word of the integration above it

#: The one module of the core that may spell CLI flags: the options definition, where messages take them from.
OPTIONS_MODULE = "adalncache.options"

#: A command-line flag: ``--max-plans``, ``-o``.
CLI_FLAG = re.compile(r"(?<![\w-])(?:--[a-z][a-z0-9-]*|-o\b)")

#: Words of the layer above the core: the integration, its entry points, the model object it patches.
ABOVE = re.compile(r"diffusers|enable_adaln_cache|load_transformer|model\.to\b", re.IGNORECASE)


def _message_strings(tree: ast.AST) -> Iterable[tuple[int, str]]:
    """Every string constant and f-string part that is not a docstring (docstrings document; these are said)."""
    docstrings = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                docstrings.add(id(first.value))
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            yield node.lineno, node.value


def _imports_diffusers(tree: ast.AST) -> bool:
    """Whether the module imports diffusers itself (MiniMax-H3's schedules, its time embedder)."""
    for node in ast.walk(tree):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names = [node.module]
        if any(name.split(".")[0] == "diffusers" for name in names):
            return True
    return False


def core_speaking_above(root: Path = SRC) -> list[str]:
    """Where a runtime-core module's strings spell a CLI flag or speak of the integration above it.

    A flag belongs to the command line; the core takes it from the options definition
    (``adalncache.options.flag``), so a renamed flag changes in one place. The integration's words
    (diffusers, its entry points, ``model.to``) are an upward dependency no import shows. Exempt:
    a bare identifier (``"diffusers"`` is a checkpoint layout's name, data rather than prose) and a
    module that imports diffusers itself, whose messages name what it needs installed.
    """
    found = []
    for module, path in modules(root).items():
        if layer(module) != 0 or module == OPTIONS_MODULE:
            continue
        tree = ast.parse(path.read_text(), filename=str(path))
        own_dependency = _imports_diffusers(tree)
        for line, text in _message_strings(tree):
            for match in CLI_FLAG.finditer(text):
                found.append(f"{module}:{line}: flag {match.group(0)} in {text!r}")
            if text.isidentifier() or own_dependency:
                continue
            for match in ABOVE.finditer(text):
                found.append(f"{module}:{line}: {match.group(0)!r} in {text!r}")
    return found


def test_the_core_names_no_flag_and_nothing_above_it() -> None:
    found = core_speaking_above()
    assert not found, (
        "the runtime core spells a CLI flag (take it from adalncache.options.flag/knob) or speaks of the "
        "integration above it (phrase it neutrally):\n" + "\n".join(found)
    )


#: CLI flags the integration still spells in its messages, each with how many times: written before the
#: messages took their flags from the options definition. The list may only shrink (a count going down, a
#: flag going away); a new flag, or one more use of a listed one, fails: take it from
#: ``adalncache.options.flag``.
INTEGRATION_FLAGS = {
    "--checkpoint": 5,
    "--max-plans": 1,
    "--plan-width": 1,
    "--precision": 1,
    "--shard": 2,
    "--steps": 1,
    "--timesteps": 1,
}


def flags_spelled(root: Path = SRC, level: int = 1) -> dict[str, list[str]]:
    """Each CLI flag written in the messages of the modules of ``level``, with where (``module:line``)."""
    found: dict[str, list[str]] = {}
    for module, path in modules(root).items():
        if layer(module) != level:
            continue
        for line, text in _message_strings(ast.parse(path.read_text(), filename=str(path))):
            for match in CLI_FLAG.finditer(text):
                found.setdefault(match.group(0), []).append(f"{module}:{line}")
    return found


def test_the_integration_spells_no_new_flag() -> None:
    """The integration's messages name flags through the options definition: the flags it still spells
    itself are a list that only shrinks."""
    found = flags_spelled()
    grown = {flag: where for flag, where in found.items() if len(where) > INTEGRATION_FLAGS.get(flag, 0)}
    assert not grown, "CLI flags spelled in the integration (take them from adalncache.options.flag):\n" + "\n".join(
        f"  {flag}: {', '.join(where)}" for flag, where in sorted(grown.items())
    )


def test_the_speech_scan_finds_flags_and_words_above(tmp_path: Path) -> None:
    root = _tree(
        tmp_path,
        {
            "__init__.py": "",
            "a.py": 'def f(n):\n    """Set --max-plans (documented)."""\n    return f"set {n} (CLI --max-plans)"\n',
            "b.py": 'MSG = "close the diffusers handle first"\n',
            "c.py": 'LAYOUT = "diffusers"\nOUT = "-o FILE"\n',
            "d.py": 'import diffusers\nMSG = "install diffusers"\n',
            "options.py": 'FLAG = "--max-plans"\n',
            "cli.py": 'FLAG = "--max-plans"\n',
            "integrations/x.py": 'MSG = "the diffusers handle, --device"\n',
        },
    )
    found = core_speaking_above(root)
    assert sorted(entry.split(":")[0] for entry in found) == ["adalncache.a", "adalncache.b", "adalncache.c"]
    assert any("flag -o" in entry for entry in found)
    assert flags_spelled(root) == {"--device": ["adalncache.integrations.x:1"]}


# ---------------------------------------------------------------------------------------------
# structure: one concept per module, measured over the whole package (no cap on a class or a function:
# a cap splits one concept over several files)

#: The package stays small enough to read whole: at most this many lines and modules in ``src/adalncache``.
MAX_PACKAGE_LINES = 23_950
MAX_PACKAGE_MODULES = 90


def package_size(root: Path = SRC) -> tuple[int, int]:
    """(lines, modules) of the package under ``root``: every ``.py`` file, every line counted."""
    paths = list(modules(root).values())
    return sum(len(path.read_text().splitlines()) for path in paths), len(paths)


def test_the_package_stays_within_its_structure_budget() -> None:
    """Lines and modules of ``src/adalncache`` stay within the budget: a concept that grows a second
    module, or code written twice, shows here rather than in a review."""
    lines, count = package_size()
    assert lines <= MAX_PACKAGE_LINES, f"src/adalncache has {lines} lines (budget {MAX_PACKAGE_LINES})"
    assert count <= MAX_PACKAGE_MODULES, f"src/adalncache has {count} modules (budget {MAX_PACKAGE_MODULES})"


def test_the_size_scan_counts_every_line_of_every_module(tmp_path: Path) -> None:
    root = _tree(tmp_path, {"__init__.py": "", "a.py": "x = 1\n\n# c\n", "sub/__init__.py": "", "sub/b.py": "y = 2\n"})
    assert package_size(root) == (4, 4)


# ---------------------------------------------------------------------------------------------
# the tools are not fought: no formatter opt-outs, a handful of type ignores, each saying why

ROOT = SRC.parents[1]
#: How many ``type: ignore`` the runtime may hold ("a handful"): each is a place mypy cannot follow.
MAX_RUNTIME_IGNORES = 8
IGNORE = re.compile(r"#\s*type:\s*ignore(?P<codes>\[[^\]]+\])?(?P<rest>.*)")


def tool_overrides(paths: Iterable[Path], root: Path = ROOT) -> tuple[list[str], int]:
    """(problems, ignores in ``src``): each formatter opt-out, and each ``type: ignore`` without an
    error code or without a comment after it that says why. Comments only (``tokenize``), so a string
    that spells the words is not counted."""
    problems: list[str] = []
    runtime = 0
    for path in paths:
        with path.open() as handle:
            comments = [t for t in tokenize.generate_tokens(handle.readline) if t.type == tokenize.COMMENT]
        for token in comments:
            where = f"{path.relative_to(root)}:{token.start[0]}"
            if re.search(r"fmt:\s*(skip|off)", token.string):
                problems.append(f"{where}: a formatter opt-out")
            found = IGNORE.search(token.string)
            if found is None:
                continue
            if path.relative_to(root).parts[0] == "src":
                runtime += 1
            if not found["codes"] or not found["rest"].strip().lstrip("#").strip():
                problems.append(f"{where}: a type ignore needs its error code and a comment saying why")
    return problems, runtime


def test_the_tools_are_not_fought() -> None:
    paths = sorted(p for folder in ("src", "tests", "scripts", "examples") for p in (ROOT / folder).rglob("*.py"))
    problems, runtime = tool_overrides(paths)
    assert not problems, "\n".join(problems)
    assert runtime <= MAX_RUNTIME_IGNORES, f"{runtime} type ignores in src (at most {MAX_RUNTIME_IGNORES})"


def test_the_override_scan_finds_bare_ignores_and_opt_outs(tmp_path: Path) -> None:
    path = tmp_path / "x.py"
    path.write_text(
        "a = f(1)  # type: ignore\n"
        "b = f(2)  # type: ignore[arg-type]\n"
        "c = f(3)  # type: ignore[arg-type]  # wrong on purpose\n"
        "d = [1,2]  # fmt: skip\n"
        "e = '# type: ignore  # fmt: skip'\n"
    )
    problems, runtime = tool_overrides([path], tmp_path)
    assert [p.split(":")[1] for p in problems] == ["1", "2", "4"] and runtime == 0, problems


# ---------------------------------------------------------------------------------------------
# the checker itself, on made-up trees


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / PACKAGE
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_checker_finds_a_deferred_cycle_and_an_upward_import(tmp_path: Path) -> None:
    root = _tree(
        tmp_path,
        {
            "__init__.py": "",
            "a.py": "from .b import x\n",
            "b.py": "def f():\n    from . import a\n",
            "c.py": "import adalncache.tools.bench\n",
            "tools/__init__.py": "",
            "tools/bench.py": "from ..a import y\n",
        },
    )
    edges = import_edges(root)
    [group] = cycles(edges)
    assert {(e.source, e.target) for e in group} == {("adalncache.a", "adalncache.b"), ("adalncache.b", "adalncache.a")}
    assert any("b.py:2" in str(e) for e in group)
    problems = upward_imports(edges)
    assert len(problems) == 1 and problems[0].startswith("adalncache.c -> adalncache.tools.bench")


@pytest.mark.parametrize(
    ("text", "target"),
    [
        ("from .sub import mod\n", "adalncache.sub.mod"),
        ("from .sub.mod import thing\n", "adalncache.sub.mod"),
        ("from adalncache.sub import thing\n", "adalncache.sub"),
        ("import adalncache.sub.mod as m\n", "adalncache.sub.mod"),
    ],
)
def test_checker_resolves_imports_to_modules(tmp_path: Path, text: str, target: str) -> None:
    root = _tree(tmp_path, {"__init__.py": "", "x.py": text, "sub/__init__.py": "", "sub/mod.py": ""})
    assert [(e.source, e.target) for e in import_edges(root)] == [("adalncache.x", target)]


# ---------------------------------------------------------------------------------------------------- the map

ARCHITECTURE = SRC.parents[1] / "docs" / "architecture.md"
MAP_LAYERS = {"core": 0, "integration": 1, "command line": 2}


def architecture_map(text: str) -> list[tuple[str, str]]:
    """``(file, layer)`` of every row of the "Where each concept lives" table of docs/architecture.md."""
    section = text.split("## Where each concept lives", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^\| `([^`]+\.py)` \| ([a-z ]+) \|", section, flags=re.M)


def test_the_architecture_map_names_every_module_once() -> None:
    """docs/architecture.md maps each module to the concept it owns: a module added, moved or removed
    without the map changing fails here, and so does a row whose layer is not the module's."""
    rows = architecture_map(ARCHITECTURE.read_text())
    files = [path for path, _ in rows]
    repeated = sorted({path for path in files if files.count(path) > 1})
    assert not repeated, f"modules mapped twice: {repeated}"
    actual = {str(path.relative_to(SRC)): name for name, path in modules().items()}
    assert sorted(set(files) - set(actual)) == [], "the map names files that do not exist"
    assert sorted(set(actual) - set(files)) == [], "modules missing from docs/architecture.md's map"
    wrong = [
        f"{path}: mapped to the {where}, but the import rules put it in {LAYER_NAMES[layer(actual[path])]}"
        for path, where in rows
        if MAP_LAYERS[where] != layer(actual[path])
    ]
    assert not wrong, "\n".join(wrong)


def test_the_map_check_sees_a_missing_module_and_a_wrong_layer() -> None:
    text = (
        "## Where each concept lives\n\n| `cache.py` | integration | x |\n| `cli.py` | command line | y |\n\n## Next\n"
    )
    assert architecture_map(text) == [("cache.py", "integration"), ("cli.py", "command line")]
    assert MAP_LAYERS["integration"] != layer("adalncache.cache")
