"""The training loop: data -> train module -> metrics. The engine is a `pretrain.train_module.TrainModule`
(plain PyTorch/DDP or DeepSpeed); everything else the loop does runs as callbacks (pretrain/callbacks.py):
the checkpoint manager (checkpoints/manager.py) and the stability, speed and memory monitors
(pretrain/monitors.py). The loop itself knows nothing about ZeRO or checkpoint files."""
from __future__ import annotations

import contextlib
import itertools
import json
import os
import random
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np
import torch

import ops
from checkpoints.layout import CHECKPOINTS, DEEPSPEED_CONFIG, RUN_CONFIG, SUMMARY, step_dirs
from checkpoints.manager import CheckpointManager, check_resume_engine, model_config_mismatch
from checkpoints.schedule import planned_steps
from models import LanguageModel, build_from_config, flops_per_step, get_arch, model_info
from models.config import VOCAB_SIZE
from pretrain import grad_accumulation
from pretrain.callbacks import Callback, TrainProgress
from pretrain.config import RunConfig, ac_mode, gradient_accumulation, preset_note, resolve_compile, save_config
from pretrain.distributed import barrier, dist_env, init_process_group
from pretrain.errors import ConfigError, OutputFailed, UserError, run_cli
from pretrain.faults import injected_nonfinite_steps
from pretrain.logs import get_logger
from pretrain.memory import (choose_checkpointing, configure_allocator, describe_setting, estimate_peak_gib,
                             fit_warning, larger_micro_batch)
from pretrain.metrics import MetricsLogger, Progress, logged_row_at, peak_flops
from pretrain.monitors import MemoryMonitor, SpeedMonitor, StabilityMonitor, TrainingStopped
from pretrain.profiling import StepProfiler
from pretrain.train_module import StepResult, TorchTrainModule, TrainModule, lr_at

logger = get_logger(__name__)
# sequences per validation batch (--eval-batches counts these): the validation set does not depend on
# --micro-batch
EVAL_BATCH = 8


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])




def check_device(requested: str) -> None:
    """--device cuda on a machine (or a torch build) without CUDA: say so before anything starts."""
    if requested == "cuda" and not torch.cuda.is_available():
        build = "a CPU-only torch build" if torch.version.cuda is None else f"torch built for CUDA {torch.version.cuda}"
        raise UserError(f"--device cuda: no CUDA device is visible here ({build}, "
                        f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}); "
                        f"use --device cpu (or auto), or run on a machine with a GPU")


def is_out_of_memory(err: BaseException) -> bool:
    # cuBLAS reports a failed workspace allocation as its own error, not as torch.OutOfMemoryError
    return isinstance(err, torch.OutOfMemoryError) or (
        isinstance(err, RuntimeError) and ("CUBLAS_STATUS_ALLOC_FAILED" in str(err) or "out of memory" in str(err)))


def out_of_memory_message(cfg: RunConfig, device: torch.device, step: int, mode: str | None = None,
                          fraction: float | None = None) -> str:
    """What did not fit and the settings that change it (the caller adds the original error). `mode` and
    `fraction`: the activation checkpointing in use (default: as configured)."""
    t = cfg.train
    mode = mode or ac_mode(t)
    fraction = t.ac_fraction if fraction is None else fraction
    where = f"{device}"
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory / 2**30
        where = f"the {total:.0f} GiB of {torch.cuda.get_device_name(device)}"
    ac = describe_setting(mode, fraction, cfg.model().n_layers)
    fixes = []
    if t.micro_batch > 1:
        fixes.append(f"a smaller --micro-batch (e.g. {max(1, t.micro_batch // 2)}; gradient accumulation keeps the "
                     f"global batch)")
    if mode != "full" or fraction < 1:
        fixes.append("activation checkpointing: --activation-checkpointing full (every block recomputed in the "
                     "backward: about 25% fewer tokens/s), or full with --ac-fraction 0.5 (half the blocks, "
                     "half the cost), or auto (the fewest blocks estimated to fit)")
    fixes.append(f"a shorter --seq-len (now {t.seq_len})")
    if cfg.dist.zero < 3:
        fixes.append("more GPUs with --zero 3 (shards weights and optimizer state)")
    return (f"out of memory in step {step + 1}: {cfg.arch} {cfg.size} with --seq-len {t.seq_len} x --micro-batch "
            f"{t.micro_batch} = {t.seq_len * t.micro_batch:,} tokens per micro-batch (activation checkpointing "
            f"{ac}) does not fit in {where}. Use " + "; or ".join(fixes) + ". See docs/training.md, Long context")


