"""The checkpoint manager's guarantees, checked on real runs: partial or corrupt checkpoints (truncated
file, deleted manifest, damaged bytes, a kill during the save) are skipped by --resume auto with a
warning naming them; a background save never exposes a half-written checkpoint; retention keeps the last
k checkpoints and never touches snapshots; SIGUSR1 stops the loop with a checkpoint; the snapshot
schedule."""
from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import checkpoints.manager as manager_mod
from checkpoint_utils import env, losses, make_dataset, run_flags, train_in_process
from checkpoints import SnapshotSchedule, find_resume_checkpoint, verify
from checkpoints.schedule import log_spaced

TPS = 6 * 16  # tokens per step of run_flags


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    return make_dataset(tmp_path_factory.mktemp("data"))


@pytest.fixture(scope="module")
def finished_run(dataset, tmp_path_factory) -> Path:
    """9 steps, a checkpoint every 3 (all kept)."""
    run = tmp_path_factory.mktemp("runs") / "run"
    train_in_process(run_flags(run, dataset, 9, "--save-every", "3", "--keep-last", "0"))
    return run


def copy_run(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def skipped_names(ckpt_dir: Path) -> tuple[Path | None, list[str]]:
    messages: list[str] = []
    return find_resume_checkpoint(ckpt_dir, on_skip=messages.append), messages


def test_complete_run_resumes_from_newest(finished_run):
    chosen, messages = skipped_names(finished_run / "checkpoints")
    assert chosen.name == "step_00000009" and messages == []
    assert (finished_run / "checkpoints" / "latest").read_text().strip() == "step_00000009"


@pytest.mark.parametrize("damage", ["truncate", "delete_manifest", "flip_byte", "delete_file"])
def test_damaged_newest_checkpoint_is_skipped_with_a_warning(finished_run, tmp_path, damage):
    run = copy_run(finished_run, tmp_path / "run")
    newest = run / "checkpoints" / "step_00000009"
    target = newest / "module" / "optimizer.pt"
    if damage == "truncate":
        with open(target, "r+b") as f:
            f.truncate(target.stat().st_size // 2)
    elif damage == "delete_manifest":
        (newest / "manifest.json").unlink()
    elif damage == "flip_byte":
        data = bytearray(target.read_bytes())
        data[len(data) // 2] ^= 0xFF
        target.write_bytes(bytes(data))
    else:
        (newest / "trainer" / "rank_00000.pt").unlink()
    assert verify(newest) is not None
    chosen, messages = skipped_names(run / "checkpoints")
    assert chosen.name == "step_00000006"
    assert len(messages) == 1 and str(newest) in messages[0]
    expected = {"truncate": "truncated", "delete_manifest": "no manifest.json", "flip_byte": "checksum",
                "delete_file": "missing"}[damage]
    assert expected in messages[0]


def test_resume_auto_skips_a_truncated_checkpoint_and_continues_exactly(finished_run, dataset, tmp_path, capfd):
    run = copy_run(finished_run, tmp_path / "run")
    target = run / "checkpoints" / "step_00000009" / "module" / "model.pt"
    with open(target, "r+b") as f:
        f.truncate(10)
    metrics_before = (run / "metrics.jsonl").read_text()
    trainer = train_in_process(run_flags(run, dataset, 9, "--save-every", "3", "--keep-last", "0", "--resume", "auto"))
    err = capfd.readouterr().err
    assert "step_00000009" in err and "truncated" in err
    assert trainer.step == 9
    got = losses(run)
    # steps 7..9 replayed from step 6 give the same losses as the first time
    ref = {}
    for line in metrics_before.splitlines():
        row = json.loads(line)
        ref[row["step"]] = row["loss"]
    for step in (7, 8, 9):
        assert got[step] == [ref[step], ref[step]]
    # the damaged checkpoint was replaced by a good one
    assert verify(run / "checkpoints" / "step_00000009") is None


def test_explicit_resume_of_a_damaged_checkpoint_is_refused(finished_run, dataset, tmp_path):
    from pretrain.config import parse_config
    from pretrain.trainer import Trainer
    run = copy_run(finished_run, tmp_path / "run")
    bad = run / "checkpoints" / "step_00000006"
    (bad / "manifest.json").unlink()
    with pytest.raises(ValueError, match=r"step_00000006.*no manifest\.json"):
        Trainer(parse_config(run_flags(run, dataset, 9, "--resume", str(bad))))


KILLER = """
import os, signal, sys
sys.path.insert(0, {root!r})
import checkpoints.manager as m
KILL_STEP = {kill_step}
where = {where!r}
def kill_if(step):
    if step == KILL_STEP:
        os.kill(os.getpid(), signal.SIGKILL)
if where == "before_manifest":
    orig = m.write_manifest
    def write_manifest(root, info=None, *a, **k):
        kill_if(info["step"])
        return orig(root, info, *a, **k)
    m.write_manifest = write_manifest
else:  # published, but the `latest` pointer not yet rewritten
    orig = m.atomic_write_text
    def atomic_write_text(path, text):
        kill_if(int(text.strip().split("_")[1]))
        return orig(path, text)
    m.atomic_write_text = atomic_write_text
from pretrain.trainer import main
sys.exit(main({flags!r}))
"""


@pytest.mark.parametrize("where", ["before_manifest", "before_latest"])
def test_kill_during_a_save_leaves_the_previous_checkpoint_loadable(dataset, tmp_path, where):
    run = tmp_path / "run"
    flags = run_flags(run, dataset, 12, "--save-every", "3", "--keep-last", "0")
    script = KILLER.format(root=str(Path(__file__).resolve().parents[1]), kill_step=6, where=where, flags=flags)
    proc = subprocess.run([sys.executable, "-c", script], env=env(), capture_output=True, text=True, timeout=240)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    ckpt_dir = run / "checkpoints"
    assert (ckpt_dir / "latest").read_text().strip() == "step_00000003"  # the pointer moves only after publishing
    chosen, messages = skipped_names(ckpt_dir)
    if where == "before_manifest":
        assert not (ckpt_dir / "step_00000006").exists()
        assert chosen.name == "step_00000003"
        assert len(messages) == 1 and "step_00000006.tmp" in messages[0] and "never finished" in messages[0]
    else:
        # complete on disk although `latest` still names step 3: resume scans, it does not trust the pointer
        assert chosen.name == "step_00000006" and messages == []
    # a fresh start cleans the unfinished save up and resumes
    trainer = train_in_process(flags + ["--resume", "auto", "--max-steps", "7"])
    assert trainer.step == 7
    assert not list(ckpt_dir.glob("*.tmp"))


def test_background_save_never_exposes_a_half_written_checkpoint(dataset, tmp_path, monkeypatch):
    """At the moment the manifest is written and at the moment of publishing, the new checkpoint is not
    visible as step_N, `latest` still names the previous one, and resume would take the previous one;
    and the writing happens off the training thread."""
    run = tmp_path / "run"
    ckpt_dir = run / "checkpoints"
    seen: list[dict] = []

    def observe(step: int, stage: str) -> None:
        seen.append({"stage": stage, "step": step, "thread": threading.current_thread().name,
                     "final_exists": (ckpt_dir / f"step_{step:08d}").exists(),
                     "latest": (ckpt_dir / "latest").read_text().strip() if (ckpt_dir / "latest").exists() else None,
                     "resume": (find_resume_checkpoint(ckpt_dir, on_skip=lambda m: None) or Path("none")).name})

    orig_manifest, orig_publish = manager_mod.write_manifest, manager_mod.publish_dir

    def write_manifest(root, info=None, *a, **k):
        if info and info.get("kind") == "checkpoint":
            observe(info["step"], "manifest")
        return orig_manifest(root, info, *a, **k)

    def publish_dir(tmp, final):
        if final.parent == ckpt_dir:
            observe(int(final.name.split("_")[1]), "publish")
        return orig_publish(tmp, final)

    monkeypatch.setattr(manager_mod, "write_manifest", write_manifest)
    monkeypatch.setattr(manager_mod, "publish_dir", publish_dir)
    train_in_process(run_flags(run, dataset, 6, "--save-every", "3", "--async-save", "true"))
    assert [(s["stage"], s["step"]) for s in seen] == [("manifest", 3), ("publish", 3), ("manifest", 6), ("publish", 6)]
    for s in seen:
        assert s["thread"] == "checkpoint-writer"
        assert not s["final_exists"]
        prev = None if s["step"] == 3 else "step_00000003"
        assert s["latest"] == prev and s["resume"] == (prev or "none")
    assert (ckpt_dir / "latest").read_text().strip() == "step_00000006"


def test_retention_keeps_the_last_k_and_never_deletes_snapshots(dataset, tmp_path, capsys, monkeypatch):
    run = tmp_path / "run"
    real_save = manager_mod.save_safetensors

    def slow_save(*args, **kwargs):  # a slow disk: the loop moves on while a snapshot is being written
        time.sleep(0.2)
        return real_save(*args, **kwargs)

    monkeypatch.setattr(manager_mod, "save_safetensors", slow_save)
    trainer = train_in_process(run_flags(run, dataset, 12, "--save-every", "2", "--keep-last", "2",
                                         "--snapshot-every-tokens", str(3 * TPS), "--snapshot-log-points", "2"))
    ckpts = sorted(p.name for p in (run / "checkpoints").iterdir() if p.is_dir())
    assert ckpts == ["step_00000010", "step_00000012"]
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_00000012"
    # snapshots: every 3 steps' tokens, plus log-spaced points at 96 and 96*sqrt(3)=166 tokens (steps 1, 2)
    expected = sorted({3, 6, 9, 12} | {1, math.ceil(round(TPS * math.sqrt(3)) / TPS)})
    snaps = sorted(int(p.name.split("_")[1]) for p in (run / "snapshots").iterdir())
    assert snaps == expected == [1, 2, 3, 6, 9, 12]
    for step in snaps:
        d = run / "snapshots" / f"step_{step:08d}"
        assert verify(d) is None
        meta = json.loads((d / "meta.json").read_text())
        assert meta["step"] == step and meta["tokens"] == step * TPS
        assert meta["flops"] == pytest.approx(step * trainer.flops_per_step)
    # the log names each snapshot's own tokens, though the background writer finishes steps later
    out = capsys.readouterr().out
    logged = {int(m[1]): int(m[2]) for m in re.finditer(r"snapshot step_(\d+) saved \((\d+) tokens", out)}
    assert logged == {step: step * TPS for step in snaps}
    # retention run again with k=1 still leaves every snapshot alone
    from checkpoints import apply_retention
    apply_retention(run / "checkpoints", 1)
    assert sorted(p.name for p in (run / "checkpoints").iterdir() if p.is_dir()) == ["step_00000012"]
    assert sorted(int(p.name.split("_")[1]) for p in (run / "snapshots").iterdir()) == expected


def test_sigusr1_stops_the_loop_with_a_checkpoint(dataset, tmp_path, monkeypatch):
    from pretrain.config import parse_config
    from pretrain.trainer import Trainer
    run = tmp_path / "run"
    before = signal.getsignal(signal.SIGUSR1)
    trainer = Trainer(parse_config(run_flags(run, dataset, 50, "--save-every", "0")))
    real_step = trainer.module.train_step

    def train_step(micro, step, **kw):
        if step == 4:  # during the 5th step, as Slurm's --signal=USR1 would arrive
            os.kill(os.getpid(), signal.SIGUSR1)
        return real_step(micro, step, **kw)

    monkeypatch.setattr(trainer.module, "train_step", train_step)
    summary = trainer.fit()
    assert summary["stop"] == "signal" and summary["step"] == 5
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_00000005"
    assert verify(run / "checkpoints" / "step_00000005") is None
    assert signal.getsignal(signal.SIGUSR1) is before  # handlers are given back at the end


def _pretrain(argv: list, capsys) -> tuple[int, str, str]:
    """launch/pretrain.py's main in this process: (exit code, stdout, stderr)."""
    from pretrain.trainer import main
    rc = main([str(a) for a in argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_a_checkpoint_folder_that_cannot_be_made_fails_the_save(dataset, tmp_path, capsys, monkeypatch):
    """The save's own folder cannot be created (a read-only checkpoints/, EROFS): the documented failed
    save (exit 4, one line naming the step and the intact previous checkpoint), not a bare OSError."""
    import errno
    real_mkdir = Path.mkdir

    def mkdir(self, *args, **kwargs):
        if "step_00000004.tmp" in str(self):
            raise OSError(errno.EROFS, "Read-only file system", str(self))
        return real_mkdir(self, *args, **kwargs)

    monkeypatch.setattr(Path, "mkdir", mkdir)
    run = tmp_path / "run"
    rc, _, err = _pretrain(run_flags(run, dataset, 8, "--save-every", "2", "--keep-last", "0"), capsys)
    assert rc == 4, err
    assert "Traceback" not in err
    line = next(ln for ln in err.splitlines() if "error:" in ln)
    assert line.startswith("error: checkpoint step 4 not written: ") and "Read-only file system" in line, line
    assert "step_00000002 is intact" in line and "--resume auto" in line, line
    assert sorted(p.name for p in (run / "checkpoints").iterdir() if p.is_dir()) == ["step_00000002"]


def test_resume_auto_before_the_first_checkpoint_sets_the_snapshots_aside(dataset, tmp_path, capsys):
    """A run stopped before its first checkpoint, resumed with --resume auto and another --lr, trains from
    step 0 again: its snapshots hold the new run's weights, and the stopped attempt's are moved to
    superseded-<time>/ (not kept as if they were the replayed steps')."""
    run, ref = tmp_path / "run", tmp_path / "ref"
    flags = ("--save-every", "0", "--snapshot-every-tokens", str(2 * TPS), "--snapshot-log-points", "0")
    assert _pretrain(run_flags(run, dataset, 4, *flags), capsys)[0] == 0
    shutil.rmtree(run / "checkpoints")  # as if killed before the final checkpoint was written
    old = {s: (run / "snapshots" / f"step_{s:08d}" / "model.safetensors").read_bytes() for s in (2, 4)}
    rc, out, _ = _pretrain(run_flags(run, dataset, 4, *flags, "--lr", "1e-3", "--resume", "auto"), capsys)
    assert rc == 0 and "starting from step 0" in out
    assert _pretrain(run_flags(ref, dataset, 4, *flags, "--lr", "1e-3"), capsys)[0] == 0
    for s in (2, 4):
        name = f"step_{s:08d}"
        got = (run / "snapshots" / name / "model.safetensors").read_bytes()
        assert got == (ref / "snapshots" / name / "model.safetensors").read_bytes() and got != old[s]
    aside = [p for p in (run / "snapshots").iterdir() if p.name.startswith("superseded-")]
    assert len(aside) == 1 and (aside[0] / "step_00000004" / "model.safetensors").read_bytes() == old[4]


def test_resume_auto_without_run_json_takes_the_checkpoints_run_id(finished_run, dataset, tmp_path, capsys):
    """A run directory whose run.json is lost (or checkpoints copied into a new --out): --resume auto
    continues from its newest checkpoint under the run id the checkpoints record, rather than making a new
    id under which every checkpoint is "another run's" (refused, then and at every later resume)."""
    run = copy_run(finished_run, tmp_path / "run")
    run_id = json.loads((run / "run.json").read_text())["run_id"]
    (run / "run.json").unlink()
    rc, out, err = _pretrain(run_flags(run, dataset, 12, "--save-every", "3", "--keep-last", "0",
                                       "--resume", "auto"), capsys)
    assert rc == 0, err
    assert "another run" not in err and "step_00000009 at step 9" in out
    assert json.loads((run / "run.json").read_text())["run_id"] == run_id
    assert json.loads((run / "checkpoints" / "step_00000012" / "meta.json").read_text())["run_id"] == run_id


def _files(run: Path) -> dict[str, bytes]:
    """Every file of a run directory and its bytes (the lock file, rewritten by every start, left out)."""
    return {str(p.relative_to(run)): p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file() and p.name != ".lock"}


@pytest.mark.parametrize("change", [("--size", "mini"), ("--seed", "1"), ("--global-batch-tokens", "192")])
def test_a_refused_resume_changes_nothing(finished_run, dataset, tmp_path, capsys, change):
    """A resume refused for a setting that cannot change (the model, the seed, the global batch) leaves the
    run directory byte for byte as it was: summary.json too, which says how the run's last start ended (a
    study reads it to tell a finished run from a stopped one)."""
    run = copy_run(finished_run, tmp_path / "run")
    before = _files(run)
    assert json.loads(before["summary.json"])["stop"] == "finished"
    rc, _, err = _pretrain([*run_flags(run, dataset, 12, "--save-every", "3", "--keep-last", "0", "--resume", "auto"),
                            *change], capsys)
    assert rc == 2 and err.startswith("error: checkpoint "), err
    assert _files(run) == before


def test_snapshot_schedule():
    s = SnapshotSchedule(every_tokens=1000, log_points=4, tokens_per_step=10)
    # log points 10 * 100^(i/4): 10, 31.6, 100, 316 tokens -> steps 1, 4, 10, 32; then every 100 steps
    assert log_spaced(10, 1000, 4) == [10, 32, 100, 316]
    assert s.steps(300) == [1, 4, 10, 32, 100, 200, 300]
    assert SnapshotSchedule(0, 0, 10).enabled is False
    assert SnapshotSchedule(0, 3, 10, total_tokens=1000).steps(100) == [1, 5, 22]
    with pytest.raises(ValueError, match="snapshot_log_points=3 needs an end"):
        SnapshotSchedule(0, 3, 10)
    with pytest.raises(ValueError, match="must be >= 0"):
        SnapshotSchedule(-1, 0, 10)
