"""Starting repositories: a task's `repo` materialised once per node, read-only, for sandboxes to
mount copy-on-write (`checkout`), and unified diffs applied to a tree (`apply_patch`).

A source is a git repository (a working copy, a bare repository or a bundle file, a local path or a
URL `git clone` takes) checked out at a commit, or, without a commit, a directory or a tarball. An
fsspec URL of a file (`s3://.../repo.bundle`, `.../src.tar.gz`) is fetched into the cache first, so
every Ray node materialises from the same place. Checkouts live in
`<node cache>/repos/<key>/tree` (`strop.env.host.node_cache.node_cache`), one per (source, commit),
built in a temporary directory renamed into place (nothing half-written on failure), file modes,
symlinks and binary files kept, and owned by the sandbox account (the agent edits them as its own).

A git checkout carries a fresh `.git` holding that commit's tree as its only commit: the agent can
`git diff` and `git status` as on a developer's machine, and the history after (and before) the
task's commit, which may hold the answer, is not there.
"""

import os
import subprocess
import tempfile
from pathlib import Path

from strop.confined import apply_changes, copy_tree, parts_of, read_beneath, rmtree, walk
from strop.env.host.account import hand_over
from strop.env.host.node_cache import built, cache_dir, fetched, is_url, locked
from strop.env.world.layers import LayerError, extract_layer
from strop.errors import UserError
from strop.memo import by_version, content_key

_GIT_ENV = {
    "GIT_AUTHOR_NAME": "strop",
    "GIT_AUTHOR_EMAIL": "strop@localhost",
    "GIT_COMMITTER_NAME": "strop",
    "GIT_COMMITTER_EMAIL": "strop@localhost",
    "GIT_AUTHOR_DATE": "2000-01-01T00:00:00Z",  # fixed, so the same checkout gets the same commit id
    "GIT_COMMITTER_DATE": "2000-01-01T00:00:00Z",
    "GIT_CONFIG_NOSYSTEM": "1",
    "GIT_TERMINAL_PROMPT": "0",
}
_TARBALL = (".tar", ".tar.gz", ".tgz", ".tar.zst", ".tar.xz", ".tar.bz2")
_FETCHED = (*_TARBALL, ".bundle")


def git(
    *args: str, cwd: Path | None = None, check: bool = True, input: bytes | None = None, env: dict | None = None
) -> str:
    """Run git with a fixed identity and no system config; its stdout, or UserError with git's own
    last line of complaint."""
    env = {**{k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "LANG")}, **_GIT_ENV, **(env or {})}
    run = subprocess.run(["git", *args], cwd=cwd, env=env, input=input, capture_output=True)
    if check and run.returncode != 0:
        why = (run.stderr.decode(errors="replace").strip().splitlines() or ["failed"])[-1]
        raise UserError(f"git {args[0]}: {why}")
    return run.stdout.decode(errors="replace")


def _local(source: str) -> str:
    """Where to read `source` from on this node: a local path as it is; an fsspec URL of a bundle or
    tarball fetched into the cache (once); any other URL (a git remote) as it is."""
    if source.startswith("file://") or not is_url(source):
        path = Path(source.removeprefix("file://")).expanduser()
        if not path.exists():
            raise UserError(f"repository {source!r} does not exist")
        return str(path.resolve())
    if not source.endswith(_FETCHED):
        return source
    return str(fetched(source))


def _is_git(where: str) -> bool:
    if is_url(where):
        return True  # a remote: git says whether it is one
    path = Path(where)
    if path.is_file():
        with open(path, "rb") as f:
            return f.read(16).startswith((b"# v2 git bundle", b"# v3 git bundle"))
    return (path / ".git").exists() or ((path / "HEAD").is_file() and (path / "objects").is_dir())


def _mirror(where: str) -> Path:
    """A bare mirror of a git source in the cache, cloned once and fetched when a commit is missing."""
    return built(
        cache_dir("git") / (content_key(where) + ".git"),
        lambda tmp: git("clone", "--quiet", "--mirror", where, str(tmp)),
    )


def resolve_commit(source: str, commit: str) -> str:
    """The full id of `commit` in the git repository `source` (UserError if it has no such commit)."""
    where = _local(source)
    if not _is_git(where):
        raise UserError(f"repository {source!r} is not a git repository (a base_commit needs one)")
    mirror = _mirror(where)
    with locked(mirror.with_suffix(".lock")):
        sha = git("rev-parse", "--verify", "--quiet", f"{commit}^{{commit}}", cwd=mirror, check=False).strip()
        if not sha and not Path(where).is_file():  # a bundle cannot gain commits
            git("fetch", "--quiet", "--prune", "origin", "+refs/*:refs/*", cwd=mirror, check=False)
            sha = git("rev-parse", "--verify", "--quiet", f"{commit}^{{commit}}", cwd=mirror, check=False).strip()
    if not sha:
        raise UserError(f"repository {source!r} has no commit {commit!r}")
    return sha


