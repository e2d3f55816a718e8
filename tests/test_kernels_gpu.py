"""GPU checks of the Triton linear-attention kernels at real shapes, bf16, against the float64 chunked twin
(itself checked against the step-by-step recurrence in tests/test_kernels.py), every layout forced on in
turn. Skipped without CUDA; on a GPU machine run `TRITON_INTERPRET=0 pytest tests/test_kernels_gpu.py`
(conftest turns the interpreter on unless told otherwise).

Accuracy bar: relative error (norm of the difference / norm of the reference) <= 5e-3 on o, the final
state and every gradient (q, k, v, initial state, log_f), including GLA gates anywhere in [-20, 0], hard
resets (log f = -inf) and gates below the -104 floor, T = 64K and packed cu_seqlens."""
import os
import random
import statistics

import pytest
import torch
import torch.nn.functional as F

from ops import gated_linear_attn, lightning_attn
from ops import reference as R
from ops.testing import SCAN, force_plan

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
              pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                                 reason="compiled kernels wanted: run with TRITON_INTERPRET=0")]
DEV = "cuda"
BAR = 5e-3
LAYOUTS = {"scan": SCAN, "split": 4, "auto": None}  # split: segments of 4 chunks; auto: the shape rule


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def _decays(H):
    from models.tnl import tnl_decays
    return torch.tensor(tnl_decays(H, 0, 24), device=DEV)  # layer 0: the strongest decays


