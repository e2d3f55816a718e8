"""A run resumed with settings changed, checked against references of its own: the AdamW update computed
by hand, a run's config.json replayed with --config, and an uninterrupted run's losses, learning rates,
snapshots and exports. Tiny models, a few steps, in this process."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from checkpoint_utils import one_thread, small_dataset  # noqa: F401  (fixtures)
from checkpoint_utils import losses, run_flags


def _main(argv: list) -> int:
    from pretrain.trainer import main
    return main([str(a) for a in argv])


def _resumed_step(run: Path, dataset: Path, *extra: str) -> tuple[dict, dict, list[dict], set[str]]:
    """Resume `run` (--resume auto) with `extra` flags, take one optimizer step through the train module:
    the weights before and after it, the optimizer's groups after it, and the names of the decayed
    parameters (the first group's)."""
    from pretrain.config import parse_config
    from pretrain.trainer import Trainer
    flags = run_flags(run, dataset, 10, "--resume", "auto", *extra, arch="hgrn2")
    trainer = Trainer(parse_config([str(a) for a in flags]))
    try:
        model = trainer.module.model
        before = {k: v.detach().clone() for k, v in model.named_parameters()}
        decayed = {id(p) for p in trainer.module.optimizer.param_groups[0]["params"]}
        names = {k for k, p in model.named_parameters() if id(p) in decayed}
        micro = [trainer.loader.next_batch() for _ in range(trainer.accum)]
        res = trainer.module.train_step(micro, trainer.step)
        assert not res.skipped
        after = {k: v.detach().clone() for k, v in model.named_parameters()}
        groups = [{k: v for k, v in g.items() if k != "params"} for g in trainer.module.optimizer.param_groups]
    finally:
        trainer.close()
    return before, after, groups, names


def test_resume_trains_with_the_changed_adamw_settings(dataset, tmp_path):
    """Loading the checkpoint's optimizer state brings back the weight decay, betas and eps it was saved
    with; a resume with other values must train with those. AdamW's decay is decoupled from the Adam
    update, so from the same weights and batch, one step with --weight-decay 0 differs from one with the
    checkpoint's 0.1 by exactly lr x 0.1 x w on the decayed weights and not at all on the others (HGRN2's
    lower bounds are never decayed)."""
    run = tmp_path / "run"
    assert _main(run_flags(run, dataset, 3, arch="hgrn2")) == 0   # weight decay 0.1 (the default), warm-up 3 steps
    w0, kept, _, names = _resumed_step(run, dataset)
    w0_again, no_decay, groups, _ = _resumed_step(run, dataset, "--weight-decay", "0")
    lr = 3e-3  # step 4 is past the 3 warm-up steps: the full --lr
    assert names and len(names) < len(w0)
    for k in w0:
        assert torch.equal(w0[k], w0_again[k])
        if k in names:
            torch.testing.assert_close(no_decay[k] - kept[k], lr * 0.1 * w0[k], rtol=1e-3, atol=1e-8)
        else:
            assert torch.equal(no_decay[k], kept[k]), k
    assert [g["weight_decay"] for g in groups] == [0.0, 0.0]
    _, _, groups, _ = _resumed_step(run, dataset, "--beta1", "0.8", "--beta2", "0.99", "--eps", "1e-6",
                                    "--weight-decay", "0.05", "--lr", "1e-3")
    assert [(g["lr"], tuple(g["betas"]), g["eps"], g["weight_decay"]) for g in groups] == \
        [(1e-3, (0.8, 0.99), 1e-6, 0.05), (1e-3, (0.8, 0.99), 1e-6, 0.0)]


def test_a_runs_config_json_does_not_carry_how_it_was_started(tmp_path):
    """config.json of a start with --overwrite (or --resume) records that start's `overwrite`/`resume`;
    replayed with --config they would move aside, or resume, a run this command does not name, and
    `--config RUN/config.json --resume auto` would be refused as contradicting an --overwrite never given.
    A hand-written config's `resume` is still a setting."""
    from pretrain.config import parse_config, save_config
    path = tmp_path / "config.json"
    first = parse_config(["--out", str(tmp_path / "a"), "--overwrite"])
    save_config(first, path)
    assert json.loads(path.read_text())["overwrite"] is True
    again = parse_config(["--config", str(path), "--resume", "auto"])
    assert (again.resume, again.overwrite, again.run_dir) == ("auto", False, tmp_path / "a")
    other = parse_config(["--config", str(path), "--out", str(tmp_path / "b")])
    assert (other.resume, other.overwrite) == (None, False)
    resumed = parse_config(["--out", str(tmp_path / "a"), "--resume", str(tmp_path / "a" / "checkpoints" / "step_1")])
    save_config(resumed, path)
    assert parse_config(["--config", str(path), "--out", str(tmp_path / "c")]).resume is None
    (tmp_path / "run.yaml").write_text("resume: auto\n")
    assert parse_config(["--config", str(tmp_path / "run.yaml")]).resume == "auto"


def test_extended_resume_with_another_micro_batch_follows_the_uninterrupted_run(dataset, tmp_path):
    """A run finished at step 3, extended to 6 with --micro-batch 2 (the same global batch): the same
    losses as the uninterrupted 6-step run (to float round-off: the batch is summed in another order), the
    warm-up-then-constant learning rate of the schedule by hand, snapshots at the same token counts (plus
    the finished run's own at step 3), and `export.py --all` gives the snapshots' weights."""
    import sys
    from safetensors.torch import load_file
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "launch"))
    import export
    snaps = ("--snapshot-every-tokens", str(2 * 96), "--snapshot-log-points", "0")
    ref, run = tmp_path / "ref", tmp_path / "run"
    assert _main(run_flags(ref, dataset, 6, *snaps)) == 0
    assert _main(run_flags(run, dataset, 3, *snaps)) == 0
    assert _main(run_flags(run, dataset, 6, *snaps, "--resume", "auto", micro=2)) == 0
    got, want = losses(run), losses(ref)
    assert sorted(got) == list(range(1, 7)) and all(len(v) == 1 for v in got.values())
    for s in range(1, 7):
        assert got[s][0] == pytest.approx(want[s][0], rel=1e-5)
    rows = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["tokens"]) for r in rows] == [(s, 96 * s) for s in range(1, 7)]
    assert [r["lr"] for r in rows] == pytest.approx([1e-3, 2e-3, 3e-3, 3e-3, 3e-3, 3e-3])
    names = sorted(p.name for p in (run / "snapshots").iterdir())
    assert names == ["step_00000002", "step_00000003", "step_00000004", "step_00000006"]
    assert sorted(p.name for p in (ref / "snapshots").iterdir()) == ["step_00000002", "step_00000004",
                                                                     "step_00000006"]
    assert export.main([str(run), "--all"]) == 0
    for name in names:
        exported = load_file(str(run / "exports" / name / "model.safetensors"))
        snap = load_file(str(run / "snapshots" / name / "model.safetensors"))
        assert exported.keys() == snap.keys() and all(torch.equal(exported[k], snap[k]) for k in snap)
        assert json.loads((run / "exports" / name / "config.json").read_text())["tokens"] == 96 * int(name[5:])
        if (ref / "snapshots" / name).is_dir():
            other = load_file(str(ref / "snapshots" / name / "model.safetensors"))
            for k in other:
                torch.testing.assert_close(snap[k], other[k], rtol=1e-4, atol=1e-6)
