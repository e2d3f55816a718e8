"""Resume on another number of ranks (plain PyTorch / DDP with gloo on CPU): 2 processes -> 1 -> 3, each
resuming the previous one's checkpoint with --resume auto, must follow the uninterrupted one-process run:
the same data in the same order (the losses agree to float round-off; different rank counts sum the
gradients in a different order, so bitwise equality is not expected) and no step or token skipped."""
from __future__ import annotations

import json
import re

import pytest
import torch

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
            assert f"(saved by {prev} rank{'s' if prev > 1 else ''}, resumed on {nproc})" in out

    got = losses(run)
    assert sorted(got) == list(range(1, 13)) and all(len(v) == 1 for v in got.values()), got
    for step in range(1, 13):
        assert got[step][0] == pytest.approx(ref[step][0], rel=2e-5, abs=2e-5), (step, got[step], ref[step])
    # the tolerance must be far below the loss differences between batches, or it could hide a data shift
    diffs = sorted(abs(ref[s + 1][0] - ref[s][0]) for s in range(1, 12))
    assert diffs[len(diffs) // 2] > 1e-3
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["tokens"] for r in rows] == [s * TOKENS_PER_STEP for s in range(1, 13)]


def test_deepspeed_zero2_resume_on_2_then_1_then_3_ranks_and_export(dataset, tmp_path):
    """The same under DeepSpeed ZeRO-2: the manager converts the ZeRO shards to a universal checkpoint when
    the rank count changes. Then the final ZeRO checkpoint, consolidated by export (zero_to_fp32), must hold
    the same weights as the snapshot of that step (taken through DeepSpeedTrainModule.full_state_dict)."""
    pytest.importorskip("deepspeed")
    from safetensors.torch import load_file

    from checkpoints.export import Source, export_one

    reference = tmp_path / "reference"
    run_pretrain(run_flags(reference, dataset, 12, "--save-every", "4"))
    ref = losses(reference)

    run = tmp_path / "run"
    for nproc, steps in ((2, 4), (1, 8), (3, 12)):
        out = run_pretrain(run_flags(run, dataset, steps, "--save-every", "4", "--resume", "auto", "--zero", "2",
                                     "--snapshot-every-tokens", str(4 * TOKENS_PER_STEP)), nproc=nproc).stdout
        # DeepSpeed's files were staged and written in the background, hashed on the way (every rank's
        # shard + the model states + every rank's trainer state; only small side files are read back)
        m = re.search(rf"checkpoint step_{steps:08d} saved \(background.* (\d+) of (\d+) files hashed while written", out)
        assert m and int(m.group(1)) >= 2 * nproc + 1, out[-2000:]
        if steps > 4:
            assert "converting it to a DeepSpeed universal checkpoint" in out
            assert f"at step {steps - 4}" in out
    got = losses(run)
    assert sorted(got) == list(range(1, 13)) and all(len(v) == 1 for v in got.values()), got
    for step in range(1, 13):
        assert got[step][0] == pytest.approx(ref[step][0], rel=2e-5, abs=2e-5), (step, got[step], ref[step])

    ckpt = run / "checkpoints" / "step_00000012"
    exported = export_one(Source(12, "checkpoint", ckpt), tmp_path / "export_from_zero")
    from_zero = load_file(str(exported / "model.safetensors"))
    from_snapshot = load_file(str(run / "snapshots" / "step_00000012" / "model.safetensors"))
    assert from_zero.keys() == from_snapshot.keys()
    for k in from_zero:
        assert torch.equal(from_zero[k], from_snapshot[k]), k


def test_adamw_steps_move_to_their_parameters_device_after_a_universal_load():
    """DeepSpeed's universal loader leaves AdamW's `step` a CPU tensor (or a number); fused AdamW refuses a
    step off its parameter's device. ZeRO-3 keeps its fp32 partitions out of `param_groups` between steps,
    so the state must be walked by its keys. The meta device stands in for the GPU here."""
    from types import SimpleNamespace

    from pretrain.deepspeed_module import steps_to_param_device
    on_gpu, on_cpu = torch.empty(8, device="meta"), torch.empty(8)
    state = {on_gpu: {"step": torch.tensor(5.0)}, on_cpu: {"step": 7}}
    # ZeRO-3 between steps: the group keeps its options and an empty parameter list
    steps_to_param_device(SimpleNamespace(param_groups=[{"fused": True, "params": []}], state=state))
    assert state[on_gpu]["step"].device.type == "meta" and state[on_gpu]["step"].dtype == torch.float32
    assert torch.is_tensor(state[on_cpu]["step"]) and state[on_cpu]["step"].item() == 7.0
    # a non-fused AdamW takes CPU steps as they are
    plain = {on_gpu: {"step": torch.tensor(5.0)}}
    steps_to_param_device(SimpleNamespace(param_groups=[{"fused": False, "params": []}], state=plain))
    assert plain[on_gpu]["step"].device.type == "cpu"
