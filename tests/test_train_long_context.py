"""Long-context training on CPU: the fused loss (its Triton softmax pass against the twin, its chunking, and
what torch.compile makes of it: one opaque node, no index past int32), activation checkpointing (same
gradients, fewer saved bytes), regional compilation (one graph for all blocks, no graph break in any
architecture), the --compile / --activation-checkpointing flags, compile time kept out of tokens/s, and
the out-of-memory message."""
from __future__ import annotations

import logging
import math
import re

import pytest
import torch
import torch.nn.functional as F

import ops
from ops.cross_entropy import _ce_rows_torch

ARCHS = ["llama", "tnl", "hgrn2", "cos2"]


# ----------------------------------------------------------------------------------------------------
# the fused loss
# ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("V", [300, 5000])  # one block of columns, and two (the second one partial)
def test_loss_rows_kernel_matches_twin_and_reference(V):
    from ops.triton_cross_entropy import ce_rows_triton
    g = torch.Generator().manual_seed(V)
    x = torch.randn(7, V, generator=g) * 4
    t = torch.randint(0, V, (7,), generator=g)
    t[2] = -100
    t[5] = V - 1  # the last column, in the partial block
    scale = torch.tensor([1 / 6])
    a, b = x.clone(), x.clone()
    lse, tgt = ce_rows_triton(a, t, scale, -100, write_grad=True)
    lse_t, tgt_t = _ce_rows_torch(b, t, scale, -100, write_grad=True)
    torch.testing.assert_close(lse, lse_t, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(tgt, tgt_t)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-8)
    # the reference: the gradient of the mean cross-entropy over the 6 valid rows
    xr = x.double().requires_grad_(True)
    F.cross_entropy(xr, t).backward()
    torch.testing.assert_close(a.double(), xr.grad, rtol=1e-5, atol=1e-8)
    torch.testing.assert_close(lse.double(), torch.logsumexp(x.double(), -1), rtol=1e-6, atol=1e-5)


def _ref_loss(h, w, t):
    return F.cross_entropy(h @ w.t(), t) if (t != -100).any() else (h @ w.t()).sum() * 0


@pytest.mark.parametrize("chunk", [1, 7, 50, 64])
def test_fused_loss_chunks_match_full_logits(chunk):
    """Chunk boundaries anywhere (1 row, not dividing N, exactly N, more than N), ignored rows, fp64."""
    g = torch.Generator().manual_seed(chunk)
    h = torch.randn(50, 16, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(100, 16, dtype=torch.float64, generator=g, requires_grad=True)
    t = torch.randint(0, 100, (50,), generator=g)
    t[[0, 7, 49]] = -100
    loss = ops.linear_cross_entropy(h, w, t, chunk_size=chunk)
    (3 * loss).backward()  # the backward scales the gradients it computed in the forward
    h2, w2 = h.detach().clone().requires_grad_(True), w.detach().clone().requires_grad_(True)
    ref = _ref_loss(h2, w2, t)
    (3 * ref).backward()
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(h.grad, h2.grad)
    torch.testing.assert_close(w.grad, w2.grad)
    with torch.no_grad():  # the evaluation path computes no gradient and the same loss
        torch.testing.assert_close(ops.linear_cross_entropy(h, w, t, chunk_size=chunk), loss.detach())


def test_fused_loss_all_ignored_is_zero_with_zero_gradients():
    h = torch.randn(9, 4, requires_grad=True)
    w = torch.randn(11, 4, requires_grad=True)
    loss = ops.linear_cross_entropy(h, w, torch.full((9,), -100), chunk_size=4)
    loss.backward()
    assert float(loss.detach()) == 0.0 and float(h.grad.abs().max()) == 0.0 and float(w.grad.abs().max()) == 0.0


def test_fused_loss_rejects_bad_shapes():
    with pytest.raises(ValueError, match="must share d"):
        ops.linear_cross_entropy(torch.randn(3, 4), torch.randn(5, 6), torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="chunk_size"):
        ops.linear_cross_entropy(torch.randn(3, 4), torch.randn(5, 4), torch.zeros(3, dtype=torch.long), chunk_size=0)


def test_compiled_loss_is_one_opaque_node_and_matches_eager():
    torch._dynamo.reset()
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    g = torch.Generator().manual_seed(0)
    h0, w0 = torch.randn(40, 8, generator=g), torch.randn(30, 8, generator=g)
    t = torch.randint(0, 30, (40,), generator=g)

    def run(fn):
        h, w = h0.clone().requires_grad_(True), w0.clone().requires_grad_(True)
        loss = fn(h, w, t)
        loss.backward()
        return loss.detach(), h.grad, w.grad

    eager = run(lambda h, w, t: ops.linear_cross_entropy(h, w, t, chunk_size=16))
    compiled = run(torch.compile(lambda h, w, t: ops.linear_cross_entropy(h, w, t, chunk_size=16),
                                 backend=capture, fullgraph=True))
    for a, b in zip(compiled, eager):
        torch.testing.assert_close(a, b)
    targets = [str(n.target) for n in graphs[0].graph.nodes if n.op == "call_function"]
    assert sum("linear_cross_entropy" in x for x in targets) == 1, targets
    assert not any("matmul" in x or "gather" in x or "logsumexp" in x for x in targets), targets


def test_compiled_loss_has_no_index_past_int32_at_32k_tokens():
    """The crash, checked where it was made: Inductor's generated code for the loss at 32,768 tokens x
    100,280 classes (fake tensors, code generation only). The chunked loss written as plain tensor code
    gave a kernel over all rows with address constants up to -2,875,228,160 (computed in int32 on CUDA:
    an illegal memory access); as a custom op nothing of it reaches Inductor."""
    from functorch.compile import make_boxed_func
    from torch._functorch.aot_autograd import aot_module_simplified
    from torch._inductor.compile_fx import compile_fx_inner
    from torch._inductor.decomposition import select_decomp_table
    from torch._subclasses.fake_tensor import FakeTensorMode
    torch._dynamo.reset()
    sources = []

    def codegen_only(gm, example_inputs):  # let Inductor write its code, then run the graph as it is
        sources.append(getattr(compile_fx_inner(gm, example_inputs), "source_code", "") or "")
        return make_boxed_func(gm.forward)

    def backend(gm, example_inputs):
        return aot_module_simplified(gm, example_inputs, fw_compiler=codegen_only, bw_compiler=codegen_only,
                                     decompositions=select_decomp_table())

    N, d, V = 32768, 16, 100_280
    with FakeTensorMode(allow_non_fake_inputs=True):
        h = torch.randn(N, d, requires_grad=True)
        w = torch.randn(V, d, requires_grad=True)
        t = torch.randint(0, V, (N,))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = torch.compile(ops.linear_cross_entropy, backend=backend, fullgraph=True)(h, w, t)
        loss.backward()
    assert len(sources) == 2 and all(sources)  # forward and backward were generated
    constants = [abs(int(x)) for x in re.findall(r"(?<![\w.])-?\d{10,}", "\n".join(sources))]
    assert max(constants, default=0) < 2**31


# ----------------------------------------------------------------------------------------------------
# activation checkpointing and regional compilation
# ----------------------------------------------------------------------------------------------------

def _tiny(arch, n_layers=4):
    from models import build_model
    torch.manual_seed(0)
    return build_model(arch, "tiny", vocab_size=256, n_layers=n_layers)


def _saved_bytes_and_grads(model, ids):
    saved = []

    def pack(t):
        saved.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(ids, targets=ids)
    return sum(saved), loss.detach(), torch.autograd.grad(loss, list(model.parameters()))


@pytest.mark.parametrize("arch", ARCHS)
def test_activation_checkpointing_same_gradients_fewer_saved_bytes(arch):
    model = _tiny(arch)
    ids = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(0))
    results = {}
    for mode, frac in [("none", 1.0), ("mlp", 1.0), ("full", 0.5), ("full", 1.0)]:
        chosen = model.set_activation_checkpointing(mode, frac)
        assert len(chosen) == {("none", 1.0): 0, ("mlp", 1.0): 4, ("full", 0.5): 2, ("full", 1.0): 4}[(mode, frac)]
        results[(mode, frac)] = _saved_bytes_and_grads(model, ids)
    base_bytes, base_loss, base_grads = results[("none", 1.0)]
    for key, (nbytes, loss, grads) in results.items():
        torch.testing.assert_close(loss, base_loss, rtol=0, atol=0)
        # a fully checkpointed cos2 / HGRN2 block takes autograd's backward of the same forward ops
        # instead of the hand-written one: equal up to fp32 rounding
        plain = key[0] == "full" and arch in ("cos2", "hgrn2")
        tol = dict(rtol=1e-4, atol=1e-6) if plain else dict(rtol=1e-6, atol=1e-7)
        for a, b in zip(grads, base_grads):
            torch.testing.assert_close(a, b, **tol)
    b = {k: v[0] for k, v in results.items()}
    assert b[("full", 1.0)] < b[("full", 0.5)] < b[("none", 1.0)]
    assert b[("mlp", 1.0)] < b[("none", 1.0)]
    model.eval()  # never while evaluating or decoding
    assert _saved_bytes_and_grads(model, ids)[0] == base_bytes


