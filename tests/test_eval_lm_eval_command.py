"""`lm_eval --model linscale ...` works as a plain command once linscale is installed: the installed
linscale_lm_eval.pth registers the adapter when the `lm_eval` command starts (lm-eval has no plugin
discovery). Skipped when linscale is not installed into the running environment."""
import json
import shutil
import site
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from eval_utils import write_tiny_mc_task
from models import build_model, save_pretrained


def _hook_installed() -> bool:
    dirs = site.getsitepackages() + [site.getusersitepackages()]
    return any((Path(d) / "linscale_lm_eval.pth").exists() for d in dirs)


@pytest.mark.skipif(not _hook_installed(), reason="linscale is not installed here (pip install -c constraints.txt .)")
def test_plain_lm_eval_command_runs_the_linscale_model(tmp_path):
    exe = shutil.which("lm_eval", path=str(Path(sys.executable).parent)) or shutil.which("lm_eval")
    assert exe, "lm_eval command not found next to this Python"
    rows = [{"q": "The sky is", "choices": [" blue", " green"], "label": 0},
            {"q": "Fire is", "choices": [" hot", " cold"], "label": 0}]
    write_tiny_mc_task(tmp_path, "tiny_cmd", rows)
    torch.manual_seed(0)
    save_pretrained(build_model("tnl", "tiny", max_seq_len=64), tmp_path / "export")
    out = subprocess.run([exe, "--model", "linscale", "--model_args", f"pretrained={tmp_path / 'export'},device=cpu",
                          "--tasks", "tiny_cmd", "--include_path", str(tmp_path), "--output_path", str(tmp_path / "res")],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    results = list((tmp_path / "res").rglob("results*.json"))
    assert results, out.stdout[-2000:]
    acc = json.loads(results[0].read_text())["results"]["tiny_cmd"]["acc,none"]
    assert 0.0 <= acc <= 1.0
