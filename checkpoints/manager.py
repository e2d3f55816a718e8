"""The checkpoint manager: resume checkpoints (full state, kept k at a time), weights-only snapshots on a
schedule (never removed), background saving, graceful stop on signals, and resume.

How a save stays crash-safe with several ranks: every rank writes and fsyncs its files in `step_N.tmp/`
and then publishes a marker `parts/rank_R.done`, its last touch of the directory (checkpoints/markers.py);
rank 0 waits for all markers, checksums every file into the manifest (written last), renames the
directory to `step_N`, and only then rewrites the `latest` pointer and applies retention. A kill at any
instant leaves either no `step_N` (the `.tmp` is ignored and removed at the next start) or a complete
one; the previous checkpoint is untouched until a newer one is complete. Coordination goes through the
file system, not collectives, so the background threads never start a collective alongside the training
thread's.

A save that fails (disk full, I/O error) on any rank stops training on every rank at the next step
boundary (the stop flag is reduced over ranks with the signal flag), the partial save is removed, and
every rank raises SaveFailed with one message: what was not written, the device, the space needed and
free, and that the previous checkpoint is intact. A save that cannot fit is refused before anything is
written (`_check_space`).

The manager is a training callback (pretrain/callbacks.py): it resumes in `post_attach`, agrees with the
other ranks on stopping in `stop_requested`, saves on its schedule in `post_step`, and writes the final
snapshot and checkpoint in `post_train`. What it saves comes from the train module, through the contract
of `pretrain.train_module.TrainModule` (save_state / load_state / full_state_dict / stage_state), and
from the trainer's own state (`state_dict` / `load_state_dict`: progress, data loader, RNG, callbacks).
"""
from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Protocol

import torch

from checkpoints import markers
from checkpoints.atomic import atomic_write_text, fsync_dir, publish_dir
from checkpoints.disk import device_of, disk_full_cause, free_bytes, headroom, human_bytes, looks_like_short_write
from checkpoints.errors import CheckpointError, SaveFailed
from checkpoints.hashio import FileRecord, save_safetensors, save_torch
from checkpoints.layout import (CHECKPOINTS, EXPORTS, LATEST, META, MODEL_WEIGHTS, MODULE_DIR, PARTS_DIR, SNAPSHOTS,
                                TMP_SUFFIX, TORCH_MODEL, TRAINER_DIR, TRASH_SUFFIX, parse_step, step_dirs, step_name,
                                tmp_dirs)
from checkpoints.manifest import verify, write_manifest
from checkpoints.run_dir import checkpoint_run_id, read_run_id
from checkpoints.schedule import SnapshotSchedule, resumed_schedule, schedule_of_config
from checkpoints.signals import StopSignal
from checkpoints.staging import StagingBuffers
from checkpoints.layout import DEEPSPEED_DIR
from checkpoints.universal import make_universal, needs_universal
from checkpoints.writer import BackgroundWriter
from pretrain.callbacks import Callback, TrainProgress
from pretrain.distributed import DistEnv, all_gather_object, all_reduce_max, barrier, broadcast_object
from pretrain.logs import get_logger
from pretrain.train_module import TrainModule

if TYPE_CHECKING:
    from models import ModelConfig
    from pretrain.config import RunConfig

logger = get_logger(__name__)

PIN_FRACTION = 0.1  # while staging buffers are being page-locked, at most this share of a step goes to it
PIN_MAX_S = 0.05    # ... and at most this long per step (the time since the last step can include an eval)


class Stateful(Protocol):
    """What holds the trainer's own state (progress, data loader, RNG, callbacks): the Trainer."""

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


def code_version() -> dict | None:
    """The git commit of the code that trained (and whether it had uncommitted changes)."""
    root = Path(__file__).resolve().parents[1]
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True,
                                timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return {"commit": commit or None, "dirty": bool(dirty)}


def rank_file(rank: int) -> str:
    return f"rank_{rank:05d}.pt"


# ---------------------------------------------------------------------------------------------------
# finding and pruning checkpoints (plain functions: export and tests use them without a trainer)
# ---------------------------------------------------------------------------------------------------

def find_resume_checkpoint(ckpt_dir: Path, checksums: bool = True,
                           on_skip: Callable[[str], None] = logger.warning, run_id: str | None = None) -> Path | None:
    """The newest complete, intact checkpoint under ckpt_dir (scanning the directories, not trusting the
    `latest` pointer: a crash between publishing and the pointer update leaves the pointer one behind).
    Every newer one that is partial or corrupt is reported through `on_skip`, by name and reason. With
    `run_id`, checkpoints recording another run's id are skipped too (one run's history only)."""
    ckpt_dir = Path(ckpt_dir)
    for tmp in tmp_dirs(ckpt_dir):
        on_skip(f"checkpoint {tmp} was never finished (a save cut short); skipped")
    for _, path in reversed(step_dirs(ckpt_dir)):
        other = checkpoint_run_id(path) if run_id is not None else None
        if other is not None and other != run_id:
            on_skip(f"checkpoint {path} belongs to another run (run id {other}, this run {run_id}); skipped")
            continue
        problem = verify(path, checksums=checksums)
        if problem is None:
            return path
        on_skip(f"checkpoint {path} is incomplete or corrupt: {problem}; skipped")
    return None


def read_latest(ckpt_dir: Path) -> str | None:
    p = Path(ckpt_dir) / LATEST
    return p.read_text().strip() if p.is_file() else None