@pytest.mark.parametrize("arch", ["cos2", "hgrn2"])
def test_fully_checkpointed_blocks_use_the_plain_forms(arch):
    """A compiled checkpointed block would keep the inputs of a hand-written autograd.Function: the
    token mixers of cos2 and HGRN2 learn from their block when it recomputes itself, and only then."""
    model = _tiny(arch)
    chosen = model.set_activation_checkpointing("full", 0.5)
    assert [b.token_mixer.recomputed for b in model.blocks] == [i in chosen for i in range(len(model.blocks))]
    model.set_activation_checkpointing("mlp", 1.0)
    assert not any(b.token_mixer.recomputed for b in model.blocks)
    model.set_activation_checkpointing("full", 1.0)
    assert all(b.token_mixer.recomputed for b in model.blocks)
    model.set_activation_checkpointing("none")
    assert not any(b.token_mixer.recomputed for b in model.blocks)


def test_checkpointed_blocks_spread_over_the_depth():
    model = _tiny("llama", n_layers=8)
    assert model.set_activation_checkpointing("full", 0.5) == [1, 3, 5, 7]
    assert model.set_activation_checkpointing("mlp", 0.25) == [3, 7]
    assert model.set_activation_checkpointing("none") == [] and not model.gradient_checkpointing
    model.gradient_checkpointing = True
    assert all(b.recompute == "full" for b in model.blocks)
    with pytest.raises(ValueError, match="choose from"):
        model.set_activation_checkpointing("selective")


def _graph_break_log():
    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    torch._logging.set_logs(graph_breaks=True)
    handler = Keep()
    logging.getLogger("torch._dynamo").addHandler(handler)
    return records, handler