def _gates(shape, kind, g):
    if kind == "mixed":
        return F.logsigmoid(torch.randn(shape, device=DEV, generator=g) * 3 + 2)
    if kind == "wide":  # uniform in [-20, 0] per step and channel
        return -20.0 * torch.rand(shape, device=DEV, generator=g)
    if kind == "moderate":  # uniform in [-5, 0]: tame chunks by half blocks, d log_f's largest errors
        return -5.0 * torch.rand(shape, device=DEV, generator=g)
    if kind == "-20":
        return torch.full(shape, -20.0, device=DEV)
    if kind == "near1":
        return -1e-6 * torch.rand(shape, device=DEV, generator=g)
    if kind == "floor":  # HGRN2-like gates with, in every third key channel, hard resets (log f = -inf) at a
        # chunk start and mid-chunk, and gates far below the -104 floor before milder ones of their chunk
        x = F.logsigmoid(torch.randn(shape, device=DEV, generator=g) * 3 + 2)
        ch = torch.arange(shape[-1], device=DEV) % 3 == 0
        T = shape[1]
        for t, val in ((64, -float("inf")), (T // 3, -float("inf")), (T // 2, -1e4), (T // 2 + 1, -3e38)):
            x[:, t, :, ch] = val
        return x
    raise ValueError(kind)


def _inputs(B, T, H, Dk, Dv, kind, gates="mixed"):
    g = torch.Generator(device=DEV).manual_seed(0)
    r = lambda *s: (torch.randn(*s, device=DEV, generator=g) * 0.5).to(torch.bfloat16)  # noqa: E731
    q, k, v = r(B, T, H, Dk), r(B, T, H, Dk), r(B, T, H, Dv)
    if kind == "gla":
        x = _gates((B, T, H, Dk), gates, g)
    else:
        x = _decays(H) if kind == "la" else None
    return q, k, v, x


def _run(kind, q, k, v, x, h0=None, cu=None):
    f = gated_linear_attn if kind == "gla" else lightning_attn
    return f(q, k, v, x, initial_state=h0, output_final_state=True, cu_seqlens=cu, impl="triton")


def _ref64(kind, q, k, v, x, h0=None):
    if kind == "gla":
        return R.gated_linear_attn_chunked(q, k, v, x, h0)
    return R.lightning_attn_chunked(q, k, v, x, h0)


def _ref64_per_doc(kind, q, k, v, x, h0, cu):
    """The float64 twin run on each document of `cu` (the whole sequence without it); h0 per document."""
    bounds = [0, q.shape[1]] if cu is None else cu.tolist()
    outs, states = [], []
    for i, (s, e) in enumerate(zip(bounds[:-1], bounds[1:])):
        xs = x[:, s:e] if kind == "gla" else x
        hs = None if h0 is None else (h0[i:i + 1] if cu is not None else h0)
        oi, Si = _ref64(kind, q[:, s:e], k[:, s:e], v[:, s:e], xs, hs)
        outs.append(oi)
        states.append(Si)
    return torch.cat(outs, 1), torch.cat(states, 0)


def _compare(kind, q, k, v, x, h0, layout, cu=None, state_loss=True):
    """Errors of o, S and every gradient (loss on o and, if state_loss, S) against float64; asserts the
    outputs' dtypes and shape."""
    ins = [q, k, v] + ([h0] if h0 is not None else []) + ([x] if kind == "gla" else [])
    ins = [t.detach().clone().requires_grad_(True) for t in ins]
    xi = ins[-1] if kind == "gla" else x
    hi = ins[3] if h0 is not None else None
    sc = LAYOUTS.get(layout, layout)  # a name, or a segment length in chunks
    with force_plan(seg_chunks=sc) if sc is not None else _nullctx():
        o, S = _run(kind, ins[0], ins[1], ins[2], xi, hi, cu)
        # the ops' contract: o in v's dtype and shape, the final state in fp32
        assert o.dtype == v.dtype and o.shape == v.shape and S.dtype == torch.float32, (o.dtype, o.shape, S.dtype)
        do, dS = torch.randn_like(o, dtype=torch.float32), torch.randn_like(S) * float(state_loss)
        grads = torch.autograd.grad((o.float() * do).sum() + (S * dS).sum(), ins)
    d64 = [t.detach().double().requires_grad_(True) for t in ins]
    x64 = d64[-1] if kind == "gla" else (None if x is None else x.double())
    h64 = d64[3] if h0 is not None else None
    ro, rS = _ref64_per_doc(kind, d64[0], d64[1], d64[2], x64, h64, cu)
    rg = torch.autograd.grad((ro * do.double()).sum() + (rS * dS.double()).sum(), d64)
    names = ["dq", "dk", "dv"] + (["dh0"] if h0 is not None else []) + (["dlog_f"] if kind == "gla" else [])
    errs = {"o": rel(o, ro), "S": rel(S, rS), **{n: rel(a, b) for n, a, b in zip(names, grads, rg)}}
    finite = all(torch.isfinite(t).all() for t in (o, S, *grads))
    return errs, finite


class _nullctx:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


@pytest.mark.parametrize("layout", ["scan", "split"])
@pytest.mark.parametrize("kind,Dk,Dv,gates", [
    ("la", 128, 128, None), ("la", 64, 96, None), ("nodecay", 256, 128, None), ("nodecay", 96, 64, None),
    ("gla", 128, 128, "mixed"), ("gla", 128, 128, "wide"), ("gla", 128, 128, "moderate"), ("gla", 256, 64, "mixed"),
    ("gla", 96, 64, "wide"), ("gla", 128, 128, "floor"),
    # the head widths of the small study sizes (models/sizes.py l1d32 ... l1d96: one head of width d)
    ("la", 32, 32, None), ("la", 48, 48, None), ("nodecay", 96, 96, None), ("gla", 32, 32, "mixed"),
    ("gla", 48, 48, "wide"), ("gla", 96, 96, "mixed"),
])
def test_bf16_vs_float64(kind, Dk, Dv, gates, layout):
    B, T, H = 2, 1000 + 37, 4
    q, k, v, x = _inputs(B, T, H, Dk, Dv, kind, gates or "mixed")
    h0 = torch.randn(B, H, Dk, Dv, device=DEV) * 0.1
    errs, finite = _compare(kind, q, k, v, x, h0, layout)
    print(kind, Dk, Dv, gates, layout, {n: f"{e:.1e}" for n, e in errs.items()})
    assert finite and all(e <= BAR for e in errs.values()), errs


@pytest.mark.parametrize("layout", ["scan", "split"])
@pytest.mark.parametrize("kind,Dk,Dv,gates", [
    ("la", 256, 256, None), ("nodecay", 256, 256, None), ("gla", 512, 128, "wide"), ("gla", 512, 128, "mixed"),
])
def test_widest_heads_vs_float64(kind, Dk, Dv, gates, layout):
    """The widest heads `ops.linear_attention.triton_fits` admits compile (within the GPU's shared memory)
    and keep the accuracy bar."""
    from ops.linear_attention import triton_fits
    assert triton_fits("gated_linear_attn" if kind == "gla" else "lightning_attn", Dk, Dv)
    q, k, v, x = _inputs(1, 1000 + 37, 2, Dk, Dv, kind, gates or "mixed")
    h0 = torch.randn(1, 2, Dk, Dv, device=DEV) * 0.1
    errs, finite = _compare(kind, q, k, v, x, h0, layout)
    assert finite and all(e <= BAR for e in errs.values()), errs


def test_auto_runs_too_wide_heads_on_the_twin():
    """Heads wider than the kernels take run under `auto` (the chunked twin, with a warning) and match
    the float64 reference; impl='triton' refuses them with the fix."""
    from ops import linear_attention as LA
    LA._WARNED.clear()  # a width warns once per process
    q, k, v, x = _inputs(1, 300, 2, 384, 128, "la")
    with pytest.warns(UserWarning, match="auto takes the chunked twin"):
        o = lightning_attn(q, k, v, x)
    ref, _ = R.lightning_attn_chunked(q.double(), k.double(), v.double(), x.double())
    assert rel(o, ref) <= BAR
    with pytest.raises(ValueError, match="more, narrower heads"):
        lightning_attn(q, k, v, x, impl="triton")


@pytest.mark.parametrize("case,gates,layout,D", [
    ("short", "mixed", "scan", 128), ("short", "mixed", "split", 128), ("short", "wide", "scan", 128),
    ("short", "wide", "split", 128), ("short", "mixed", "split", 96), ("short", "wide", "scan", 48),
    ("long", "wide", "auto", 128), ("long", "mixed", "auto", 128), ("long", "-20", "scan", 128),
    ("packed", "wide", "scan", 128), ("packed", "wide", "split", 128),
])
def test_gla_walks_on_bf16_pairs_vs_float64(case, gates, layout, D):
    """GLA's dq / dk walks with their fp32 operand as a bf16 hi + lo pair (`ops.triton_scan.dot_exact`)
    forced on, whichever form is the default (`ops.triton_linear_attn.WALK_PAIRS`): T = 1037 with an
    initial state and a loss on the final state, T = 64K, packed documents."""
    with force_plan(walk_split=True):
        if case == "long":
            q, k, v, x = _inputs(1, 65536, 2, D, D, "gla", gates)
            errs, finite = _compare("gla", q, k, v, x, None, layout, state_loss=False)
        elif case == "packed":
            lens = [1500, 77, 2600, 64, 4100]
            cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), device=DEV)
            q, k, v, x = _inputs(1, sum(lens), 4, D, D, "gla", gates)
            h0 = torch.randn(len(lens), 4, D, D, device=DEV) * 0.1
            errs, finite = _compare("gla", q, k, v, x, h0, layout, cu=cu)
        else:
            q, k, v, x = _inputs(2, 1037, 4, D, D, "gla", gates)
            h0 = torch.randn(2, 4, D, D, device=DEV) * 0.1
            errs, finite = _compare("gla", q, k, v, x, h0, layout)
    print("gla bf16-pair walks", case, gates, layout, D, {n: f"{e:.1e}" for n, e in errs.items()})
    assert finite and all(e <= BAR for e in errs.values()), errs


