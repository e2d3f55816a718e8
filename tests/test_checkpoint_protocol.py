"""The ranks' save protocol under adversarial timing (checkpoints/markers.py): 2-4 gloo ranks on CPU save a
checkpoint hundreds of times in a row, each rank sleeping a random few milliseconds at every step of the
protocol (before and after each file and marker write, each fsync, the marker's rename, rank 0's reading of
the markers, its removal of `parts/`, the manifest, the publish) and inside every directory fsync, where a
rank that touched `parts/` after publishing its marker once lost a save to rank 0's cleanup. Every save
must be published, every kept checkpoint intact, no rank may see an error.

CI runs a few hundred saves in total (tiny tensors, millisecond delays, fsync stubbed out: its cost is
time, which the delays stand in for); `LINSCALE_STRESS_SAVES=2000` runs that many per world size (an
opt-in stress run)."""
from __future__ import annotations

import json
import os
import multiprocessing as mp
from pathlib import Path

import pytest


DELAYS = (0.0, 0.0, 0.0005, 0.002, 0.006)  # seconds, drawn at every point of the protocol


def _worker(rank: int, world: int, saves: int, run: Path, result: Path, fail: tuple[int, int] | None = None) -> None:
    """One rank (a forked child of the test process: no second torch import): saves `saves` checkpoints
    through the real CheckpointManager with random delays everywhere, stopping as the training loop does;
    writes what it saw to `result`. `fail=(rank, step)`: that rank's disk is full during that step's save."""
    import random
    import time
    import traceback
    from types import SimpleNamespace

    import torch
    import torch.distributed as dist
    from torch import nn

    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"file://{run}.store", rank=rank, world_size=world)
        import checkpoints.atomic as atomic
        import checkpoints.manager as manager
        import checkpoints.markers as markers
        from checkpoints.manager import CheckpointManager
        from checkpoints.run_dir import write_run_id
        from pretrain.config import parse_config
        from pretrain.distributed import DistEnv
        from pretrain.callbacks import TrainProgress
        from pretrain.train_module import TorchTrainModule

        rng = random.Random(1000 * rank + 7)
        hits: dict[str, int] = {}

        def hook(point: str, r: int) -> None:
            hits[point] = hits.get(point, 0) + 1
            time.sleep(rng.choice(DELAYS))

        real_fsync_dir = atomic.fsync_dir

        def slow_fsync_dir(path) -> None:
            time.sleep(rng.choice(DELAYS))
            real_fsync_dir(path)
            time.sleep(rng.choice(DELAYS))

        markers.HOOK = hook
        # every module that fsyncs a directory during a save gets the slow one; fsync itself costs only
        # time here (the injected delays stand in for it), so it is stubbed out to keep the saves fast
        for mod in (atomic, markers, manager):
            mod.fsync_dir = slow_fsync_dir
        os.fsync = lambda fd: None

        cfg = parse_config(["--out", str(run), "--save-every", "1", "--keep-last", "3", "--snapshot-every-tokens",
                            "0", "--snapshot-log-points", "0", "--max-steps", str(saves), "--device", "cpu"])
        model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 3))
        progress = TrainProgress()
        # the trainer's own state, as the manager sees it (a stand-in for pretrain.trainer.Trainer)
        trainer = SimpleNamespace(state_dict=lambda: {"step": progress.step, "rank": rank,
                                                      "payload": torch.full((16,), float(progress.step))},
                                  load_state_dict=lambda state: None)
        module = TorchTrainModule(model, cfg.optim, torch.device("cpu"), "fp32")
        if rank == 0:
            run.mkdir(parents=True, exist_ok=True)
            write_run_id(run)
        dist.barrier()
        if fail is not None and fail[0] == rank:
            import errno

            import checkpoints.hashio as hashio
            real_write = hashio.HashingFile.write

            def write(self, data):
                if f"step_{fail[1]:08d}.tmp" in str(self.path):
                    raise OSError(errno.ENOSPC, "No space left on device")
                return real_write(self, data)
            hashio.HashingFile.write = write
        from checkpoints.errors import SaveFailed
        mgr = CheckpointManager(cfg, cfg.model(), DistEnv(rank, world, rank, torch.device("cpu")), module, progress,
                                trainer, tokens_per_step=64, flops_per_step_ne=1.0, total_steps=saves)
        mgr.post_attach()
        failure = None
        try:
            reason = None
            for step in range(1, saves + 1):
                reason = mgr.stop_requested()  # as the training loop: every rank agrees to stop
                if reason:
                    break
                progress.step, progress.tokens = step, step * 64
                with torch.no_grad():
                    for p in model.parameters():
                        p.add_(0.01)
                mgr.post_step(progress)  # stages this step's checkpoint; the previous save is finished first
            mgr.post_train(reason or "finished")
        except SaveFailed as err:
            failure = {"message": str(err), "quiet": getattr(err, "quiet", False), "at_step": progress.step}
        mgr.signal.uninstall()
        result.write_text(json.dumps({"rank": rank, "saved": [h["step"] for h in mgr.history], "hits": hits,
                                      "failure": failure}))
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - reported by the test
        result.write_text(json.dumps({"rank": rank, "error": traceback.format_exc()}))
        raise


