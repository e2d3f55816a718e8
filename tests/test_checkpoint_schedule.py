"""The snapshot schedule is a property of the run: its log-spaced points are fixed at the first start and
recorded in every checkpoint, so a resume with a larger --max-steps / --max-tokens, another
--snapshot-every-tokens, or on another number of ranks takes its snapshots where the first start put
them (checked against an uninterrupted run and against the files written); the snapshots already taken
are never taken again or lost."""
from __future__ import annotations

import json
import os
import re
import signal
from pathlib import Path

import pytest

from checkpoint_utils import make_dataset, one_thread, run_flags, run_pretrain  # noqa: F401  (fixture)
from checkpoints.schedule import SnapshotSchedule, log_spaced, recorded_schedule, resumed_schedule

TPS = 6 * 16  # tokens per step of run_flags


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    return make_dataset(tmp_path_factory.mktemp("data"), docs=120)


def snapshot_steps(run: Path) -> list[int]:
    return sorted(int(p.name[len("step_"):]) for p in (run / "snapshots").glob("step_*"))


def weights(run: Path, step: int) -> bytes:
    return (run / "snapshots" / f"step_{step:08d}" / "model.safetensors").read_bytes()


def pretrain(argv: list, capsys) -> tuple[int, str, str]:
    from pretrain.trainer import main
    rc = main([str(a) for a in argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def stopped_at(flags: list[str], step: int, monkeypatch) -> dict:
    """Train in this process and stop with SIGUSR1 during step `step` (a checkpoint of that step is written)."""
    from pretrain.config import parse_config
    from pretrain.trainer import Trainer
    trainer = Trainer(parse_config(flags))
    real_step = trainer.module.train_step

    def train_step(micro, i, **kw):
        if i == step - 1:
            os.kill(os.getpid(), signal.SIGUSR1)
        return real_step(micro, i, **kw)

    monkeypatch.setattr(trainer.module, "train_step", train_step)
    summary = trainer.fit()
    assert summary["stop"] == "signal" and summary["step"] == step
    return summary


def test_schedule_record_round_trip_and_resume_rules():
    first = SnapshotSchedule(0, 4, 10, total_tokens=2000)
    assert first.log_tokens == log_spaced(10, 2000, 4) and first.log_end == 2000
    again = SnapshotSchedule.from_record(json.loads(json.dumps(first.record())))
    assert again.log_tokens == first.log_tokens and again.steps(500) == first.steps(200)
    # a longer run: the points stay; the note names the first start's spacing and what the flags would give
    longer, note = resumed_schedule(first.record(), 0, 4, 10, 6000)
    assert longer.log_tokens == first.log_tokens and longer.steps(600) == [1, 4, 15, 54]
    assert note and "keep the spacing of the run's first start: 4 points from 10 to 2000 tokens (steps 1, 4, 15, 54)" \
        in note and "--max-steps/--max-tokens they would end at 6000 tokens" in note
    # regular spacing switched on at the resume: it applies, the log points stay
    regular, note = resumed_schedule(first.record(), 1000, 4, 10, 6000)
    assert regular.log_tokens == first.log_tokens and regular.steps(300) == [1, 4, 15, 54, 100, 200, 300]
    assert "--snapshot-every-tokens they would end at 1000 tokens" in note
    # the same end: nothing to say
    assert resumed_schedule(first.record(), 0, 4, 10, 2000)[1] is None
    # another --snapshot-log-points: spaced over the first start's span; 0 turns them off
    denser, note = resumed_schedule(first.record(), 0, 8, 10, 6000)
    assert denser.log_tokens == log_spaced(10, 2000, 8) and "--snapshot-log-points 4 -> 8" in note
    off, note = resumed_schedule(first.record(), 0, 0, 10, 6000)
    assert off.log_tokens == [] and not off.enabled and "(none)" in note
    # points asked for where neither the checkpoint nor the flags give an end
    with pytest.raises(ValueError, match="--snapshot-log-points 3 needs an end"):
        resumed_schedule(SnapshotSchedule(0, 0, 10).record(), 0, 3, 10, None)


def test_an_extended_run_keeps_the_log_points_of_its_first_start(dataset, tmp_path, capsys, monkeypatch):
    """A run planned for 20 steps with 4 log points, stopped at step 2 and resumed for 40 steps: its
    snapshots fall at the first start's points (steps 1, 3, 5, 10), hold bitwise the weights the
    uninterrupted 20-step run has there, and the snapshot of step 1 is not written again."""
    snaps = ("--snapshot-every-tokens", "0", "--snapshot-log-points", "4")
    reference = tmp_path / "reference"
    assert pretrain(run_flags(reference, dataset, 20, "--save-every", "0", *snaps), capsys)[0] == 0
    first_points = SnapshotSchedule(0, 4, TPS, 20 * TPS).steps(20)
    assert first_points == [1, 3, 5, 10] and snapshot_steps(reference) == [1, 3, 5, 10, 20]

    run = tmp_path / "run"
    stopped_at(run_flags(run, dataset, 20, "--save-every", "0", *snaps), 2, monkeypatch)
    assert snapshot_steps(run) == [1]
    step1 = (run / "snapshots" / "step_00000001" / "model.safetensors").stat().st_mtime_ns
    capsys.readouterr()
    rc, out, err = pretrain(run_flags(run, dataset, 40, "--save-every", "0", *snaps, "--resume", "auto"), capsys)
    assert rc == 0, err
    # 40 steps spaced afresh would put them at steps 1, 3, 7, 16
    assert SnapshotSchedule(0, 4, TPS, 40 * TPS).steps(40) == [1, 3, 7, 16]
    assert snapshot_steps(run) == [1, 3, 5, 10, 40]
    for step in first_points:
        assert weights(run, step) == weights(reference, step), step
    assert (run / "snapshots" / "step_00000001" / "model.safetensors").stat().st_mtime_ns == step1
    assert ("snapshot log points keep the spacing of the run's first start: 4 points from 96 to 1920 tokens "
            "(steps 1, 3, 5, 10); spaced by this start's --max-steps/--max-tokens they would end at 3840 tokens") in out
    # the checkpoint records the schedule, for the next resume and for tools that list the points
    meta = json.loads((run / "checkpoints" / "step_00000040" / "meta.json").read_text())
    assert meta["snapshot_schedule"]["log_tokens"] == log_spaced(TPS, 20 * TPS, 4)
    assert recorded_schedule(run / "checkpoints" / "step_00000040").steps(40) == [1, 3, 5, 10]
    # extended once more, by tokens this time: still the first start's points, nothing written again
    before = {s: weights(run, s) for s in snapshot_steps(run)}
    rc, _, err = pretrain([*run_flags(run, dataset, 60, "--save-every", "0", *snaps, "--resume", "auto"),
                           "--max-tokens", str(45 * TPS)], capsys)
    assert rc == 0, err
    assert snapshot_steps(run) == [1, 3, 5, 10, 40, 45]
    assert all(weights(run, s) == b for s, b in before.items())


def test_another_snapshot_every_tokens_at_a_resume_keeps_the_log_points(dataset, tmp_path, capsys, monkeypatch):
    """--snapshot-every-tokens changed at a resume: the regular points follow the new value from there on,
    the log-spaced points (spaced up to the first regular point of the first start) stay; another
    --snapshot-log-points spaces that many anew over the same span."""
    run = tmp_path / "run"
    first = ("--snapshot-every-tokens", str(12 * TPS), "--snapshot-log-points", "3")
    # log points 96, 220, 503 tokens: steps 1, 3, 6
    assert SnapshotSchedule(12 * TPS, 3, TPS).steps(12) == [1, 3, 6, 12]
    stopped_at(run_flags(run, dataset, 12, "--save-every", "0", *first), 2, monkeypatch)
    capsys.readouterr()
    later = ("--snapshot-every-tokens", str(5 * TPS), "--snapshot-log-points", "3")
    # spaced by the new value they would be 96, 164, 281 tokens: steps 1, 2, 3
    assert SnapshotSchedule(5 * TPS, 3, TPS).steps(12) == [1, 2, 3, 5, 10]
    rc, out, err = pretrain(run_flags(run, dataset, 12, "--save-every", "0", *later, "--resume", "auto"), capsys)
    assert rc == 0, err
    assert snapshot_steps(run) == [1, 3, 5, 6, 10, 12]
    assert "spaced by this start's --snapshot-every-tokens they would end at 480 tokens" in out
    assert "--snapshot-every-tokens 1152 -> 480" in out

    # another count of log points: spaced over the first start's span (96 to 1152 tokens), the passed ones
    # (at or before the resumed step) not taken; the snapshots taken stay as they are
    run2 = tmp_path / "run2"
    stopped_at(run_flags(run2, dataset, 12, "--save-every", "0", *first), 2, monkeypatch)
    capsys.readouterr()
    denser = ("--snapshot-every-tokens", str(12 * TPS), "--snapshot-log-points", "6")
    respaced = SnapshotSchedule(12 * TPS, 6, TPS, log_end=12 * TPS)
    assert respaced.log_steps() == [1, 2, 3, 4, 6, 8]
    rc, out, err = pretrain(run_flags(run2, dataset, 12, "--save-every", "0", *denser, "--resume", "auto"), capsys)
    assert rc == 0, err
    assert snapshot_steps(run2) == [1, 3, 4, 6, 8, 12]  # step 2, passed before the resume, is not taken
    assert "--snapshot-log-points 3 -> 6: the log-spaced points are spaced anew over the run's first span from 96 " \
           "to 1152 tokens (steps 1, 2, 3, 4, 6, 8)" in out


def test_a_checkpoint_without_a_recorded_schedule_follows_its_config(dataset, tmp_path, capsys, monkeypatch):
    """A checkpoint written before the schedule was recorded (its meta.json holds none): the resume spaces
    the log points as the checkpoint's own recorded config did."""
    run = tmp_path / "run"
    snaps = ("--snapshot-every-tokens", "0", "--snapshot-log-points", "4")
    real_record = SnapshotSchedule.record
    with monkeypatch.context() as m:   # the first start writes checkpoints as the earlier code did
        m.setattr(SnapshotSchedule, "record", lambda self: None)
        stopped_at(run_flags(run, dataset, 20, "--save-every", "0", *snaps), 2, monkeypatch)
    meta = json.loads((run / "checkpoints" / "step_00000002" / "meta.json").read_text())
    assert meta.get("snapshot_schedule") is None
    assert SnapshotSchedule.record is real_record
    assert recorded_schedule(run / "checkpoints" / "step_00000002").steps(20) == [1, 3, 5, 10]
    capsys.readouterr()
    rc, _, err = pretrain(run_flags(run, dataset, 24, "--save-every", "0", *snaps, "--resume", "auto"), capsys)
    assert rc == 0, err
    assert snapshot_steps(run) == [1, 3, 5, 10, 24]


def test_a_resume_on_another_number_of_ranks_keeps_the_log_points(dataset, tmp_path):
    """Started on 2 ranks (gloo) for 8 steps with 3 log points (steps 1, 2, 4), resumed on 1 for 64: the
    first start's points stand (64 steps spaced afresh would give steps 1, 4, 16)."""
    run = tmp_path / "run"
    snaps = ("--snapshot-every-tokens", "0", "--snapshot-log-points", "3", "--save-every", "4")
    run_pretrain(run_flags(run, dataset, 8, *snaps), nproc=2)
    assert snapshot_steps(run) == [1, 2, 4, 8]
    assert SnapshotSchedule(0, 3, TPS, 64 * TPS).steps(64) == [1, 4, 16]
    out = run_pretrain(run_flags(run, dataset, 64, *snaps, "--save-every", "32", "--resume", "auto")).stdout
    assert "(saved by 2 ranks, resumed on 1)" in out
    assert snapshot_steps(run) == [1, 2, 4, 8, 64]
    assert re.search(r"keep the spacing of the run's first start: 3 points from 96 to 768 tokens \(steps 1, 2, 4\)", out)