@pytest.mark.parametrize("level_blocks", [0, 3])
@pytest.mark.parametrize("block", [32, 16])
def test_gla_level_launches_vs_float64(block, level_blocks):
    """The level kernels (every chunk of gates uniform in [-20, 0] is not tame) at each launch the tuning
    table may pick (32- or 16-wide key blocks), a product per level or the pairs inside blocks of 8 rows as
    one (level_blocks=3): T = 1037 with initial states, then packed documents."""
    with force_plan(launch={"A_sub": {"block": block}, "dqk_sub": {"block": block}}, level_blocks=level_blocks):
        q, k, v, x = _inputs(2, 1037, 4, 128, 128, "gla", "wide")
        errs, finite = _compare("gla", q, k, v, x, torch.randn(2, 4, 128, 128, device=DEV) * 0.1, "scan")
        lens = [1500, 77, 2600, 64]
        cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), device=DEV)
        q, k, v, x = _inputs(1, sum(lens), 4, 128, 128, "gla", "wide")
        errs_p, finite_p = _compare("gla", q, k, v, x, torch.randn(4, 4, 128, 128, device=DEV) * 0.1, "split", cu=cu)
    print("gla level launches", block, level_blocks, {n: f"{e:.1e}/{errs_p[n]:.1e}" for n, e in errs.items()})
    assert finite and finite_p and all(e <= BAR for e in [*errs.values(), *errs_p.values()]), (errs, errs_p)


