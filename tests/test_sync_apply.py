"""In-place engine apply: live bf16 tensors become the new version exactly, between steps."""

import threading
import time

import numpy as np
import torch

from strop.sync.apply import EngineSync, apply_inplace, bits_view, stage
from strop.sync.replica import prepare_patch
from strop.sync.store import Publisher, Store


def _model_versions(steps: int) -> list[dict[str, torch.Tensor]]:
    """bf16 snapshots of a small MLP whose fp32 weights drift by small random steps (an
    optimizer's first step costs seconds of lazy imports, and only the deltas matter here)."""
    g = torch.Generator().manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
    out = []
    with torch.no_grad():
        for _ in range(steps + 1):
            out.append({k: v.detach().to(torch.bfloat16).clone() for k, v in model.state_dict().items()})
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=g) * 3e-5)
    return out


def test_apply_inplace_is_exact_and_touches_only_changes(tmp_path):
    v = _model_versions(1)
    store = Store(str(tmp_path))
    pub = Publisher(store)
    for s in v:
        pub.publish({k: bits_view(t) for k, t in s.items()})
    live = {k: t.clone() for k, t in v[0].items()}
    ptrs = {k: t.data_ptr() for k, t in live.items()}
    state = {k: bits_view(t) for k, t in live.items()}
    patch, failed = prepare_patch(state, {k: t.crc32() for k, t in state.items()}, store.delta_bytes(1))
    assert not failed and patch.changes
    pause = apply_inplace(live, stage(patch, live))
    assert pause < 0.05
    for k in live:
        assert torch.equal(live[k].view(torch.int16), v[1][k].view(torch.int16)), k
        assert live[k].data_ptr() == ptrs[k]  # same storage: patched, not replaced


def test_engine_follows_store_between_decode_steps(tmp_path):
    v = _model_versions(3)
    store = Store(str(tmp_path))
    pub = Publisher(store)
    pub.publish({k: bits_view(t) for k, t in v[0].items()})
    live = {k: t.clone() for k, t in v[0].items()}
    sync = EngineSync(live, version=0)
    stop = threading.Event()
    threading.Thread(target=sync.follow, args=(store,), kwargs={"poll_s": 0.01, "stop": stop}, daemon=True).start()
    for s in v[1:]:
        pub.publish({k: bits_view(t) for k, t in s.items()})
    deadline = time.time() + 20
    while sync.version < 3 and time.time() < deadline:  # the "decode loop"
        sync.swap_point()
        time.sleep(0.002)
    stop.set()
    assert sync.version == 3
    for k in live:
        assert np.array_equal(bits_view(live[k]).data, bits_view(v[3][k]).data), k
    assert sync.pauses and max(sync.pauses) < 0.05
