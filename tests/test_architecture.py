"""The package's shape, checked mechanically (docs/design.md): folders are layers of the stack and
import downward only, no module imports itself back through a circle, no code outside kv/
branches on a KV policy's name (a policy's facts are methods on it), and scripts/ reach the engine
only through the API or the bench floor (flexgen_sparpr/bench/), named exceptions aside, and the
bench floor and every script reach the engine only through the API, where only LLM (api/llm.py)
makes an Engine; no module is longer than MAX_LINES and scripts/ stay thin."""
from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

from flexgen_sparpr.kv.policies import POLICIES

ROOT = Path(__file__).resolve().parent.parent / "flexgen_sparpr"
# bottom to top; a folder imports only from its own layer and the ones below
LAYERS = [
    {"errors", "utils"},
    {"storage"},
    {"models"},
    {"weights", "runtime"},
    {"kv"},
    {"engine"},
    {"config"},  # options, validation, preflight, prompts: under every face
    {"api", "upstream"},
    {"bench"},  # the benchmarks: above the API they drive
    {"cli", "serve", "flex_opt", "dist_flex_opt", "__main__"},
]
LEVEL = {name: i for i, names in enumerate(LAYERS) for name in names}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in ROOT.rglob("*.py")}


def imports(name: str, path: Path, known: set[str]) -> set[str]:
    """Package modules `name` imports anywhere in its file (function-level imports too)."""
    return {m for m in absolute_imports(name, path) if m in known}


def graph() -> dict[str, set[str]]:
    mods = modules()
    return {name: imports(name, path, set(mods)) for name, path in mods.items()}


def folder(name: str) -> str:
    return name.split(".")[1] if "." in name else name


