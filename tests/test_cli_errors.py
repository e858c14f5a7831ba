"""User mistakes get one clear line on stderr and exit code 2, never a traceback."""

import subprocess
import sys

import pytest


def run_cli(*args: str, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "strop.cli", *args], capture_output=True, text=True, cwd=cwd, timeout=120
    )


@pytest.mark.parametrize(
    "args, needle",
    [
        (["midtrain", "--set", "data.stdlib=false"], "corpus is empty"),
        (["midtrain", "--set", "data.stdlib=false", "--set", "data.dirs=['/no/such/dir']"], "does not exist"),
        (["midtrain", "--set", "midtrain.stepz=3"], "midtrain.stepz"),
        (["midtrain", "--set", "midtrain.steps=many"], "midtrain.steps"),
        (["midtrain", "-c", "/no/such.toml"], "does not exist"),
        (["eval", "midtrain", "--checkpoint", "/tmp"], "not a model directory"),
        (["eval", "policy", "--policy", "/tmp"], "no policy at"),
        (["bench", "async", "--repeats", "0"], "at least 1"),
        (["bench", "budget", "--steps", "1"], "at least 2"),
        (["bench", "budget", "--policy", "/no/such/dir"], "no policy at"),
        (["bench", "engine", "--repeats", "0"], "at least 1"),
        (["bench", "mismatch", "--repeats", "0"], "at least 1"),
        (["frobnicate"], "unknown command"),
    ],
)
def test_user_mistakes_exit_2_with_one_line(args, needle, tmp_path):
    out = run_cli(*args, "--set", f"run.out_dir={tmp_path}") if args[0] == "midtrain" else run_cli(*args)
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr
    assert needle in out.stderr
    assert len([line for line in out.stderr.splitlines() if line.startswith("strop: error")]) == 1


