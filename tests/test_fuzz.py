"""Fuzz: random and hostile input at every door strop has. The invariant is the same everywhere:
a one-line error and exit 2 (or a 4xx), nothing written outside the directory the input named, no
process or folder left behind, the served model unchanged.

Doors: config values (`--set`), command-line arguments of the commands that read files, bind
ports or open sandboxes, the whole argument space of `agent`, `serve key`, `sync` and `tasks`,
HTTP bodies and headers of the server, damaged safetensors and delta files, answers of the code
under test to the isolated grader's judge, the run directory `demo --fresh` deletes. Each test
draws its cases from a seeded generator: the fast suite runs `FAST` of them (well under a minute
in all), `-m slow` runs `SLOW` times as many from other seeds. One file past 500 lines: every
door's cases come from the same seeded generators and meet the same invariant checks, which live
here.
"""

import contextlib
import io
import json
import os
import random
import socket
import struct
import subprocess
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

from strop.cli import main
from strop.config import Config, load_config
from strop.errors import UserError
from tests.conftest import served_tiny_moe, write_delta_files

REPO = Path(__file__).resolve().parents[1]
FAST, SLOW = 1, 12  # case-count multipliers

# value lists, kept dense
# fmt: off
NUMBERS = ["0", "-1", "1", "2", "-0", "0.5", "1e308", "-1e308", "inf", "-inf", "nan", "+nan", "9223372036854775808",
           "-9223372036854775809", "1_000", "0x10", "1e-320", "true", "false"]
WORDS = ["", ".", "..", "/", "a/b", "../..", "~", "-rf", "--help", "é", "\t", " x ", "a" * 300, "x\ny", "$(rm -rf /)",
         "'", '"', "\\", "nul\x01", "run", "demo", "..hidden"]
STRUCTS = ["[]", "[7]", "[-1]", "[1, 2, 3, 4, 5, 6]", '["x"]', "[[1]]", "[1.5]", "{a = 1}", "[", "{", "=", "==",
           "[inf]", "[nan]", '"quoted"', "'single'", '"""triple"""']
# fmt: on


def hostile(rng: random.Random) -> str:
    return rng.choice(rng.choice([NUMBERS, WORDS, STRUCTS]))


def fields() -> list[str]:
    import dataclasses

    return [f"{s.name}.{f.name}" for s in dataclasses.fields(Config) for f in dataclasses.fields(s.type)]


def repo_state() -> str:
    """Every file git sees in the repository, ignored ones included: nothing may appear there."""
    return subprocess.run(
        ["git", "status", "--porcelain", "--ignored", "--untracked-files=all"], cwd=REPO, capture_output=True, text=True
    ).stdout


def leftovers() -> set[str]:
    """Scratch folders and child processes this process owns."""
    me = os.getpid()
    dirs = {
        str(p)
        for base in (Path("/tmp"), Path("/dev/shm"))
        for p in base.glob(f"strop-*-{me}-*")
        if not p.name.startswith("strop-sbx-")
    }  # the per-process sandbox root lives as long as the process
    kids = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields_ = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields_[1]) == me and fields_[0] != "Z":
            kids.add(f"pid {stat.parent.name}")
    return dirs | kids