def apply_retention(ckpt_dir: Path, keep_last: int, upto: int | None = None, run_id: str | None = None) -> list[Path]:
    """Delete resume checkpoints older than the newest `keep_last` complete ones (0 keeps all); the one
    `latest` names is always kept. Never deletes anything newer than step `upto` (the checkpoint just
    published: whatever lies beyond it is not this history's to judge), and with `run_id` never touches a
    checkpoint of another run. A checkpoint counts as kept only when its files have the manifest's sizes,
    so a truncated one never stands in for a good one. Only `ckpt_dir` is touched: snapshots live
    elsewhere and are never removed. Returns what was deleted."""
    if keep_last <= 0:
        return []
    ckpt_dir = Path(ckpt_dir)
    ours = [(s, p) for s, p in step_dirs(ckpt_dir) if (upto is None or s <= upto)
            and (run_id is None or checkpoint_run_id(p) in (None, run_id))]
    good = [(s, p) for s, p in ours if verify(p, checksums=False) is None]
    if len(good) <= keep_last:
        return []
    oldest_kept = good[-keep_last][0]
    latest = read_latest(ckpt_dir)
    deleted = []
    for step, path in ours:
        if step >= oldest_kept or path.name == latest:
            continue
        trash = path.with_name(path.name + TRASH_SUFFIX)  # renamed first: a half-deleted dir must not look loadable
        os.replace(path, trash)
        shutil.rmtree(trash, ignore_errors=True)
        deleted.append(path)
    return deleted


def _engine(zero: int) -> str:
    return "plain PyTorch/DDP (--zero 0)" if not zero else f"DeepSpeed ZeRO-{zero} (--zero {zero})"


def saved_zero_stage(path: Path, meta: dict | None = None) -> int:
    """The ZeRO stage a checkpoint was written with (its meta.json, else its module/ layout)."""
    path = Path(path)
    if meta is None:
        try:
            meta = json.loads((path / META).read_text())
        except (OSError, ValueError):
            meta = {}
    if meta.get("zero") is not None:
        return int(meta["zero"])
    return 0 if (path / MODULE_DIR / TORCH_MODEL).is_file() else int((path / MODULE_DIR / DEEPSPEED_DIR).is_dir())


def engine_mismatch(path: Path, zero: int, meta: dict | None = None) -> str | None:
    """Why checkpoint `path` cannot be resumed with --zero `zero` (None: it can). The optimizer state's
    layout belongs to the engine: plain PyTorch writes whole tensors, ZeRO-1/2/3 their own partitioning,
    so the stage must match (the number of ranks may change: ZeRO is resharded through DeepSpeed's
    universal checkpoint)."""
    saved = saved_zero_stage(path, meta)
    if saved == zero:
        return None
    return (f"checkpoint {path} was written by {_engine(saved)} and this run is {_engine(zero)}: the optimizer "
            f"state is laid out per engine and cannot be loaded across them. Resume it with --zero {saved} "
            f"(on any number of ranks)")


def model_config_mismatch(saved: dict, current: dict) -> list[str]:
    keys = sorted(set(saved) | set(current))
    return [f"{k}: checkpoint {saved.get(k)!r}, this run {current.get(k)!r}" for k in keys
            if k != "size" and saved.get(k) != current.get(k)]


# the run config's entries a resume does not report as changed settings: how this start was asked for, and
# what is derived from other fields or checked on its own (the model, by model_config_mismatch)
NOT_SETTINGS = {"resume", "overwrite", "model", "train.global_batch"}


def changed_settings(saved: dict, current: dict) -> list[str]:
    """The run-config settings (as flags: `--lr 0.003 -> 0.001`) that differ between a checkpoint's
    recorded config (`saved`, `RunConfig.to_dict()`) and this start's; fields one of them lacks (a config
    written by other code) are left out."""
    from pretrain.config import flag_name, flatten_sections
    before, now = flatten_sections(saved), flatten_sections(current)
    return [f"{flag_name(k)} {before[k]} -> {now[k]}" for k in now
            if k in before and k not in NOT_SETTINGS and before[k] != now[k]]


# settings a resume cannot change: the data loader's position (samples consumed, in a permutation drawn
# from the seed) means another order, or another sequence length, from the checkpoint on
FIXED_SETTINGS = {"train.seed": "the seed draws the order of the data, whose position the checkpoint holds",
                  "train.seq_len": "the data loader's position counts sequences of that length"}


def fixed_setting_mismatch(path: Path, saved: dict, current: dict) -> str | None:
    """Why checkpoint `path` (its recorded run config `saved`) cannot be resumed with this start's config,
    naming the flag and its value in the checkpoint; None when it can."""
    from pretrain.config import flag_name, flatten_sections
    before, now = flatten_sections(saved), flatten_sections(current)
    for key, why in FIXED_SETTINGS.items():
        if key in before and before[key] != now.get(key):
            flag = flag_name(key)
            return (f"checkpoint {path} was trained with {flag} {before[key]} and this run has {flag} {now.get(key)}: "
                    f"{why}; resume it with {flag} {before[key]}, or train into another --out")
    return None


# ---------------------------------------------------------------------------------------------------
# the manager
# ---------------------------------------------------------------------------------------------------