@pytest.mark.parametrize("layout", ["scan", "split"])
@pytest.mark.parametrize("kind", ["la", "gla"])
def test_cached_launches_match_the_jit(kind, layout):
    """ops.triton_launch's cached launches against JITFunction.run: bit-identical outputs and gradients,
    with aligned inputs, then 2-byte-offset (misaligned) views of the same values, then packed input."""
    from ops import triton_launch
    H, D, T = 4, 128, 1037
    q, k, v, x = _inputs(1, T, H, D, D, kind, "mixed")

    def offset(t):  # the same values at a 2-byte offset: contiguous, not 16-byte aligned
        buf = torch.empty(t.numel() + 8, dtype=t.dtype, device=DEV)
        view = buf[1:1 + t.numel()].view(t.shape)
        view.copy_(t)
        return view
    cu = torch.tensor([0, 300, 337, T], device=DEV)
    cases = [(q, k, v, x, None), (offset(q), offset(k), offset(v), x, None), (q, k, v, x, cu)]
    outs = {}
    for enabled in (False, True, True):  # the second True run takes the cached kernels throughout
        triton_launch.ENABLED = enabled
        try:
            res = []
            for qq, kk, vv, xx, cc in cases:
                ins = [t.detach().clone().requires_grad_(True) for t in (qq, kk, vv)]
                xi = xx.detach().clone().requires_grad_(True) if kind == "gla" else xx
                with force_plan(seg_chunks=LAYOUTS[layout]):
                    o, S = _run(kind, *ins, xi, None, cc)
                    grads = torch.autograd.grad((o.float() * o.float().sin()).sum() + S.sum(),
                                                ins + ([xi] if kind == "gla" else []))
                res.append([o, S, *grads])
            outs.setdefault(enabled, []).append(res)
        finally:
            triton_launch.ENABLED = True
    ref = outs[False][0]
    for run in outs[True]:
        for got_case, ref_case in zip(run, ref):
            for a, b in zip(got_case, ref_case):
                assert torch.equal(a, b)


@pytest.mark.parametrize("kind,gates,layout", [
    ("la", None, "auto"), ("nodecay", None, "auto"), ("gla", "wide", "auto"), ("gla", "mixed", "auto"),
    ("gla", "-20", "auto"), ("gla", "near1", "auto"), ("gla", "wide", "scan"), ("gla", "-20", "scan"),
    ("gla", "moderate", "auto"),
])
def test_long_sequence_vs_float64(kind, gates, layout):
    """T = 64K in the layout the shape rule picks (split, at one sequence of two heads), GLA also in the
    scan layout (its d log_f anchors do not depend on the layout): TNL's strongest decays, cos2's undecayed
    sums, GLA gates uniform in [-20, 0] and in [-5, 0], HGRN2-like, at the floor, near 1."""
    B, T, H = 1, 65536, 2
    Dk = 256 if kind == "nodecay" else 128
    q, k, v, x = _inputs(B, T, H, Dk, 128, kind, gates or "mixed")
    errs, finite = _compare(kind, q, k, v, x, None, layout, state_loss=False)
    print(kind, gates, layout, {n: f"{e:.1e}" for n, e in errs.items()})
    assert finite and all(e <= BAR for e in errs.values()), errs


@pytest.mark.parametrize("layout", ["scan", "split"])
@pytest.mark.parametrize("kind", ["la", "gla"])
def test_packed_vs_float64(kind, layout):
    """Packed documents (boundaries inside chunks, one shorter than a chunk) with per-document initial
    states, against float64 run per document."""
    H, D = 4, 128
    lens = [1500, 77, 2600, 64, 4100]
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), device=DEV)
    q, k, v, x = _inputs(1, sum(lens), H, D, D, kind, "wide")
    h0 = torch.randn(len(lens), H, D, D, device=DEV) * 0.1
    errs, finite = _compare(kind, q, k, v, x, h0, layout, cu=cu)
    print(kind, layout, {n: f"{e:.1e}" for n, e in errs.items()})
    assert finite and all(e <= BAR for e in errs.values()), errs