def test_import_linter_contracts_hold():
    """The same floors as import-linter's contracts in pyproject.toml (a layers contract, and no
    face but the command line's own importing cli/), checked by import-linter itself (a test
    dependency: requirements.txt)."""
    exe = Path(sys.executable).with_name("lint-imports")
    assert exe.exists(), "import-linter is not installed: pip install -r requirements.txt"
    repo = ROOT.parent
    r = subprocess.run([str(exe), "--no-cache"], cwd=repo, capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": str(repo)})
    assert r.returncode == 0 and "0 broken" in r.stdout, r.stdout[-4000:] + r.stderr[-2000:]


# what the bench floor reaches only through the API (LLM, api/llm.py; api/measure.py); import-linter's
# contract says the same
BENCH_BEHIND_THE_API = ("engine", "storage")


def test_the_bench_floor_reaches_the_engine_only_through_the_api():
    found = sorted(f"{m} imports {d}" for m, deps in graph().items() if folder(m) == "bench"
                   for d in deps if folder(d) in BENCH_BEHIND_THE_API)
    assert not found, "\n".join(found)


# the floor under the faces and the faces other than the command line: no flag parsing in them
# (the command line builds its parser from config/flags.py's table; cli/parser.py)
NO_ARGPARSE = ("config", "api", "serve")
PARSING = ("argparse", "flexgen_sparpr.utils.args", "flexgen_sparpr.cli")


def absolute_imports(name: str, path: Path) -> set[str]:
    """Every module `name` imports anywhere in its file, absolute (the standard library's too)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package
            for _ in range(node.level - 1):
                base = base.rpartition(".")[0]
            base = (f"{base}.{node.module}" if node.module else base) if node.level else node.module
            out |= {base} | {f"{base}.{a.name}" for a in node.names}
    return out


def test_config_api_and_serve_parse_no_flags():
    """Options, types and checks live in config/ as a table, not as argparse calls: config/, api/ and
    serve/ import neither argparse, nor utils/args.py's parser, nor anything of cli/."""
    found = sorted(f"{m} imports {d}" for m, path in modules().items() if folder(m) in NO_ARGPARSE
                   for d in absolute_imports(m, path) if any(d == x or d.startswith(x + ".") for x in PARSING))
    assert not found, "\n".join(found)


def test_the_parsing_check_catches_what_it_looks_for():
    assert "argparse" in absolute_imports("flexgen_sparpr.utils.args", ROOT / "utils" / "args.py")
    assert "flexgen_sparpr.utils.args" in absolute_imports("flexgen_sparpr.cli.parser", ROOT / "cli" / "parser.py")
    assert "flexgen_sparpr.config.flags" in absolute_imports("flexgen_sparpr.cli.parser", ROOT / "cli" / "parser.py")


def test_every_folder_has_a_layer():
    assert {folder(m) for m in modules() if m != "flexgen_sparpr"} <= set(LEVEL)


def test_folders_import_downward_only():
    upward = sorted(f"{m} imports {d}" for m, deps in graph().items() if m != "flexgen_sparpr"
                    for d in deps if d != "flexgen_sparpr" and LEVEL[folder(d)] > LEVEL[folder(m)])
    assert not upward, "\n".join(upward)


def circles(g: dict[str, set[str]]) -> list[str]:
    """Every import circle met by a depth-first walk of g, as 'a -> b -> a'."""
    state, found = {}, []

    def visit(m, path):
        state[m] = "open"
        for d in sorted(g[m]):
            if state.get(d) == "open":
                found.append(" -> ".join(path[path.index(d):] + [d]))
            elif d not in state:
                visit(d, path + [d])
        state[m] = "done"
    for m in sorted(g):
        if m not in state:
            visit(m, [m])
    return found


def policy_branches(tree: ast.AST, names: set[str]) -> list[int]:
    """Lines of the comparisons and match cases against one of the names."""
    def named(node) -> bool:
        if isinstance(node, ast.Constant):
            return node.value in names
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            return any(named(e) for e in node.elts)
        return False
    return [node.lineno for node in ast.walk(tree)
            if (isinstance(node, ast.Compare) and any(named(x) for x in [node.left, *node.comparators]))
            or (isinstance(node, ast.MatchValue) and named(node.value))]


def test_no_import_circle():
    found = circles(graph())
    assert not found, "\n".join(found)


def test_no_policy_name_in_a_branch_outside_kv():
    """A comparison or match against a registered policy's name, outside kv/, is policy
    knowledge leaking upward (ask the policy instead)."""
    found = [f"{path.relative_to(ROOT.parent)}:{line}" for name, path in modules().items() if folder(name) != "kv"
             for line in policy_branches(ast.parse(path.read_text()), set(POLICIES))]
    assert not found, "\n".join(found)


def test_the_checks_catch_what_they_look_for():
    g = graph()
    assert "flexgen_sparpr.kv.block_table" in g["flexgen_sparpr.engine.executor"]
    assert "flexgen_sparpr.kv.policies" in g["flexgen_sparpr.engine.config"]  # `from ..kv import policies`
    assert "flexgen_sparpr.utils.paths" in g["flexgen_sparpr.kv.policies.sparpr_plan"]  # a function-level import
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a -> b -> c -> a"]
    src = 'if p == "sparpr":\n    pass\nok = p.name in ("x", "dense")\nmatch p:\n    case "h2o":\n        pass\n'
    assert policy_branches(ast.parse(src), {"sparpr", "dense", "h2o"}) == [1, 3, 5]


SCRIPTS = ROOT.parent / "scripts"
# folders a script reaches only through the API (`LLM`) or the bench floor (flexgen_sparpr/bench/)
BEHIND_THE_API = ("cli", "engine", "kv", "storage", "runtime")
# the scripts allowed past that floor, each with its reason
SCRIPT_EXCEPTIONS = {
    "fingerprint.py": "a refactor's white-box check, not a benchmark: it runs the command line in-process "
                      "(cli.run) with SparPR's cost model pinned by a monkeypatch, and calls the upstream "
                      "hook's private summaries",
}


def reached_behind_the_api(source: str) -> list[str]:
    """The flexgen_sparpr modules behind the API that a script's source imports (anywhere in it)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
            [node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level else []
        found += [m for m in names if m.split(".")[:1] == ["flexgen_sparpr"] and m.split(".")[1:2]
                  and m.split(".")[1] in BEHIND_THE_API]
    return found


def test_scripts_reach_the_engine_only_through_the_api_or_the_bench_floor():
    found = [f"scripts/{p.name} imports {m}" for p in sorted(SCRIPTS.glob("*.py")) if p.name not in SCRIPT_EXCEPTIONS
             for m in reached_behind_the_api(p.read_text())]
    assert not found, "\n".join(found)


def test_no_script_imports_the_engine_or_storage_not_even_an_exception():
    found = [f"scripts/{p.name} imports {m}" for p in sorted(SCRIPTS.glob("*.py"))
             for m in reached_behind_the_api(p.read_text()) if m.split(".")[1] in BENCH_BEHIND_THE_API]
    assert not found, "\n".join(found)


# the one maker of engines outside engine/: every face, benchmark and script makes its engine as LLM(...)
ENGINE_MAKER = "flexgen_sparpr.api.llm"


def engine_makings(tree: ast.AST) -> list[int]:
    """Lines that import the Engine class, or call something named Engine."""
    return [node.lineno for node in ast.walk(tree)
            if (isinstance(node, ast.ImportFrom) and any(a.name == "Engine" for a in node.names))
            or (isinstance(node, ast.Call) and "Engine" in (getattr(node.func, "id", None),
                                                            getattr(node.func, "attr", None)))]


def test_only_llm_makes_an_engine():
    files = [(str(p.relative_to(ROOT.parent)), p) for name, p in sorted(modules().items())
             if folder(name) != "engine" and name != ENGINE_MAKER] + [(f"scripts/{p.name}", p)
                                                                      for p in sorted(SCRIPTS.glob("*.py"))]
    found = [f"{name}:{line}" for name, p in files for line in engine_makings(ast.parse(p.read_text()))]
    assert not found, "make engines as LLM(...) (api/llm.py): " + ", ".join(found)
    assert engine_makings(ast.parse((ROOT / "api" / "llm.py").read_text()))  # the maker is still where it says


def test_every_script_exception_is_still_needed():
    stale = [name for name in SCRIPT_EXCEPTIONS
             if not (SCRIPTS / name).is_file() or not reached_behind_the_api((SCRIPTS / name).read_text())]
    assert not stale, f"no longer reach behind the API (drop them from SCRIPT_EXCEPTIONS): {stale}"


def test_the_script_check_catches_what_it_looks_for():
    src = ("import flexgen_sparpr.engine.executor\nfrom flexgen_sparpr.bench.results import md_table\n"
           "def f():\n    from flexgen_sparpr.cli.run import run\n    from flexgen_sparpr import LLM\n")
    assert sorted(reached_behind_the_api(src)) == ["flexgen_sparpr.cli.run", "flexgen_sparpr.engine.executor"]
    made = "from x import Engine as E\nimport x\ne = x.Engine(1)\nf = Engine()\ng = LLM('m')\n"
    assert engine_makings(ast.parse(made)) == [1, 3, 4]


MAX_LINES = 300  # a module fits on a screen or two (../shared/STYLE.md; the structure issue's cap)
SCRIPTS_MAX_LINES = 3000  # scripts/ only orchestrate: their logic lives on the bench floor


def test_no_package_module_is_longer_than_the_cap():
    long = {str(p.relative_to(ROOT)): n for p in sorted(ROOT.rglob("*.py"))
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"over {MAX_LINES} lines (split them by job): {long}"


def test_scripts_stay_thin():
    """scripts/ under SCRIPTS_MAX_LINES lines in all, with no private helper module of their own."""
    files = sorted(SCRIPTS.glob("*.py")) + sorted(SCRIPTS.glob("*.sh"))
    total = sum(len(p.read_text().splitlines()) for p in files)
    private = [p.name for p in SCRIPTS.glob("_*.py")]
    assert total < SCRIPTS_MAX_LINES and not private, (total, private)