@pytest.mark.parametrize("arch,impl", [(a, "auto") for a in ARCHS] + [("tnl", "triton"), ("hgrn2", "triton")])
def test_regional_compile_one_graph_no_graph_break(arch, impl):
    """TrainModule.compile compiles each block: all blocks share one graph (TNL's decays are inputs), no
    graph break (the TORCH_LOGS=graph_breaks log stays empty), the gradients equal eager ones. The whole
    model also compiles as one graph (fullgraph=True raises on a break), as a whole-module compile would.
    impl 'triton' runs the Triton ops (under the interpreter on CPU), as a GPU does: their custom ops
    return tensors of data-dependent length (the forward's per-segment states for the backward), which
    a regional compile without fullgraph=True must still keep inside its one graph."""
    if impl == "triton":
        pytest.importorskip("triton")
    from torch._dynamo.utils import counters

    from ops import set_default_impl
    from pretrain.config import OptimConfig
    from pretrain.grad_accumulation import expose
    from pretrain.train_module import TorchTrainModule
    # one sequence and three blocks keep the interpreted kernels' launches few (each costs ~0.2-0.4 s on CPU)
    ids = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(0))
    model = _tiny(arch, n_layers=3)
    # two kinds of block, two graphs: blocks 0 and 2 share the plain one (TNL's decays differ between them)
    assert model.set_activation_checkpointing("mlp", 0.5) == [1]
    set_default_impl(impl)
    records, handler = _graph_break_log()
    try:
        loss = model(ids, targets=ids)
        ref = torch.autograd.grad(loss, list(model.parameters()))
        torch._dynamo.reset()
        counters.clear()
        module = TorchTrainModule(model, OptimConfig(), torch.device("cpu"), "fp32")  # weight grads fused
        module.compile(backend="aot_eager")
        loss2 = model(ids, targets=ids)
        loss2.backward()
        expose(module.fused_grads)
        got = [p.grad for p in model.parameters()]
        assert counters["stats"]["unique_graphs"] == 2
        torch._dynamo.reset()
        whole = torch.compile(_tiny(arch, n_layers=3), backend="aot_eager", fullgraph=True)
        whole(ids, targets=ids).backward()
    finally:
        set_default_impl("auto")
        logging.getLogger("torch._dynamo").removeHandler(handler)
        torch._logging.set_logs()
        torch._dynamo.reset()
    assert sum(counters["graph_break"].values()) == 0 and not [r for r in records if "break" in r.lower()], records
    torch.testing.assert_close(loss2, loss)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


# ----------------------------------------------------------------------------------------------------
# flags, compile time in the log, out-of-memory message
# ----------------------------------------------------------------------------------------------------

def test_compile_and_checkpointing_flags():
    from pretrain.config import parse_config, resolve_compile
    cfg = parse_config(["--size", "70m"])
    assert cfg.train.compile == "auto" and cfg.train.activation_checkpointing == "none"
    assert resolve_compile(cfg, "cuda") and not resolve_compile(cfg, "cpu")
    assert resolve_compile(parse_config(["--size", "70m", "--zero", "2"]), "cuda")  # ZeRO-1/2: regional, on
    assert resolve_compile(parse_config(["--size", "70m", "--zero", "1"]), "cuda")
    assert not resolve_compile(parse_config(["--size", "70m", "--zero", "2"]), "cpu")
    assert resolve_compile(parse_config(["--size", "70m", "--zero", "3"]), "cuda")  # ZeRO-3: per block too
    assert resolve_compile(parse_config(["--size", "70m", "--zero", "3", "--compile"]), "cuda")
    assert not resolve_compile(parse_config(["--size", "70m", "--zero", "3"]), "cpu")
    assert resolve_compile(parse_config(["--size", "70m", "--zero", "2", "--compile"]), "cuda")
    assert not resolve_compile(parse_config(["--size", "70m", "--no-compile"]), "cuda")
    assert resolve_compile(parse_config(["--size", "70m", "--compile"]), "cpu")
    assert parse_config(["--size", "70m", "--compile", "false"]).train.compile == "false"
    assert parse_config(["--activation-checkpointing"]).train.activation_checkpointing == "full"
    c = parse_config(["--activation-checkpointing", "mlp", "--ac-fraction", "0.5"])
    assert (c.train.activation_checkpointing, c.train.ac_fraction) == ("mlp", 0.5)
    assert parse_config(["--activation-checkpointing", "true"]).train.activation_checkpointing == "full"
    assert parse_config(["--activation-checkpointing", "auto"]).train.activation_checkpointing == "auto"
    with pytest.raises(ValueError, match="choose one of none, mlp, full, auto"):
        parse_config(["--activation-checkpointing", "selective"])
    with pytest.raises(ValueError, match="ac-fraction"):
        parse_config(["--ac-fraction", "0"])


def test_yaml_checkpointing_switch_still_works(tmp_path):
    from pretrain.config import parse_config
    p = tmp_path / "run.yaml"
    p.write_text("train: {activation_checkpointing: true, compile: false}\n")
    cfg = parse_config(["--config", str(p)])
    assert cfg.train.activation_checkpointing == "full" and cfg.train.compile == "false"


def _flags(tmp_path, arch="tnl"):
    from checkpoint_utils import VOCAB, make_dataset
    data = make_dataset(tmp_path / "data", docs=40)
    return ["--arch", arch, "--size", "tiny", "--model", f"vocab_size={VOCAB}", "--model", "n_layers=2",
            "--data", str(data), "--seq-len", "16", "--global-batch-tokens", "64", "--micro-batch", "2",
            "--max-steps", "4", "--log-every", "2", "--eval-every", "0", "--save-every", "0",
            "--out", str(tmp_path / "run")]


