"""The dependency direction of ../shared/DESIGN.md, checked on the source: every `import` of a strop
module (at top level or inside a function) points from a package to one in a lower layer, and no
packages import each other in a cycle. Reads the files with `ast`; imports nothing of strop."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "strop"

# Low to high. A package may import packages of lower layers only: never a peer in its own layer,
# never one above. The foundation's single modules (errors, config, ...) may import each other,
# without a cycle.
FOUNDATION = {
    "strop",
    "errors",
    "outputs",
    "jsonl",
    "threads",
    "memory",
    "lifetime",
    "gc_freeze",
    "native",
    "cpu",
    "config",
    "report",
    "tracking",
    "run_files",
    "checkpoint",
    "kernels",
    "policy_api",
    "confined",
    "memo",
    "terminal",
}
LAYERS: list[set[str]] = [
    FOUNDATION,
    {"data"},  # corpus -> tokenizer -> packed token streams
    {"model", "sync"},  # models know nothing of training; the codec nothing of models
    {"engine", "env"},  # the environment is handed a policy client; the engine knows no environment
    {"train"},  # mid-training and SFT (SFT's demonstrations come from the environment's oracle)
    {"rl"},
    {"online"},  # the online cycle reuses RL's loss and trainer on served completions
    {"runtime"},  # places components and builds a run (`runtime.rl_run`)
    {"bench"},  # benchmark programs (edge: each is a command the cli runs)
    {"commands"},  # every other command's arguments and wiring
    {"cli"},
]
LAYER = {name: i for i, layer in enumerate(LAYERS) for name in layer}

# Inside strop/env, the same rule between its sub-packages, low to high. The single modules at its
# top (the records every sub-package passes around) may import each other, without a cycle.
ENV_FOUNDATION = {"env", "task", "episode", "plugins", "runner", "recipe"}
ENV_LAYERS: list[set[str]] = [
    ENV_FOUNDATION,
    {"host"},  # the sandbox account, the node cache, scratch directories
    {"sandbox"},  # the interface and bubblewrap's parts
    {"world"},  # images, repositories, a task's world opened as a sandbox, its patches
    {"harness", "grading"},  # the agent loop and tools; the checker and hack monitor: peers
    {"tasks"},  # where Task records come from: suites by name, task files, mining, synthesis
    {"suites"},  # strop's built-in suites, found by entry point like a user's
    {"demonstrators"},  # scripted policies that play tasks through the harness
]
ENV_LAYER = {name: i for i, layer in enumerate(ENV_LAYERS) for name in layer}


def _module(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _package(module: str) -> str:
    """strop.rl.buffer -> rl; strop.config -> config; strop -> strop."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "strop"


def _imported(tree: ast.AST, module: str, is_package: bool) -> set[str]:
    """The strop modules a file imports, relative imports resolved; `from package import module`
    names the module."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")[: len(module.split(".")) - node.level + (1 if is_package else 0)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            subs = {f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in MODULES}
            found |= subs if len(subs) == len(node.names) else subs | {target}
    return {m for m in found if m == "strop" or m.startswith("strop.")}


def _env_package(module: str) -> str | None:
    """strop.env.sandbox.bwrap -> sandbox; strop.env.task -> task; strop.env -> env; None outside env."""
    parts = module.split(".")
    if parts[:2] != ["strop", "env"]:
        return None
    return parts[2] if len(parts) > 2 else "env"


MODULES = {_module(p) for p in ROOT.rglob("*.py")}


def module_imports() -> dict[str, set[str]]:
    """{strop module: the strop modules it imports}; `from package import module` counts as the module."""
    edges: dict[str, set[str]] = {}
    for path in sorted(ROOT.rglob("*.py")):
        module = _module(path)
        tree = ast.parse(path.read_text(), str(path))
        edges[module] = {t for t in _imported(tree, module, path.name == "__init__.py") if t != "strop" and t != module}
    return edges


def _package_edges(package_of) -> dict[str, dict[str, list[str]]]:
    """{importing package: {imported package: [importing modules]}}, between distinct packages, where
    `package_of(module)` names a module's package (None: not counted)."""
    edges: dict[str, dict[str, list[str]]] = {}
    for module, targets in module_imports().items():
        for target in targets:
            src, dst = package_of(module), package_of(target)
            if src is not None and dst is not None and src != dst:
                edges.setdefault(src, {}).setdefault(dst, []).append(module)
    return edges


