"""The training loop: data -> train module -> metrics, with the stopping, skipping and spike rules of the
recipe. Checkpointing and the DeepSpeed engine plug in through `pretrain.train_module`-style modules and
the `checkpoints` package; the loop itself knows nothing about ZeRO."""
from __future__ import annotations

import json
import math
import os
import random
import time
from pathlib import Path

import numpy as np
import torch

import ops
from checkpoints.layout import CHECKPOINTS, DEEPSPEED_CONFIG, RUN_CONFIG, SUMMARY
from models import LanguageModel, build_from_config, flops_per_step, model_info
from models.config import VOCAB_SIZE
from pretrain.config import RunConfig, ac_mode, gradient_accumulation, resolve_compile, save_config
from pretrain.distributed import DistEnv, barrier, dist_env, init_process_group
from pretrain.errors import EXIT_STOPPED, ConfigError, OutputFailed, UserError, run_cli
from pretrain.metrics import MetricsLogger, Progress, peak_flops
from pretrain.train_module import TorchTrainModule, lr_at


def log(msg: str, env: DistEnv | None = None) -> None:
    if env is None or env.is_main:
        print(f"[linscale] {msg}", flush=True)


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


def memory_stats(device: torch.device) -> dict[str, float]:
    """Peak accelerator memory of this rank (rank 0 logs), or the process's peak RSS on CPU."""
    if device.type == "cuda":
        return {"max_memory_gb": torch.cuda.max_memory_allocated(device) / 2**30,
                "max_memory_reserved_gb": torch.cuda.max_memory_reserved(device) / 2**30}
    try:
        import resource
        return {"max_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}  # KiB on Linux
    except (ImportError, OSError):
        return {}


def decay_table(model: LanguageModel) -> list[list[float]] | None:
    """TNL's fixed per-layer, per-head decays (logged at start, as DESIGN asks)."""
    if model.config.arch != "tnl":
        return None
    return [b.token_mixer.decays for b in model.blocks]


class TrainingStopped(UserError, RuntimeError):
    """The run stopped itself on purpose (e.g. too many non-finite steps); the message says why and what to do."""
    exit_code = EXIT_STOPPED


def check_device(requested: str) -> None:
    """--device cuda on a machine (or a torch build) without CUDA: say so before anything starts."""
    if requested == "cuda" and not torch.cuda.is_available():
        build = "a CPU-only torch build" if torch.version.cuda is None else f"torch built for CUDA {torch.version.cuda}"
        raise UserError(f"--device cuda: no CUDA device is visible here ({build}, "
                        f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}); "
                        f"use --device cpu (or auto), or run on a machine with a GPU")