def test_compile_time_is_logged_and_kept_out_of_tokens_per_s(tmp_path, monkeypatch, capsys):
    import json

    from pretrain.train_module import TorchTrainModule
    real = TorchTrainModule.compile
    monkeypatch.setattr(TorchTrainModule, "compile", lambda self: real(self, backend="aot_eager"))
    from pretrain.config import parse_config
    from pretrain.trainer import Trainer
    torch._dynamo.reset()
    trainer = Trainer(parse_config(_flags(tmp_path) + ["--compile"]))
    trainer.fit()
    torch._dynamo.reset()
    out = capsys.readouterr().out
    assert "torch.compile: on" in out and "step 1: torch.compile built 1 graph(s)" in out
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["step"] == 2 and rows[0]["compile_s"] > 0
    # the first interval's rate is step 2's alone: its time is below the compile step's
    assert rows[0]["step_time_s"] < rows[0]["compile_s"]
    assert math.isclose(rows[0]["tokens_per_s"] * rows[0]["step_time_s"], trainer.tokens_per_step, rel_tol=1e-9)
    assert rows[1]["compile_s"] == rows[0]["compile_s"]  # nothing compiled after step 1


def _out_of_memory_in(method: str, flags: list[str], monkeypatch, capsys) -> tuple[int, str]:
    """(exit code, stderr) of a run whose TorchTrainModule.`method` runs out of memory."""
    from pretrain import trainer as trainer_mod
    from pretrain.train_module import TorchTrainModule

    def oom(self, *a, **k):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 24.00 GiB")

    monkeypatch.setattr(TorchTrainModule, method, oom)
    code = trainer_mod.main(flags)
    return code, capsys.readouterr().err


def test_out_of_memory_names_the_settings(tmp_path, monkeypatch, capsys):
    code, err = _out_of_memory_in("train_step", _flags(tmp_path, "llama") + ["--micro-batch", "4", "--no-compile"],
                                  monkeypatch, capsys)
    assert code == 3
    assert "out of memory in step 1" in err and "--seq-len 16 x --micro-batch 4 = 64 tokens" in err
    assert "--micro-batch (e.g. 2" in err and "--activation-checkpointing full" in err
    assert "Tried to allocate 24.00 GiB" in err and "Traceback" not in err
    # a share of the blocks is named by its blocks, as the auto log line names them
    from pretrain.config import parse_config
    from pretrain.trainer import out_of_memory_message
    cfg = parse_config(_flags(tmp_path, "tnl") + ["--no-compile"])
    msg = out_of_memory_message(cfg, torch.device("cpu"), 0, "full", 0.5)
    assert "(activation checkpointing full on 1 of 2 blocks)" in msg


def test_out_of_memory_in_the_evaluation_names_the_settings(tmp_path, monkeypatch, capsys):
    """The evaluation after a step runs out of memory the same way: one line, exit 3, no traceback."""
    code, err = _out_of_memory_in("eval_loss", _flags(tmp_path, "tnl") + ["--no-compile", "--eval-every", "2"],
                                  monkeypatch, capsys)
    assert code == 3
    assert "out of memory in step 2" in err and "Tried to allocate 24.00 GiB" in err and "Traceback" not in err


# ----------------------------------------------------------------------------------------------------
# the memory estimate behind --activation-checkpointing auto, and the benchmark's report
# ----------------------------------------------------------------------------------------------------

# peak GiB allocated, measured on an H100 80GB (launch/bench_train.py, compiled, bf16; the JSONs under
# docs/bench_train), to 0.1 GiB: 410m and 1B, one to four sequences of 2K-8K and one of 32K or 64K a
# micro-batch, with none, the MLP or a share of the blocks checkpointed (at 32K and 64K both the shares
# auto takes now and the larger ones, in eighths, of a more cautious estimate)
MEASURED = [
    ('tnl', '410m', 8192, 'none', 1.0, 18.0), ('tnl', '410m', 16384, 'none', 1.0, 26.3),
    ('tnl', '410m', 32768, 'none', 1.0, 43.4), ('tnl', '410m', 65536, 'full', 3 / 25, 69.4),
    ('tnl', '410m', 65536, 'full', 0.5, 46.0), ('tnl', '1b', 8192, 'full', 1.0, 20.2),
    ('tnl', '1b', 8192, 'none', 1.0, 36.3), ('tnl', '1b', 16384, 'full', 1.0, 21.9),
    ('tnl', '1b', 16384, 'mlp', 1.0, 37.6), ('tnl', '1b', 16384, 'none', 1.0, 52.5),
    ('tnl', '1b', 32768, 'full', 0.25, 70.0), ('tnl', '1b', 32768, 'full', 0.5, 55.2),
    ('tnl', '1b', 32768, 'mlp', 1.0, 56.3), ('tnl', '1b', 65536, 'full', 22 / 32, 66.8),
    ('tnl', '1b', 65536, 'full', 0.875, 44.9),
    ('llama', '410m', 8192, 'none', 1.0, 16.8), ('llama', '410m', 16384, 'none', 1.0, 23.8),
    ('llama', '410m', 32768, 'none', 1.0, 38.3), ('llama', '410m', 65536, 'full', 0.25, 53.8),
    ('llama', '410m', 65536, 'none', 1.0, 65.4), ('llama', '1b', 8192, 'none', 1.0, 33.1),
    ('llama', '1b', 16384, 'none', 1.0, 46.0), ('llama', '1b', 32768, 'full', 2 / 32, 69.3),
    ('llama', '1b', 32768, 'full', 0.375, 54.7), ('llama', '1b', 65536, 'full', 19 / 32, 67.7),
    ('llama', '1b', 65536, 'full', 0.75, 53.4),
    ('hgrn2', '410m', 8192, 'none', 1.0, 19.4), ('hgrn2', '410m', 16384, 'none', 1.0, 28.8),
    ('hgrn2', '410m', 32768, 'none', 1.0, 47.9), ('hgrn2', '410m', 65536, 'full', 7 / 26, 67.1),
    ('hgrn2', '410m', 65536, 'full', 0.5, 51.0), ('hgrn2', '1b', 8192, 'none', 1.0, 37.8),
    ('hgrn2', '1b', 16384, 'none', 1.0, 55.3), ('hgrn2', '1b', 32768, 'full', 11 / 32, 68.2),
    ('hgrn2', '1b', 32768, 'full', 0.5, 58.0), ('hgrn2', '1b', 65536, 'full', 23 / 32, 66.6),
    ('hgrn2', '1b', 65536, 'full', 0.875, 46.6),
    ('cos2', '410m', 8192, 'none', 1.0, 19.0), ('cos2', '410m', 16384, 'none', 1.0, 28.2),
    ('cos2', '410m', 32768, 'none', 1.0, 47.7), ('cos2', '410m', 65536, 'full', 7 / 25, 66.5),
    ('cos2', '410m', 65536, 'full', 0.5, 51.4), ('cos2', '1b', 8192, 'none', 1.0, 38.1),
    ('cos2', '1b', 16384, 'none', 1.0, 56.4), ('cos2', '1b', 32768, 'full', 0.375, 68.2),
    ('cos2', '1b', 32768, 'full', 0.625, 51.8), ('cos2', '1b', 65536, 'full', 0.75, 66.0),
    ('cos2', '1b', 65536, 'full', 0.875, 49.9),
    # four sequences of 8192 a micro-batch, the fused weight-gradient projections on (docs/bench_train/
    # h100-ac-fused-projections-after)
    ('tnl', '1b', 32768, 'full', 1.0, 25.0), ('tnl', '1b', 32768, 'full', 0.5, 54.6),
    ('cos2', '1b', 32768, 'full', 1.0, 26.1),
    # the same, `auto`'s choice (docs/bench_train/h100-ac-auto-4x8192)
    ('tnl', '1b', 32768, 'full', 8 / 32, 69.5), ('hgrn2', '1b', 32768, 'full', 11 / 32, 67.6),
    ('cos2', '1b', 32768, 'full', 12 / 32, 67.0),
]


