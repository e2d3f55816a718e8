"""Resume on another number of ranks (plain PyTorch / DDP with gloo on CPU): 2 processes -> 1 -> 3, each
resuming the previous one's checkpoint with --resume auto, must follow the uninterrupted one-process run:
the same data in the same order (the losses agree to float round-off; different rank counts sum the
gradients in a different order, so bitwise equality is not expected) and no step or token skipped."""
from __future__ import annotations

import json

import pytest

from checkpoint_utils import losses, make_dataset, run_flags, run_pretrain

TOKENS_PER_STEP = 6 * 16


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return make_dataset(tmp_path_factory.mktemp("data"))


def test_resume_on_2_then_1_then_3_ranks(dataset, tmp_path):
    reference = tmp_path / "reference"
    run_pretrain(run_flags(reference, dataset, 12, "--save-every", "4"))
    ref = losses(reference)

    run = tmp_path / "run"
    for nproc, steps in ((2, 4), (1, 8), (3, 12)):
        out = run_pretrain(run_flags(run, dataset, steps, "--save-every", "4", "--resume", "auto"), nproc=nproc).stdout
        meta = json.loads((run / "checkpoints" / f"step_{steps:08d}" / "meta.json").read_text())
        assert meta["world_size"] == nproc
        if steps > 4:
            prev = {8: 2, 12: 1}[steps]
            assert f"resumed from {run / 'checkpoints' / f'step_{steps - 4:08d}'} at step {steps - 4}" in out
            assert f"(saved by {prev} ranks, resumed on {nproc})" in out

    got = losses(run)
    assert sorted(got) == list(range(1, 13)) and all(len(v) == 1 for v in got.values()), got
    for step in range(1, 13):
        assert got[step][0] == pytest.approx(ref[step][0], rel=2e-5, abs=2e-5), (step, got[step], ref[step])
    # the tolerance must be far below the loss differences between batches, or it could hide a data shift
    diffs = sorted(abs(ref[s + 1][0] - ref[s][0]) for s in range(1, 12))
    assert diffs[len(diffs) // 2] > 1e-3
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["tokens"] for r in rows] == [s * TOKENS_PER_STEP for s in range(1, 13)]
