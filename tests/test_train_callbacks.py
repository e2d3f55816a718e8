"""The train module contract and the callbacks: both engines are TrainModules (an incomplete one cannot be
built); a callback sees every step through its hooks with the run's own counters, adds its field to the
metrics rows, and its state rides in the resume checkpoint so that a resumed run ends where an
uninterrupted one does."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from checkpoint_utils import make_dataset, run_flags
from pretrain.callbacks import Callback


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return make_dataset(tmp_path_factory.mktemp("data"))


def test_engines_implement_the_train_module_contract():
    from pretrain.deepspeed_module import DeepSpeedTrainModule
    from pretrain.train_module import TorchTrainModule, TrainModule
    assert issubclass(TorchTrainModule, TrainModule) and issubclass(DeepSpeedTrainModule, TrainModule)

    class Incomplete(TrainModule):  # no train_step, no checkpoint contract
        def eval_loss(self, batches):
            return 0.0

    with pytest.raises(TypeError, match="abstract"):
        Incomplete()


class LossSum(Callback):
    """Sums the losses it is shown, adds the sum to every metrics row, and records the hooks it gets."""

    def __init__(self) -> None:
        self.loss_sum = 0.0
        self.steps_seen: list[int] = []
        self.hooks: list[str] = []

    def state_dict(self) -> dict:
        return {"test_loss_sum": self.loss_sum}

    def load_state_dict(self, state: dict) -> None:
        self.loss_sum = state.get("test_loss_sum", 0.0)

    def post_attach(self) -> None:
        self.hooks.append("post_attach")

    def pre_step(self, progress) -> None:
        self.hooks.append(f"pre_step {progress.step}")

    def post_train_batch(self, progress, result) -> None:
        self.hooks.append(f"post_train_batch {progress.step}")
        self.steps_seen.append(progress.step)
        self.loss_sum += result.loss

    def pre_log_metrics(self, progress, row) -> None:
        row["test_loss_sum"] = self.loss_sum

    def post_step(self, progress) -> None:
        self.hooks.append(f"post_step {progress.step}")

    def post_train(self, stop_reason: str) -> None:
        self.hooks.append(f"post_train {stop_reason}")

    def close(self) -> None:
        self.hooks.append("close")


def _rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_a_callback_sees_every_step_and_its_state_survives_a_resume(dataset, tmp_path):
    from pretrain.config import parse_config
    from pretrain.trainer import Trainer
    torch.set_num_threads(1)
    ref_cb = LossSum()
    ref = tmp_path / "ref"
    Trainer(parse_config(run_flags(ref, dataset, 4, "--save-every", "2")), callbacks=[ref_cb]).fit()
    rows = _rows(ref)
    assert ref_cb.hooks == ["post_attach"] + [h for s in range(4) for h in
                                              (f"pre_step {s}", f"post_train_batch {s + 1}", f"post_step {s + 1}")] \
        + ["post_train finished", "close"]
    # the row of step s carries the sum of the losses of steps 1..s, as the trainer logged them
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert [r["test_loss_sum"] for r in rows] == pytest.approx([sum(r["loss"] for r in rows[:i + 1]) for i in range(4)])

    # stopped after step 2 (its checkpoint holds the callback's sum), resumed to step 4 with a new callback
    run = tmp_path / "run"
    Trainer(parse_config(run_flags(run, dataset, 2, "--save-every", "2")), callbacks=[LossSum()]).fit()
    resumed = LossSum()
    Trainer(parse_config(run_flags(run, dataset, 4, "--save-every", "2", "--resume", "auto")),
            callbacks=[resumed]).fit()
    assert resumed.steps_seen == [3, 4]
    assert resumed.loss_sum == pytest.approx(ref_cb.loss_sum, rel=1e-6)
    assert _rows(run)[-1]["test_loss_sum"] == pytest.approx(rows[-1]["test_loss_sum"], rel=1e-6)


def test_speed_monitor_warns_when_one_step_reaches_dynamos_recompile_limit(monkeypatch, capsys):
    """A step that built as many graphs as Dynamo's recompile limit says so (blocks that each recompile run
    eagerly past the limit); one graph, the regional compile's usual count, only logs the compile time."""
    import pretrain.monitors as M
    from pretrain.callbacks import TrainProgress
    from torch._dynamo import config as dynamo_config

    graphs = [0]
    monkeypatch.setattr(M, "compiled_graph_count", lambda: graphs[0])
    mon = M.SpeedMonitor(torch.device("cpu"), 100, 1e9, 1, None)
    for step, built in ((1, 1), (2, dynamo_config.recompile_limit)):
        mon.pre_step(TrainProgress(step=step))
        graphs[0] += built
        mon.post_train_batch(TrainProgress(step=step), None)
    out = capsys.readouterr()
    assert "step 1: torch.compile built 1 graph(s)" in out.out
    assert "step 1:" not in out.err
    assert f"step 2: torch.compile built {dynamo_config.recompile_limit} graphs in one step" in out.err
    assert "TORCH_LOGS=recompiles" in out.err and "--no-compile" in out.err


def test_a_start_that_trains_nothing_keeps_the_runs_final_loss(dataset, tmp_path):
    """A finished run started again (a job resubmitted, `--resume auto` at the same limit) trains nothing;
    its summary still gives the run's final loss and validation loss, from its own metrics row."""
    from pretrain.config import parse_config
    from pretrain.trainer import Trainer
    torch.set_num_threads(1)
    run = tmp_path / "run"
    flags = run_flags(run, dataset, 2, "--save-every", "2", "--eval-every", "2", "--eval-batches", "1")
    first = Trainer(parse_config(flags)).fit()
    assert first["final_loss"] is not None and first["val_loss"] is not None
    (run / "summary.json").unlink()  # as pretrain.sbatch does before each attempt
    again = Trainer(parse_config(flags + ["--resume", "auto"])).fit()
    assert (again["step"], again["final_loss"], again["val_loss"]) == (2, first["final_loss"], first["val_loss"])
    assert json.loads((run / "summary.json").read_text())["final_loss"] == first["final_loss"]
