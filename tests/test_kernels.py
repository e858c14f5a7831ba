"""The C kernels (`strop.kernels`): they compute what torch computes, and they are batch-invariant —
a row's bits do not change when its batch is shuffled, cut into other groups, or run beside other
rows, whatever tile shape, expert group or slot it lands in."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from strop import kernels

pytestmark = pytest.mark.skipif(not kernels.available(), reason="no C compiler")


def _regroupings(n: int, seed: int) -> list[list[torch.Tensor]]:
    """Ways to feed n rows: one call, shuffled, and shuffled then cut into random groups of 1-40
    rows (every tile shape of the matrix kernels, expert groups past MOE_GROUP)."""
    gen = torch.Generator().manual_seed(seed)
    ways = [[torch.arange(n)], [torch.randperm(n, generator=gen)]]
    for _ in range(4):
        perm, groups, at = torch.randperm(n, generator=gen), [], 0
        while at < n:
            size = int(torch.randint(1, 41, (1,), generator=gen))
            groups.append(perm[at : at + size])
            at += size
        ways.append(groups)
    ways.append([torch.tensor([i]) for i in range(n)])  # one row at a time
    return ways


def _check_invariant(fn, n: int, seed: int = 0) -> None:
    """fn(rows) -> a tensor with one leading entry per row: every regrouping gives the same bits."""
    full = fn(torch.arange(n))
    for groups in _regroupings(n, seed):
        got = torch.empty_like(full)
        for rows in groups:
            got[rows] = fn(rows)
        assert torch.equal(got, full)


def test_linear_matches_torch_and_is_batch_invariant():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(120, 64, generator=gen)
    for n in (32, 96, 80, 8):  # whole 32-column blocks, and widths padded to one
        w, bias = torch.randn(n, 64, generator=gen), torch.randn(n, generator=gen)
        packed = kernels.pack_linear(w)
        assert not packed.bf16 and packed.n == n
        assert torch.allclose(kernels.linear(x, packed, bias), F.linear(x, w, bias), atol=1e-4)
        _check_invariant(lambda rows: kernels.linear(x[rows], packed, bias), len(x))
        exact = w.bfloat16().float()  # bf16 values pack as bf16: half the bytes, the same bits
        assert kernels.pack_linear(exact).bf16
        assert torch.equal(
            kernels.linear(x, kernels.pack_linear(exact)), kernels.linear(x, kernels.pack_linear(exact, False))
        )


def test_row_kernels_match_torch_and_are_batch_invariant():
    gen = torch.Generator().manual_seed(1)
    x, w = torch.randn(90, 40, generator=gen), torch.rand(40, generator=gen) + 0.5
    ref = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w
    assert torch.allclose(kernels.rms_norm(x, w, 1e-6), ref, atol=1e-5)
    _check_invariant(lambda rows: kernels.rms_norm(x[rows], w, 1e-6), len(x))
    g, u = torch.randn(90, 28, generator=gen) * 4, torch.randn(90, 28, generator=gen)  # 28: a 4-wide tail
    assert torch.allclose(kernels.silu_mul(g, u), F.silu(g) * u, atol=1e-5)
    _check_invariant(lambda rows: kernels.silu_mul(g[rows], u[rows]), len(g))
    grads, act = kernels.silu_mul_backward(g, u, x[:, :28], with_act=True)
    gr, ur = g.clone().requires_grad_(), u.clone().requires_grad_()
    (F.silu(gr) * ur).backward(x[:, :28])
    assert torch.allclose(act, F.silu(g) * u, atol=1e-5)
    assert torch.allclose(grads, torch.cat([gr.grad, ur.grad], 1), atol=1e-5)


def test_qk_norm_rope_matches_torch_and_is_batch_invariant():
    gen = torch.Generator().manual_seed(2)
    heads, nq, d, P = 3, 2, 16, 50
    src, w = torch.randn(60, heads * d, generator=gen), torch.rand(heads, d, generator=gen) + 0.5
    ang = torch.arange(P)[:, None] * torch.rand(d // 2, generator=gen)
    cos = torch.cat([ang.cos(), ang.cos()], 1)
    sin = torch.cat([-ang.sin(), ang.sin()], 1)  # the rotate-half sign folded in
    pos = torch.randint(0, P, (60,), generator=gen)
    y = src.view(60, heads, d)
    y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + 1e-6) * w
    ref = y * cos[pos][:, None] + y.roll(d // 2, -1) * sin[pos][:, None]
    assert torch.allclose(kernels.qk_norm_rope(src, w, cos, sin, pos, nq, 1e-6), ref, atol=1e-5)
    _check_invariant(lambda rows: kernels.qk_norm_rope(src[rows], w, cos, sin, pos[rows], nq, 1e-6), len(src))


@pytest.mark.parametrize("dk,dv", [(32, 32), (64, 64), (16, 16), (24, 8)])
def test_attention_matches_torch_and_is_batch_invariant(dk, dv):
    """Query rows over a cache: any mix of slots and positions, shuffled or regrouped, and a
    slot's keys copied into another slot (a reused prefix) give the same bits."""
    gen = torch.Generator().manual_seed(3)
    S, nq, nk, L = 4, 4, 2, 80
    kc, vc = torch.randn(S, nk, L, dk, generator=gen), torch.randn(S, nk, L, dv, generator=gen)
    N = 50
    q = torch.randn(N, nq, dk, generator=gen)
    slots, pos = torch.randint(0, S - 1, (N,), generator=gen), torch.randint(0, L, (N,), generator=gen)
    out, lse = kernels.attention(q, kc, vc, slots, pos, 0.3, with_lse=True)
    for i in range(0, N, 7):  # one query row against its slot's keys 0..pos
        T = int(pos[i]) + 1
        K, V = (c[slots[i]][None, :, :T].repeat_interleave(2, 1) for c in (kc, vc))
        s = (q[i][None, :, None] @ K.transpose(-1, -2))[0, :, 0] * 0.3
        assert torch.allclose(lse[i], s.logsumexp(-1), atol=1e-5)
        assert torch.allclose(out[i], (torch.softmax(s, -1)[:, None] @ V[0])[:, 0], atol=1e-5)
    _check_invariant(lambda rows: kernels.attention(q[rows], kc, vc, slots[rows], pos[rows], 0.3), N)
    kc[S - 1], vc[S - 1] = kc[0], vc[0]  # the keys of slot 0 in another slot, stale rows past them differ
    kc[S - 1, :, L // 2 :] += 1.0
    at0 = (slots == 0) & (pos < L // 2)
    moved = kernels.attention(q[at0], kc, vc, torch.full((int(at0.sum()),), S - 1), pos[at0], 0.3)
    assert torch.equal(moved, out[at0])


def test_router_matches_torch_and_is_batch_invariant():
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(70, 32, generator=gen)[:, :8] * 3  # strided rows, as a padded router projection gives
    for norm in (True, False):
        w, ids = kernels.route_softmax(logits, 8, 3, norm)
        probs = torch.softmax(logits, -1)
        top = probs.topk(3, -1)
        assert torch.equal(ids, top.indices)
        assert torch.allclose(w, top.values / top.values.sum(-1, keepdim=True) if norm else top.values, atol=1e-6)
        assert torch.equal(kernels.route_softmax_at(logits, 8, ids, norm), w)  # replay gives the same bits
        _check_invariant(lambda rows: kernels.route_softmax(logits[rows], 8, 3, norm)[0], len(logits))
        _check_invariant(lambda rows: kernels.route_softmax_at(logits[rows], 8, ids.flip(1)[rows], norm), len(logits))


def test_experts_match_torch_and_are_batch_invariant():
    gen = torch.Generator().manual_seed(5)
    E, H, I, K = 8, 64, 32, 2
    gate_up, down = torch.randn(E, 2 * I, H, generator=gen) * 0.1, torch.randn(E, H, I, generator=gen) * 0.1
    N = 120  # most experts get more rows than one MOE_GROUP
    x, w = torch.randn(N, H, generator=gen), torch.rand(N, K, generator=gen)
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(N)])
    packs = kernels.pack_experts(gate_up, down)
    gate, up = torch.einsum("nkih,nh->nki", gate_up[ids], x).chunk(2, -1)
    ref = (torch.einsum("nkhi,nki->nkh", down[ids], F.silu(gate) * up) * w[..., None]).sum(1)
    assert torch.allclose(kernels.moe_experts(x, ids, w, *packs), ref, atol=1e-5)
    _check_invariant(lambda rows: kernels.moe_experts(x[rows], ids[rows], w[rows], *packs), N)
    exact = (gate_up.bfloat16().float(), down.bfloat16().float())  # bf16 values: bf16 packs, the same bits
    p16 = kernels.pack_experts(*exact)
    assert p16[0].dtype == p16[1].dtype == torch.bfloat16
    assert torch.equal(kernels.moe_experts(x, ids, w, *p16), kernels.moe_experts(x, ids, w, *(t.float() for t in p16)))


