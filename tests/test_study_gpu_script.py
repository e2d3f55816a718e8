"""launch/gpu/mini_bilingual.sh, the procedure that carries a study to a machine without its data (bundle), trains
and evaluates it there in parts (device), and brings the results back into the config's folder with the report
(collect). Here the "device" is this machine with the dataset moved away: the bundle must restore it, the parts
must train exactly the runs a study run where the data is trains, a second call must skip finished work, and
collect must rebuild the report from the small files that came back."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

from checkpoint_utils import make_dataset
from test_study import ROOT, losses, study, study_yaml

SCRIPT = "launch/gpu/mini_bilingual.sh"


def tree_digest(path: Path) -> dict[str, str]:
    return {str(f.relative_to(path)): hashlib.sha256(f.read_bytes()).hexdigest()
            for f in sorted(path.rglob("*")) if f.is_file()}


def script(root: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    e = {**os.environ, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1", "PYTHONPATH": "", **env}
    res = subprocess.run(["bash", SCRIPT, *args], cwd=root, env=e, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, f"{SCRIPT} {' '.join(args)} exited {res.returncode}:\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
    return res


def test_bundle_device_parts_and_collect(tmp_path):
    # a checkout to run from: the repository's code, and a study config in a folder of its own
    root = tmp_path / "root"
    root.mkdir()
    for item in ROOT.iterdir():
        if item.name not in (".git", "data", "studies", ".gpu", "docs"):
            (root / item.name).symlink_to(item)
    data = make_dataset(tmp_path / "datasets" / "synth")
    cfg = study_yaml(tmp_path, data, name="g", archs=["llama", "hgrn2"], tokens=960)
    raw = yaml.safe_load(cfg.read_text())
    raw["out"] = "studies/g"                     # relative: under the checkout the script runs in
    (root / "cfgdir").mkdir()
    (root / "cfgdir" / "study.yaml").write_text(yaml.safe_dump(raw))
    env = {"STUDY_CONFIG": "cfgdir/study.yaml", "BUNDLE": str(root / ".gpu" / "b"), "WHEELS": str(tmp_path / "nowheels"),
           "SITE": str(tmp_path / "site"), "LINSCALE_SHARED_DATA": str(tmp_path / "shared"), "TRAIN_DEADLINE": "3000",
           "DEADLINE": "6000"}

    script(root, "bundle", **env)
    bundle = sorted(p.name for p in (root / ".gpu" / "b").iterdir())
    assert bundle == ["data.tar.xz", "eval_inputs.tar"]   # valid_loss only: no task files, no lm-eval wheel
    digest = tree_digest(data)
    shutil.move(data, tmp_path / "datasets" / "synth_here")   # the "device" lacks the dataset

    out1, out2 = tmp_path / "out1", tmp_path / "out2"
    res1 = script(root, "device", "1", OUT=str(out1), **env)
    assert tree_digest(data) == digest                         # unpacked from the bundle, byte for byte
    assert "[gpu] part 1: llama-a llama-b" in res1.stdout
    script(root, "device", "2", OUT=str(out2), **env)
    for out, part in ((out1, 1), (out2, 2)):
        assert {p.name for p in out.iterdir()} == {f"part{part}.log", f"status_part{part}.txt", f"results_part{part}.tgz"}
        assert "2/2 runs trained and evaluated" in (out / f"status_part{part}.txt").read_text()
    # finished runs lose their resume checkpoints only
    for run in ("llama-a", "hgrn2-b"):
        d = root / "studies" / "g" / "runs" / run
        assert not (d / "checkpoints").exists() and (d / "snapshots").is_dir() and (d / "exports").is_dir()
    # a part by architecture names and SIZES (sizes added to a study later): only those runs, plain file names
    some = script(root, "device", "hgrn2,llama", OUT=str(tmp_path / "out4"), SIZES="b", **env)
    assert "[gpu] part hgrn2,llama: llama-b hgrn2-b" in some.stdout
    assert {p.name for p in (tmp_path / "out4").iterdir()} == {"parthgrn2-llama.log", "status_parthgrn2-llama.txt",
                                                               "results_parthgrn2-llama.tgz"}
    # a part by run names, with a file name of its own
    named = script(root, "device", "hgrn2-b,llama-a", OUT=str(tmp_path / "out6"), PART_NAME="x", **env)
    # a second call skips finished work
    assert "[gpu] part hgrn2-b,llama-a: llama-a hgrn2-b" in named.stdout and named.stdout.count("skipped") >= 2
    assert "llama-a: trained" in named.stdout
    assert {p.name for p in (tmp_path / "out6").iterdir()} == {"partx.log", "status_partx.txt", "results_partx.tgz"}
    for part, sizes, what in (("tnl", "b", "architecture(s) ['tnl']"), ("llama", "c", "size(s) ['c']")):
        e = {**os.environ, "PYTHON": sys.executable, "PYTHONPATH": "", **env, "OUT": str(tmp_path / "out5"), "SIZES": sizes}
        bad = subprocess.run(["bash", SCRIPT, "device", part], cwd=root, env=e, capture_output=True, text=True, timeout=300)
        assert bad.returncode != 0 and what in bad.stderr, bad.stderr[-2000:]

    # the same config where the data is: the carried runs trained the same steps to the same losses
    shutil.rmtree(data)
    shutil.move(tmp_path / "datasets" / "synth_here", data)
    here = tmp_path / "here.yaml"
    here.write_text(yaml.safe_dump({**raw, "out": str(tmp_path / "here")}))
    study("run", "--config", here, "--stages", "train", "--no-report")
    for run in ("llama-a", "hgrn2-a", "llama-b", "hgrn2-b"):
        assert losses(root / "studies" / "g" / "runs" / run) == losses(tmp_path / "here" / "runs" / run)

    # collect on a fresh "CPU side": only what came back
    shutil.rmtree(root / "studies")
    script(root, "collect", str(out1), str(out2), **env)
    docs = root / "cfgdir"
    from scaling.study import load_study, plan_study
    plans = {p.name: p for p in plan_study(load_study(docs / "study.yaml", base=root))}
    for run in ("llama-a", "hgrn2-a", "llama-b", "hgrn2-b"):
        assert losses(docs / "runs" / run) == losses(tmp_path / "here" / "runs" / run)
        results = json.loads((docs / "eval" / run / "results.json").read_text())["snapshots"]
        assert sorted(r["step"] for r in results) == plans[run].snapshot_steps
        assert all(r["results"]["valid_loss"]["loss"] > 0 for r in results)
    report = (docs / "report.md").read_text()
    assert "4/4 runs trained and evaluated" in report, report[:1500]  # collected without the validation windows
    assert (docs / "table3.md").is_file() and (docs / "fits.json").is_file() and (docs / "metrics_vs_compute.png").is_file()
    assert sorted(p.name for p in (docs / "logs").iterdir()) == ["part1.log", "part2.log", "status_part1.txt",
                                                                 "status_part2.txt"]
    assert not any(line.startswith("step ") for line in (docs / "logs" / "part1.log").read_text().splitlines())

    # a later tarball replaces what an earlier one held of its runs: here llama-a trained again (fewer rows) and
    # not yet evaluated; its earlier metrics and evaluations must not survive next to the new run's files
    import tarfile
    later = tmp_path / "out7"
    later.mkdir()
    study_dir = root / "studies" / "g"
    rows = (study_dir / "runs" / "llama-a" / "metrics.jsonl").read_text().splitlines()[:4]
    fake = tmp_path / "later"
    for f in ("config.json", "summary.json"):
        (fake / "runs" / "llama-a").mkdir(parents=True, exist_ok=True)
        shutil.copy(study_dir / "runs" / "llama-a" / f, fake / "runs" / "llama-a" / f)
    (fake / "runs" / "llama-a" / "metrics.jsonl").write_text("\n".join(rows) + "\n")
    with tarfile.open(later / "results_partz.tgz", "w:gz") as t:
        t.add(fake / "runs", arcname="runs")
    assert (study_dir / "eval" / "llama-a").is_dir() and (docs / "eval" / "llama-a").is_dir()
    script(root, "collect", str(out1), str(out2), str(later), **env)
    assert (docs / "runs" / "llama-a" / "metrics.jsonl").read_text().splitlines() == rows
    assert not (study_dir / "eval" / "llama-a").exists() and not (docs / "eval" / "llama-a").exists()
    assert not (study_dir / "state" / "llama-a").exists()
    assert (docs / "eval" / "hgrn2-a" / "results.json").is_file()                # the other runs untouched
    assert "3/4 runs trained and evaluated" in (docs / "report.md").read_text()