@pytest.mark.parametrize("arch,size,tokens,mode,fraction,measured", MEASURED)
def test_memory_estimate_is_a_close_upper_bound(arch, size, tokens, mode, fraction, measured):
    """Never below a measured peak (auto must not pick a setting that runs out of memory), and at most
    12% above it (auto must not checkpoint more blocks than it needs)."""
    from models import model_config
    from pretrain.memory import estimate_peak_gib
    est = estimate_peak_gib(model_config(arch, size), tokens, mode, fraction)
    assert measured - 0.1 <= est <= 1.12 * measured


# rank 0's peak GiB allocated under DeepSpeed ZeRO, compiled per block, bf16 (launch/bench_multi_gpu.py on
# H200s; docs/bench_multi_gpu/h200-zero12-per-block, h200-zero3-1gpu/compiled, h200-x2): arch, size,
# tokens a micro-batch, stage, data-parallel ranks, measured
ZERO_MEASURED = [
    ('tnl', '1b', 16384, 1, 1, 63.94), ('llama', '1b', 16384, 1, 1, 57.38),
    ('tnl', '1b', 16384, 2, 1, 60.88), ('llama', '1b', 16384, 2, 1, 55.40), ('llama', '1b', 16384, 2, 2, 47.51),
    ('tnl', '1b', 16384, 3, 1, 59.28), ('llama', '1b', 16384, 3, 1, 52.72),
    ('tnl', '1b', 32768, 3, 2, 84.88), ('llama', '1b', 32768, 3, 2, 72.61), ('tnl', '7b', 8192, 3, 2, 133.12),
]


@pytest.mark.parametrize("arch,size,tokens,zero,ranks,measured", ZERO_MEASURED)
def test_memory_estimate_under_zero_is_a_close_upper_bound(arch, size, tokens, zero, ranks, measured):
    """Under ZeRO too the estimate never falls below a measured peak, and stays within 15% above it (the 7B
    cell, whose blocks' activations are extrapolated from 410m and 1B, is the loosest)."""
    from models import model_config
    from pretrain.memory import estimate_peak_gib
    est = estimate_peak_gib(model_config(arch, size), tokens, zero=zero, ranks=ranks)
    assert measured <= est <= 1.15 * measured


def test_zero_state_shrinks_with_ranks_and_auto_follows():
    from models import model_config
    from pretrain.memory import STATE_BYTES_PER_PARAM, choose_checkpointing, state_bytes_per_param
    assert state_bytes_per_param() == STATE_BYTES_PER_PARAM
    for zero in (1, 2, 3):
        per = [state_bytes_per_param(zero, n) for n in (1, 2, 4, 8, 64)]
        assert per == sorted(per, reverse=True) and per[0] > STATE_BYTES_PER_PARAM > per[-1]
    # every stage splits at least the fp32 master weights and Adam's moments
    assert all(state_bytes_per_param(z, 1) - state_bytes_per_param(z, 2) >= 6 for z in (1, 2, 3))
    with pytest.raises(ValueError, match="zero stage"):
        state_bytes_per_param(4, 2)
    with pytest.raises(ValueError, match="ranks"):
        state_bytes_per_param(3, 0)
    # TNL 7B at 8K on 141 GB GPUs: the whole optimizer state on one rank needs checkpointing; ZeRO-3
    # over 8 ranks fits without
    cfg, budget = model_config("tnl", "7b"), 0.9 * 139.8
    assert choose_checkpointing(cfg, 8192, budget)[0] == "full"
    assert choose_checkpointing(cfg, 8192, budget, zero=3, ranks=8) == ("none", 1.0)