def _first_line(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [type(err).__name__])[0]


def compile_failed_message(cfg: RunConfig, step: int, err: BaseException) -> str:
    """torch.compile (Dynamo or Inductor) failed while building a step's graph: what failed and the way on
    (`LINSCALE_TRACEBACK=1` shows the traceback)."""
    engine = f"DeepSpeed ZeRO-{cfg.dist.zero}" if cfg.dist.zero else "plain PyTorch"
    inner = getattr(err, "inner_exception", None) or err.__cause__  # the backend's own error, if wrapped
    what = f"{type(err).__name__}: {_first_line(err)}"
    if inner is not None:
        what = f"{type(err).__name__} ({type(inner).__name__}: {_first_line(inner)})"
    return (f"torch.compile failed in step {step + 1} ({cfg.arch} {cfg.size}, {engine}, --compile "
            f"{cfg.train.compile}): {what}. Train eagerly with --no-compile "
            f"(2-3x fewer tokens/s; --resume auto continues from the run's last checkpoint), and report the "
            f"error with LINSCALE_TRACEBACK=1's traceback; see docs/training.md, --compile")


def check_vocab(vocab_size: int, data: str | None) -> None:
    """Every token id the data can produce must be a row of the embedding: checked at start rather than at
    the first forward. Data tokenized here (the default corpus, a data YAML streamed) can hold any id of
    the tokenizer; a prepared dataset is scanned for an id >= vocab_size only when vocab_size is below the
    tokenizer's (a small synthetic vocabulary), stopping at the first one found."""
    from data_pipeline.tokenizer import ENCODING_NAME, get_tokenizer
    n_vocab = get_tokenizer().n_vocab
    if vocab_size >= n_vocab:
        return
    fix = (f"use --model vocab_size={n_vocab} or more (the default is {VOCAB_SIZE}), or "
           f"leave --model vocab_size out")
    if data is None or str(data).endswith((".yaml", ".yml")):
        raise UserError(f"--model vocab_size={vocab_size} is smaller than the tokenizer's {n_vocab:,} ids "
                        f"({ENCODING_NAME}, which {'the embedded corpus' if data is None else data} is tokenized "
                        f"with); the first batch would index past the embedding; {fix}")
    from data_pipeline.shards import TOKEN_DTYPE
    root = Path(data)
    roots = [r for r in (root / "train", root / "val", root) if (r / "meta.json").is_file()]
    chunk = 1 << 24
    for r in roots:
        meta = json.loads((r / "meta.json").read_text())
        for src in meta.get("sources", []):
            token_files = src.get("token_files") or [sh["tokens"] for sh in src.get("shards", [])]
            for rel in token_files:
                path = r / rel
                if not path.is_file() or path.stat().st_size < 4:
                    continue
                ids = np.memmap(path, dtype=TOKEN_DTYPE, mode="r")
                for a in range(0, len(ids), chunk):
                    top = int(ids[a:a + chunk].max())
                    if top >= vocab_size:
                        raise UserError(f"--model vocab_size={vocab_size}: the data in {data} holds token ids up "
                                        f"to at least {top} ({path}), outside an embedding of {vocab_size} rows; "
                                        f"use --model vocab_size={top + 1} or more (data tokenized with "
                                        f"{ENCODING_NAME} needs {n_vocab}; the default is {VOCAB_SIZE})")