def run_ranks(tmp_path: Path, world: int, saves: int, fail: tuple[int, int] | None = None) -> list[dict]:
    import torch
    import checkpoints.manager  # noqa: F401 - imported once here, shared by the forked ranks
    import pretrain.config  # noqa: F401
    torch.optim.AdamW([torch.zeros(1, requires_grad=True)])  # its first use imports torch._dynamo (seconds)
    ctx = mp.get_context("fork")  # the children share this process's imports: starting a rank takes ms
    run = tmp_path / "run"
    results = [tmp_path / f"rank{r}.json" for r in range(world)]
    procs = [ctx.Process(target=_worker, args=(r, world, saves, run, results[r], fail)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=600)
    out = []
    for r, (p, res) in enumerate(zip(procs, results)):
        data = json.loads(res.read_text()) if res.exists() else {"error": f"no result (exit code {p.exitcode})"}
        assert p.exitcode == 0 and "error" not in data, f"rank {r}: {data.get('error')}"
        out.append(data)
    return out


@pytest.mark.parametrize("world,saves", [(2, 120), (3, 60), (4, 80)])
def test_saves_under_random_delays_at_every_protocol_step(tmp_path, world, saves):
    saves = int(os.environ.get("LINSCALE_STRESS_SAVES", saves))
    results = run_ranks(tmp_path, world, saves)
    rank0 = results[0]
    assert rank0["saved"] == list(range(1, saves + 1))  # rank 0 published every one
    # the delays really were injected at every point of the protocol, on every rank
    for res in results:
        for point in ("rank_writing", "rank_files_durable", "marker_written", "marker_fsynced", "parts_fsynced",
                      "marker_published"):
            assert res["hits"].get(point) == saves, (res["rank"], point, res["hits"])
    for point in ("markers_seen", "parts_removed", "manifest_written", "published"):
        assert rank0["hits"].get(point) == saves, (point, rank0["hits"])
    from checkpoints.manifest import verify
    ckpts = tmp_path / "run" / "checkpoints"
    kept = sorted(p.name for p in ckpts.iterdir() if p.is_dir())
    assert kept == [f"step_{s:08d}" for s in range(saves - 2, saves + 1)]
    assert (ckpts / "latest").read_text().strip() == f"step_{saves:08d}"
    for name in kept:
        assert verify(ckpts / name) is None
        assert sorted(os.listdir(ckpts / name / "trainer")) == [f"rank_{r:05d}.pt" for r in range(world)]
        assert not (ckpts / name / "parts").exists()


@pytest.mark.parametrize("fail_rank", [0, 1])
def test_a_full_disk_on_one_rank_stops_every_rank(tmp_path, fail_rank):
    """ENOSPC while one rank writes its part of step 5's checkpoint: every rank stops (at the same point),
    all with the same message naming step 5 and the full disk (rank 0 prints it, the others exit quietly),
    the partial save is removed and step 4's checkpoint is the intact newest one."""
    results = run_ranks(tmp_path, 3, 40, fail=(fail_rank, 5))
    messages = {r["failure"]["message"] for r in results}
    assert len(messages) == 1, messages
    message = messages.pop()
    assert message.startswith("checkpoint step 5 not written: no space left on "), message
    assert "step_00000004 is intact" in message
    assert [r["failure"]["quiet"] for r in results] == [False, True, True]
    assert len({r["failure"]["at_step"] for r in results}) == 1 and results[0]["failure"]["at_step"] < 10
    from checkpoints.manifest import verify
    ckpts = tmp_path / "run" / "checkpoints"
    assert not list(ckpts.glob("*.tmp")) and (ckpts / "latest").read_text().strip() == "step_00000004"
    assert verify(ckpts / "step_00000004") is None