def test_auto_checkpointing_takes_the_cheapest_setting_that_fits():
    from models import model_config
    from pretrain.memory import choose_checkpointing, estimate_peak_gib
    cfg = model_config("tnl", "1b")
    budget = 0.9 * 79.1  # an H100 80GB
    assert choose_checkpointing(cfg, 8192, budget) == ("none", 1.0)
    mode, f32 = choose_checkpointing(cfg, 32768, budget)
    _, f64 = choose_checkpointing(cfg, 65536, budget)
    assert mode == "full" and 0 < f32 < f64 <= 1.0
    l = cfg.n_layers
    for tokens, f in ((32768, f32), (65536, f64)):  # the fewest whole blocks: one fewer does not fit
        k = round(f * l)
        assert f == k / l and estimate_peak_gib(cfg, tokens, "full", f) <= budget
        assert estimate_peak_gib(cfg, tokens, "full", (k - 1) / l) > budget
    assert choose_checkpointing(cfg, 10**7, budget) == ("full", 1.0)  # nothing fits: the most it can do


def test_checkpointed_blocks_are_exactly_the_share_asked_for():
    """k / n of n blocks checkpoints exactly k of them, spread over the depth, for every k and n (a float
    product landing just below k must not drop a block); halves are every second block."""
    from models.lm import checkpointed_blocks
    for n in range(1, 65):
        for k in range(n + 1):
            chosen = checkpointed_blocks(n, k / n)
            assert len(chosen) == k and chosen == sorted(set(chosen)) and all(0 <= i < n for i in chosen)
            gaps = [b - a for a, b in zip(chosen, chosen[1:])]
            assert not gaps or max(gaps) - min(gaps) <= 1  # evenly spread
    assert checkpointed_blocks(32, 0.5) == list(range(1, 32, 2))
    assert checkpointed_blocks(32, 1.0) == list(range(32))


def test_larger_micro_batch_that_fits_keeps_the_global_batch():
    """The hint before the first step: the largest micro-batch that fits without checkpointing and divides
    the step's sequences, against a brute-force search; at 1B/8K on an H100 it is 2 of 8 (measured: 16K
    tokens a micro-batch peak at 52-56 GiB, 32K would need about 90)."""
    from models import model_config
    from pretrain.memory import estimate_peak_gib, larger_micro_batch
    budget = 0.9 * 79.1

    def reference(cfg, seq, micro, accum):
        fits = [micro * k for k in range(2, accum + 1) if accum % k == 0
                and estimate_peak_gib(cfg, micro * k * seq) <= budget]
        return max(fits) if fits else None

    for arch in ("tnl", "llama", "hgrn2", "cos2"):
        big = model_config(arch, "1b")
        assert larger_micro_batch(big, 8192, 1, 8, budget) == 2
        assert estimate_peak_gib(big, 4 * 8192) > budget
        assert larger_micro_batch(big, 8192, 1, 1, budget) is None      # one micro-batch a step already
        assert larger_micro_batch(big, 8192, 2, 4, budget) is None      # 4 x 8192 does not fit
        assert larger_micro_batch(big, 65536, 1, 8, budget) is None     # even 2 x 64K needs checkpointing
        for size in ("410m", "1b"):
            cfg = model_config(arch, size)
            for seq, micro, accum in [(8192, 1, 8), (8192, 1, 3), (2048, 4, 6), (2048, 1, 16), (4096, 3, 5)]:
                assert larger_micro_batch(cfg, seq, micro, accum, budget) == reference(cfg, seq, micro, accum)


def test_trainer_names_a_larger_micro_batch_before_the_first_step(monkeypatch, capsys):
    """On an 80 GB GPU, TNL 1B at 8K with --micro-batch 1 is told that 2 fits without checkpointing, under
    ZeRO as well; with 2 (or with checkpointing asked for) nothing is said."""
    import types

    import torch

    from models import model_config
    from pretrain.config import parse_config
    from pretrain.trainer import Trainer
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: types.SimpleNamespace(total_memory=int(79.1 * 2**30)))

    def hint(*flags, accum):
        cfg = parse_config(["--arch", "tnl", "--size", "1b", "--seq-len", "8192", "--global-batch-tokens",
                            str(8 * 8192), *flags])
        run = types.SimpleNamespace(cfg=cfg, model_cfg=model_config("tnl", "1b"), accum=accum,
                                    env=types.SimpleNamespace(world_size=1))
        capsys.readouterr()
        setting = Trainer._checkpointing(run, torch.device("cuda"))
        return setting, [ln for ln in capsys.readouterr().out.splitlines() if "would also fit" in ln]

    setting, lines = hint("--micro-batch", "1", accum=8)
    assert setting == ("none", 1.0) and len(lines) == 1 and "--micro-batch 2 would also fit" in lines[0]
    assert hint("--micro-batch", "2", accum=4)[1] == []
    assert hint("--micro-batch", "1", "--activation-checkpointing", "full", accum=8)[1] == []
    # under ZeRO too, with the engine's own state counted
    setting, lines = hint("--micro-batch", "1", "--zero", "3", accum=8)
    assert len(lines) == 1 and "--micro-batch 2 would also fit" in lines[0]
    assert hint("--micro-batch", "2", "--zero", "2", accum=4)[1] == []


def test_fit_warning_names_a_setting_that_fits():
    """A setting whose estimate exceeds the GPU gets a warning before the first step, naming what auto
    would take there (and that setting's estimate fits); one that fits gets none; a micro-batch that fits
    under no checkpointing is told to shrink, with --sp only for the models that can split a sequence."""
    from models import model_config
    from pretrain.memory import estimate_peak_gib, fit_warning
    gib = 79.1
    llama, tnl = model_config("llama", "1b"), model_config("tnl", "1b")
    assert fit_warning(tnl, 8192, "none", 1.0, gib) is None
    assert fit_warning(llama, 65536, "full", 1.0, gib) is None
    msg = fit_warning(llama, 65536, "none", 1.0, gib)
    est = estimate_peak_gib(llama, 65536)
    assert f"estimated peak {est:.0f} GiB" in msg and "checkpointing off" in msg and "65,536 tokens" in msg
    m = re.search(r"auto \(here: full on (\d+) of 32 blocks, estimated (\d+) GiB\)", msg)
    assert m and int(m.group(2)) <= 0.9 * gib and 0 < int(m.group(1)) < 32
    big = fit_warning(llama, 2**20, "full", 1.0, gib)
    assert "Even with every block checkpointed" in big and "--micro-batch" in big and "--sp" not in big
    assert "--sp N" in fit_warning(tnl, 2**20, "full", 1.0, gib)