class Trainer:
    """Builds a run from its config and trains it (`fit`). `callbacks`: more callbacks, run after the
    monitors and before the checkpoint manager (so their state in a checkpoint is that of its step)."""

    def __init__(self, cfg: RunConfig, callbacks: Sequence[Callback] = ()):
        from data_pipeline import build_loader

        from checkpoints.run_dir import open_run_directory

        self.cfg = cfg
        self.extra_callbacks = list(callbacks)
        self.callbacks: list[Callback] = []
        self.metrics: MetricsLogger | None = None
        check_device(cfg.train.device)
        self.env = env = dist_env(cfg.train.device)
        if cfg.ops.impl == "triton" and env.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise UserError("--ops-impl triton runs the Triton kernels, which need a CUDA GPU (or "
                            "TRITON_INTERPRET=1, the slow CPU interpreter the tests use); on this device use "
                            "--ops-impl auto (the PyTorch twins)")
        ops.set_config(cfg.ops)  # recorded in config.json with the rest of the run config
        self.run_dir = Path(cfg.run_dir)
        # rank 0 locks the directory (held until close()) and refuses to start over an earlier run
        self.run_lock = open_run_directory(self.run_dir, cfg.resume, cfg.overwrite, env.is_main)
        try:
            self._build(build_loader)
        except BaseException:
            self.close()
            raise

    def _build(self, build_loader) -> None:
        cfg, env = self.cfg, self.env
        self.model_cfg = cfg.model()
        t = cfg.train
        self.precision = t.precision if t.precision != "auto" else ("bf16" if env.device.type == "cuda" else "fp32")
        sp = cfg.dist.sp
        if env.world_size % sp:
            # the usual cause is a launch without torchrun (one process) or with another process count: say how
            # to launch, not only what is wrong
            other = ("; or train without --sp" if env.world_size == 1 else
                     f" or choose an --sp that divides {env.world_size}")
            raise ConfigError(f"--sp {sp} must divide the number of ranks ({env.world_size} process"
                              f"{'es' if env.world_size > 1 else ''}): each sequence-parallel group is {sp} ranks; "
                              f"launch a multiple of {sp} processes (torchrun --nproc_per_node {sp} "
                              f"launch/pretrain.py ... --sp {sp}){other}")
        self.dp_size = env.world_size // sp  # ranks that draw distinct samples
        try:
            self.accum = gradient_accumulation(cfg.global_batch, self.dp_size, t.micro_batch, t.allow_inexact_batch)
        except ValueError as err:
            # the arithmetic counts data-parallel ranks; under --sp the user counts processes
            sp_note = (f" (with --sp {sp} the ranks above are data-parallel groups: {env.world_size} ranks / --sp "
                       f"{sp} = {self.dp_size}; a rank count above means that many x {sp} processes)") if sp > 1 else ""
            raise ValueError(f"{err}{sp_note}{preset_note(cfg)}") from None
        # the batch actually trained on (differs from the requested one only with --allow-inexact-batch)
        self.global_batch = self.dp_size * t.micro_batch * self.accum
        self.tokens_per_step = self.dp_size * t.micro_batch * self.accum * t.seq_len
        self.flops_per_step = flops_per_step(self.model_cfg, self.tokens_per_step // t.seq_len, t.seq_len)
        self.flops_per_step_ne = flops_per_step(self.model_cfg, self.tokens_per_step // t.seq_len, t.seq_len, False)
        seed_everything(t.seed + env.rank)

        # what can be checked before the (slow) engine and model are built
        if cfg.data is not None and str(cfg.data).endswith((".yaml", ".yml")):  # streamed: its inputs must exist
            from data_pipeline.config import load_data_config
            from data_pipeline.sources import check_inputs
            check_inputs(load_data_config(cfg.data), f"--data {cfg.data}")
        check_vocab(self.model_cfg.vocab_size, cfg.data)
        check_resume_engine(self.run_dir, cfg.resume, cfg.dist.zero)

        init_process_group(env, cfg.dist.backend)
        model = build_from_config(self.model_cfg)
        self.sp, self.dp_rank = None, env.rank
        if sp > 1:  # hooks on the one-device model (pretrain/sequence_parallel.py), before any engine wraps it
            from pretrain.sequence_parallel import SequenceParallelPlan, build_groups
            self.sp, self.dp_rank, _ = build_groups(sp)
            self.sp_plan = SequenceParallelPlan(model, self.sp, equal_segments=True)  # the loader's split
        self.ac, self.ac_fraction = self._checkpointing(env.device)
        self.ac_blocks = model.set_activation_checkpointing(self.ac, self.ac_fraction)
        self.model = model
        self.module: TrainModule
        if cfg.dist.zero > 0:
            from pretrain.deepspeed_module import DeepSpeedTrainModule
            self.module = DeepSpeedTrainModule(model, cfg, env, self.precision, self.accum)
        else:
            fuse = grad_accumulation.fusion_wanted(t.grad_accum_fusion, env.world_size, self.accum)
            self.module = TorchTrainModule(model, cfg.optim, env.device, self.precision, ddp=env.world_size > 1,
                                           fuse_grad_accumulation=fuse)
        self.module.sequence_segments = sp
        self.compiled = resolve_compile(cfg, env.device.type)
        if self.compiled:
            self.module.compile()

        self.loader = build_loader(cfg.data, t.seq_len, self.global_batch, t.micro_batch,
                                   rank=self.dp_rank, world_size=self.dp_size, seed=t.seed, doc_starts=t.doc_reset,
                                   planned_steps=self.total_steps(), **self._sp_segment())
        self.val_batches = self._validation_batches(build_loader) if t.eval_every else []

        self.progress = TrainProgress()
        self.inject_nonfinite_steps = injected_nonfinite_steps()  # test-only seam (pretrain.faults)
        # the callbacks, in the order their hooks run: the stability monitor's stop comes before the
        # checkpoint manager's scheduled save, and its fields before the speed monitor's in a row
        self.stability = StabilityMonitor(t.spike_factor, t.max_bad_steps, self.run_dir / CHECKPOINTS)
        self.speed = SpeedMonitor(env.device, self.tokens_per_step, self.flops_per_step, env.world_size,
                                  peak_flops(env.device))
        self.checkpointer = CheckpointManager(cfg, self.model_cfg, env, self.module, self.progress, self,
                                              self.tokens_per_step, self.flops_per_step_ne, self.total_steps(),
                                              metrics_failed=lambda: self.metrics is not None and
                                              self.metrics.failed is not None)
        profiler = ([StepProfiler(t.profile_step, env.device, self.run_dir, env.rank, self.speed)]
                    if t.profile_step else [])
        self.callbacks = [self.stability, self.speed, MemoryMonitor(env.device), *self.extra_callbacks, *profiler,
                          self.checkpointer]
        self._check_same_model_without_checkpoints()
        for cb in self.callbacks:
            cb.post_attach()  # the checkpoint manager resumes here

        if env.is_main:
            # the start takes the run directory only now, its resume accepted (a refused one changes nothing):
            # summary.json says how the newest start ended, and an earlier start's ("finished" at an earlier
            # step) must not stand for this one should it stop without writing its own (a bad-step stop, a crash)
            (self.run_dir / SUMMARY).unlink(missing_ok=True)
            save_config(cfg, self.run_dir / RUN_CONFIG)
            engine_config = self.module.engine_config()
            if engine_config is not None:
                (self.run_dir / DEEPSPEED_CONFIG).write_text(json.dumps(engine_config, indent=2))
        # after post_attach: a resume has set the step, and rows of later steps replayed now replace the old ones
        self.metrics = MetricsLogger(self.run_dir, enabled=env.is_main, purge_step=self.progress.step + 1)

    def close(self) -> None:
        """Give back what the trainer holds: the callbacks' resources (the signal handlers), the metrics files,
        the run directory's lock. fit() calls it on every way out; a Trainer that is never fitted should call
        it (tests do)."""
        for cb in self.callbacks:
            cb.close()
        if self.metrics is not None:
            self.metrics.close()
        if getattr(self, "run_lock", None) is not None:
            self.run_lock.release()
        if getattr(self, "env", None) is not None and self.env.world_size > 1 and torch.distributed.is_initialized():
            # an orderly end for gloo/NCCL's threads: left to interpreter exit they can abort the process
            # ("terminate called without an active exception") after a finished run. After a finished run
            # every rank meets here first, so no rank tears the group down while another still talks in it.
            if getattr(self, "_ended_together", False):
                torch.distributed.barrier()
            torch.distributed.destroy_process_group()

    # -- setup helpers ------------------------------------------------------------------------------
    def _checkpointing(self, device: torch.device) -> tuple[str, float]:
        """The run's activation checkpointing; `auto` asks pretrain.memory what fits this GPU."""
        t = self.cfg.train
        mode = ac_mode(t)
        if device.type != "cuda":
            return ("none", 1.0) if mode == "auto" else (mode, t.ac_fraction)
        total = torch.cuda.get_device_properties(device).total_memory / 2**30
        logger.info(f"CUDA allocator: PYTORCH_CUDA_ALLOC_CONF={os.environ.get('PYTORCH_CUDA_ALLOC_CONF', '')}")
        tokens = t.micro_batch * t.seq_len // self.cfg.dist.sp  # a rank holds its segment of each sequence
        # ZeRO splits its state over the data-parallel ranks (the ranks of a sequence-parallel group hold
        # alike copies; counting only the groups keeps the estimate on the safe side)
        shard = dict(zero=self.cfg.dist.zero, ranks=max(1, self.env.world_size // self.cfg.dist.sp))
        if mode == "auto":
            mode, frac = choose_checkpointing(self.model_cfg, tokens, 0.9 * total, **shard)
            logger.info(f"--activation-checkpointing auto: {describe_setting(mode, frac, self.model_cfg.n_layers)}"
                        f" (estimated peak {estimate_peak_gib(self.model_cfg, tokens, mode, frac, **shard):.0f} of "
                        f"{total:.0f} GiB)")
        else:
            frac = t.ac_fraction
        warning = fit_warning(self.model_cfg, tokens, mode, frac, total, **shard)
        if warning:
            logger.warning(warning)
        if mode == "none":
            # ZeRO-3's wait for its parameter hooks between blocks shrinks with larger micro-batches too
            bigger = larger_micro_batch(self.model_cfg, t.seq_len // self.cfg.dist.sp, t.micro_batch, self.accum,
                                        0.9 * total, **shard)
            if bigger:
                logger.info(f"--micro-batch {bigger} would also fit without activation checkpointing (estimated "
                            f"peak {estimate_peak_gib(self.model_cfg, bigger * tokens // t.micro_batch, **shard):.0f}"
                            f" of {total:.0f} GiB) and is usually faster: the same global batch in fewer, larger "
                            f"micro-batches (docs/training.md, Micro-batch)")
        return mode, frac

    def _check_same_model_without_checkpoints(self) -> None:
        """--resume auto into a run that stopped before its first checkpoint starts from step 0 and appends to
        its metrics: right for the same model (the replayed steps' rows supersede the old ones), wrong for
        another, whose rows would be mixed into the first one's log. Checked on every rank (each reads the
        run's files), before anything is written. With checkpoints, their own model check applies."""
        path = self.run_dir / RUN_CONFIG
        if self.cfg.resume != "auto" or not path.is_file() or step_dirs(self.run_dir / CHECKPOINTS):
            return
        try:
            saved = json.loads(path.read_text()).get("model") or {}
        except ValueError:
            return
        diff = model_config_mismatch(saved, self.model_cfg.to_dict())
        if diff:
            raise UserError(f"--resume auto: {self.run_dir} holds no checkpoint yet, but its config.json and metrics "
                            f"are of another model ({'; '.join(diff[:3]).replace('checkpoint', 'there')}); starting "
                            f"here would mix this model's rows into its log: use another --out, or --overwrite to "
                            f"move the old files aside")

    def _sp_segment(self) -> dict:
        return {} if self.sp is None else {"sp_rank": self.sp.rank, "sp_size": self.sp.size}

    def _validation_batches(self, build_loader) -> list[dict]:
        """The validation set: the first eval_batches x EVAL_BATCH sequences of the val split, the same
        for any --micro-batch (a speed setting), with document resets as in training; grouped for the
        forward into equal batches of at most --micro-batch rows (memory)."""
        from data_pipeline.loader import first_pass, stack_batches
        t = self.cfg.train
        try:
            val = build_loader(self.cfg.data, t.seq_len, 1, 1, rank=0, world_size=1, seed=t.seed, split="val",
                               doc_starts=t.doc_reset, **self._sp_segment())
        except (TypeError, ValueError, FileNotFoundError) as err:
            logger.info(f"no validation split ({err}); validation loss disabled")
            return []
        wanted = t.eval_batches * EVAL_BATCH
        seqs = list(itertools.islice(first_pass(val), wanted))   # the set ends at the first repeat
        n = len(seqs)
        if n == 0:
            logger.warning(f"validation loss disabled: the val split holds no whole window of {t.seq_len + 1} "
                           f"tokens ({val.provider.describe()}); prepare a larger val split or lower --seq-len")
            return []
        if n < wanted:
            logger.warning(f"--eval-batches {t.eval_batches} asks for {wanted} validation sequences of {t.seq_len} "
                           f"tokens, but the val split holds {n} distinct ones: the validation set is those {n} "
                           f"(lower --eval-batches to {max(1, n // EVAL_BATCH)} or prepare a larger val split)")
        rows = max(b for b in range(1, min(t.micro_batch, n) + 1) if n % b == 0)  # equal batches: a plain mean
        return [stack_batches(seqs[i:i + rows], t.seq_len) for i in range(0, n, rows)]

    # -- state for checkpoints ----------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Everything of the trainer's own that an exact resume needs (the module holds model + optimizer):
        progress, data loader, RNG, and the callbacks' state (their keys side by side with these)."""
        p = self.progress
        state = {"step": p.step, "tokens": p.tokens, "flops": p.flops, "loader": self.loader.state_dict(),
                 "rng": rng_state()}
        for cb in self.callbacks:
            state.update(cb.state_dict())
        return state

    def load_state_dict(self, state: dict) -> None:
        self.progress.step, self.progress.tokens, self.progress.flops = state["step"], state["tokens"], state["flops"]
        self.loader.load_state_dict(state["loader"])
        if state.get("rng") is not None:
            set_rng_state(state["rng"])
        for cb in self.callbacks:
            cb.load_state_dict(state)

    # the progress counters, by name (scripts and tests read and advance them)
    step = property(lambda self: self.progress.step, lambda self, v: setattr(self.progress, "step", v))
    tokens = property(lambda self: self.progress.tokens, lambda self, v: setattr(self.progress, "tokens", v))
    flops = property(lambda self: self.progress.flops, lambda self, v: setattr(self.progress, "flops", v))

    # -- the loop -----------------------------------------------------------------------------------
    def done(self) -> bool:
        t = self.cfg.train
        return (t.max_steps is not None and self.step >= t.max_steps) or \
               (t.max_tokens is not None and self.tokens >= t.max_tokens)

    def total_steps(self) -> int | None:
        return planned_steps(self.cfg.train.max_steps, self.cfg.train.max_tokens, self.tokens_per_step)

    def _nothing_to_train(self) -> str:
        """The one line for a start whose progress already meets the limits (e.g. a resume of a finished
        run): which limit, where the run is, and how to train further."""
        t, p = self.cfg.train, self.progress
        reached = []  # (flag, its value, where the run is in its unit)
        if t.max_steps is not None and p.step >= t.max_steps:
            reached.append(("--max-steps", t.max_steps, p.step))
        if t.max_tokens is not None and p.tokens >= t.max_tokens:
            reached.append(("--max-tokens", t.max_tokens, p.tokens))
        where = "the checkpoint is" if p.step > 0 else "the run is"
        limits = " and ".join(f"{flag} is {value}" for flag, value, _ in reached)
        raise_ = " and ".join(f"{flag} above {now}" for flag, _, now in reached)
        return (f"nothing trained: {where} at step {p.step} ({p.tokens} tokens) and {limits}; to train further, "
                f"raise {raise_}" + (" and run again with --resume auto" if p.step > 0 else ""))

    def announce(self) -> None:
        info = model_info(self.model_cfg, self.tokens_per_step // self.cfg.train.seq_len, self.cfg.train.seq_len)
        e = self.env
        logger.info(f"{self.model_cfg.arch} {self.model_cfg.size}: {info.params_non_embedding / 1e6:.1f}M non-embedding, "
            f"{info.params_total / 1e6:.1f}M total parameters; {self.flops_per_step / 1e12:.3g} TFLOPs/step")
        if self.global_batch != self.cfg.global_batch:
            logger.info(f"--allow-inexact-batch: training on {self.global_batch} sequences per step instead of the "
                f"requested {self.cfg.global_batch}")
        engine = f"DeepSpeed ZeRO-{self.cfg.dist.zero}" if self.cfg.dist.zero else \
            ("DDP" if e.world_size > 1 else "PyTorch")
        if self.sp is not None:
            engine += f" x sequence parallel {self.sp.size} ({self.dp_size} data-parallel groups)"
        sp = self.cfg.dist.sp
        ranks = (f"{self.dp_size} data-parallel group(s) of {sp} sequence-parallel ranks" if sp > 1
                 else f"{self.dp_size} ranks")
        logger.info(f"engine: {engine}; batch: {self.global_batch} x {self.cfg.train.seq_len} tokens = {ranks} x "
                    f"micro {self.cfg.train.micro_batch} x accumulation {self.accum}; precision {self.precision}; "
                    f"device {e.device}")
        logger.info(f"data: {self.loader.describe()}")
        t = self.cfg.train
        ac = "off" if not self.ac_blocks else \
            f"{self.ac} on {len(self.ac_blocks)} of {self.model_cfg.n_layers} blocks"
        fused = "on" if getattr(self.module, "fused_grads", None) else "off"
        logger.info(f"torch.compile: {'on' if self.compiled else 'off'} (--compile {t.compile}); activation checkpointing: {ac}; "
                    f"weight-gradient fusion: {fused} (--grad-accum-fusion {t.grad_accum_fusion})")
        for line in get_arch(self.model_cfg.arch).describe(self.model):  # e.g. TNL's decay table
            logger.info(line)
        if self.total_steps() is None:
            logger.info("no --max-steps/--max-tokens given: training until stopped (checkpoints keep the progress)")
        logger.info(f"run directory: {self.run_dir}")

    def fit(self) -> dict:
        """Train until done or stopped; returns the summary. Gives back the run directory on every way out."""
        try:
            summary = self._fit()
            self._ended_together = True  # every rank returns from _fit together (stops are agreed collectively)
            return summary
        finally:
            self.close()

    def _stop_reason(self) -> str | None:
        """The first callback's reason to stop now, or None (a collective: every rank calls it)."""
        return next((r for r in (cb.stop_requested() for cb in self.callbacks) if r is not None), None)

    def _stop_reason_now(self) -> bool:
        return self._stop_reason() is not None

    def _fit(self) -> dict:
        self.announce()
        progress = Progress(self.total_steps(), self.env.is_main)
        p, t = self.progress, self.cfg.train
        steps_this_session = 0
        last = {}
        stop_reason = "finished"
        for cb in self.callbacks:
            cb.pre_train(p)
        if self.done() and self.env.is_main:
            logger.info(self._nothing_to_train())

        def log_row(res: StepResult, lr: float, is_eval: bool) -> dict:
            """Logs the row of step p.step (`res`: its result), evaluating first when `is_eval`."""
            row = {"step": p.step, "tokens": p.tokens, "loss": res.loss, "lr": lr, "flops": p.flops,
                   "flops_non_embedding": p.step * self.flops_per_step_ne, "grad_norm": res.grad_norm}
            for cb in self.callbacks:
                cb.pre_log_metrics(p, row)
            if is_eval:
                with self._stop_on_oom_or_compile_failure(p.step - 1):  # the evaluation after step p.step
                    val_loss = self.module.eval_loss(self.val_batches, stop=self._stop_reason_now)
                if val_loss is None:
                    logger.warning(f"step {p.step}: validation pass cut short by a stop request; no val_loss "
                                   f"at this step")
                else:
                    row["val_loss"] = val_loss
                for cb in self.callbacks:
                    cb.post_eval()
            self.metrics.log(row)
            progress.line(p.step, row, steps_this_session, self.speed.excluded_total_s,
                          self.speed.excluded_steps_total)
            return row

        res: StepResult | None = None
        lr, logged_step = 0.0, p.step
        while not self.done():
            reason = self._stop_reason()
            if reason is not None:  # 'signal'; 'save_failed' (post_train raises SaveFailed); 'log_failed' (below)
                stop_reason = reason
                if res is not None and logged_step != p.step and reason != "log_failed":
                    # the run stops (and its checkpoint is written) at a step --log-every would not log: its
                    # row, so that the log, the console and summary.json end at the step the run ends at
                    last = log_row(res, lr, is_eval=False)
                break
            micro = [self.loader.next_batch() for _ in range(self.accum)]
            inject = p.step in self.inject_nonfinite_steps
            for cb in self.callbacks:
                cb.pre_step(p)
            with self._stop_on_oom_or_compile_failure(p.step):
                res = self.module.train_step(micro, p.step, inject_nonfinite=inject)
            lr = lr_at(p.step, self.cfg.optim)
            p.step += 1
            steps_this_session += 1
            p.tokens += self.tokens_per_step
            p.flops += self.flops_per_step
            for cb in self.callbacks:
                cb.post_train_batch(p, res)
            is_log = p.step % t.log_every == 0 or self.done() or any(cb.wants_log() for cb in self.callbacks)
            is_eval = bool(self.val_batches) and t.eval_every and (p.step % t.eval_every == 0 or self.done())
            if is_log or is_eval:
                last, logged_step = log_row(res, lr, is_eval), p.step
            try:
                for cb in self.callbacks:
                    cb.post_step(p)
            except TrainingStopped as stop:
                if stop.checkpoint:
                    for cb in self.callbacks:
                        cb.save_now()
                raise
        for cb in self.callbacks:
            cb.post_train(stop_reason)
        barrier()
        self.metrics.close()
        if stop_reason == "log_failed":
            raise self._log_failure()
        if not last and self.env.is_main:  # nothing logged in this start: the run's own row of this step
            last = logged_row_at(self.run_dir, p.step)
        summary = {"step": p.step, "tokens": p.tokens, "flops": p.flops, "final_loss": last.get("loss"),
                   "val_loss": last.get("val_loss"), "bad_steps_total": self.stability.bad_steps_total,
                   "stop": stop_reason}
        if self.env.is_main:
            (self.run_dir / SUMMARY).write_text(json.dumps(summary, indent=2))
            logger.info(f"done: {summary}")
        return summary

    @contextlib.contextmanager
    def _stop_on_oom_or_compile_failure(self, step: int) -> Iterator[None]:
        """Out of memory, or torch.compile failing to build a graph, in the work of step `step` (0-based):
        the run stops with one line saying what to change (`TrainingStopped`) instead of a traceback."""
        try:
            yield
        except (torch.OutOfMemoryError, RuntimeError) as err:
            from torch._dynamo.exc import TorchDynamoException  # Dynamo's and Inductor's errors
            if is_out_of_memory(err):
                message = (out_of_memory_message(self.cfg, self.env.device, step, self.ac, self.ac_fraction)
                           + f" (original error: {_first_line(err)})")
            elif self.compiled and isinstance(err, TorchDynamoException):
                message = compile_failed_message(self.cfg, step, err)
            else:
                raise
            self.metrics.close()
            raise TrainingStopped(message) from err

    def _log_failure(self) -> OutputFailed:
        """The error a run ends with when rank 0 could not write metrics.jsonl (printed by rank 0 only)."""
        done = [p.name for s, p in step_dirs(self.run_dir / CHECKPOINTS) if s <= self.step]
        resume = (f"--resume auto continues from the newest checkpoint {done[-1]} (replaying the later steps)"
                  if done else "no checkpoint exists yet: the run starts again from step 0")
        err = OutputFailed(f"{self.metrics.path}: a row could not be written: {self.metrics.failed}; training "
                           f"stopped at step {self.step} without a checkpoint of the unlogged steps; {resume}. "
                           f"Free space there, or move the run directory to a bigger disk and pass it as --out; "
                           f"then --resume auto")
        err.quiet = not self.env.is_main
        return err


def _main(argv: list[str] | None = None) -> int:
    from pretrain.config import parse_config
    configure_allocator()  # before the first CUDA allocation
    trainer = Trainer(parse_config(argv))
    trainer.fit()
    return 0


def main(argv: list[str] | None = None) -> int:
    """`launch/pretrain.py`: user errors end in one `error:` line and an exit code (pretrain/errors.py)."""
    return run_cli(_main, argv)
