"""What a run logs, read back against independent references: TensorBoard's event files read with
tensorboard's own EventAccumulator (as its UI reads a run directory) against metrics.jsonl, the rows and
summary.json of a run stopped by a signal between log steps, and the console's ETA against the test's own
clock."""
from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
import torch

from checkpoint_utils import make_dataset, run_flags
from pretrain.callbacks import Callback


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return make_dataset(tmp_path_factory.mktemp("data"))


def _rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _tensorboard_steps(run: Path, tag: str) -> list[tuple[int, float]]:
    """(step, value) of `tag` as TensorBoard shows the run: all event files of the directory, in order, with
    its purging of the steps a restarted writer declared superseded."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(run / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


class CrashAfter(Callback):
    """Raises after the row of step `step` is logged: a crash between checkpoints."""

    def __init__(self, step: int) -> None:
        self.step = step

    def post_step(self, progress) -> None:
        if progress.step == self.step:
            raise RuntimeError("crash")


def test_tensorboard_shows_each_step_once_after_a_resume_replays_steps(dataset, tmp_path):
    """A crash after step 3 with the newest checkpoint at step 2: the resume replays step 3 and logs it
    again. metrics.jsonl keeps both rows (docs/checkpoints.md, Exactness); TensorBoard shows every step
    once, with the values of the last row written for it, not a second segment running back to step 3."""
    from pretrain.config import parse_config
    from pretrain.trainer import Trainer
    torch.set_num_threads(1)
    run = tmp_path / "run"
    with pytest.raises(RuntimeError, match="crash"):
        Trainer(parse_config(run_flags(run, dataset, 5, "--save-every", "2")), callbacks=[CrashAfter(3)]).fit()
    time.sleep(1.1)  # event files are named by the second they were opened in, and read in that order
    Trainer(parse_config(run_flags(run, dataset, 5, "--save-every", "2", "--resume", "auto"))).fit()
    rows = _rows(run)
    assert [r["step"] for r in rows] == [1, 2, 3, 3, 4, 5]
    final = {r["step"]: r for r in rows}  # the last row of each step
    for key in ("loss", "grad_norm", "tokens"):
        shown = _tensorboard_steps(run, f"train/{key}")
        assert [s for s, _ in shown] == [1, 2, 3, 4, 5], key
        assert [v for _, v in shown] == pytest.approx([final[s][key] for s in range(1, 6)], rel=1e-6), key


class SignalAfter(Callback):
    """Sends this process SIGTERM after step `step` (as Slurm's warning would), and records every step's loss."""

    def __init__(self, step: int) -> None:
        self.step = step
        self.losses: dict[int, float] = {}

    def post_train_batch(self, progress, result) -> None:
        self.losses[progress.step] = result.loss

    def post_step(self, progress) -> None:
        if progress.step == self.step:
            os.kill(os.getpid(), signal.SIGTERM)


def test_a_stop_between_log_steps_logs_the_step_it_stops_at(dataset, tmp_path, capsys):
    """--log-every 5 and SIGTERM after step 7: the run stops at step 7 with a checkpoint of it, so the resume
    starts at step 8 and step 7 is never trained again. Its row is logged at the stop (console, metrics.jsonl,
    TensorBoard), and summary.json's final_loss is step 7's loss, not step 5's."""
    from pretrain.config import parse_config
    from pretrain.trainer import Trainer
    torch.set_num_threads(1)
    run = tmp_path / "run"
    watch = SignalAfter(7)
    summary = Trainer(parse_config(run_flags(run, dataset, 20, "--log-every", "5", "--save-every", "0")),
                      callbacks=[watch]).fit()
    assert summary["stop"] == "signal" and summary["step"] == 7
    rows = _rows(run)
    assert [r["step"] for r in rows] == [5, 7]
    assert rows[-1]["loss"] == watch.losses[7] and rows[-1]["tokens"] == 7 * 6 * 16
    assert summary["final_loss"] == watch.losses[7]
    assert json.loads((run / "summary.json").read_text())["final_loss"] == watch.losses[7]
    assert [s for s, _ in _tensorboard_steps(run, "train/loss")] == [5, 7]
    assert "step 7/20" in capsys.readouterr().out


class SlowFirstStepClock(Callback):
    """Makes the first step of the process slow (a compile's stand-in: SpeedMonitor keeps it out of the rate)
    and stamps the end of every step with the test's own clock."""

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s
        self.ends: dict[int, float] = {}
        self.first = True

    def pre_step(self, progress) -> None:
        if self.first:
            self.first = False
            time.sleep(self.delay_s)

    def post_step(self, progress) -> None:
        self.ends[progress.step] = time.time()


def test_eta_leaves_out_the_one_off_first_step(dataset, tmp_path, monkeypatch):
    """The ETA is the remaining steps at the pace of the steps that recur. A first step that took 3 s (on a
    GPU, minutes of compiling) is not charged to each remaining step: at step 6 of 12 the ETA matches 6 x
    the mean step time measured here from step 2 on, not (3 s + 5 steps) / 6 x 6."""
    import pretrain.metrics as M
    from pretrain.config import parse_config
    from pretrain.trainer import Trainer
    torch.set_num_threads(1)
    etas: list[float] = []
    fmt = M._fmt_duration
    monkeypatch.setattr(M, "_fmt_duration", lambda s: etas.append(s) or fmt(s))
    clock = SlowFirstStepClock(3.0)
    Trainer(parse_config(run_flags(tmp_path / "run", dataset, 12, "--log-every", "6", "--save-every", "0")),
            callbacks=[clock]).fit()
    assert len(etas) == 2 and etas[1] == 0.0  # rows of steps 6 and 12
    per_step = (clock.ends[6] - clock.ends[1]) / 5  # steps 2-6, by the test's clock
    assert etas[0] == pytest.approx(6 * per_step, rel=0.5, abs=0.3)
    assert etas[0] < 1.5  # the first step's 3 s would add 3 s / 6 x 6 = 3 s


def test_eta_is_unknown_until_a_recurring_step_is_timed():
    """A row whose steps were all one-off (the first, compiling step at --log-every 1) has no pace to go by:
    the ETA says '?' rather than the compile time x the remaining steps; the last step's ETA is 0."""
    from pretrain.metrics import Progress
    row = {"loss": 1.0, "lr": 1e-3, "tokens_per_s": None}
    progress = Progress(total_steps=100, enabled=True)
    progress.start -= 60.0  # a first step that compiled for a minute
    import io
    from contextlib import redirect_stdout
    out = io.StringIO()
    with redirect_stdout(out):
        progress.line(1, row, 1, one_off_s=60.0, one_off_steps=1)
        progress.line(100, row, 100, one_off_s=60.0, one_off_steps=1)
    first, last = out.getvalue().splitlines()
    assert first.endswith("ETA ?") and last.endswith("ETA 0m00s")


def test_summary_json_speaks_for_the_newest_start_only(tmp_path):
    """A finished run's summary.json ("finished" at step 3) is removed when the run is started again, so a
    start that stops without writing its own (here: too many non-finite steps, exit 3) leaves none, rather
    than the earlier start's "finished" for a run that has since moved on and stopped."""
    import subprocess

    from checkpoint_utils import env, make_dataset, pretrain_cmd, run_flags, run_pretrain
    data = make_dataset(tmp_path / "data")
    run = tmp_path / "run"
    run_pretrain(run_flags(run, data, 3, "--save-every", "3"))
    assert json.loads((run / "summary.json").read_text())["stop"] == "finished"
    e = {**env(), "LINSCALE_INJECT_NONFINITE": "4,5"}
    p = subprocess.run(pretrain_cmd(run_flags(run, data, 6, "--resume", "auto", "--max-bad-steps", "2")), env=e,
                       capture_output=True, text=True, timeout=240)
    assert p.returncode == 3, p.stdout[-2000:] + p.stderr[-2000:]
    assert not (run / "summary.json").exists()
    assert os.path.isdir(run / "checkpoints")


def test_console_lines_come_from_rank_zero_unless_every_rank_speaks_and_then_name_their_rank(
        monkeypatch, capsys):
    from pretrain.logs import get_logger
    log = get_logger("test.ranks")
    for rank in ("0", "2"):
        monkeypatch.setenv("RANK", rank)
        log.info("plain")
        log.warning("every rank", extra={"all_ranks": True})
    out, err = capsys.readouterr()
    assert out.splitlines() == ["[linscale] plain"]
    assert err.splitlines() == ["[linscale rank 0] WARNING: every rank", "[linscale rank 2] WARNING: every rank"]