class CheckpointManager(Callback):
    """Owns RUN/checkpoints and RUN/snapshots for one trainer (see the module docstring).

    Args:
        run: the run's configuration (checkpoint section, --resume, --zero, run directory; recorded in meta.json)
        model_cfg: the model's configuration (recorded; a resume must match it)
        env: this process's rank, world size and device
        module: the train module whose model + optimizer are saved
        progress: the run's step / tokens / FLOPs counters (read at every save)
        trainer_state: the trainer's own state, saved per rank and given back on resume
        tokens_per_step, flops_per_step_ne: per-step constants of the run (recorded; a resume must match)
        total_steps: steps the run is to train (None: until stopped), for the snapshot schedule
        metrics_failed: whether this rank's metrics could not be written (rank 0's full disk): a stop reason
    """

    def __init__(self, run: RunConfig, model_cfg: ModelConfig, env: DistEnv, module: TrainModule,
                 progress: TrainProgress, trainer_state: Stateful, tokens_per_step: int, flops_per_step_ne: float,
                 total_steps: int | None, metrics_failed: Callable[[], bool] = lambda: False) -> None:
        self.run = run
        self.metrics_failed = metrics_failed
        self.model_cfg = model_cfg
        self.cfg = run.checkpoint
        self.env = env
        self.module = module
        self.progress = progress
        self.trainer_state = trainer_state
        self.tokens_per_step = tokens_per_step
        self.flops_per_step_ne = flops_per_step_ne
        self.run_dir = Path(run.run_dir)
        self.ckpt_dir = self.run_dir / CHECKPOINTS
        self.snap_dir = self.run_dir / SNAPSHOTS
        if self.cfg.save_every < 0 or self.cfg.keep_last < 0:
            raise ValueError(f"checkpoint: save_every={self.cfg.save_every} and keep_last={self.cfg.keep_last} "
                             f"must be >= 0 (save_every 0: only at the end or on a signal; keep_last 0: keep all)")
        # the snapshot schedule of a fresh start; a resume replaces it with the one its checkpoint records
        # (load): the log-spaced points are fixed at the run's first start (checkpoints/schedule.py)
        self.total_tokens = total_steps * tokens_per_step if total_steps is not None else None
        self._schedule_error: ValueError | None = None
        try:
            self.schedule = SnapshotSchedule(self.cfg.snapshot_every_tokens, self.cfg.snapshot_log_points,
                                             tokens_per_step, self.total_tokens)
        except ValueError as err:
            if not run.resume:
                raise
            # a checkpoint's recorded schedule may give the end the flags lack: decided once resumed
            self._schedule_error = err
            self.schedule = SnapshotSchedule(self.cfg.snapshot_every_tokens, 0, tokens_per_step)
        self.resumed_step: int | None = None  # the step this start resumed at (None: a fresh start)
        self.writer = BackgroundWriter()
        self._abort = threading.Event()  # set when a save is abandoned: rank 0's writer stops waiting
        self._last_bytes: dict[str, int] = {}  # size of this run's last checkpoint / snapshot (space checks)
        self._unwritten = 0  # bytes of saves staged in this step and not yet handed to the writer
        self.signal = StopSignal()
        self.code = code_version() if self.env.is_main else None
        self.run_id = read_run_id(self.run_dir) if self.env.is_main else None
        self._module_buffers = StagingBuffers()
        self._snapshot_buffers = StagingBuffers()
        self._reserved = False
        self.pin_fraction = PIN_FRACTION
        self._last_step_end: float | None = None
        self.last_saved_step: int | None = None
        self.last_snapshot_step: int | None = None
        self.history: list[dict] = []  # one row per save: step, kind, stall_s, write_s (for logs and benchmarks)

    # -- lifecycle -----------------------------------------------------------------------------------
    def post_attach(self) -> None:
        """At trainer construction (the run directory is locked and cleaned of unfinished saves by
        checkpoints.run_dir): resume if asked, then install signal handlers (last, so a failed start leaves
        the process's handlers as they were)."""
        resume_from = self._choose_resume()
        barrier()
        if resume_from is None and self._schedule_error is not None:
            raise self._schedule_error  # a fresh start after all (--resume auto without a checkpoint)
        if resume_from is not None:
            self.load(resume_from)
            # only once the checkpoint has loaded (model, batch, seed, data all accepted): a refused resume
            # leaves the run's later checkpoints, snapshots and exports, and `latest`, as they were
            if self.env.is_main:
                self._set_aside_later_history(resume_from, checkpoints=self.run.resume != "auto")
            barrier()
        self.signal.install()

    def _choose_resume(self) -> Path | None:
        target = self.run.resume
        if not target:
            return None
        chosen: str | None = None
        error: tuple[str, str] | None = None
        if self.env.is_main:  # one rank verifies (checksums read every byte) and tells the others
            try:
                chosen = self._choose_on_main(target)
            except (CheckpointError, ValueError) as err:
                error = (type(err).__name__, str(err))
        chosen, error = broadcast_object((chosen, error))
        if error:
            raise (CheckpointError if error[0] != "ValueError" else ValueError)(error[1])
        return Path(chosen) if chosen else None

    def _choose_on_main(self, target: str) -> str | None:
        if target == "auto":
            skipped: list[str] = []

            def on_skip(msg: str) -> None:
                skipped.append(msg)
                logger.warning(msg)
            path = find_resume_checkpoint(self.ckpt_dir, on_skip=on_skip, run_id=self.run_id)
            if path is None:
                published = step_dirs(self.ckpt_dir)
                if published:  # checkpoints are there but none can be used: never silently start over
                    raise CheckpointError(
                        f"--resume auto: {self.ckpt_dir} holds {len(published)} checkpoint(s) and none can be "
                        f"resumed: " + " | ".join(m.replace("checkpoint ", "", 1) for m in skipped)
                        + f". Nothing was changed. To start from step 0 anyway, run without --resume and with "
                          f"--overwrite (they are moved to {self.run_dir}/overwritten-<time>/); to use "
                          f"one of them regardless, pass --resume with its path")
                if self._schedule_error is not None:  # refused before the stopped attempt's files are moved
                    raise self._schedule_error
                logger.info(f"--resume auto: no complete checkpoint in {self.ckpt_dir} yet; starting from step 0")
                # the steps are replayed from 0, under the flags given now: what the stopped attempt wrote
                # (snapshots, exports) is not kept as if it held the replayed steps' weights
                self._set_aside_after(0, "--resume auto (no checkpoint: from step 0)", checkpoints=False)
                return None
            # what a stopped run wrote after its newest checkpoint (snapshots, exports) is replayed from
            # it, under the flags given now, which may differ (another --lr): the old files are set aside
            # (post_attach, once the checkpoint has loaded), not kept as if they held the replayed steps'
            # weights. Later checkpoints that auto passed over (corrupt, or another run's) stay where they
            # are, named in the warnings above.
            return str(path)
        path = Path(target)
        if path.is_dir() and ((path / CHECKPOINTS).is_dir() or path.name == CHECKPOINTS):
            where = path / CHECKPOINTS if path.name != CHECKPOINTS else path
            newest = step_dirs(where)
            raise ValueError(f"--resume {target}: a run directory (or its checkpoints/), not one checkpoint; pass "
                             f"one of its checkpoints ({where}/step_N"
                             + (f", e.g. {newest[-1][1]}" if newest else "")
                             + "), or --resume auto with --out set to that run")
        problem = verify(path)
        if problem is not None:
            raise ValueError(f"--resume {target}: {problem}. Pass a complete checkpoint directory "
                             f"({self.ckpt_dir}/step_N) or --resume auto to take the newest complete one")
        try:
            meta = json.loads((path / META).read_text())
        except (OSError, ValueError):
            meta = {}
        if meta.get("kind") == "snapshot":
            raise ValueError(f"--resume {target}: a snapshot (the weights, for evaluation), which holds no optimizer "
                             f"or data-loader state; resume from a checkpoint ({path.parent.parent / CHECKPOINTS}"
                             f"/step_N)")
        self._refuse_a_branch_that_trains_nothing(target, path, meta)
        return target  # the later history is set aside by post_attach, once this checkpoint has loaded

    def _refuse_a_branch_that_trains_nothing(self, target: str, path: Path, meta: dict) -> None:
        """--resume of one of this run's earlier checkpoints that is already at or past --max-steps /
        --max-tokens: nothing would be trained from it, and resuming it would still set this run's later
        checkpoints, snapshots and exports aside as an abandoned branch. Refused before anything moves."""
        step, tokens = meta.get("step"), meta.get("tokens")
        t = self.run.train
        if not isinstance(step, int) or not isinstance(tokens, int):
            return
        reached = [(flag, limit, now) for flag, limit, now in (("--max-steps", t.max_steps, step),
                                                               ("--max-tokens", t.max_tokens, tokens))
                   if limit is not None and now >= limit]
        if not reached:
            return
        try:
            inside = Path(os.path.realpath(path)).parent == Path(os.path.realpath(self.ckpt_dir))
        except OSError:
            inside = False
        later = [f"{parent.name}/{p.name}" for parent in (self.ckpt_dir, self.snap_dir, self.run_dir / EXPORTS)
                 for s, p in step_dirs(parent) if s > step] if inside else []
        if not later:
            return  # nothing to set aside: the start trains nothing and says so (Trainer._nothing_to_train)
        shown = ", ".join(later[:4]) + (f" and {len(later) - 4} more" if len(later) > 4 else "")
        limits = " and ".join(f"{flag} is {limit}" for flag, limit, _ in reached)
        raise_ = " and ".join(f"{flag} above {now}" for flag, _, now in reached)
        raise ValueError(f"--resume {target}: the checkpoint is at step {step} ({tokens} tokens) and {limits}, so "
                         f"nothing would be trained from it, while resuming it would set this run's later history "
                         f"({shown}) aside as an abandoned branch; nothing was changed. To train on from it, raise "
                         f"{raise_}; to continue the run's newest checkpoint, pass --resume auto")

    def _set_aside_later_history(self, path: Path, checkpoints: bool = True) -> None:
        """Resuming one of this run's own checkpoints starts a new branch of its history (an earlier one
        by path, or the newest by `--resume auto` after a stop): the checkpoints (by path only: auto leaves
        the later ones it passed over), snapshots and exports after it belong to the abandoned branch. They
        are moved into
        `superseded-<time>/` folders (not deleted), so that `--resume auto` and retention only ever see
        one history and a replayed step never keeps a snapshot of the other branch."""
        try:
            inside = Path(os.path.realpath(path)).parent == Path(os.path.realpath(self.ckpt_dir))
        except OSError:
            inside = False
        step = parse_step(path.name)
        if not inside or step is None:
            return
        self._set_aside_after(step, f"--resume {path}", checkpoints)
        if checkpoints and (self.ckpt_dir / LATEST).is_file() and read_latest(self.ckpt_dir) != path.name:
            atomic_write_text(self.ckpt_dir / LATEST, path.name + "\n")

    def _set_aside_after(self, step: int, why: str, checkpoints: bool) -> None:
        """Move this run's checkpoints (with `checkpoints`), snapshots and exports of steps after `step` into
        `superseded-<time>/` folders next to them; `why` starts the log line."""
        stamp = time.strftime("%Y%m%d-%H%M%S")
        for parent in ((self.ckpt_dir,) if checkpoints else ()) + (self.snap_dir, self.run_dir / EXPORTS):
            later = [p for s, p in step_dirs(parent) if s > step]
            if not later:
                continue
            dest = parent / f"superseded-{stamp}"
            dest.mkdir(exist_ok=True)
            for p in later:
                os.replace(p, dest / p.name)
            logger.info(f"{why}: {len(later)} later {parent.name} of the abandoned branch "
                        f"({', '.join(p.name for p in later)}) moved to {dest}")

    def load(self, path: Path) -> None:
        path = Path(path)
        meta = json.loads((path / META).read_text())
        current = self.model_cfg.to_dict()
        diff = model_config_mismatch(meta["model"], current)
        if diff:
            raise ValueError(f"checkpoint {path} holds a different model ({'; '.join(diff)}); resume it with "
                             f"the same --arch/--size/--model overrides, or train into another --out")
        if meta.get("tokens_per_step") not in (None, self.tokens_per_step):
            raise ValueError(f"checkpoint {path} was trained with {meta['tokens_per_step']} tokens per step but "
                             f"this run has {self.tokens_per_step}; keep --global-batch-tokens and "
                             f"--seq-len when resuming")
        mismatch = engine_mismatch(path, self.run.dist.zero, meta)
        if mismatch:
            raise CheckpointError(mismatch)
        saved_run = meta.get("config") or {}
        fixed = fixed_setting_mismatch(path, saved_run, self.run.to_dict())
        if fixed:
            raise ValueError(fixed)
        saved_world = int(meta["world_size"])
        same_world = saved_world == self.env.world_size
        if needs_universal(path / MODULE_DIR, saved_world, self.env.world_size):
            if self.env.is_main:  # ZeRO shards of another rank count: reshard once through DeepSpeed
                logger.info(f"{path}: ZeRO checkpoint of {saved_world} ranks, this run has {self.env.world_size}; "
                     f"converting it to a DeepSpeed universal checkpoint")
                make_universal(path / MODULE_DIR)
            barrier()
        self.module.load_state(path / MODULE_DIR)
        own = path / TRAINER_DIR / rank_file(self.env.rank)
        state = torch.load(own if same_world else path / TRAINER_DIR / rank_file(0), map_location="cpu",
                           weights_only=False)  # our own files, checksummed; they hold numpy RNG state
        if not same_world:
            # The loader's state is global (samples consumed), so rank 0's resumes every rank's slice.
            # Per-rank RNG streams cannot be carried over to a different rank count; each rank keeps the
            # stream seeded for it (the recipe draws no random numbers during training: no dropout).
            state["rng"] = None
        try:
            self.trainer_state.load_state_dict(state)
        except ValueError as err:  # the data loader refuses a position in other data
            data = saved_run.get("data")
            raise ValueError(f"checkpoint {path} (trained on --data "
                             f"{data if data is not None else 'left out: the embedded corpus'}): {err}; or train "
                             f"into another --out") from None
        schedule_note = self._resume_schedule(meta, saved_run)
        step = self.progress.step
        self.last_saved_step = step
        self.resumed_step = step
        self.last_snapshot_step = step if (self.snap_dir / step_name(step)).is_dir() else None
        if self.env.is_main:
            note = "" if same_world else f" (saved by {saved_world} rank{'s' if saved_world != 1 else ''}, resumed on {self.env.world_size})"
            logger.info(f"resumed from {path} at step {step}, {self.progress.tokens} tokens{note}")
            changed = changed_settings(saved_run, self.run.to_dict())
            if changed:
                logger.info(f"settings changed since checkpoint {path.name}, applied from step {step + 1} on: "
                            + "; ".join(changed))
            if schedule_note:
                logger.info(schedule_note)

    def _resume_schedule(self, meta: dict, saved_run: dict) -> str | None:
        """Follow the snapshot schedule the loaded checkpoint records in its meta.json (a checkpoint written
        before it was recorded: the schedule its recorded config gives), so that the log-spaced points stay
        where the run's first start put them (checkpoints/schedule.py). Returns the line to log, if any."""
        recorded = meta.get("snapshot_schedule")
        if not isinstance(recorded, dict):
            old = schedule_of_config(saved_run, self.tokens_per_step)
            recorded = old.record() if old is not None else None
        if recorded is None:
            if self._schedule_error is not None:
                raise self._schedule_error
            return None
        self.schedule, note = resumed_schedule(recorded, self.cfg.snapshot_every_tokens, self.cfg.snapshot_log_points,
                                               self.tokens_per_step, self.total_tokens)
        self._schedule_error = None
        return note

    # -- hooks the training loop calls ----------------------------------------------------------------
    def stop_requested(self) -> str | None:
        """'signal' once any rank got SIGTERM/SIGUSR1/SIGINT, 'save_failed' once any rank's background save
        failed, 'log_failed' once rank 0 could not write a metrics row, else None. All ranks must agree, or
        one would stop while the others wait for it in a collective: the flags are reduced over ranks (one tiny all-reduce per step)."""
        flags = all_reduce_max([1.0 if self.signal.received is not None else 0.0,
                                1.0 if self.writer.failed else 0.0,
                                1.0 if self.metrics_failed() else 0.0], self.env.device)
        if flags[1] > 0:
            self._abort.set()  # rank 0's writer may be waiting for a rank that will never finish
            return "save_failed"
        if flags[2] > 0:  # rank 0 could not write metrics.jsonl (a full disk): post_train saves nothing new
            return "log_failed"
        return "signal" if flags[0] > 0 else None

    def post_step(self, progress: TrainProgress | None = None) -> None:
        """After every step: the snapshot and the checkpoint that are due (staged now, written in the
        background unless --async-save false)."""
        p = self.progress
        if not self._reserved:
            self._reserve_staging()
        self._pin_some()
        jobs = []
        if self.schedule.due(p.tokens - self.tokens_per_step, p.tokens):
            jobs.append(self._stage_snapshot())
        if self.cfg.save_every and p.step % self.cfg.save_every == 0:
            jobs.append(self._stage_checkpoint(blocking=not self.cfg.async_save))
        self._run([j for j in jobs if j is not None], blocking=not self.cfg.async_save)

    def save(self, blocking: bool | None = None) -> None:
        """A resume checkpoint of the current step now (every rank must call it)."""
        blocking = (not self.cfg.async_save) if blocking is None else blocking
        self._run([self._stage_checkpoint(blocking)], blocking)
        if blocking:
            self.wait()

    def save_now(self) -> None:
        """The run stops itself on purpose: a resume checkpoint of this step, written before it ends."""
        self.save(blocking=True)

    def snapshot(self, blocking: bool = False) -> None:
        self._run([self._stage_snapshot()], blocking)

    def post_train(self, stop_reason: str) -> None:
        """Final snapshot (finished runs with snapshots on), final checkpoint, and wait for the writer. After
        a failed save: no new save; the partial one is removed and SaveFailed raised on every rank."""
        step = self.progress.step
        if stop_reason == "save_failed":
            self.wait()
            raise RuntimeError("a failed save was not reported")  # wait() raises SaveFailed first
        if stop_reason == "log_failed":
            # no checkpoint of steps whose rows are missing: a resume replays them and logs them again
            self.wait()
            self.signal.uninstall()
            return
        jobs = []
        # a resumed start that trained nothing (its checkpoint already meets the limits) writes nothing
        trained = self.resumed_step != step
        if stop_reason == "finished" and self.schedule.enabled and self.last_snapshot_step != step and trained:
            jobs.append(self._stage_snapshot())
        if self.last_saved_step != step:
            jobs.append(self._stage_checkpoint(blocking=False))
        self._run([j for j in jobs if j is not None], blocking=False)
        self.wait()
        self.signal.uninstall()
        if stop_reason == "signal" and self.env.is_main:
            logger.info(f"stopped by {self.signal.received} at step {step}; checkpoint {self.ckpt_dir / step_name(step)} "
                 f"written; continue with --resume auto")

    def wait(self) -> None:
        """Block until every save of this rank is written (and, on rank 0, published); raise SaveFailed on
        every rank when any rank's save failed. Every rank must call it."""
        self._settle(self.writer.finish())
        barrier()

    def close(self) -> None:
        """Give back the signal handlers (on every way out of the trainer)."""
        self.signal.uninstall()

    # -- failures -------------------------------------------------------------------------------------
    def _settle(self, local: BaseException | None) -> None:
        """Collective (every rank, training thread): if a save failed on any rank, remove the partial save
        (rank 0, once every rank's writer has stopped) and raise SaveFailed everywhere, with one message
        (printed by rank 0; the others exit quietly with the same code)."""
        failure = _describe_failure(local) if local is not None else None
        failures = [f for f in all_gather_object(failure) if f is not None]
        # the rank whose own write failed says more than rank 0 giving up on waiting for it
        failure = next((f for f in failures if not f["secondary"]), failures[0] if failures else None)
        if failure is None:
            return
        self._abort.set()
        barrier()
        if self.env.is_main:
            for d in (self.ckpt_dir, self.snap_dir):
                for tmp in tmp_dirs(d):
                    shutil.rmtree(tmp, ignore_errors=True)
        barrier()
        err = SaveFailed(self._failure_message(failure))
        err.quiet = not self.env.is_main
        raise err

    def _failure_message(self, f: dict) -> str:
        prev = [p.name for s, p in step_dirs(self.ckpt_dir) if f["step"] is None or s < f["step"]]
        kept = f"the previous checkpoint {self.ckpt_dir / prev[-1]} is intact" if prev else "no earlier checkpoint exists"
        what = f"{f['kind']} step {f['step']} not written"
        if f["disk_full"] or f["short_write"]:
            free = free_bytes(self.ckpt_dir)
            needs = f"needs ~{human_bytes(f['needed'])}, " if f.get("needed") else ""
            head = (f"{what}: no space left on {device_of(self.ckpt_dir)} ({needs}{human_bytes(free)} free)"
                    if f["disk_full"] or free < (f.get("needed") or 0) + headroom(self.ckpt_dir) else
                    f"{what}: a write came up short ({f['error']}; {human_bytes(free)} free on "
                    f"{device_of(self.ckpt_dir)})")
            # --keep-last prunes only once a newer checkpoint is complete, so the next save still needs room
            # beside every checkpoint kept now: say what frees space before it
            fix = ("Free space there (checkpoints older than the intact one may be deleted by hand; a lower "
                   "--keep-last frees space only after the next checkpoint is written), or move the run directory "
                   "to a bigger disk and pass it as --out; then --resume auto")
        else:
            head = f"{what}: {f['error']}"
            fix = "Fix the cause, then --resume auto"
        partial = "" if f.get("before_writing") else "the partial save was removed, "
        return f"{head}; {partial}{kept}. {fix}"

    def _check_space(self, kind: str, step: int, needed: int) -> None:
        """Refuse (every rank, before anything is written) a save that cannot fit: rank 0 compares the
        expected size with the free space and tells the others."""
        problem = None
        if self.env.is_main:
            free = free_bytes(self.ckpt_dir)
            # saves staged for the same step (a snapshot and a checkpoint) are written after both checks
            self._unwritten += needed
            if self._unwritten + headroom(self.ckpt_dir) > free:
                problem = {"kind": kind, "step": step, "needed": self._unwritten, "disk_full": True, "short_write": False,
                           "error": "", "before_writing": True}
        problem = broadcast_object(problem)
        if problem is not None:
            err = SaveFailed(self._failure_message(problem).replace("no space left on", "not enough space on"))
            err.quiet = not self.env.is_main
            raise err

    def _expected_bytes(self, kind: str) -> int:
        """What the next save will write (all ranks together): the size of this run's last one of that kind,
        else fp32 weights (snapshot) or weights + two Adam moments (checkpoint)."""
        last = self._last_bytes.get(kind)
        if last:
            return last
        numel = sum(getattr(p, "ds_numel", p.numel()) for p in self.module.model.parameters())
        return numel * 4 * (1 if kind == "snapshot" else 3)

    # -- staging (training thread) and writing (background thread) -------------------------------------
    def _reserve_staging(self) -> None:
        """After the first step (the optimizer state exists only then), allocate and touch the host buffers
        of the background save in the writer thread; `_pin_some` then page-locks them a piece at a time.
        Modules that cannot tell their staged layout in advance (DeepSpeed) get their buffers at the first
        save (pageable then, pinned over the following steps)."""
        self._reserved = True
        if not (self.cfg.async_save and self.env.device.type == "cuda"):
            return
        state = self.module.stage_layout()  # references only: the thread reads shapes and dtypes
        if state is not None:
            self.writer.submit(lambda: self._module_buffers.reserve(state), name="checkpoint-reserve")

    def _pin_some(self) -> None:
        """Page-lock a bounded piece of the staging buffers: at most `pin_fraction` of the last step's time
        (at least one piece of staging.PIECE_BYTES). Pinning everything at once would hold the training
        thread's CUDA calls for seconds (docs/checkpoints.md, "Background saving")."""
        now = time.perf_counter()
        last, self._last_step_end = self._last_step_end, now
        if self.env.device.type != "cuda":
            return
        pending = [b for b in (self._module_buffers, self._snapshot_buffers) if not b.fully_pinned]
        if not pending:
            return
        budget = min(self.pin_fraction * (now - last), PIN_MAX_S) if last is not None else 0.0
        t0 = time.perf_counter()
        for b in pending:
            b.pin_some(max(0.0, budget - (time.perf_counter() - t0)))
        self._last_step_end = time.perf_counter()  # the pinning time is not part of the next step's interval

    def _run(self, jobs: list[Callable[[], None]], blocking: bool) -> None:
        self._unwritten = 0  # handed to the writer: the next save's space check waits for them to land
        if not jobs:
            return
        if blocking:
            error = None
            try:
                for job in jobs:
                    job()
            except Exception as err:  # noqa: BLE001 - reported on every rank by _settle
                error = err
            self._settle(error)
            barrier()
        else:
            self.writer.submit(lambda: [job() for job in jobs])

    def _stage_checkpoint(self, blocking: bool) -> Callable[[], None] | None:
        p, rank, world = self.progress, self.env.rank, self.env.world_size
        step = p.step
        if self.last_saved_step == step:
            return None
        self._settle(self.writer.finish())  # one save in flight at a time: staging buffers are reused
        needed = self._expected_bytes("checkpoint")
        self._check_space("checkpoint", step, needed)
        t0 = time.perf_counter()
        name = step_name(step)
        tmp = self.ckpt_dir / (name + TMP_SUFFIX)
        parts = tmp / PARTS_DIR
        trainer_state = copy.deepcopy(self.trainer_state.state_dict())
        module_dir = tmp / MODULE_DIR
        write_module: Callable[[], dict] | None = None
        try:
            # a folder that cannot be made (read-only, a file in the way) fails like any write of the save:
            # exit 4 with the previous checkpoint named, on every rank
            for sub in (MODULE_DIR, TRAINER_DIR, PARTS_DIR):
                (tmp / sub).mkdir(parents=True, exist_ok=True)
            # a host copy now, files written (and hashed) by write(); or, where the module cannot, saved now
            write_module = self.module.stage_state(self._module_buffers, module_dir)
            if write_module is None:
                self.module.save_state(module_dir)
        except Exception as err:  # noqa: BLE001 - e.g. a full disk under a synchronous save_state
            markers.publish_failed(parts, rank, _one_line(err))
            self._settle(_WriteError("checkpoint", step, needed, err))
            raise
        meta = {"kind": "checkpoint", "step": step, "tokens": p.tokens, "flops": p.flops,
                "flops_non_embedding": step * self.flops_per_step_ne, "tokens_per_step": self.tokens_per_step,
                "world_size": world, "module": type(self.module).__name__, "zero": self.run.dist.zero,
                "model": self.model_cfg.to_dict(), "config": self.run.to_dict(), "code": self.code,
                "run_id": self.run_id, "snapshot_schedule": self.schedule.record(),
                "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S")}
        stall = time.perf_counter() - t0
        self.last_saved_step = step

        def write() -> None:
            t1 = time.perf_counter()
            # 1. this rank's files, fsynced, then its marker (markers.py: its last touch of the directory)
            try:
                markers.point("rank_writing", rank)
                written: dict[Path, FileRecord] = dict(write_module()) if write_module is not None else {}
                own = tmp / TRAINER_DIR / rank_file(rank)
                written[own] = save_torch(trainer_state, own)
                for d in sorted({p.parent for p in written}):
                    fsync_dir(d)
                markers.point("rank_files_durable", rank)
                # the marker carries this rank's checksums, so rank 0 need not read its files back
                markers.publish_done(parts, rank, {os.path.relpath(p, tmp): r for p, r in written.items()})
            except BaseException as err:
                markers.publish_failed(parts, rank, _one_line(err))
                raise _WriteError("checkpoint", step, needed, err) from err
            if rank != 0:
                return
            # 2. rank 0: every rank's marker, then the manifest, then publish, then `latest`, then retention
            try:
                known = markers.wait_for_all(parts, world, self._abort)
                shutil.rmtree(parts)
                markers.point("parts_removed", 0)
                (tmp / META).write_text(json.dumps(meta, indent=1))
                files = write_manifest(tmp, {"kind": "checkpoint", "step": step}, known=known)["files"]
                markers.point("manifest_written", 0)
                publish_dir(tmp, self.ckpt_dir / name)
                markers.point("published", 0)
            except BaseException as err:
                raise _WriteError("checkpoint", step, needed, err) from err
            self._last_bytes["checkpoint"] = sum(f["size"] for f in files.values())
            deleted: list[Path] = []
            try:  # the checkpoint is complete and published: a failure from here on only warns
                atomic_write_text(self.ckpt_dir / LATEST, name + "\n")
                deleted = apply_retention(self.ckpt_dir, self.cfg.keep_last, upto=step, run_id=self.run_id)
            except OSError as err:
                logger.warning(f"checkpoint {name} is complete, but updating `latest` or removing old checkpoints failed "
                     f"({_one_line(err)}); --resume auto still finds {name}")
            took = time.perf_counter() - t1
            self.history.append({"step": step, "kind": "checkpoint", "stall_s": stall, "write_s": took,
                                 "blocking": blocking, "hashed_while_writing": len(known)})
            logger.info(f"checkpoint {name} saved ({'blocking' if blocking else f'background, stall {stall:.3f} s'}, "
                 f"written in {took:.2f} s, {len(known)} of {len(files)} files hashed while written)"
                 + (f"; removed {', '.join(p.name for p in deleted)}" if deleted else ""))
        return write

    def _stage_snapshot(self) -> Callable[[], None] | None:
        p = self.progress
        step = p.step
        if self.last_snapshot_step == step:
            return None
        final = self.snap_dir / step_name(step)
        # a complete snapshot of this step is of this branch (a resume sets aside the later ones), e.g. one
        # written just before the checkpoint it resumed: nothing to write again
        skip = self.env.is_main and verify(final, checksums=False) is None
        skip = broadcast_object(skip)
        if skip:
            self.last_snapshot_step = step
            return None
        self._settle(self.writer.finish())
        needed = self._expected_bytes("snapshot")
        self._check_space("snapshot", step, needed)
        t0 = time.perf_counter()
        state = self.module.full_state_dict()  # every rank: a gather under ZeRO-3
        self.last_snapshot_step = step
        if not self.env.is_main:
            return None
        staged = self._snapshot_buffers.stage({k: v.float() for k, v in state.items()})
        del state
        from data_pipeline.tokenizer import ENCODING_NAME
        meta = {"kind": "snapshot", "step": step, "tokens": p.tokens, "flops": p.flops,
                "flops_non_embedding": step * self.flops_per_step_ne, "model": self.model_cfg.to_dict(),
                "tokenizer": ENCODING_NAME, "run": self.run_dir.name, "run_id": self.run_id, "code": self.code,
                "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S")}
        stall = time.perf_counter() - t0

        def write() -> None:
            t1 = time.perf_counter()
            tmp = self.snap_dir / (final.name + TMP_SUFFIX)
            try:
                if tmp.exists():
                    shutil.rmtree(tmp)
                tmp.mkdir(parents=True)
                rec = save_safetensors(staged, tmp / MODEL_WEIGHTS)
                (tmp / META).write_text(json.dumps(meta, indent=1))
                write_manifest(tmp, {"kind": "snapshot", "step": step}, known={MODEL_WEIGHTS: rec})
                publish_dir(tmp, final)
            except BaseException as err:
                raise _WriteError("snapshot", step, needed, err) from err
            self._last_bytes["snapshot"] = rec.size
            took = time.perf_counter() - t1
            self.history.append({"step": step, "kind": "snapshot", "stall_s": stall, "write_s": took})
            logger.info(f"snapshot {final.name} saved ({meta['tokens']} tokens, written in {took:.2f} s)")
        return write


