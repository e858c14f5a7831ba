"""The demo's numbers do not depend on the instruction set (slow: three subprocesses train and
decode a tiny policy). On an AVX-512 machine, strop's pinned numerics (`strop.cpu`) must give the
bits an AVX2 machine gives: training steps (ATen and MKL, forward, backward, AdamW) and decoding
(the C kernels, built natively here with 16-float AVX-512 vectors, beside torch's ops) emulated on
AVX2 by the libraries' own variables and the kernels built for x86-64-v3. Without the pin the same
work gives other bits, so the check is not vacuous: that difference is what made the same
`make demo` train warm starts 11.5% and 39.5% apart."""

import os
import subprocess
import sys

import pytest

from strop import cpu

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not (cpu.pinnable() and "avx512f" in cpu.flags()), reason="needs an AVX-512 CPU to differ from AVX2"
    ),
]

# Trains a tiny MoE 4 steps on the corpus tokens and decodes with it (greedy and sampled); prints a
# digest of the weights and of every token id and logprob. `pin` says whether strop pins first.
SCRIPT = """
import hashlib, sys
import strop.cpu, strop.native
if sys.argv[1] == "pin":
    strop.cpu.pin_numerics()
from strop.threads import set_threads
set_threads(2)
import torch
from strop.config import DataSection, ModelSection
from strop.data.corpus import load_corpus
from strop.data.packing import tokenize_documents
from strop.data.tokenizer import train_tokenizer
from strop.engine.engine import Engine
from strop.model.policy import build_model
from strop.policy_api import SamplingParams
from strop.train.midtrain import lm_loss

corpus = load_corpus(DataSection(val_files=5))
tok = train_tokenizer(corpus.train[:100], vocab_size=512, sample_bytes=200_000)
ids = torch.tensor(tokenize_documents(tok, corpus.train[:100])[: 4 * 8 * 129].astype("int64")).view(4, 8, 129)
section = ModelSection(hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=32, num_experts=8,
                       experts_per_token=2, expert_size=32, dense_size=128, max_positions=512)
model = build_model(section, tok, seed=0).train()
opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
for batch in ids:
    ce, aux = lm_loss(model, batch, 0.01)
    opt.zero_grad()
    (ce + 0.01 * aux).backward()
    opt.step()
digest = hashlib.sha256()
for _, t in sorted(model.state_dict().items()):
    digest.update(t.detach().contiguous().numpy().tobytes())
engine = Engine(model.eval(), tok, max_batch=4, max_len=512)
assert engine.forward.kernel_path, "the C kernels are needed"
prompts = [ids[0, i, :64].tolist() for i in range(4)]
params = [SamplingParams(max_tokens=48, temperature=t, stop_token_ids=[], seed=i) for i, t in enumerate([0, 1, 0, 1])]
for o in engine.generate(prompts, params):
    digest.update(repr((o.token_ids, o.logprobs)).encode())
print(digest.hexdigest())
"""

AVX2_MACHINE = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "AVX2,STRICT", "ONEDNN_MAX_CPU_ISA": "AVX2"}


def digest(pin: bool, march: str, env: dict, tmp_path) -> str:
    base = {k: v for k, v in os.environ.items() if k not in (*cpu.PINNED, "STROP_NUMERICS")}
    base["XDG_CACHE_HOME"] = str(tmp_path / march)  # both builds made here, not taken from the user's cache
    base["STROP_MARCH"] = march  # "x86-64-v3": the kernels an AVX2 machine builds
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, "pin" if pin else "no"],
        env={**base, **env},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.split()[-1]


def test_pinned_numerics_are_an_avx2_machines_bit_for_bit(tmp_path):
    pinned = digest(True, "native", {}, tmp_path)  # libraries told AVX2, kernels on AVX-512
    avx2 = digest(False, "x86-64-v3", {"STROP_NUMERICS": "native", **AVX2_MACHINE}, tmp_path)  # an AVX2 machine's
    native = digest(False, "native", {"STROP_NUMERICS": "native"}, tmp_path)  # AVX-512 everywhere
    assert pinned == avx2
    assert native != pinned, "AVX-512 and AVX2 paths gave the same bits: the check lost its power"
