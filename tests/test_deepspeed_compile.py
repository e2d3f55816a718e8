"""torch.compile under DeepSpeed on CPU (gloo, one process): ZeRO-1/2 compile each block in place, as the
plain path does: one graph shared by every block, no graph break, the same losses as the eager engine.
(ZeRO-3 is refused at parse time: tests/test_train_long_context.py.) Runs in a subprocess: DeepSpeed's
process group and Dynamo's counters stay out of the test process."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from checkpoint_utils import ROOT, env

pytest.importorskip("deepspeed")

SCRIPT = textwrap.dedent("""
    import json, logging, sys
    import torch
    from torch._dynamo.utils import counters
    from models import build_model
    from pretrain.config import parse_config
    from pretrain.deepspeed_module import DeepSpeedTrainModule
    from pretrain.distributed import dist_env, init_process_group

    zero = int(sys.argv[1])
    cfg = parse_config(["--arch", "tnl", "--size", "tiny", "--model", "vocab_size=256", "--zero", str(zero),
                        "--device", "cpu", "--seq-len", "24", "--global-batch-tokens", "48", "--micro-batch", "2",
                        "--lr", "3e-3", "--warmup-steps", "0"])
    e = dist_env("cpu")
    init_process_group(e)
    g = torch.Generator().manual_seed(1)
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
        m = DeepSpeedTrainModule(model, cfg, e, "fp32", 1)
        torch._dynamo.reset()
        counters.clear()
        if compiled:
            m.compile(backend="aot_eager")
        losses = [m.train_step([b], i).loss for i, b in enumerate(batches)]
        blocks = sum(getattr(b, "_compiled_call_impl", None) is not None for b in m.model.blocks)
        return {"losses": losses, "blocks": len(m.model.blocks), "compiled_blocks": blocks,
                "engine_compiled": bool(m.engine.is_compiled), "graphs": counters["stats"]["unique_graphs"]}

    eager = run(False)
    out = {"eager": eager, "compiled": run(True), "breaks": breaks}
    print("RESULT " + json.dumps(out))
""")


def _run(zero: int) -> dict:
    e = env()
    e.update({"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1",
              "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(29700 + 10 * zero + os.getpid() % 10)})
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(zero)], env=e, capture_output=True, text=True,
                          timeout=240, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])


@pytest.mark.parametrize("zero", [1, 2])
def test_zero12_compiles_each_block_like_the_plain_path(zero):
    r = _run(zero)
    c = r["compiled"]
    assert c["compiled_blocks"] == c["blocks"] >= 2 and not c["engine_compiled"]
    assert c["graphs"] == 1, c     # every block shares one graph
    assert not r["breaks"], r["breaks"]
    assert c["losses"] == pytest.approx(r["eager"]["losses"], rel=1e-5)
    assert r["eager"]["compiled_blocks"] == 0