def cli(*argv: str) -> tuple[int, str]:
    """`strop ARGV` in this process: (exit code, stderr). Any exception but SystemExit escaping is a bug."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            code = main(list(argv))
        except SystemExit as e:  # argparse's own errors (a malformed flag): exit 2 and its usage line
            code = e.code
    return code, err.getvalue()


def one_line_error(code: int, err: str, argv) -> None:
    assert code in (0, 2), (argv, code, err[-2000:])
    assert "Traceback" not in err, (argv, err[-2000:])
    if code == 2:
        lines = [line for line in err.splitlines() if "error:" in line]
        assert len(lines) == 1, (argv, err[-2000:])


# ---- config values ---------------------------------------------------------------------------


def fuzz_config(n: int, seed: int) -> None:
    rng = random.Random(seed)
    keys = fields() + ["run", "nosuch.key", "run.name.deeper", "rl.", ".x", "", "=", "model.path.x"]
    for _ in range(n):
        overrides = [f"{rng.choice(keys)}={hostile(rng)}" for _ in range(rng.randint(1, 4))]
        if rng.random() < 0.1:
            overrides.append(rng.choice(WORDS))  # no '=' at all
        try:
            cfg = load_config(None, overrides)
        except UserError as e:
            assert str(e) and "\n" not in str(e), overrides
            continue
        for section in cfg.__dict__.values():
            for v in section.__dict__.values():
                assert not isinstance(v, float) or np.isfinite(v), overrides
        assert cfg.run_dir.parent == Path(cfg.run.out_dir) and cfg.run_dir.name == cfg.run.name not in (
            "",
            ".",
            "..",
        ), overrides


def test_fuzz_config_values():
    fuzz_config(400 * FAST, 0)


@pytest.mark.slow
def test_fuzz_config_values_long():
    fuzz_config(400 * SLOW, 1)


# ---- command lines -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """Files the commands are pointed at: real ones, damaged ones, directories, missing paths."""
    d = tmp_path_factory.mktemp("fuzz")
    write_delta_files(d, 256)
    (d / "junk.bin").write_bytes(os.urandom(300))
    (d / "empty").write_bytes(b"")
    (d / "dir").mkdir()
    (d / "model").mkdir()
    (d / "model" / "config.json").write_text('{"architectures": ["Qwen3MoeForCausalLM"]}')
    (d / "model" / "model.safetensors").write_bytes(os.urandom(64))
    return d


def paths(d: Path) -> list[str]:
    return [
        str(d / n)
        for n in (
            "base.safetensors",
            "new.safetensors",
            "delta.bin",
            "junk.bin",
            "empty",
            "dir",
            "model",
            "missing",
            "missing/deep/file",
            "base.safetensors/inside",
        )
    ] + ["", "-", "/"]


def command_lines(rng: random.Random, d: Path) -> list[str]:
    p, out = (lambda: rng.choice(paths(d))), (lambda: str(d / "out" / f"o{rng.randrange(10**6)}"))
    choices = [
        lambda: [
            "sync",
            "encode",
            "--base",
            p(),
            "--new",
            p(),
            "-o",
            rng.choice([out(), p()]),
            "--version",
            rng.choice(NUMBERS),
        ],
        lambda: ["sync", "decode", "--base", p(), p(), "-o", rng.choice([out(), p()])],
        lambda: [
            "serve",
            "--checkpoint",
            p(),
            "--port",
            rng.choice(NUMBERS + ["99999", "65536"]),
            "--max-batch",
            rng.choice(NUMBERS),
            "--max-len",
            rng.choice(NUMBERS),
            "--host",
            rng.choice(["127.0.0.1", "", "999.1.1.1", "::1", "nohost.invalid"]),
        ],
        lambda: [
            "sandbox",
            "run",
            "--timeout",
            rng.choice(NUMBERS),
            "--memory",
            rng.choice(NUMBERS),
            *rng.choice([[], ["--repo", p()]]),
            "--",
            "true",
        ],
        lambda: [
            "tasks",
            rng.choice(["list", "export", "check"]),
            "--suite",
            rng.choice(["synthetic", "humaneval", "nope", "synthetic/zz", ""]),
            rng.choice(["synthetic-d1-eval-0000", "synthetic-d9-eval-1", "x", "", "../../etc"]),
            out(),
            "--json",
            rng.choice([out(), p()]),
        ],
        lambda: [
            "eval",
            "policy",
            "--policy",
            p(),
            "--set",
            "rollout.eval_episodes=1",
            "--set",
            f"rollout.eval_difficulties={rng.choice(STRUCTS)}",
        ],
        lambda: [
            "agent",
            "--repo",
            p(),
            "--endpoint",
            rng.choice(["http://127.0.0.1:9", "nonsense", "ftp://x", ""]),
            "--tokenizer",
            p(),
            "hi",
        ],
        # (never a directory of two real snapshots, such as "" = here: that runs the benchmark)
        lambda: [
            "bench",
            "sync",
            "--demo-run",
            rng.choice([str(d / n) for n in ("dir", "missing", "junk.bin", "model")] + ["/"]),
            "--quick",
            "--no-fanout",
        ],
        # (not midtrain or demo: a valid config would start them)
        lambda: [rng.choice(["sft", "train"]), "--config", p(), "--set", f"run.out_dir={d / 'runs'}"],
        lambda: (
            [rng.choice(["frobnicate", "sync", "tasks", "bench"])] + [hostile(rng) for _ in range(rng.randint(0, 3))]
        ),
    ]
    return [str(a) for a in rng.choice(choices)()]


def fuzz_cli(n: int, seed: int, d: Path) -> None:
    """Run from `d`: relative outputs land there, and the repository must not change at all."""
    rng = random.Random(seed)
    before, stray = repo_state(), leftovers()
    for _ in range(n):
        argv = command_lines(rng, d)
        if argv[:4] == ["tasks", "check", "--suite", "synthetic"] and len(argv) > 5 and argv[4].endswith("0000"):
            argv[5] = str(d / "dir")  # a real check of an empty workspace: a sandbox opens and closes
        code, err = cli(*argv)
        one_line_error(code, err, argv)
        # nothing outside the fuzz directory: only outputs it named, and the base file stays whole
        assert (d / "base.safetensors").stat().st_size > 0
    assert repo_state() == before
    assert leftovers() <= stray


def test_fuzz_command_lines(inputs, monkeypatch):
    monkeypatch.chdir(inputs)
    fuzz_cli(40 * FAST, 0, inputs)


@pytest.mark.slow
def test_fuzz_command_lines_long(inputs, monkeypatch):
    monkeypatch.chdir(inputs)
    fuzz_cli(40 * SLOW, 1, inputs)


# ---- argument spaces ---------------------------------------------------------------------------


def argument_space(rng: random.Random, d: Path) -> dict[tuple[str, ...], dict]:
    """Per command: its flags (and positionals, keyed by position) -> a draw of a value for it."""
    p, out = (lambda: rng.choice(paths(d))), (lambda: str(d / "out" / f"o{rng.randrange(10**6)}"))
    num, word = (lambda: rng.choice(NUMBERS)), (lambda: rng.choice(WORDS))
    file_or_out = lambda: rng.choice([out(), p(), str(d / "out")])  # noqa: E731
    suite = lambda: rng.choice(["synthetic", "chain", "humaneval", "nope", "jsonl:" + p(), "", "a.b.c"])  # noqa: E731
    task = lambda: rng.choice(["synthetic-d1-eval-0000", "chain-d1-eval-0000", "x", "", "../../etc"])  # noqa: E731
    return {
        ("agent",): {
            0: word,  # the instruction
            "--repo": p,
            # never a policy that answers: an unreachable endpoint, or a checkpoint that does not load
            "--endpoint": lambda: rng.choice(["http://127.0.0.1:9", "nonsense", "ftp://x", ""]),
            "--checkpoint": lambda: rng.choice([str(d / "model"), p()]),
            "--tokenizer": p,
            "--model": word,
            "--max-turns": num,
            "--max-context": num,
            "--context-strategy": lambda: rng.choice(["none", "summarize", "truncation", "masking", "x"]),
            "--max-resets": num,
            "--temperature": num,
            "--timeout": num,
            "--apply": None,
            "--json": file_or_out,
        },
        ("serve", "key"): {
            "--keys": file_or_out,
            "--name": word,
            "--scopes": lambda: rng.choice(["infer", "infer,feedback", "admin,", ",", "", "root", "infer,infer"]),
            "--rate": num,
            "--burst": num,
        },
        ("sync", "encode"): {
            "--base": p,
            "--new": p,
            "-o": file_or_out,
            "--version": num,
            "--base-version": num,
        },
        ("sync", "decode"): {"--base": p, 0: p, "-o": file_or_out},
        ("tasks", "list"): {"--suite": suite, "--split": lambda: rng.choice(["train", "eval", "test", ""])},
        ("tasks", "export"): {"--suite": suite, 0: task, 1: lambda: rng.choice([out(), p()])},
        ("tasks", "check"): {
            "--suite": suite,
            0: task,
            1: lambda: rng.choice([str(d / "dir"), p()]),
            "--json": file_or_out,
            "--mode": lambda: rng.choice(["binary", "fraction", "all"]),
        },
        # (never the mutated suite: a valid --target would build it)
        ("tasks", "build"): {"--suite": lambda: rng.choice(["synthetic", "nope", ""]), "--target": num},
    }


def draw_arguments(rng: random.Random, d: Path) -> list[str]:
    """A command line from one command's argument space: a random subset of its flags (a required one
    may be missing), values drawn per flag, positionals in order, now and then a flag twice, an
    unknown flag or a stray word."""
    spaces = argument_space(rng, d)
    words = rng.choice(sorted(spaces))
    space = spaces[words]
    argv = list(words)
    flags = [f for f in space if isinstance(f, str)]
    for flag in rng.sample(flags, rng.randint(0, len(flags))) + ([rng.choice(flags)] if rng.random() < 0.1 else []):
        argv += [flag] if space[flag] is None else [flag, space[flag]()]
    argv += [space[i]() for i in sorted(k for k in space if isinstance(k, int)) if rng.random() < 0.9]
    if rng.random() < 0.1:
        argv.insert(rng.randrange(len(words), len(argv) + 1), rng.choice(["--nosuch", "-x", hostile(rng)]))
    return argv


def fuzz_arguments(n: int, seed: int, d: Path) -> None:
    """Every command line exits 0 or 2 with one error line, never a traceback; nothing is written
    outside the fuzz directory, no process or scratch folder is left behind."""
    rng = random.Random(seed)
    before, stray = repo_state(), leftovers()
    for _ in range(n):
        argv = draw_arguments(rng, d)
        code, err = cli(*argv)
        one_line_error(code, err, argv)
        assert (d / "base.safetensors").stat().st_size > 0
    assert repo_state() == before
    assert leftovers() <= stray


def test_fuzz_argument_spaces(inputs, monkeypatch):
    monkeypatch.chdir(inputs)
    fuzz_arguments(60 * FAST, 0, inputs)


@pytest.mark.slow
def test_fuzz_argument_spaces_long(inputs, monkeypatch):
    monkeypatch.chdir(inputs)
    fuzz_arguments(60 * SLOW, 1, inputs)


def fuzz_remove_run_dir(n: int, seed: int, tmp: Path) -> None:
    """`demo --fresh`'s deletion with hostile out_dir and run.name: it removes out_dir/name when that
    is a run directory the demo made (its marker inside, not reached through a link), and nothing
    else, ever."""
    from strop.outputs import OUTPUT_MARKER, remove_output

    rng = random.Random(seed)
    for i in range(n):
        root = tmp / f"case{i}"
        (root / "runs" / "real").mkdir(parents=True)
        (root / "runs" / "real" / OUTPUT_MARKER).write_text("demo\n")
        (root / "runs" / "plain").mkdir()
        (root / "runs" / "plain" / "summary.json").write_text("{}")  # the old marker: a user could write it
        (root / "keep.txt").write_text("x")
        (root / "runs" / "link").symlink_to(root / "runs" / "real")
        out = root / rng.choice(["runs", "runs/real", ".", "runs/../runs", "missing", "runs/link"])
        name = rng.choice(WORDS + ["real", "plain", "link"])
        try:
            cfg = load_config(None, [f"run.out_dir={out}", f"run.name={name}"])
            remove_output(cfg.run_dir, "demo")
        except UserError:
            pass
        gone = not (root / "runs" / "real").exists() or not (root / "runs" / "real" / OUTPUT_MARKER).exists()
        assert (
            (root / "keep.txt").exists()
            and (root / "runs" / "plain" / "summary.json").exists()
            and (root / "runs" / "link").is_symlink()
        )
        assert not gone or (out.resolve() == (root / "runs").resolve() and name == "real")


def test_fuzz_fresh_run_directory(tmp_path):
    fuzz_remove_run_dir(60 * FAST, 0, tmp_path)


@pytest.mark.slow
def test_fuzz_fresh_run_directory_long(tmp_path):
    fuzz_remove_run_dir(60 * SLOW, 1, tmp_path)


# ---- damaged files -----------------------------------------------------------------------------


def damage(blob: bytes, rng: random.Random) -> bytes:
    b = bytearray(blob)
    kind = rng.randrange(6)
    if kind == 0 and b:  # flip bits
        for _ in range(rng.randint(1, 8)):
            b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
    elif kind == 1:  # truncate
        del b[rng.randrange(len(b) + 1) :]
    elif kind == 2:  # random bytes spliced in
        at = rng.randrange(len(b) + 1)
        b[at:at] = os.urandom(rng.randint(1, 64))
    elif kind == 3 and len(b) >= 8:  # a lying length prefix
        b[:8] = struct.pack("<Q", rng.choice([0, 1, 7, len(b), len(b) - 8, 2**63, 2**64 - 1]))
    elif kind == 4:  # a hostile JSON header (safetensors layout)
        header = json.dumps(
            rng.choice(
                [
                    {"a": 1},
                    [],
                    "x",
                    {"w": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}},
                    {"w": {"dtype": "BF16", "shape": [10**12], "data_offsets": [0, 2]}},
                    {"w": {"dtype": "Q99", "shape": [1], "data_offsets": [0, 1]}},
                    {"w": {"dtype": "F32", "shape": [1], "data_offsets": [4, 0]}},
                    {"w": {"dtype": "F32", "shape": [True], "data_offsets": [0, 4]}},
                ]
            )
        ).encode()
        b = bytearray(struct.pack("<Q", len(header)) + header + b"\0" * 8)
    else:  # swap two slices
        i, j = sorted(rng.randrange(len(b) + 1) for _ in range(2))
        b = b[j:] + b[i:j] + b[:i]
    return bytes(b)


def fuzz_files(n: int, seed: int, d: Path) -> None:
    from strop.engine.engine import load_weights_file
    from strop.sync import codec, tensors

    rng = random.Random(seed)
    st_blob, delta = (d / "new.safetensors").read_bytes(), (d / "delta.bin").read_bytes()
    base, new = tensors.load(str(d / "base.safetensors")), tensors.load(str(d / "new.safetensors"))
    for i in range(n):
        bad = damage(st_blob, rng)
        try:
            tensors.from_bytes(bad)
        except ValueError:
            pass
        path = d / f"damaged{i % 4}.safetensors"
        path.write_bytes(bad)
        try:
            load_weights_file(str(path))
        except ValueError:
            pass
        bad = damage(delta, rng)
        try:
            got = codec.decode(base, bad)
        except codec.DeltaError:
            continue
        # a damaged delta that still decodes must decode to exactly the new weights
        assert sorted(got) == sorted(new) and all(np.array_equal(got[k].data, new[k].data) for k in new)


def test_fuzz_damaged_files(inputs):
    fuzz_files(300 * FAST, 0, inputs)


@pytest.mark.slow
def test_fuzz_damaged_files_long(inputs):
    fuzz_files(300 * SLOW, 1, inputs)


def fuzz_decode_cli(n: int, seed: int, d: Path) -> None:
    """`strop sync decode` of damaged deltas: exit 2, and the previous output file stays whole."""
    rng = random.Random(seed)
    delta = (d / "delta.bin").read_bytes()
    out = d / "decoded.safetensors"
    out.write_bytes(b"previous")
    for _ in range(n):
        (d / "damaged.delta").write_bytes(damage(delta, rng))
        code, err = cli(
            "sync", "decode", "--base", str(d / "base.safetensors"), str(d / "damaged.delta"), "-o", str(out)
        )
        one_line_error(code, err, "decode")
        assert out.read_bytes() == b"previous" if code else out.read_bytes() == (d / "new.safetensors").read_bytes()
        out.write_bytes(b"previous")


def test_fuzz_decode_command(inputs):
    fuzz_decode_cli(30 * FAST, 0, inputs)


@pytest.mark.slow
def test_fuzz_decode_command_long(inputs):
    fuzz_decode_cli(30 * SLOW, 1, inputs)


# ---- the server --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def served(tiny_tokenizer):
    with served_tiny_moe(tiny_tokenizer, max_batch=4, max_len=128) as s:
        yield s


VALID = {
    "/v1/completions": {"model": "tiny", "prompt": "def f(x):", "max_tokens": 2},
    "/v1/chat/completions": {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    "/weights/update": {"path": "/nonexistent", "version": 1},
}
JSONISH = [
    None,
    True,
    False,
    0,
    -1,
    1.5,
    2**70,
    -(2**70),
    "",
    "x" * 3000,
    "tiny",
    [],
    [1, "a"],
    {},
    {"a": {"b": []}},
    [[10**9]],
    [-5],
    "\u0000",
    "\ud800"[:0] + "é",
    [[]] * 50,
]


def mutate(body: dict, rng: random.Random):
    body = json.loads(json.dumps(body))
    for _ in range(rng.randint(1, 3)):
        op = rng.randrange(4)
        keys = list(body) + [
            "stream",
            "n",
            "logprobs",
            "tools",
            "stop",
            "seed",
            "top_p",
            "temperature",
            "tool_choice",
            "max_completion_tokens",
            "return_routed_experts",
            "prompt",
            "messages",
            "path",
            "version",
        ]
        key = rng.choice(keys)
        if op == 0:
            body.pop(key, None)
        elif op == 1:
            body[key] = rng.choice(JSONISH)
        elif op == 2 and isinstance(body.get("messages"), list) and body["messages"]:
            body["messages"][0] = rng.choice(
                [
                    {"role": "user"},
                    {"role": "tool", "content": 3},
                    {"content": "x"},
                    {"role": "assistant", "content": None, "tool_calls": rng.choice(JSONISH)},
                    "hi",
                    [],
                ]
            )
        else:
            body[key] = mutate({"nested": rng.choice(JSONISH)}, rng) if rng.random() < 0.3 else rng.choice(JSONISH)
    return body


RAW = [
    b"GET / HTTP/1.1\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\r\nContent-Length: -5\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\r\nContent-Length: 99999999999\r\n\r\n{",
    b"POST /v1/completions HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nZZ\r\nxx\r\n",
    b"POST /v1/completions HTTP/1.1\r\nContent-Length: 3\r\nContent-Length: 9\r\n\r\nabc",
    b"BREW /coffee HTCPCP/1.0\r\n\r\n",
    b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03",
    b"GET /" + b"a" * 70000 + b" HTTP/1.1\r\n\r\n",
    b"POST /weights/update HTTP/1.1\r\nHost: x\r\n" + b"X-Pad: " + b"b" * 20000 + b"\r\n\r\n",
    b"\r\n\r\n\r\n",
]


def weights(engine) -> list[torch.Tensor]:
    return [t.detach().clone() for t in engine.named_tensors().values()]


def fuzz_http(n: int, seed: int, served, d: Path) -> None:
    url, engine = served
    rng = random.Random(seed)
    before, version = weights(engine), engine.version
    with httpx.Client(timeout=60) as client:
        for i in range(n):
            path = rng.choice(list(VALID))
            kind = rng.randrange(10)
            headers = {
                "content-type": rng.choice(["application/json", "text/plain", "application/x-www-form-urlencoded", ""])
            }
            if kind < 6:
                body = mutate(VALID[path], rng)
                if path == "/weights/update" and rng.random() < 0.5:
                    body["path"] = str(
                        d / rng.choice(["junk.bin", "empty", "dir", "model", "delta.bin", "damaged0.safetensors"])
                    )
                content = json.dumps(body).encode()
            elif kind < 8:
                content = os.urandom(rng.randint(0, 200))
            else:
                content = json.dumps(VALID[path]).encode()[: rng.randint(0, 40)]
            r = client.post(url + path, content=content, headers=headers)
            assert r.status_code < 500, (path, content[:300], r.status_code, r.text[:300])
            if kind == 9 and i % 3 == 0:  # raw bytes no HTTP client would send
                with socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1])), timeout=10) as s:
                    s.sendall(rng.choice(RAW))
                    s.shutdown(socket.SHUT_WR)
                    try:
                        reply = s.recv(200)
                    except (TimeoutError, ConnectionResetError):
                        reply = b""
                    status = reply.split(b" ")[1:2]
                    assert not status or not status[0].startswith(b"5"), reply
        assert client.get(url + "/health").json()["status"] == "ok"
    assert engine.version == version and all(torch.equal(a, b) for a, b in zip(weights(engine), before))


def test_fuzz_http(served, inputs):
    fuzz_http(120 * FAST, 0, served, inputs)


@pytest.mark.slow
def test_fuzz_http_long(served, inputs):
    fuzz_http(120 * SLOW, 1, served, inputs)


# ---- answers to the isolated grader ------------------------------------------------------------


def fuzz_judge(n: int, seed: int, tmp: Path) -> None:
    """The judge reading hostile answers (whatever the agent's code wrote) never crashes and never
    passes a check a correct answer would not."""
    from strop.env.grading import programs as gp

    rng = random.Random(seed)
    checks = tmp / "checks.py"
    checks.write_text(
        "def total(call):\n    assert call('m', 'f', 1, 2) == 3\n\n\n"
        "def pair(call):\n    assert call('m', 'g', [1]) == (1, [1])\n\n\n"
        "CHECKS = [('sum', total), ('pair', pair)]\n"
    )
    (tmp / "calls.json").write_text(json.dumps([["m", "f", gp.encode([1, 2])], ["m", "g", gp.encode([[1]])]]))
    answers = [[{"value": 3}, {"value": gp.encode((1, [1]))}]]
    for _ in range(n):
        junk = rng.choice(
            [
                lambda: os.urandom(rng.randint(0, 100)),
                lambda: json.dumps(rng.choice(JSONISH)).encode(),
                lambda: json.dumps(
                    [
                        rng.choice(
                            [
                                {"value": rng.choice(JSONISH)},
                                {"raised": rng.choice(JSONISH)},
                                {"value": 3, "raised": "X"},
                                {"value": {"tuple": rng.choice(JSONISH)}},
                                {"value": {"float": "nan"}},
                                {},
                            ]
                        )
                        for _ in range(rng.randint(0, 3))
                    ]
                ).encode(),
                lambda: (b"[" * 100000) + (b"]" * 100000),
            ]
        )()
        (tmp / "answers.json").write_bytes(junk)
        gp.judge(str(checks), str(tmp / "verdict.json"), [str(tmp / "calls.json"), str(tmp / "answers.json")])
        verdict = json.loads((tmp / "verdict.json").read_text())
        assert not verdict["pending"]
        for name, outcome, _ in verdict["checks"]:
            assert outcome != "passed" or junk == json.dumps(answers[0]).encode(), (name, junk[:200])
    (tmp / "answers.json").write_text(json.dumps(answers[0]))
    gp.judge(str(checks), str(tmp / "verdict.json"), [str(tmp / "calls.json"), str(tmp / "answers.json")])
    assert [o for _, o, _ in json.loads((tmp / "verdict.json").read_text())["checks"]] == ["passed", "passed"]


def test_fuzz_judge(tmp_path):
    fuzz_judge(200 * FAST, 0, tmp_path)


@pytest.mark.slow
def test_fuzz_judge_long(tmp_path):
    fuzz_judge(200 * SLOW, 1, tmp_path)