def test_help_lists_commands():
    out = run_cli("--help")
    assert out.returncode == 0 and "midtrain" in out.stdout


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A small base/new safetensors pair, a delta between them, and broken inputs."""
    import struct

    from tests.conftest import write_delta_files

    d = tmp_path_factory.mktemp("cli")
    write_delta_files(d)
    header = b'{"a":1}'
    (d / "header.safetensors").write_bytes(struct.pack("<Q", len(header)) + header)
    (d / "latin1.toml").write_bytes('[run]\nname = "caf\xe9"\n'.encode("latin-1"))
    (d / "a_file").write_text("x")
    (d / "policy").mkdir()
    (d / "policy" / "config.json").write_text('{"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe"}')
    (d / "policy" / "model.safetensors").write_bytes(b"garbage" * 100)
    return d


@pytest.mark.parametrize(
    "args, needle",
    [
        (
            ["sync", "encode", "--base", "{d}/base.safetensors", "--new", "{d}/new.safetensors", "-o", "{d}"],
            "is a directory",
        ),
        (
            [
                "sync",
                "encode",
                "--base",
                "{d}/base.safetensors",
                "--new",
                "{d}/new.safetensors",
                "-o",
                "{d}/missing/dir/f",
            ],
            "does not exist",
        ),
        (["sync", "decode", "--base", "{d}/base.safetensors", "{d}/delta.bin", "-o", "{d}"], "is a directory"),
        (
            ["sync", "decode", "--base", "{d}/base.safetensors", "{d}/delta.bin", "-o", "{d}/missing/dir/f"],
            "does not exist",
        ),
        (
            ["sync", "encode", "--base", "{d}/header.safetensors", "--new", "{d}/new.safetensors", "-o", "{d}/x"],
            "malformed",
        ),
        (["sync", "decode", "--base", "{d}/header.safetensors", "{d}/delta.bin", "-o", "{d}/x"], "malformed"),
        (["midtrain", "-c", "{d}/latin1.toml"], "not UTF-8"),
        (["midtrain", "-c", "{d}"], "is a directory"),
        (["midtrain", "--set", "rl.lr=inf"], "not a finite number"),
        (["tasks", "export", "--suite", "synthetic", "synthetic-d1-eval-0000", "{d}/a_file"], "not a directory"),
        (
            ["tasks", "check", "--suite", "synthetic", "synthetic-d1-eval-0000", "{d}", "--json", "{d}/a_file/x.json"],
            "does not exist",
        ),
        (["eval", "policy", "--policy", "{d}/policy", "--set", "rollout.eval_episodes=1"], "cannot load"),
        (
            ["eval", "policy", "--policy", "{d}/policy", "--set", "rollout.eval_difficulties=[]"],
            "rollout.eval_difficulties",
        ),
        (["eval", "policy", "--policy", "{d}/policy", "--set", "rollout.eval_difficulties=[7]"], "difficult"),
        (["serve", "--checkpoint", "{d}/policy", "--port", "99999"], "--port"),
        (["serve", "--checkpoint", "{d}/policy", "--max-batch", "0"], "--max-batch"),
        (["sandbox", "run", "--timeout", "nan", "--", "true"], "--timeout"),
        (["sandbox", "run", "--timeout", "inf", "--", "true"], "--timeout"),
        (["agent", "--repo", "{d}", "--endpoint", "http://127.0.0.1:9", "--tokenizer", "{d}", "hi"], "--endpoint"),
        (["train", "--policy", "{d}/policy", "--out", "{d}/policy"], "not made by `strop train`"),
        (["bench", "async", "--out", "{d}"], "not made by `strop bench async`"),
        (["agent", "--repo", "{d}", "--endpoint", "not a url", "--tokenizer", "{d}", "hi"], "--endpoint"),
    ],
)
def test_reported_tracebacks_are_one_line_exit_2(files, args, needle):
    out = run_cli(*[a.replace("{d}", str(files)) for a in args])
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr
    assert needle in out.stderr, out.stderr
    assert len([line for line in out.stderr.splitlines() if line.startswith("strop: error")]) == 1


def test_json_into_a_missing_directory_is_refused_before_the_work(files, tmp_path):
    """`--json missing/dir/x.json` made every missing folder on the way (even at `/`), while `sync -o`
    refused a missing folder: both now refuse it, up front, as one line."""
    repo = tmp_path / "repo"
    assert run_cli("tasks", "export", "--suite", "synthetic", "synthetic-d1-eval-0000", str(repo)).returncode == 0
    out = tmp_path / "missing" / "dir" / "x.json"
    res = run_cli("tasks", "check", "--suite", "synthetic", "synthetic-d1-eval-0000", str(repo), "--json", str(out))
    assert res.returncode == 2 and "does not exist" in res.stderr and "Traceback" not in res.stderr, res.stderr
    assert not (tmp_path / "missing").exists()


@pytest.mark.parametrize(
    "args, needle",
    [
        (["serve", "key", "--keys", "{d}/nodir/keys.json", "--name", "a", "--scopes", "infer"], "does not exist"),
        (["serve", "key", "--keys", "/dev/zero", "--name", "a", "--scopes", "infer"], "not a regular file"),
        (["serve", "key", "--keys", "{d}/k.json", "--name", "a", "--scopes", "infer", "--rate", "inf"], "finite"),
        (["serve", "key", "--keys", "{d}/k.json", "--name", "a\nb", "--scopes", "infer"], "one line"),
        (
            ["serve", "--checkpoint", "{d}/policy", "--keys", "{d}/k.json", "--weights-store", "/nonexistent/w"],
            "--weights",
        ),
        (["midtrain", "--config", "/dev/zero"], "not a regular file"),
        (
            [
                "sync",
                "encode",
                "--base",
                "{d}/base.safetensors",
                "--new",
                "{d}/new.safetensors",
                "-o",
                "{d}/x",
                "--version",
                "-5",
            ],
            "--version",
        ),
        (["sync", "decode", "--base", "{d}/base.safetensors", "{d}/trailing.bin", "-o", "{d}/x"], "past its"),
        # refused before the model in --checkpoint (which cannot load) is touched
        (["agent", "--repo", "{d}", "--checkpoint", "{d}/policy", "--timeout", "nan", "hi"], "--timeout"),
        (["agent", "--repo", "{d}", "--checkpoint", "{d}/policy", "--temperature", "nan", "hi"], "--temperature"),
        (["agent", "--repo", "{d}", "--checkpoint", "{d}/policy", "--max-turns", "-1", "hi"], "--max-turns"),
        (["agent", "--repo", "{d}", "--checkpoint", "{d}/policy", "--max-context", "0", "hi"], "--max-context"),
    ],
)
def test_issue_45_silences_and_tracebacks_are_one_line_exit_2(files, args, needle):
    """Item 8 of issue 45, case by case (the damaged demo summary is in test_outputs)."""
    (files / "trailing.bin").write_bytes((files / "delta.bin").read_bytes() + b"xx")
    out = run_cli(*[a.replace("{d}", str(files)) for a in args])
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert needle in out.stderr, out.stderr
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert not (files / "k.json").exists() and not (files / "x").exists()


def test_a_closed_stdout_is_one_line_not_a_traceback():
    """`strop tasks list ... | head`: a BrokenPipeError traceback. The chain suite's list (~200 KB)
    outgrows the pipe (64 KiB), so the writer is still writing when the reader closes; humaneval's
    (5 KB) fitted, and the command often finished first and exited 0."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "strop.cli", "tasks", "list", "--suite", "chain"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout.readline()
    proc.stdout.close()  # as `head -1` does
    err = proc.stderr.read()
    assert proc.wait(timeout=60) == 2 and "Traceback" not in err and "broken pipe" in err, err
    assert len(err.strip().splitlines()) == 1


