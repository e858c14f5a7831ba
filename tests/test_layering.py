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
    "beneath",
    "jsonl",
    "threads",
    "memory",
    "lifetime",
    "native",
    "config",
    "report",
    "tracking",
    "run_files",
    "checkpoint",
    "kernels",
    "policy_api",
}
LAYERS: list[set[str]] = [
    FOUNDATION,
    {"data"},  # corpus -> tokenizer -> packed token streams
    {"model", "sync"},  # models know nothing of training; the codec nothing of models
    {"engine", "env"},  # the environment is handed a policy client; the engine knows no environment
    {"train"},  # mid-training and SFT (SFT's demonstrations come from the environment's oracle)
    {"rl"},
    {"online"},  # the online cycle reuses RL's loss and trainer on served completions
    {"runtime"},  # places components and builds a run (`runtime.build`)
    {"bench"},  # benchmark programs (edge: each is a command the cli runs)
    {"commands"},  # every other command's arguments and wiring
    {"cli"},
]
LAYER = {name: i for i, layer in enumerate(LAYERS) for name in layer}


def _module(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _package(module: str) -> str:
    """strop.rl.buffer -> rl; strop.config -> config; strop -> strop."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "strop"


def _imported(tree: ast.AST, module: str, is_package: bool) -> set[str]:
    """The strop modules a file imports, relative imports resolved."""
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
            found.add(target)
            found |= {f"{target}.{a.name}" for a in node.names if target == "strop"}  # from strop import x
    return {m for m in found if m == "strop" or m.startswith("strop.")}


def package_imports() -> dict[str, dict[str, list[str]]]:
    """{importing package: {imported package: [importing modules]}}, between distinct packages."""
    edges: dict[str, dict[str, list[str]]] = {}
    for path in sorted(ROOT.rglob("*.py")):
        module = _module(path)
        tree = ast.parse(path.read_text(), str(path))
        for target in _imported(tree, module, path.name == "__init__.py"):
            src, dst = _package(module), _package(target)
            if target == "strop" and module != "strop":
                continue  # `import strop` alone names no package
            if src != dst:
                edges.setdefault(src, {}).setdefault(dst, []).append(module)
    return edges


def test_every_package_has_a_layer():
    packages = {_package(_module(p)) for p in ROOT.rglob("*.py")}
    assert {"rl", "engine", "cli"} <= packages  # the scan reads the source tree
    assert packages - LAYER.keys() == set(), "place each new package or top-level module in LAYERS"


def test_imports_point_down_the_layers():
    wrong = []
    for src, targets in package_imports().items():
        for dst, modules in targets.items():
            both_foundation = src in FOUNDATION and dst in FOUNDATION
            if not both_foundation and LAYER[dst] >= LAYER[src]:
                wrong.append(f"{src} -> {dst} ({', '.join(sorted(set(modules)))})")
    assert wrong == [], "imports against the dependency direction:\n" + "\n".join(sorted(wrong))


def test_no_cycle_between_packages():
    edges = {src: set(targets) for src, targets in package_imports().items()}
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
    assert cycles == [], "import cycles between packages:\n" + "\n".join(cycles)


def test_the_scan_sees_lazy_and_relative_imports():
    """The scan's own check: an import inside a function and a relative one both count."""
    tree = ast.parse("def f():\n    from strop.rl.buffer import StalenessBuffer\nfrom ..sync import codec\n")
    assert _imported(tree, "strop.engine.x", False) == {"strop.rl.buffer", "strop.sync"}