def test_fit_warning_names_zero3_where_the_state_alone_does_not_fit():
    """TNL 7B on one 80 GB GPU: its weights, gradients and optimizer state alone exceed the budget, so no
    micro-batch or sequence length fits; the warning says so and names ZeRO-3 with the fewest ranks
    (a power of two) that fit, by the documented constants: 16.5 bytes a parameter on the plain path,
    16.5 + 6.5 - 14.5 (1 - 1/r) under ZeRO-3 on r ranks, 4 d bytes a token per checkpointed block, the
    loss's buffers, 1.5 GiB."""
    from models import exact_params, model_config
    from pretrain.memory import fit_warning
    gib, tokens = 79.1, 8192
    cfg = model_config("tnl", "7b")
    P, d, l, v = exact_params(cfg)["total"], cfg.d_model, cfg.n_layers, cfg.vocab_size

    def hand(bytes_per_param: float, tok: int) -> float:
        return (bytes_per_param * P + tok * (l * 4 * d + 4 * d) + 4096 * v * 2 + v * d * 8) / 2**30 + 1.5
    assert hand(16.5, 0) > 0.9 * gib  # the premise: no token count fits without sharding
    ranks = next(r for r in (2 ** i for i in range(11)) if hand(16.5 + 6.5 - 14.5 * (1 - 1 / r), tokens) <= 0.9 * gib)
    for zero, dp in ((0, 1), (3, 2)):
        msg = fit_warning(cfg, tokens, "none", 1.0, gib, zero, dp)
        assert "cannot fit" in msg and "--zero 3 over more GPUs" in msg, msg
        assert f"on {ranks} data-parallel ranks" in msg, msg
        assert "use fewer tokens" not in msg and "\n" not in msg
    # where the tokens are what does not fit, fewer tokens stay the advice
    assert "use fewer tokens" in fit_warning(model_config("tnl", "1b"), 2**20, "full", 1.0, gib)