GATES = ("mixed", "wide", "moderate", "-20", "near1")


def _random_case(seed: int) -> dict:
    """A case no other test names: op, head widths (odd and not powers of two among them), batch, length
    (a single token, a chunk and a row either side of one, thousands), packed documents (lengths 1, 63, 64,
    65 and random), heads, dtype, layout (the shape rule or a forced segment length), gates, an initial
    state, a transposed memory layout and a loss on the final state, all drawn from `seed`."""
    from ops.linear_attention import TRITON_MAX_WIDTHS
    rng = random.Random(seed)
    kind = rng.choice(["la", "nodecay", "gla", "gla"])
    mk, mv = TRITON_MAX_WIDTHS["gated_linear_attn" if kind == "gla" else "lightning_attn"]
    widths = [16, 32, 48, 64, 80, 96, 128, 160, 192, 256]
    case = dict(seed=seed, kind=kind, Dk=rng.choice([w for w in widths if w <= mk]),
                Dv=rng.choice([w for w in widths if w <= mv]), H=rng.randint(1, 6),
                dtype=rng.choice([torch.bfloat16, torch.bfloat16, torch.float16, torch.float32]),
                layout=rng.choice(["auto", "scan", 1, 2, 3, 5]), gates=rng.choice(list(GATES)),
                h0=rng.random() < 0.5, transposed=rng.random() < 0.5, state_loss=rng.random() < 0.5)
    if rng.random() < 0.3:
        case["lens"] = [rng.choice([1, 63, 64, 65, rng.randint(1, 3000)]) for _ in range(rng.randint(1, 6))]
        case["B"], case["T"] = 1, sum(case["lens"])
    else:
        case["lens"] = None
        case["B"], case["T"] = rng.randint(1, 3), rng.choice([1, 7, 63, 64, 65, 129, rng.randint(2, 5000)])
    # gates in the inputs' dtype or in fp32, as a model may hand them over; never in fp16, whose range
    # cannot hold d log_f at strong gates (log f = -20: every gradient is about e^-20, below fp16's 6e-8)
    case["gate_dtype"] = rng.choice([torch.float32, case["dtype"]])
    if case["gate_dtype"] == torch.float16:
        case["gate_dtype"] = torch.float32
    return case


@pytest.mark.parametrize("seed", range(24))
def test_random_cases_vs_float64(seed):
    """Randomly drawn cases (`_random_case`) against the float64 twin run per document (`_compare`): o,
    the final state and every gradient within the bar, all finite; inputs in a transposed memory layout
    are read as they lie (`_compare`'s copies keep their strides)."""
    c = _random_case(seed)
    B, T, H, Dk, Dv, kind = c["B"], c["T"], c["H"], c["Dk"], c["Dv"], c["kind"]
    g = torch.Generator(device=DEV).manual_seed(seed)

    def values(*shape):  # [B, T, H, D] values, stored [B, H, T, D] when transposed
        x = torch.randn(*shape, device=DEV, generator=g) * 0.5
        return x.transpose(1, 2).contiguous().transpose(1, 2).to(c["dtype"]) if c["transposed"] else x.to(c["dtype"])

    q, k, v = values(B, T, H, Dk), values(B, T, H, Dk), values(B, T, H, Dv)
    N = B if c["lens"] is None else len(c["lens"])
    h0 = torch.randn(N, H, Dk, Dv, device=DEV, generator=g) * 0.1 if c["h0"] else None
    if kind == "gla":
        x = _gates((B, T, H, Dk), c["gates"], g).to(c["gate_dtype"])
    else:
        x = _decays(H) if kind == "la" else None
    cu = None if c["lens"] is None else torch.tensor([0] + list(torch.tensor(c["lens"]).cumsum(0)), device=DEV)
    one_layout = min(T, H) == 1  # one token or one head: transposed or not, the same memory layout
    assert q.is_contiguous() != c["transposed"] or one_layout
    assert q.clone().is_contiguous() == q.is_contiguous()  # what `_compare` hands the op
    errs, finite = _compare(kind, q, k, v, x, h0, c["layout"], cu=cu, state_loss=c["state_loss"])
    print(c, {n: f"{e:.1e}" for n, e in errs.items()})
    assert finite and all(e <= BAR for e in errs.values()), (c, errs)


