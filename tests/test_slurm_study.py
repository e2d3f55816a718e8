"""The job scripts `launch/study.py run --slurm` writes (scaling/study/slurm.py), run as Slurm would run them,
without a cluster: each must load the study the submitter planned, wherever the submitter ran from."""
from __future__ import annotations

import os
import shutil
import subprocess
import uuid
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def test_report_job_of_a_study_with_a_relative_out_writes_where_the_study_is(tmp_path, monkeypatch):
    """A study YAML with a relative `out`, submitted from a directory other than the checkout: the training array
    trains into that directory's STUDY/runs (absolute RUN_DIR), so the evaluation and report jobs must read the
    same STUDY, not one of the same relative name inside the checkout."""
    from scaling.study import load_study
    from scaling.study.slurm import report_script, stage_script
    name = f"relout-{uuid.uuid4().hex[:8]}"
    (tmp_path / "study.yaml").write_text(yaml.safe_dump({
        "name": "rel", "out": name, "archs": ["llama"],
        "sizes": [{"name": "a", "n_layers": 1, "d_model": 32, "n_heads": 1, "d_glu": 64}],
        "tokens": 1920, "seq_len": 16, "global_batch_tokens": 96, "model": {"vocab_size": 256},
        "recipe": {"train": {"micro_batch": 6, "device": "cpu"}, "checkpoint": {"save_every": 0}},
        "evaluation": {"tasks": ["valid_loss"]}}))
    monkeypatch.chdir(tmp_path)
    study = load_study(tmp_path / "study.yaml")
    assert study.out == tmp_path / name
    script = tmp_path / "report.sbatch"
    script.write_text(report_script(study))
    from scaling.study.plan import plan_study
    assert f"cd {tmp_path}" in stage_script(study, plan_study(study), "evaluate", ("export", "evaluate"))
    elsewhere = tmp_path / "spool"  # slurmd starts a job's copy of the script elsewhere
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    try:
        p = subprocess.run(["bash", str(script)], cwd=elsewhere, env={**env, "SLURM_JOB_ID": "7"},
                           capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
        assert (tmp_path / name / "report" / "report.md").is_file(), p.stdout[-2000:]
        assert not (ROOT / name).exists()
    finally:
        shutil.rmtree(ROOT / name, ignore_errors=True)
