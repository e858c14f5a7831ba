"""A repository's recipe: how its code is made importable and how its tests run, in the task's world.

Most Python projects are not importable from a bare checkout: a `src/` layout needs `src` on the
import path, a build step needs running, and only an install makes some importable at all. A recipe
says it once, and every run of the repository's code uses it: the miner and the synthesizer
(`strop.env.tasks`) while they validate, `strop tasks validate` and the checker before the tests,
and the episode before the agent's first turn (`strop.env.world.task_world.prepare_world`).

- `paths`: directories of the repository put on Python's import path (`PYTHONPATH`, in every
  command of the world: the test command, the setup commands, the agent's shell);
- `setup`: shell commands run in the world's repository before anything else (e.g.
  `pip install --no-deps --no-index --no-build-isolation -e .` where the image has pip and the
  build backend); a failing one means the repository does not build there;
- the test command stays the task's `test_command` (`strop.env.runner.TEST_COMMAND` by default).

`detect` reads a checkout the way the packaging tools would: pytest's own `pythonpath` setting
(pytest >= 7 applies it itself: nothing to add), setuptools' `package_dir` (`setup.cfg`,
`[tool.setuptools]`), hatch's and poetry's package lists, tox's `PYTHONPATH`, and finally a `src/`
directory holding a package; each finding is a line of `Recipe.notes`. A recipe file (TOML, the same
keys: `paths`, `setup`, `test_command`) overrides what is detected (`read_recipe_file`).
"""

import configparser
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from strop.errors import UserError

KEYS = ("paths", "setup", "test_command")


@dataclass(frozen=True)
class Recipe:
    """How a repository is made importable (see the module docstring); plain data, hashable."""

    paths: tuple[str, ...] = ()
    setup: tuple[str, ...] = ()
    notes: tuple[str, ...] = field(default=(), compare=False)  # why: what `detect` found (not recorded in tasks)

    def __bool__(self) -> bool:
        return bool(self.paths or self.setup)

    def to_record(self) -> dict:
        """The task-file field `recipe` (absent keys are empty)."""
        return {k: list(v) for k, v in (("paths", self.paths), ("setup", self.setup)) if v}

    @staticmethod
    def from_record(record: dict) -> "Recipe":
        return Recipe(paths=tuple(record.get("paths", ())), setup=tuple(record.get("setup", ())))


def check_path(where: str, path: str) -> str:
    """A recipe path: relative, inside the repository, normalised ("src/" -> "src")."""
    p = PurePosixPath(path)
    if not path or p.is_absolute() or ".." in p.parts or "\\" in path or ":" in path:
        raise UserError(f"{where}: a recipe path is a directory inside the repository, got {path!r}")
    return p.as_posix()


def _toml(root: Path, name: str) -> dict:
    file = root / name
    if not file.is_file() or file.is_symlink():
        return {}
    try:
        return tomllib.loads(file.read_text(errors="replace"))
    except tomllib.TOMLDecodeError:
        return {}


def _ini(root: Path, name: str) -> configparser.ConfigParser:
    parser = configparser.ConfigParser(interpolation=None)
    file = root / name
    if file.is_file() and not file.is_symlink():
        try:
            parser.read_string(file.read_text(errors="replace"))
        except configparser.Error:
            pass  # a file configparser cannot read tells nothing
    return parser


def _is_dir(root: Path, rel: str) -> bool:
    path = root / rel
    return path.is_dir() and not path.is_symlink()


def _holds_code(root: Path, rel: str) -> bool:
    """Whether directory `rel` holds a package or a module (what a package directory is for)."""
    if not _is_dir(root, rel):
        return False
    return any(
        (p.is_dir() and (p / "__init__.py").is_file()) or (p.suffix == ".py" and p.is_file())
        for p in (root / rel).iterdir()
        if not p.is_symlink()
    )


def _pytest_pythonpath(root: Path) -> str | None:
    """The file that sets pytest's own `pythonpath` (pytest applies it itself), if any."""
    if "pythonpath" in _toml(root, "pyproject.toml").get("tool", {}).get("pytest", {}).get("ini_options", {}):
        return "pyproject.toml"
    for name, section in (("pytest.ini", "pytest"), ("tox.ini", "pytest"), ("setup.cfg", "tool:pytest")):
        ini = _ini(root, name)
        if ini.has_option(section, "pythonpath"):
            return name
    return None


