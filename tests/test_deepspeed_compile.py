"""torch.compile under DeepSpeed on CPU (gloo): every ZeRO stage compiles each block in place, as the plain
path does: one graph shared by every block, no graph break, the same losses (training and evaluation) as the
eager engine. ZeRO-1/2
compile the block's whole call; ZeRO-3 marks the blocks as leaf modules (their parameters gathered in hooks
on the block) and compiles each block's forward inside those hooks, also with the parameters partitioned
over two ranks and with activation checkpointing. Runs in subprocesses: DeepSpeed's process group and
Dynamo's counters stay out of the test process."""
from __future__ import annotations

import atexit
import functools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

from checkpoint_utils import ROOT, env, free_port

pytest.importorskip("deepspeed")

SCRIPT = textwrap.dedent("""
    import json, logging, sys
    import torch
    from torch._dynamo.utils import counters
    from models import build_model
    from pretrain.config import parse_config
    from pretrain.deepspeed_module import DeepSpeedTrainModule
    from pretrain.distributed import dist_env, init_process_group

    zero, ac, ds_json = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    e = dist_env("cpu")
    cfg = parse_config(["--arch", "tnl", "--size", "tiny", "--model", "vocab_size=256", "--zero", str(zero),
                        "--device", "cpu", "--seq-len", "24", "--global-batch-tokens", str(48 * e.world_size),
                        "--micro-batch", "2", "--lr", "3e-3", "--warmup-steps", "0",
                        "--activation-checkpointing", ac] + (["--deepspeed-config", ds_json] if ds_json else []))
    init_process_group(e)
    g = torch.Generator().manual_seed(1 + e.rank)
    batches = [{"input_ids": torch.randint(0, 256, (2, 24), generator=g),
                "targets": torch.randint(0, 256, (2, 24), generator=g)} for _ in range(3)]
    breaks = []
    class Keep(logging.Handler):
        def emit(self, record):
            if "break" in record.getMessage().lower():
                breaks.append(record.getMessage())
    torch._logging.set_logs(graph_breaks=True)
    logging.getLogger("torch._dynamo").addHandler(Keep())

    def run(compiled):
        torch.manual_seed(0)
        model = build_model("tnl", "tiny", vocab_size=256)
        model.set_activation_checkpointing(ac)
        m = DeepSpeedTrainModule(model, cfg, e, "fp32", 1)
        torch._dynamo.reset()
        counters.clear()
        if compiled:
            m.compile(backend="aot_eager")
        losses = [m.train_step([b], i).loss for i, b in enumerate(batches)]
        # ZeRO-3: after a step every parameter is partitioned again (no rank keeps it whole)
        released = [p.numel() == 0 for p in m.model.parameters() if hasattr(p, "ds_id")]
        graphs = counters["stats"]["unique_graphs"]
        grad_on = []  # whether autograd recorded the evaluation's forwards (it must not: no activations kept)
        hook = m.model.register_forward_pre_hook(lambda mod, args: grad_on.append(torch.is_grad_enabled()))
        val = m.eval_loss(batches[:2])  # eval mode, no grad: another graph, the same parameters gathered
        hook.remove()
        calls = sum(getattr(b, "_compiled_call_impl", None) is not None for b in m.model.blocks)
        forwards = sum(hasattr(b.forward, "_torchdynamo_orig_callable") for b in m.model.blocks)
        return {"losses": losses, "blocks": len(m.model.blocks), "compiled_calls": calls,
                "compiled_forwards": forwards, "leaves": sum(getattr(b, "_z3_leaf", False) for b in m.model.blocks),
                "engine_compiled": bool(m.engine.is_compiled), "graphs": graphs, "val": val,
                "torch_linear": torch.nn.functional.linear is torch._C._nn.linear,
                "released": sum(released), "zero3_params": len(released), "eval_grad_on": grad_on}

    eager = run(False)
    out = {"eager": eager, "compiled": run(True), "breaks": breaks}
    print("RESULT " + json.dumps(out))
""")