def test_sampler_softmax_matches_torch_and_is_batch_invariant():
    gen = torch.Generator().manual_seed(6)

    def softmax(x: torch.Tensor) -> torch.Tensor:
        n = len(x)
        ones, zeros = np.ones(n, np.float32), np.zeros(n, np.int64)
        return torch.from_numpy(kernels.sample_rows(x.numpy(), ones, ones, zeros)[0])

    for V in (4096, 100):  # with and without a tail past whole 32-blocks
        x = torch.randn(20, V, generator=gen) * 4
        assert torch.allclose(softmax(x), torch.softmax(x, -1), rtol=1e-5, atol=0)
        _check_invariant(lambda rows: softmax(x[rows]), len(x))


def test_avx512_matrix_kernels_give_the_8_lane_kernels_bits(tmp_path):
    """Where the CPU has AVX-512 the matrix kernels run on 16-float vectors; a machine without it runs
    the 8-float ones. Both add the same products in the same order per output: the same bits, so an
    engine and a trainer on different machines still agree (the source built both ways here)."""
    import ctypes
    import subprocess

    from strop.native import FLAGS, read_sources

    if "avx512f" not in open("/proc/cpuinfo").read():
        pytest.skip("no AVX-512 here: only the 8-float kernels are built")
    (tmp_path / "k.c").write_text(read_sources("strop.kernels", *kernels.SOURCES))
    libs = []
    for name, flags in (("wide", []), ("narrow", ["-mno-avx512f"])):
        so = tmp_path / f"{name}.so"
        cmd = ["cc", *FLAGS, *flags, str(tmp_path / "k.c"), "-o", str(so), "-lm"]
        subprocess.run(cmd, check=True)
        libs.append(ctypes.CDLL(str(so)))
    torch.manual_seed(0)
    P, I64 = ctypes.c_void_p, ctypes.c_int64
    for rows in (1, 2, 3, 4, 5, 7, 8, 9, 16, 23):
        for n, m in ((64, 40), (96, 77), (160, 576)):
            for bf16 in (False, True):
                w = torch.randn(n, m)
                packed = kernels.pack_linear(w.bfloat16().float() if bf16 else w, as_bf16=bf16)
                x, outs = torch.randn(rows, m), []
                for lib in libs:
                    y = torch.empty(rows, n)
                    args = (P(x.data_ptr()), I64(rows), P(packed.data.data_ptr()), I64(int(bf16)), None)
                    lib.linear_packed(*args, P(y.data_ptr()), I64(m), I64(n))
                    outs.append(y)
                assert torch.equal(outs[0], outs[1]), (rows, n, m, bf16)


def test_threads_split_products_without_changing_a_bit():
    """Large products split their column blocks between threads: the same bits on 1 and 3 threads, a
    forked child (which has no workers) still computes, and another Python thread's product meanwhile
    runs alone rather than waiting."""
    import multiprocessing
    from concurrent.futures import ThreadPoolExecutor

    torch.manual_seed(0)
    w, x = torch.randn(1000, 576), torch.randn(16, 576)
    packed = kernels.pack_linear(w)
    kernels.set_threads(1)
    alone = kernels.linear(x, packed)
    kernels.set_threads(3)
    try:
        assert torch.equal(kernels.linear(x, packed), alone)
        with ThreadPoolExecutor(4) as pool:
            assert all(torch.equal(y, alone) for y in pool.map(lambda _: kernels.linear(x, packed), range(8)))
        child = multiprocessing.get_context("fork").Process(target=kernels.linear, args=(x, packed))
        child.start()
        child.join(60)
        assert child.exitcode == 0
    finally:
        kernels.set_threads(1)