def package_imports() -> dict[str, dict[str, list[str]]]:
    """{importing package: {imported package: [importing modules]}}, between distinct packages."""
    return _package_edges(_package)


def env_imports() -> dict[str, dict[str, list[str]]]:
    """The same between the sub-packages (and top modules) of strop/env."""
    return _package_edges(_env_package)


def test_every_package_has_a_layer():
    packages = {_package(_module(p)) for p in ROOT.rglob("*.py")}
    assert {"rl", "engine", "cli"} <= packages  # the scan reads the source tree
    assert packages - LAYER.keys() == set(), "place each new package or top-level module in LAYERS"


def _upward(edges: dict[str, dict[str, list[str]]], layer: dict[str, int], foundation: set[str]) -> list[str]:
    """The edges that point to a package of the same or a higher layer (foundation to foundation
    allowed), as "src -> dst (importing modules)"."""
    wrong = []
    for src, targets in edges.items():
        for dst, modules in targets.items():
            if not (src in foundation and dst in foundation) and layer[dst] >= layer[src]:
                wrong.append(f"{src} -> {dst} ({', '.join(sorted(set(modules)))})")
    return sorted(wrong)


def test_imports_point_down_the_layers():
    wrong = _upward(package_imports(), LAYER, FOUNDATION)
    assert wrong == [], "imports against the dependency direction:\n" + "\n".join(wrong)


def _cycles(edges: dict[str, set[str]]) -> list[str]:
    state: dict[str, str] = {}  # "open" while on the DFS path, "done" after
    cycles = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = "open"
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == "open":
                cycles.append(" -> ".join(path[path.index(nxt) :] + [node, nxt]) if nxt in path else f"{node} -> {nxt}")
            elif nxt not in state:
                visit(nxt, path + [node])
        state[node] = "done"

    for node in sorted(edges):
        if node not in state:
            visit(node, [])
    return cycles


def test_no_cycle_between_packages():
    cycles = _cycles({src: set(targets) for src, targets in package_imports().items()})
    assert cycles == [], "import cycles between packages:\n" + "\n".join(cycles)


def test_every_env_subpackage_has_a_layer():
    found = {_env_package(m) for m in MODULES} - {None}
    assert {"sandbox", "harness", "tasks"} <= found
    assert found - ENV_LAYER.keys() == set(), "place each new strop/env sub-package or module in ENV_LAYERS"


def test_env_imports_point_down_its_layers():
    wrong = _upward(env_imports(), ENV_LAYER, ENV_FOUNDATION)
    assert wrong == [], "imports against strop/env's order:\n" + "\n".join(wrong)


def test_no_cycle_between_modules():
    """No two modules import each other, directly or through others (lazy imports count)."""
    cycles = _cycles(module_imports())
    assert cycles == [], "import cycles between modules:\n" + "\n".join(cycles)


def test_the_scan_sees_lazy_and_relative_imports():
    """The scan's own check: an import inside a function and a relative one both count, and
    `from package import module` names the module."""
    tree = ast.parse("def f():\n    from strop.rl.buffer import StalenessBuffer\nfrom ..sync import codec, store\n")
    assert _imported(tree, "strop.engine.x", False) == {"strop.rl.buffer", "strop.sync.codec", "strop.sync.store"}
    tree = ast.parse("from strop.env import task, plugins\nfrom strop import confined\nfrom strop.sync import x\n")
    assert _imported(tree, "strop.rl.x", False) == {
        "strop.env.task",
        "strop.env.plugins",
        "strop.confined",
        "strop.sync",
    }