def history(source: str, rev: str = "HEAD") -> tuple[Path, str]:
    """A git directory holding the history of the git repository `source` (the node's mirror, to read
    with `git log` and `git diff`), and the full id of `rev` there. A working copy's `rev` is read in
    the working copy as it is now (the mirror fetches what it lacks)."""
    where = _local(source)
    if not _is_git(where):
        raise UserError(f"repository {source!r} is not a git repository")
    if Path(where).is_dir():
        found = git(
            "-c",
            "safe.directory=*",
            "rev-parse",
            "--verify",
            "--quiet",
            f"{rev}^{{commit}}",
            cwd=Path(where),
            check=False,
        )
        if not found.strip():
            raise UserError(f"repository {source!r} has no commit {rev!r}")
        rev = found.strip()
    sha = resolve_commit(source, rev)
    return _mirror(where), sha


def _stamp(source: str, commit: str = "") -> tuple:
    """What identifies the content of a plain directory or tarball source (size and times of every
    entry); a commit identifies its own."""
    if commit:
        return ()
    path = Path(_local(source))
    if path.is_file():
        st = path.stat()
        return (st.st_size, st.st_mtime_ns)
    entries = []
    for d, dirs, files in sorted(walk(path)):
        for n in sorted(files + dirs):
            st = os.lstat(os.path.join(d, n))
            entries.append((os.path.relpath(os.path.join(d, n), path), st.st_size, st.st_mtime_ns))
    return tuple(entries)


@by_version(_stamp, maxsize=256)
def checkout(source: str, commit: str = "") -> Path:
    """The read-only tree of `source` at `commit` (see the module docstring), built on first use."""
    sha = resolve_commit(source, commit) if commit else ""
    where = _local(source)

    def build(tmp: Path) -> None:
        if sha:
            _git_tree(_mirror(where), sha, tmp / "tree")
        else:
            _plain_tree(Path(where), tmp / "tree")
        hand_over(tmp / "tree")
        (tmp / "source.txt").write_text(f"{source} {sha}\n")

    return built(cache_dir("repos") / content_key(where, sha or repr(_stamp(source))), build) / "tree"


def _git_tree(mirror: Path, sha: str, tree: Path) -> None:
    """`sha`'s files in `tree` (modes and symlinks as git records them), under a fresh one-commit `.git`."""
    tree.mkdir()
    with tempfile.TemporaryDirectory(dir=tree.parent) as tmp:
        index = {"GIT_INDEX_FILE": f"{tmp}/index"}
        where = ["-c", "core.symlinks=true", "--git-dir", str(mirror), "--work-tree", str(tree)]
        git(*where, "read-tree", sha, env=index)
        git(*where, "checkout-index", "--all", "--force", env=index)
    git("init", "--quiet", "--initial-branch=main", cwd=tree)
    git("add", "--all", "--force", cwd=tree)
    git("commit", "--quiet", "--no-verify", "--allow-empty", "-m", f"base {sha[:12]}", cwd=tree)


def commit_start(tree: Path) -> None:
    """Make the files of the checkout `tree` (changed since `checkout`) the one commit of its `.git`,
    so that `git diff` and `git status` show an agent its own changes, not how the start was made
    (a synthesized task's bug)."""
    if not (tree / ".git").is_dir():
        return
    git("add", "--all", "--force", cwd=tree)
    git("commit", "--quiet", "--no-verify", "--amend", "--allow-empty", "--no-edit", cwd=tree)


def _plain_tree(path: Path, tree: Path) -> None:
    """A directory source copied without following links out of it (and without its `.git`), or a
    tarball unpacked like an image layer."""
    if path.is_dir():
        copy_tree(path, tree)
        rmtree(tree / ".git")
        return
    if not path.name.endswith(_TARBALL):
        raise UserError(f"repository {str(path)!r} is a file but not a tarball or a git bundle")
    tree.mkdir()
    fd = os.open(tree, os.O_RDONLY | os.O_DIRECTORY)
    try:
        with open(path, "rb") as f:
            extract_layer(f, fd)
    except LayerError as e:
        raise UserError(f"repository {str(path)!r}: {e}") from None
    finally:
        os.close(fd)


def apply_patch(tree: Path, patch: str) -> dict[str, bytes | None]:
    """The files a unified diff changes, after it applies to `tree` (relative path -> new bytes,
    None = deleted; a symbolic link it makes as its target path, as a sandbox's diff reports one);
    `tree` is not modified. UserError with git's reason if it does not apply. Neither tree is read
    through a link: a patch that makes a link reads nothing it points at, one that edits a file
    reached through the repository's own link does not apply."""
    if not patch.strip():
        return {}
    with tempfile.TemporaryDirectory(prefix="strop-patch-") as tmp:
        work = Path(tmp) / "w"
        paths = sorted(
            {
                p
                for line in git("apply", "--numstat", "-z", "-", cwd=Path(tmp), input=patch.encode()).split("\0")
                for p in [line.split("\t")[-1]]
                if p
            }
        )
        for rel in paths:
            parts_of(rel)  # a plain relative path, or UserError: nothing is made outside `work`
        work.mkdir()
        apply_changes(work, {rel: data for rel in paths if (data := read_beneath(tree, rel, links=False)) is not None})
        git("apply", "--whitespace=nowarn", "-", cwd=work, input=patch.encode())
        return {rel: read_beneath(work, rel) for rel in paths}