class _WriteError(RuntimeError):
    """A save that failed in a writer (carries what the message needs: kind, step, expected size)."""

    def __init__(self, kind: str, step: int, needed: int, cause: BaseException) -> None:
        super().__init__(f"{kind} step {step}: {_one_line(cause)}")
        self.kind, self.step, self.needed, self.cause = kind, step, needed, cause


def _one_line(err: BaseException) -> str:
    cause = disk_full_cause(err)
    if cause is not None:
        err = cause
    text = " ".join(str(err).split()) or type(err).__name__
    return text if len(text) <= 300 else text[:297] + "..."


def _describe_failure(err: BaseException) -> dict:
    """A picklable summary of a failed save (for the message every rank shows)."""
    kind, step, needed = "checkpoint", None, None
    if isinstance(err, _WriteError):
        kind, step, needed, cause = err.kind, err.step, err.needed, err.cause
    else:
        cause = err
    return {"kind": kind, "step": step, "needed": needed, "error": _one_line(cause),
            "disk_full": disk_full_cause(cause) is not None, "short_write": looks_like_short_write(cause),
            "secondary": isinstance(cause, markers.SaveAbandoned)}


def check_resume_engine(run_dir: Path, resume: str | None, zero: int) -> None:
    """Before the (slow) engine is built: refuse a resume whose checkpoint was written by another engine
    (see engine_mismatch). Looks at the explicit --resume checkpoint, or for `auto` at the newest one of
    the run that has a readable meta.json; `load` checks again on what is really chosen."""
    if not resume:
        return
    if resume == "auto":
        candidates = [p for _, p in reversed(step_dirs(Path(run_dir) / CHECKPOINTS))]
        run_id = read_run_id(run_dir)
        candidates = [p for p in candidates if checkpoint_run_id(p) in (None, run_id)][:1]
    else:
        candidates = [Path(resume)]
    for path in candidates:
        try:
            meta = json.loads((path / META).read_text())
        except (OSError, ValueError):
            continue
        mismatch = engine_mismatch(path, zero, meta)
        if mismatch:
            raise CheckpointError(mismatch)