def compiled_graph_count() -> int:
    """Graphs torch.compile has produced in this process (grows by one with every compile or recompile)."""
    from torch._dynamo.utils import counters
    return counters["stats"]["unique_graphs"]


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
    ac = "off" if mode == "none" else f"{mode}" + (f" on {fraction:.0%} of the blocks" if fraction < 1 else "")
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
    def __init__(self, cfg: RunConfig):
        from data_pipeline import build_loader

        from checkpoints.run_dir import open_run_directory

        self.cfg = cfg
        self.checkpointer = None
        self.metrics = None
        check_device(cfg.train.device)
        self.env = env = dist_env(cfg.train.device)
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
            raise ConfigError(f"--sp {sp} must divide the number of ranks ({env.world_size}): each sequence-parallel "
                              f"group is {sp} ranks")
        self.dp_size = env.world_size // sp  # ranks that draw distinct samples
        self.accum = gradient_accumulation(cfg.global_batch, self.dp_size, t.micro_batch, t.allow_inexact_batch)
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
        from checkpoints.manager import check_resume_engine
        check_resume_engine(self.run_dir, cfg.resume, cfg.dist.zero)

        init_process_group(env, cfg.dist.backend)
        model = build_from_config(self.model_cfg)
        self.sp, self.dp_rank = None, env.rank
        if sp > 1:  # hooks on the one-device model (pretrain/sequence_parallel.py), before any engine wraps it
            from pretrain.sequence_parallel import SequenceParallelPlan, build_groups
            self.sp, self.dp_rank, _ = build_groups(sp)
            self.sp_plan = SequenceParallelPlan(model, self.sp)
        self.ac, self.ac_fraction = self._checkpointing(env.device)
        self.ac_blocks = model.set_activation_checkpointing(self.ac, self.ac_fraction)
        self.model = model
        if cfg.dist.zero > 0:
            from pretrain.deepspeed_module import DeepSpeedTrainModule
            self.module = DeepSpeedTrainModule(model, cfg, env, self.precision, self.accum)
        else:
            self.module = TorchTrainModule(model, cfg.optim, env.device, self.precision, ddp=env.world_size > 1)
        self.compiled = resolve_compile(cfg, env.device.type)
        if self.compiled:
            self.module.compile()
        self.compile_time_s = 0.0  # wall time of the steps that compiled (excluded from tokens/s)

        self.loader = build_loader(cfg.data, t.seq_len, self.global_batch, t.micro_batch,
                                   rank=self.dp_rank, world_size=self.dp_size, seed=t.seed, doc_starts=t.doc_reset,
                                   **self._sp_segment())
        self.val_batches = self._validation_batches(build_loader) if t.eval_every else []

        self.step = 0
        self.tokens = 0
        self.flops = 0.0
        self.bad_steps_in_row = 0
        self.bad_steps_total = 0
        self.loss_ema: float | None = None
        self.inject_nonfinite_steps: set[int] = {int(s) for s in os.environ.get("LINSCALE_INJECT_NONFINITE", "").split(",") if s}
        self._maybe_attach_checkpointer()  # sets self.checkpointer

        if env.is_main:
            save_config(cfg, self.run_dir / RUN_CONFIG)
            if getattr(self.module, "ds_config", None) is not None:
                (self.run_dir / DEEPSPEED_CONFIG).write_text(json.dumps(self.module.ds_config, indent=2))
        self.metrics = MetricsLogger(self.run_dir, enabled=env.is_main)
        self.peak = peak_flops(env.device)

    def close(self) -> None:
        """Give back what the trainer holds: the metrics files, the signal handlers, the run directory's lock.
        fit() calls it on every way out; a Trainer that is never fitted should call it (tests do)."""
        if self.checkpointer is not None:
            self.checkpointer.signal.uninstall()
        if self.metrics is not None:
            self.metrics.close()
        if getattr(self, "run_lock", None) is not None:
            self.run_lock.release()
        if getattr(self, "env", None) is not None and self.env.world_size > 1 and torch.distributed.is_initialized():
            # an orderly end for gloo/NCCL's threads: left to interpreter exit they can abort the process
            # ("terminate called without an active exception") after a finished run
            torch.distributed.destroy_process_group()

    # -- setup helpers ------------------------------------------------------------------------------
    def _checkpointing(self, device: torch.device) -> tuple[str, float]:
        """The run's activation checkpointing; `auto` asks pretrain.memory what fits this GPU."""
        t = self.cfg.train
        mode = ac_mode(t)
        if mode != "auto":
            return mode, t.ac_fraction
        if device.type != "cuda":
            return "none", 1.0
        from pretrain.memory import choose_checkpointing, estimate_peak_gib
        total = torch.cuda.get_device_properties(device).total_memory / 2**30
        mode, frac = choose_checkpointing(self.model_cfg, t.micro_batch * t.seq_len, 0.9 * total)
        log(f"--activation-checkpointing auto: {mode}" + (f" on {frac:.0%} of the blocks" if mode != "none" else "")
            + f" (estimated peak {estimate_peak_gib(self.model_cfg, t.micro_batch * t.seq_len, mode, frac):.0f} "
            f"of {total:.0f} GiB)", self.env)
        return mode, frac

    def _sp_segment(self) -> dict:
        return {} if self.sp is None else {"sp_rank": self.sp.rank, "sp_size": self.sp.size}

    def _validation_batches(self, build_loader) -> list[dict]:
        t = self.cfg.train
        try:
            val = build_loader(self.cfg.data, t.seq_len, t.micro_batch, t.micro_batch, rank=0, world_size=1,
                               seed=t.seed, split="val", **self._sp_segment())
        except (TypeError, ValueError, FileNotFoundError) as err:
            log(f"no validation split ({err}); validation loss disabled", self.env)
            return []
        return [val.next_batch() for _ in range(t.eval_batches)]

    def _maybe_attach_checkpointer(self) -> None:
        try:
            from checkpoints import attach_to_trainer
        except ImportError:
            return
        attach_to_trainer(self)

    # -- state for checkpoints ----------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Everything of the trainer's own that an exact resume needs (the module holds model + optimizer)."""
        return {"step": self.step, "tokens": self.tokens, "flops": self.flops, "loader": self.loader.state_dict(),
                "rng": rng_state(), "bad_steps_total": self.bad_steps_total, "loss_ema": self.loss_ema}

    def load_state_dict(self, state: dict) -> None:
        self.step, self.tokens, self.flops = state["step"], state["tokens"], state["flops"]
        self.loader.load_state_dict(state["loader"])
        if state.get("rng") is not None:
            set_rng_state(state["rng"])
        self.bad_steps_total = state.get("bad_steps_total", 0)
        self.loss_ema = state.get("loss_ema")

    # -- the loop -----------------------------------------------------------------------------------
    def done(self) -> bool:
        t = self.cfg.train
        return (t.max_steps is not None and self.step >= t.max_steps) or \
               (t.max_tokens is not None and self.tokens >= t.max_tokens)

    def total_steps(self) -> int | None:
        t = self.cfg.train
        candidates = [t.max_steps] if t.max_steps is not None else []
        if t.max_tokens is not None:
            candidates.append(math.ceil(t.max_tokens / self.tokens_per_step))
        return min(candidates) if candidates else None

    def announce(self) -> None:
        info = model_info(self.model_cfg, self.tokens_per_step // self.cfg.train.seq_len, self.cfg.train.seq_len)
        e = self.env
        log(f"{self.model_cfg.arch} {self.model_cfg.size}: {info.params_non_embedding / 1e6:.1f}M non-embedding, "
            f"{info.params_total / 1e6:.1f}M total parameters; {self.flops_per_step / 1e12:.3g} TFLOPs/step", e)
        if self.global_batch != self.cfg.global_batch:
            log(f"--allow-inexact-batch: training on {self.global_batch} sequences per step instead of the "
                f"requested {self.cfg.global_batch}", e)
        engine = f"DeepSpeed ZeRO-{self.cfg.dist.zero}" if self.cfg.dist.zero else \
            ("DDP" if e.world_size > 1 else "PyTorch")
        if self.sp is not None:
            engine += f" x sequence parallel {self.sp.size} ({self.dp_size} data-parallel groups)"
        log(f"engine: {engine}; batch: {self.global_batch} x {self.cfg.train.seq_len} tokens = {self.dp_size} ranks x micro "
            f"{self.cfg.train.micro_batch} x accumulation {self.accum}; precision {self.precision}; device {e.device}", e)
        log(f"data: {self.loader.describe()}", e)
        t = self.cfg.train
        ac = "off" if not self.ac_blocks else \
            f"{self.ac} on {len(self.ac_blocks)} of {self.model_cfg.n_layers} blocks"
        log(f"torch.compile: {'on' if self.compiled else 'off'} (--compile {t.compile}); activation checkpointing: {ac}", e)
        table = decay_table(self.model)
        if table is not None:
            log(f"TNL decay schedule '{self.model_cfg.tnl_decay_schedule}' (lambda per layer x head):", e)
            for i, row in enumerate(table):
                log(f"  layer {i:2d}: " + " ".join(f"{x:.5f}" for x in row), e)
        if self.total_steps() is None:
            log("no --max-steps/--max-tokens given: training until stopped (checkpoints keep the progress)", e)
        log(f"run directory: {self.run_dir}", e)

    def fit(self) -> dict:
        """Train until done or stopped; returns the summary. Gives back the run directory on every way out."""
        try:
            return self._fit()
        finally:
            self.close()

    def _fit(self) -> dict:
        self.announce()
        progress = Progress(self.total_steps(), self.env.is_main)
        t = self.cfg.train
        steps_this_session = 0
        last_time = time.time()
        last_log_step = self.step
        compile_time_in_interval, compile_steps_in_interval = 0.0, 0
        last = {}
        stop_reason = "finished"
        while not self.done():
            reason = (self.checkpointer.stop_requested() if self.checkpointer is not None
                      else "log_failed" if self.metrics.failed else None)
            if reason is not None:  # 'signal'; 'save_failed' (at_end raises SaveFailed); 'log_failed' (below)
                stop_reason = reason
                break
            micro = [self.loader.next_batch() for _ in range(self.accum)]
            inject = self.step in self.inject_nonfinite_steps
            graphs, step_start = compiled_graph_count(), time.time()
            try:
                res = self.module.train_step(micro, self.step, inject_nonfinite=inject)
            except (torch.OutOfMemoryError, RuntimeError) as err:
                if not is_out_of_memory(err):
                    raise
                self.metrics.close()
                raise TrainingStopped(out_of_memory_message(self.cfg, self.env.device, self.step, self.ac,
                                                            self.ac_fraction)
                                      + f" (original error: {str(err).splitlines()[0]})") from err
            if compiled_graph_count() != graphs:
                # this step compiled: report its time as compile time and keep it out of tokens/s
                spent = time.time() - step_start
                self.compile_time_s += spent
                compile_time_in_interval += spent
                compile_steps_in_interval += 1
                log(f"step {self.step + 1}: torch.compile built {compiled_graph_count() - graphs} graph(s); the step "
                    f"took {spent:.1f} s (compile time so far {self.compile_time_s:.1f} s, not counted in tokens/s)",
                    self.env)
            lr = lr_at(self.step, self.cfg.optim)
            self.step += 1
            steps_this_session += 1
            self.tokens += self.tokens_per_step
            self.flops += self.flops_per_step
            if res.skipped:
                self.bad_steps_in_row += 1
                self.bad_steps_total += 1
                log(f"step {self.step}: non-finite loss ({res.loss}) or gradient norm ({res.grad_norm}); update "
                    f"skipped ({self.bad_steps_in_row} in a row, {self.bad_steps_total} in total)", self.env)
            else:
                self.bad_steps_in_row = 0
            spike = False
            if not res.skipped:
                if self.loss_ema is not None and res.loss > t.spike_factor * self.loss_ema:
                    spike = True
                    log(f"step {self.step}: loss spike {res.loss:.4f} (running mean {self.loss_ema:.4f})", self.env)
                self.loss_ema = res.loss if self.loss_ema is None else 0.98 * self.loss_ema + 0.02 * res.loss
            is_log = self.step % t.log_every == 0 or self.done() or res.skipped or spike
            is_eval = bool(self.val_batches) and t.eval_every and (self.step % t.eval_every == 0 or self.done())
            if is_log or is_eval:
                if self.env.device.type == "cuda":
                    torch.cuda.synchronize()
                now = time.time()
                timed_steps = self.step - last_log_step - compile_steps_in_interval
                dt = (now - last_time - compile_time_in_interval) / timed_steps if timed_steps > 0 else None
                last_time, last_log_step = now, self.step
                compile_time_in_interval, compile_steps_in_interval = 0.0, 0
                row = {"step": self.step, "tokens": self.tokens, "loss": res.loss, "lr": lr,
                       "flops": self.flops, "flops_non_embedding": self.step * self.flops_per_step_ne,
                       "tokens_per_s": self.tokens_per_step / dt if dt else None, "grad_norm": res.grad_norm,
                       "step_time_s": dt, "skipped": res.skipped, "bad_steps_total": self.bad_steps_total}
                if self.compile_time_s:
                    row["compile_s"] = self.compile_time_s
                if spike:
                    row["loss_spike"] = True
                if self.peak and dt:
                    row["mfu"] = self.flops_per_step / dt / (self.peak * self.env.world_size)
                row.update(memory_stats(self.env.device))
                if is_eval:
                    row["val_loss"] = self.module.eval_loss(self.val_batches)
                    last_time = time.time()  # the evaluation is not training time
                self.metrics.log(row)
                progress.line(self.step, row, steps_this_session)
                last = row
            if t.max_bad_steps and self.bad_steps_in_row >= t.max_bad_steps:  # after the row is logged
                if self.checkpointer is not None:
                    self.checkpointer.save(blocking=True)
                self.metrics.close()
                raise TrainingStopped(f"{self.bad_steps_in_row} non-finite steps in a row (limit --max-bad-steps "
                                      f"{t.max_bad_steps}); stopped at step {self.step} with a checkpoint of it "
                                      f"(the weights are those of the last good step). Lower --lr, check the data, "
                                      f"or resume from an earlier checkpoint in {self.run_dir / CHECKPOINTS}")
            if self.checkpointer is not None:
                self.checkpointer.after_step()
        if self.checkpointer is not None:
            self.checkpointer.at_end(stop_reason)
        barrier()
        self.metrics.close()
        if stop_reason == "log_failed":
            raise self._log_failure()
        summary = {"step": self.step, "tokens": self.tokens, "flops": self.flops, "final_loss": last.get("loss"),
                   "val_loss": last.get("val_loss"), "bad_steps_total": self.bad_steps_total, "stop": stop_reason}
        if self.env.is_main:
            (self.run_dir / SUMMARY).write_text(json.dumps(summary, indent=2))
            log(f"done: {summary}", self.env)
        return summary

    def _log_failure(self) -> OutputFailed:
        """The error a run ends with when rank 0 could not write metrics.jsonl (printed by rank 0 only)."""
        from checkpoints.layout import step_dirs
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
    trainer = Trainer(parse_config(argv))
    trainer.fit()
    return 0


def main(argv: list[str] | None = None) -> int:
    """`launch/pretrain.py`: user errors end in one `error:` line and an exit code (pretrain/errors.py)."""
    return run_cli(_main, argv)