def test_a_weights_store_not_there_yet_is_said_in_one_line(files, tmp_path):
    """`serve --weights-store /nonexistent` started without a word. A store a run will publish to later
    is allowed (an engine may start before its trainer), with one line saying so."""
    out = run_cli("serve", "--checkpoint", str(files / "policy"), "--weights-store", str(tmp_path / "w"))
    assert out.returncode == 2 and "Traceback" not in out.stderr  # the checkpoint in {d}/policy does not load
    assert "holds no versions yet" in out.stderr.splitlines()[0], out.stderr


def test_sft_takes_the_starting_model_as_train_does(tmp_path):
    """`strop sft` under a new run name used to say "`runs/x/midtrain/model` has no tokenizer.json";
    its starting model is `--policy`, as for `strop train`, and `--base` still works with a note."""
    fresh = run_cli("sft", "--set", f"run.out_dir={tmp_path}", "--set", "run.name=x")
    assert fresh.returncode == 2 and len(fresh.stderr.strip().splitlines()) == 1, fresh.stderr
    assert (
        f"no policy at '{tmp_path}/x/midtrain/model'; run `strop midtrain` first or pass --policy DIR" in fresh.stderr
    )
    assert not (tmp_path / "x").exists()
    both = run_cli("sft", "--policy", str(tmp_path), "--base", str(tmp_path))
    assert both.returncode == 2 and "--base is the old name of --policy: pass one of them" in both.stderr
    old = run_cli("sft", "--base", str(tmp_path / "none"), "--set", f"run.out_dir={tmp_path}")
    assert old.returncode == 2 and old.stderr.splitlines() == [
        "strop sft: --base is deprecated; it is now --policy, as for strop train",
        f"strop: error: no policy at '{tmp_path}/none' (a model directory: config.json and *.safetensors)",
    ]


def test_online_once_with_an_unreachable_engine_is_one_line(tmp_path):
    """It ended in an httpx.ConnectError traceback."""
    import os
    import socket

    with socket.socket() as s:  # a local port nothing listens on
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"
    argv = ["online", "--once", "--checkpoint", str(tmp_path), "--store", str(tmp_path / "fb.db")]
    argv += ["--weights-store", str(tmp_path / "w"), "--engine", url, "--run-dir", str(tmp_path / "o")]
    env = {**os.environ, "STROP_API_KEY": "k"}
    out = subprocess.run(
        [sys.executable, "-m", "strop.cli", *argv], capture_output=True, text=True, timeout=120, env=env
    )
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert out.stderr.startswith(f"strop: error: engine {url} is unreachable: ConnectError"), out.stderr