@functools.lru_cache(maxsize=None)
def _run(zero: int, world: int = 1, ac: str = "none") -> list[dict]:
    """Every rank's result (kept: a later test compares with it). Under ZeRO-3 every parameter is
    partitioned: the tiny model's are all below the generated persistence threshold (1e6 elements), which
    would keep them whole on every rank."""
    port = str(free_port())
    ds_json = ""
    if zero == 3:
        ds_json = str(_tmp_dir() / "ds-partition-all.json")
        Path(ds_json).write_text(json.dumps({"zero_optimization": {"stage3_param_persistence_threshold": 0}}))
    procs = []
    for rank in range(world):
        e = env()
        e.update({"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "RANK": str(rank), "LOCAL_RANK": str(rank),
                  "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port})
        procs.append(subprocess.Popen([sys.executable, "-c", SCRIPT, str(zero), ac, ds_json], env=e, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True, cwd=ROOT))
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, out[-3000:] + err[-5000:]
        line = [ln for ln in out.splitlines() if ln.startswith("RESULT ")][-1]
        results.append(json.loads(line[len("RESULT "):]))
    return results


@functools.lru_cache(maxsize=None)
def _tmp_dir() -> Path:
    d = Path(tempfile.mkdtemp(prefix="linscale-ds-compile-"))
    atexit.register(shutil.rmtree, d, ignore_errors=True)
    return d


def _check(r: dict) -> dict:
    c = r["compiled"]
    assert c["graphs"] == 1, c     # every block shares one graph
    assert not r["breaks"], r["breaks"]
    assert c["losses"] == pytest.approx(r["eager"]["losses"], rel=1e-5)
    assert c["val"] == pytest.approx(r["eager"]["val"], rel=1e-5)
    assert c["eval_grad_on"] == r["eager"]["eval_grad_on"] == [False, False]
    assert r["eager"]["compiled_calls"] == r["eager"]["compiled_forwards"] == 0
    return c


@pytest.mark.parametrize("zero", [1, 2])
def test_zero12_compiles_each_block_like_the_plain_path(zero):
    c = _check(_run(zero)[0])
    assert c["compiled_calls"] == c["blocks"] >= 2 and not c["engine_compiled"] and c["leaves"] == 0


@pytest.mark.parametrize("world,ac", [(1, "none"), (2, "full")])
def test_zero3_compiles_each_block_inside_its_gathering_hooks(world, ac):
    """Partitioned over `world` ranks: every rank's losses equal the eager engine's (which gathers the same
    leaf blocks); with full activation checkpointing the backward recomputes each block on its gathered
    parameters."""
    for r in _run(3, world, ac):
        c = _check(r)
        assert c["compiled_forwards"] == c["leaves"] == c["blocks"] >= 2
        assert c["compiled_calls"] == 0 and not c["engine_compiled"]
        assert r["eager"]["leaves"] == c["blocks"]
        # DeepSpeed's memory-efficient linear reads each weight's ds_id in its backward: with it, torch 2.11's
        # Dynamo guarded on that per-block integer and built a graph for each block until its recompile limit
        assert c["torch_linear"] and r["eager"]["torch_linear"]
        assert c["released"] == c["zero3_params"] == r["eager"]["released"] > 0, c
    if world == 1:  # gathering whole blocks changes nothing: the same losses as ZeRO-1's eager engine
        assert c["losses"] == pytest.approx(_run(1)[0]["eager"]["losses"], rel=1e-5)


def test_zero3_compile_warns_when_a_user_config_brings_back_the_memory_efficient_linear(monkeypatch, capsys):
    """With DeepSpeed's linear in place of torch's (a --deepspeed-config setting memory_efficient_linear
    true), compiled blocks would recompile per block: the run says so and names the setting. ZeRO-1/2 and
    torch's own linear say nothing."""
    import types

    import torch

    from models import build_model
    from pretrain.deepspeed_module import DeepSpeedTrainModule

    model = build_model("tnl", "tiny", vocab_size=64)

    def compile_with(stage: int) -> str:
        m = types.SimpleNamespace(ds_config={"zero_optimization": {"stage": stage}}, model=model)
        DeepSpeedTrainModule.compile(m, backend="eager")
        return capsys.readouterr().err

    assert "memory_efficient_linear" not in compile_with(3)
    plain = torch.nn.functional.linear
    monkeypatch.setattr(torch.nn.functional, "linear", lambda x, w, b=None: plain(x, w, b))
    assert "memory_efficient_linear" not in compile_with(2)
    err = compile_with(3)
    assert "memory_efficient_linear is on" in err and "set it to false in --deepspeed-config" in err
