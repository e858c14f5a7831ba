"""A repository's recipe (`strop.env.recipe`): detected from its packaging files, given as a file,
recorded in task files, and applied where the repository's code runs: the checker's test run and
the agent's shell, in real sandboxes."""

import json
from pathlib import Path

import pytest

from strop.env.grading.checker import check
from strop.env.recipe import Recipe, detect, read_recipe_file
from strop.env.task import Task
from strop.env.tasks.task_file import task_from_record, task_record
from strop.env.world.task_world import prepare_world, task_sandbox
from strop.errors import UserError


def tree(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


@pytest.mark.parametrize(
    "files, paths, note",
    [
        ({"src/pkg/__init__.py": ""}, ("src",), "a src/ layout"),
        ({"src/mod.py": ""}, ("src",), "a src/ layout"),
        ({"pkg/__init__.py": "", "src/__init__.py": ""}, (), "imports from the checkout"),  # src is a package
        ({"lib/pkg/__init__.py": "", "setup.cfg": "[options]\npackage_dir =\n    = lib\n"}, ("lib",), "setup.cfg"),
        (
            {"code/pkg/__init__.py": "", "pyproject.toml": '[tool.setuptools]\npackage-dir = {"" = "code"}\n'},
            ("code",),
            "[tool.setuptools]",
        ),
        (
            {"py/pkg/__init__.py": "", "pyproject.toml": '[tool.hatch.build.targets.wheel]\npackages = ["py/pkg"]\n'},
            ("py",),
            "hatch",
        ),
        ({"s/pkg/__init__.py": "", "tox.ini": "[testenv]\nsetenv =\n    PYTHONPATH = {toxinidir}/s\n"}, ("s",), "tox"),
        (
            {"src/pkg/__init__.py": "", "pyproject.toml": '[tool.pytest.ini_options]\npythonpath = ["src"]\n'},
            (),
            "pytest sets the path itself",
        ),
        (
            {"src/pkg/__init__.py": "", "pyproject.toml": "not [toml"},
            ("src",),
            "a src/ layout",
        ),  # unreadable: no finding
        ({"m.py": ""}, (), "imports from the checkout"),
    ],
)
def test_detect_reads_the_packaging_files(tmp_path, files, paths, note):
    recipe = detect(tree(tmp_path, files))
    assert recipe.paths == paths and recipe.setup == ()
    assert any(note in n for n in recipe.notes), recipe.notes


def test_recipe_files_and_task_files(tmp_path):
    good = tree(tmp_path, {"r.toml": 'paths = ["src/"]\nsetup = ["make build"]\n'}) / "r.toml"
    recipe, command = read_recipe_file(good)
    assert (recipe.paths, recipe.setup, command) == (("src",), ("make build",), None)
    for text, why in [
        ("paths = ['../up']", "a directory inside the repository"),
        ("colour = ['red']", "unknown key 'colour'"),
        ("setup = 'make'", "'setup' must be a list"),
        ("test_command = ['pytest']", "JUnit XML to \\$STROP_JUNIT"),
        ("paths = [", "not TOML"),
    ]:
        (tmp_path / "bad.toml").write_text(text)
        with pytest.raises(UserError, match=why):
            read_recipe_file(tmp_path / "bad.toml")
    with pytest.raises(UserError, match="does not exist"):
        read_recipe_file(tmp_path / "missing.toml")
    # the task-file field: written, read back, and checked like every field
    task = Task(id="t", suite="", split="train", instruction="i", files={"a.py": ""}, fail_to_pass=["t.py::t"])
    task.recipe = Recipe(paths=("src",), setup=("true",))
    record = task_record(task)
    assert record["recipe"] == {"paths": ["src"], "setup": ["true"]}
    assert task_from_record(json.loads(json.dumps(record)), "f:1", tmp_path, "")[0].recipe == task.recipe
    assert "recipe" not in task_record(Task(id="t", suite="", split="train", instruction="i"))
    for bad, why in [({"paths": "src"}, "must be an object"), ({"paths": ["/etc"]}, "inside the repository")]:
        with pytest.raises(UserError, match=why):
            task_from_record({**record, "recipe": bad}, "f:1", tmp_path, "")
    with pytest.raises(UserError, match="'start_patch' without a 'repo'"):
        task_from_record({**record, "start_patch": "diff"}, "f:1", tmp_path, "")


SRC_LAYOUT = {
    "src/shapes/__init__.py": "def area(w, h):\n    return w * h\n",
    "tests/test_shapes.py": "from shapes import area\n\n\ndef test_area():\n    assert area(2, 3) == 6\n",
}


def test_the_checker_and_the_agents_shell_use_the_recipe():
    """A src/ layout: its tests import nothing without the recipe; with it the checker scores the
    repository and the agent's shell imports the package; a failing setup command is the reason."""
    task = Task(
        id="src",
        suite="",
        split="train",
        instruction="i",
        files=SRC_LAYOUT,
        fail_to_pass=["tests/test_shapes.py::test_area"],
    )
    assert check(task, {}, perturbed=False).reward == 0.0  # shapes does not import from the checkout
    task.recipe = Recipe(paths=("src",))
    assert check(task, {}, perturbed=False).reward == 1.0
    with task_sandbox(task) as sandbox:
        assert prepare_world(sandbox, task, 30).exit_code == 0
        run = sandbox.exec("python3 -c 'import shapes; print(shapes.area(2, 5))'")
        assert (run.exit_code, run.stdout.strip()) == (0, "10"), run.stderr
    task.recipe = Recipe(paths=("src",), setup=("echo building", "echo 'no compiler here' >&2; exit 3"))
    score = check(task, {}, perturbed=False)
    assert score.reward == 0.0 and score.reason == "setup failed: exit 3: no compiler here", score