def _declared_dirs(root: Path) -> list[tuple[str, str]]:
    """(directory, where it is declared) of the package directories the packaging files name."""
    found = []
    cfg = _ini(root, "setup.cfg")
    if cfg.has_option("options", "package_dir"):
        for line in cfg.get("options", "package_dir").splitlines():
            name, _, where = line.partition("=")
            if where.strip() and not name.strip():  # "= src": the root package directory
                found.append((where.strip(), "setup.cfg [options] package_dir"))
    tool = _toml(root, "pyproject.toml").get("tool", {})
    package_dir = tool.get("setuptools", {}).get("package-dir", {})
    if isinstance(package_dir, dict) and isinstance(package_dir.get(""), str):
        found.append((package_dir[""], "pyproject.toml [tool.setuptools] package-dir"))
    wheel = tool.get("hatch", {}).get("build", {}).get("targets", {}).get("wheel", {})
    for package in wheel.get("packages", []) if isinstance(wheel.get("packages"), list) else []:
        if isinstance(package, str) and "/" in package.strip("/"):
            found.append((package.strip("/").rsplit("/", 1)[0], "pyproject.toml [tool.hatch...wheel] packages"))
    poetry = tool.get("poetry", {}).get("packages", [])
    for package in poetry if isinstance(poetry, list) else []:
        if isinstance(package, dict) and isinstance(package.get("from"), str):
            found.append((package["from"], "pyproject.toml [tool.poetry] packages"))
    tox = _ini(root, "tox.ini")
    if tox.has_option("testenv", "setenv"):
        for value in re.findall(r"PYTHONPATH\s*=\s*(\S+)", tox.get("testenv", "setenv")):
            for part in value.split(":"):
                part = part.replace("{toxinidir}", "").strip("/")
                if part:
                    found.append((part, "tox.ini [testenv] setenv"))
    return found


def detect(root: Path) -> Recipe:
    """The recipe of the checkout at `root`, read from its files (see the module docstring)."""
    if (where := _pytest_pythonpath(root)) is not None:
        return Recipe(notes=(f"pytest's pythonpath in {where}: pytest sets the path itself",))
    paths, notes = [], []
    for rel, where in _declared_dirs(root):
        try:
            rel = check_path(where, rel)
        except UserError:
            continue
        if rel != "." and rel not in paths and _holds_code(root, rel):
            paths.append(rel)
            notes.append(f"{rel} on the import path: {where}")
    if not paths and _holds_code(root, "src") and not (root / "src" / "__init__.py").exists():
        paths.append("src")
        notes.append("src on the import path: a src/ layout (src/ holds the package)")
    return Recipe(paths=tuple(paths), notes=tuple(notes) or ("nothing to add: the code imports from the checkout",))


def read_recipe_file(path: str | Path) -> tuple[Recipe, list[str] | None]:
    """The recipe a TOML recipe file gives (keys `paths`, `setup`, `test_command`) and its test
    command (None when it names none). Errors name the file and key."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise UserError(f"recipe file {str(file)!r} does not exist")
    try:
        data = tomllib.loads(file.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"recipe file {file}: not TOML: {e}") from None
    for key, value in data.items():
        if key not in KEYS:
            raise UserError(f"recipe file {file}: unknown key {key!r} (the keys: {', '.join(KEYS)})")
        if not (isinstance(value, list) and all(isinstance(v, str) and v for v in value)):
            raise UserError(f"recipe file {file}: {key!r} must be a list of non-empty strings")
    test_command = data.get("test_command")
    if test_command is not None and not any("$STROP_JUNIT" in a for a in test_command):
        raise UserError(f"recipe file {file}: test_command must write JUnit XML to $STROP_JUNIT (see strop's)")
    paths = tuple(check_path(f"recipe file {file}", p) for p in data.get("paths", []))
    return Recipe(paths=paths, setup=tuple(data.get("setup", [])), notes=(f"from {file}",)), test_command