def test_bench_report_ratios_and_flatness(tmp_path):
    import json
    import sys
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1] / "launch"))
    import bench_train

    def cell(arch, seq, tps, ac="none", status="ok", name=None, **extra):
        r = {"arch": arch, "size": "1b", "seq": seq, "tokens_per_step": 65536, "micro_batch": max(1, 8192 // seq),
             "accumulation": 65536 // max(seq, 8192), "status": status, "ac": ac, "ac_fraction": 1.0,
             "tokens_per_s": tps, "mfu": 0.4, "peak_gib": 30.0, "device": "GPU", "date": "d", "commit": "c",
             "attempts": [{"ac": ac, "status": status, "first_step_s": 12.0}]}
        r.update(extra)
        (tmp_path / f"{name or f'{arch}-{seq}'}.json").write_text(json.dumps(r))

    cell("llama", 8192, 40000.0, graph_breaks=0)
    cell("tnl", 8192, 50000.0, graph_breaks=6)
    cell("tnl", 32768, 45000.0, ac="full")
    cell("tnl", 65536, 40000.0, ac="full", ac_fraction=11 / 32)  # the share auto chose: shown as blocks
    # 2 x 8192 tokens a micro-batch: compared with LLaMA at 2 x 8192, not at 1 x 8192
    for arch, tps in (("llama", 44000.0), ("tnl", 66000.0)):
        cell(arch, 8192, tps, micro_batch=2, accumulation=4, micro_tokens=16384, name=f"{arch}-8192-m16384")
    text = bench_train.report(tmp_path)
    assert "| tnl | 1b | 8192 | 1 x 8 | none | 50.0k | 40.0% | 30.0 | 1.250x | 12 | 6 | d |" in text
    assert "| llama | 1b | 8192 | 1 x 8 | none | 40.0k | 40.0% | 30.0 | 1.000x | 12 | 0 | d |" in text
    assert "| tnl | 1b | 8192 | 2 x 4 | none | 66.0k | 40.0% | 30.0 | 1.500x | 12 | ? | d |" in text
    assert "| llama | 1b | 8192 | 2 x 4 | none | 44.0k | 40.0% | 30.0 | 1.000x | 12 | ? | d |" in text
    lines = text.splitlines()
    assert lines.index(next(ln for ln in lines if "| 1 x 8 |" in ln and "| tnl |" in ln)) < lines.index(
        next(ln for ln in lines if "| 2 x 4 |" in ln and "| llama |" in ln))  # grouped by micro-batch
    # no LLaMA at 32K; no graph-break count recorded
    assert "| tnl | 1b | 32768 | 1 x 2 | full | 45.0k | 40.0% | 30.0 | - | 12 | ? | d |" in text
    assert "| arch | size | 8192 | 32768 | 65536 |" in text
    # flatness: each length's fastest cell (here 8K at 2 x 4) is the reference
    assert "| tnl | 1b | 1.00 (none, 2 x 4) | 0.68 (full, 1 x 2) | 0.61 (full 11/32, 1 x 1) |" in text
    assert "| tnl | 1b | 65536 | 1 x 1 | full 11/32 | 40.0k |" in text


def _bench_train():
    from launch_utils import load_launch_script
    return load_launch_script("bench_train")


def test_bench_ops_options_name_their_cells_and_their_llama(tmp_path):
    """`--ops` (an A/B of a kernel option end to end): parsed into OpsConfig fields, refused with the
    fields it takes, part of the cell's name and shown in the report, where each cell is compared with
    the LLaMA cell of its own options if there is one, else with the default one."""
    import json
    bench = _bench_train()
    assert bench.parse_ops("side_streams=false,impl=triton") == {"side_streams": False, "impl": "triton"}
    assert bench.parse_ops("") == {}
    for bad, match in (("side_streams", "FIELD=VALUE"), ("streams=false", "side_streams"),
                       ("side_streams=maybe", "true or false"), ("impl=fast", "choose one of auto")):
        with pytest.raises(ValueError, match=match):
            bench.parse_ops(bad)
    assert bench.cell_name("tnl", "1b", 8192, 16384, "none", 1.0, True, {"side_streams": False}) == \
        "tnl-1b-s8192-m16384-acnone-side_streams-false"
    # a path among the values (the autotuner's cache) stays inside the output directory's file name
    assert bench.cell_name("tnl", "1b", 8192, 16384, "none", 1.0, True, {"tune_cache": "/tmp/t une.json"}) == \
        "tnl-1b-s8192-m16384-acnone-tune_cache-_tmp_t_une.json"
    base = {"size": "1b", "seq": 8192, "tokens_per_step": 65536, "micro_batch": 2, "accumulation": 4,
            "micro_tokens": 16384, "status": "ok", "ac": "none", "ac_fraction": 1.0, "mfu": 0.5, "peak_gib": 9.0,
            "device": "GPU", "date": "d", "commit": "c", "attempts": [{"ac": "none", "status": "ok", "first_step_s": 1.0}]}
    cells = {"llama": ("llama", {}, 50000.0), "tnl": ("tnl", {}, 64000.0),
             "tnl-ab": ("tnl", {"side_streams": False}, 66000.0), "hgrn2-ab": ("hgrn2", {"gla_triton": False}, 40000.0),
             "hgrn2": ("hgrn2", {}, 55000.0), "llama-ab": ("llama", {"gla_triton": False}, 40000.0)}
    for name, (arch, ops, tps) in cells.items():
        (tmp_path / f"{name}.json").write_text(json.dumps({**base, "arch": arch, "ops": ops, "tokens_per_s": tps}))
    text = bench.report(tmp_path)
    assert "| tnl | 1b | 8192 | 2 x 4 | none | 64.0k | 50.0% | 9.0 | 1.280x |" in text
    assert "| tnl (side_streams=false) | 1b | 8192 | 2 x 4 | none | 66.0k | 50.0% | 9.0 | 1.320x |" in text  # default LLaMA
    assert "| hgrn2 (gla_triton=false) | 1b | 8192 | 2 x 4 | none | 40.0k | 50.0% | 9.0 | 1.000x |" in text  # its own


def test_bench_keeps_the_graph_break_lines_of_a_dynamo_log():
    bench = _bench_train()
    log = ("[bench] tnl 1b seq 8192 ac none: first step 9.1 s\n"
           "V1124 torch/_dynamo/symbolic_convert.py:517] [0/0] [__graph_breaks] Graph break in user code at "
           "/x/models/tnl.py:63\n"
           "[__graph_breaks] Graph Break Reason: Dynamic shape operator\n  Explanation: ...\n")
    assert bench.graph_break_lines(log) == [log.splitlines()[1], log.splitlines()[2]]
    assert bench.graph_break_lines("[bench] ok\n") == []


def test_bench_matrix_runs_a_cell_and_resumes(tmp_path):
    """The benchmark's machinery end to end on CPU (a tiny eager cell): a JSON per cell, named for the
    device; a second run skips the measured cell."""
    import json
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    cmd = [sys.executable, str(root / "launch" / "bench_train.py"), "--allow-cpu", "--archs", "tnl", "--sizes", "tiny",
           "--seqs", "32", "--tokens-per-step", "64", "--micro-tokens", "64", "--warmup", "1", "--steps", "1",
           "--no-compile", "--ac", "none", "--out", str(tmp_path)]
    env = {**__import__("os").environ, "PYTHONPATH": str(root), "CUDA_VISIBLE_DEVICES": "", "TORCH_LOGS": "graph_breaks"}
    first = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-2000:]
    files = list(tmp_path.glob("*.json"))
    assert [f.name for f in files] == ["tnl-tiny-s32-m64-acnone-eager__cpu.json"]
    res = json.loads(files[0].read_text())
    assert res["status"] == "ok" and res["micro_batch"] == 2 and res["accumulation"] == 1
    assert len(res["attempts"][0]["step_s_all"]) == 2 and res["tokens_per_s"] > 0
    assert res["graph_break_log"] == []  # run under TORCH_LOGS=graph_breaks: the log is kept, and is empty
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert "measured already" in again.stdout and again.returncode == 0
    assert res["ops"] == {} and res["ops_config"]["side_streams"] is False
    ab = subprocess.run(cmd + ["--ops", "side_streams=true"], capture_output=True, text=True, timeout=300, env=env)
    assert ab.returncode == 0, ab.stdout[-2000:] + ab.stderr[-2000:]
    res = json.loads((tmp_path / "tnl-tiny-s32-m64-acnone-eager-side_streams-true__cpu.json").read_text())
    assert res["ops"] == {"side_streams": True} and res["ops_config"]["side_streams"] is True
    bad = subprocess.run(cmd + ["--ops", "streams=off"], capture_output=True, text=True, timeout=300, env=env)
    assert bad.returncode == 2 and "FIELD=VALUE with FIELD one of impl, gla_triton, side_streams" in bad.stderr