def test_rms_norm_bf16():
    from ops.norm import rms_norm, rms_norm_reference
    x = torch.randn(4096, 2048, device=DEV).to(torch.bfloat16).requires_grad_(True)
    w = (torch.rand(2048, device=DEV) + 0.5).requires_grad_(True)
    y = rms_norm(x, w)
    dy = torch.randn_like(y)
    dx, dw = torch.autograd.grad((y.float() * dy).sum(), [x, w])
    x6, w6 = x.detach().double().requires_grad_(True), w.detach().double().requires_grad_(True)
    y6 = rms_norm_reference(x6, w6)
    dx6, dw6 = torch.autograd.grad((y6 * dy.double()).sum(), [x6, w6])
    assert rel(y, y6) < 1e-2 and rel(dx, dx6) < 1e-2 and rel(dw, dw6) < 1e-2


@pytest.mark.parametrize("B,T,H,e,start", [(2, 8192, 12, 128, 0), (1, 65_536, 16, 128, 0),
                                           (16, 2048, 12, 128, 0), (1, 4097, 32, 64, 1_000_000)])
def test_silu_lrpe_bf16(B, T, H, e, start):
    """cosFormer2's fused feature map at the model shapes (1B at 8K, 64K context, 1B at 2K, a 7B-width
    segment deep into a sequence-parallel run) against the float64 twin: outputs, dq, dk, dtheta."""
    from ops.lrpe import silu_lrpe, silu_lrpe_reference
    g = torch.Generator(device=DEV).manual_seed(0)
    q = (torch.randn(B, T, H * e, device=DEV, generator=g) * 2).to(torch.bfloat16).requires_grad_(True)
    k = (torch.randn(B, T, H * e, device=DEV, generator=g) * 2).to(torch.bfloat16).requires_grad_(True)
    theta = (10000.0 ** (-torch.arange(e, device=DEV) / e)).repeat(H, 1).requires_grad_(True)
    t = torch.arange(start, start + T, device=DEV)
    oq, ok = silu_lrpe(q, k, theta, t)
    gq, gk = torch.randn_like(oq), torch.randn_like(ok)
    got = (oq, ok) + torch.autograd.grad((oq.float() * gq).sum() + (ok.float() * gk).sum(), [q, k, theta])
    leaves = [x.detach().double().requires_grad_(True) for x in (q, k, theta)]
    rq, rk = silu_lrpe_reference(*leaves, t)
    want = (rq, rk) + torch.autograd.grad((rq * gq.double()).sum() + (rk * gk.double()).sum(), leaves)
    errs = [rel(a, b) for a, b in zip(got, want)]
    assert all(err <= BAR for err in errs), errs


def test_gpu_ms_times_the_gpu_not_the_host():
    """ops.tuning.gpu_ms, the plan's criterion: a host-bound call (5 ms of host work around a short
    kernel) must time as its short kernel, and a GPU-bound one (a spin of known length) as that spin."""
    import time

    from ops.tuning import gpu_ms
    x = torch.zeros(1 << 20, device="cuda")

    def host_bound():
        time.sleep(0.005)
        x.add_(1.0)

    def spin():
        torch.cuda._sleep(20_000_000)
    spins = []
    for _ in range(5):  # the spin's own length, clocks warmed up by the earlier ones
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        spin()
        e.record()
        e.synchronize()
        spins.append(s.elapsed_time(e))
    hb, sp = gpu_ms(host_bound, calls=4), gpu_ms(spin)
    print(f"host-bound call: {hb:.3f} ms of GPU time; spin {sp:.3f} ms against {spins[-3:]}")
    assert hb < 1.0
    assert sp == pytest.approx(statistics.median(spins[2:]), rel=0.2)
    # a clock calibration far too low (as at idle clocks) makes the first sleeps too short to hide the
    # host: those batches must be run again behind longer sleeps, not counted
    import ops.tuning as tuning
    saved = list(tuning._CYCLES_PER_MS)
    try:
        tuning._CYCLES_PER_MS[:] = [saved[0] / 50]
        assert gpu_ms(host_bound, calls=4) < 1.0
    finally:
        tuning._CYCLES_PER_MS[:] = saved
