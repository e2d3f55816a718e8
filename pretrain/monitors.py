"""The callbacks that watch training: stability (non-finite steps, loss spikes, the bad-step stop), speed
(tokens/s, step time, compile time, MFU) and memory (peak accelerator memory or RSS). Each fills its own
fields of the metrics row (pretrain/callbacks.py for the hooks)."""
from __future__ import annotations

import time
from pathlib import Path

import torch

from pretrain.callbacks import Callback, TrainProgress
from pretrain.errors import EXIT_STOPPED, UserError
from pretrain.logs import get_logger
from pretrain.train_module import StepResult

logger = get_logger(__name__)

SPIKE_EMA = 0.98  # weight of the running mean of the loss that a spike is judged against


class TrainingStopped(UserError, RuntimeError):
    """The run stopped itself on purpose (e.g. too many non-finite steps); the message says why and what to do.
    `checkpoint`: the trainer writes a resume checkpoint of the current step before it stops."""
    exit_code = EXIT_STOPPED

    def __init__(self, message: str, checkpoint: bool = False) -> None:
        super().__init__(message)
        self.checkpoint = checkpoint


class StabilityMonitor(Callback):
    """Counts skipped (non-finite) steps and stops the run after `max_bad_steps` in a row (0: never), with a
    resume checkpoint of that step; flags a loss above `spike_factor` x its running mean as a spike (logged,
    the step is kept)."""

    def __init__(self, spike_factor: float, max_bad_steps: int, checkpoint_dir: Path) -> None:
        self.spike_factor = spike_factor
        self.max_bad_steps = max_bad_steps
        self.checkpoint_dir = checkpoint_dir  # named in the stop message
        self.bad_steps_in_row = 0
        self.bad_steps_total = 0
        self.loss_ema: float | None = None
        self.skipped = False
        self.spike = False

    def state_dict(self) -> dict:
        # the streak too: a run stopped (and resumed) inside a run of non-finite steps must stop at the same
        # step as the uninterrupted run, not count --max-bad-steps afresh from the resume
        return {"bad_steps_total": self.bad_steps_total, "bad_steps_in_row": self.bad_steps_in_row,
                "loss_ema": self.loss_ema}

    def load_state_dict(self, state: dict) -> None:
        self.bad_steps_total = state.get("bad_steps_total", 0)
        self.bad_steps_in_row = state.get("bad_steps_in_row", 0)  # checkpoints written before it was saved: 0
        self.loss_ema = state.get("loss_ema")

    def post_train_batch(self, progress: TrainProgress, result: StepResult) -> None:
        self.skipped, self.spike = result.skipped, False
        if result.skipped:
            self.bad_steps_in_row += 1
            self.bad_steps_total += 1
            logger.info(f"step {progress.step}: non-finite loss ({result.loss}) or gradient norm ({result.grad_norm}); "
                        f"update skipped ({self.bad_steps_in_row} in a row, {self.bad_steps_total} in total)")
            return
        self.bad_steps_in_row = 0
        if self.loss_ema is not None and result.loss > self.spike_factor * self.loss_ema:
            self.spike = True
            logger.info(f"step {progress.step}: loss spike {result.loss:.4f} (running mean {self.loss_ema:.4f})")
        self.loss_ema = result.loss if self.loss_ema is None else SPIKE_EMA * self.loss_ema + (1 - SPIKE_EMA) * result.loss

    def wants_log(self) -> bool:
        return self.skipped or self.spike

    def pre_log_metrics(self, progress: TrainProgress, row: dict) -> None:
        row["skipped"] = self.skipped
        row["bad_steps_total"] = self.bad_steps_total
        if self.spike:
            row["loss_spike"] = True

    def post_step(self, progress: TrainProgress) -> None:
        """After the step's row is logged: stop when the limit of bad steps in a row is reached (the trainer
        has every callback's save_now write a checkpoint of this step first)."""
        if self.max_bad_steps and self.bad_steps_in_row >= self.max_bad_steps:
            raise TrainingStopped(f"{self.bad_steps_in_row} non-finite steps in a row (limit --max-bad-steps "
                                  f"{self.max_bad_steps}); stopped at step {progress.step} with a checkpoint of it "
                                  f"(the weights are those of the last good step). Lower --lr, check the data, "
                                  f"or resume from an earlier checkpoint in {self.checkpoint_dir}",
                                  checkpoint=True)


def compiled_graph_count() -> int:
    """Graphs torch.compile has produced in this process (grows by one with every compile or recompile)."""
    from torch._dynamo.utils import counters
    return counters["stats"]["unique_graphs"]


class SpeedMonitor(Callback):
    """Tokens/s, seconds per step and MFU over the steps since the last row. A step in which torch.compile
    built graphs is reported as compile time and kept out of the rate, and so is the first step of every
    process, compiled or not: eagerly it JIT-compiles and autotunes the Triton kernels and makes the
    optimizer's first call (seconds to minutes on a GPU). Validation and a step run under the profiler
    (`exclude_step`) are kept out too."""

    def __init__(self, device: torch.device, tokens_per_step: int, flops_per_step: float, world_size: int,
                 peak_flops: float | None) -> None:
        self.device = device
        self.tokens_per_step = tokens_per_step
        self.flops_per_step = flops_per_step
        self.world_size = world_size
        self.peak = peak_flops
        self.compile_time_s = 0.0  # wall time of the steps that compiled, in this process
        self.last_time = time.time()
        self.last_log_step = 0
        self.excluded_in_interval, self.excluded_steps_in_interval = 0.0, 0
        # the same, over this process: one-off time (compiles, the first step, the profiled step) that the
        # console's ETA leaves out, as it does not recur in the steps still to train
        self.excluded_total_s, self.excluded_steps_total = 0.0, 0
        self._graphs, self._step_start = 0, 0.0
        self._excluded_step, self._excluded_until = -1, 0.0
        self._first_step = True  # of this process

    def pre_train(self, progress: TrainProgress) -> None:
        self.last_time, self.last_log_step = time.time(), progress.step  # after a resume: not step 0

    def pre_step(self, progress: TrainProgress) -> None:
        self._graphs, self._step_start = compiled_graph_count(), time.time()

    def post_train_batch(self, progress: TrainProgress, result: StepResult) -> None:
        built = compiled_graph_count() - self._graphs
        first, self._first_step = self._first_step, False
        if built or first:
            spent = time.time() - self._step_start
            self.compile_time_s += spent
            self.excluded_in_interval += spent
            self.excluded_steps_in_interval += 1
            self.excluded_total_s += spent
            self.excluded_steps_total += 1
            self._excluded_step, self._excluded_until = progress.step, time.time()
            what = (f"torch.compile built {built} graph(s)" if built else
                    "the first step of this process (Triton kernels compiled and tuned, the optimizer's first call)")
            logger.info(f"step {progress.step}: {what}; the step took {spent:.1f} s "
                        f"(compile time so far {self.compile_time_s:.1f} s, not counted in tokens/s)")
            from torch._dynamo import config as dynamo_config
            limit = dynamo_config.recompile_limit
            if built >= limit:
                # every block shares one graph when nothing in it differs between blocks: this many graphs in
                # one step means a guard on something per block, and Dynamo runs the code eagerly past its limit
                logger.warning(f"step {progress.step}: torch.compile built {built} graphs in one step, Dynamo's "
                               f"recompile limit ({limit}): the compiled code recompiled (the blocks guard on "
                               f"something that differs between them), and whatever runs past the limit runs "
                               f"eagerly, 2-3x slower. TORCH_LOGS=recompiles names the guard; --no-compile "
                               f"trains eagerly throughout")

    def exclude_step(self, step: int, since: float) -> None:
        """Keeps step `step`, from time `since` until now, out of the rate: a step that another callback slowed
        on purpose (the profiler records it and then reads its trace). A compile step already kept out only
        adds the time after its own end."""
        now = time.time()
        if step == self._excluded_step:
            since = max(since, self._excluded_until)
        else:
            self.excluded_steps_in_interval += 1
            self.excluded_steps_total += 1
        self.excluded_in_interval += max(0.0, now - since)
        self.excluded_total_s += max(0.0, now - since)
        self._excluded_step, self._excluded_until = step, now

    def pre_log_metrics(self, progress: TrainProgress, row: dict) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        now = time.time()
        timed_steps = progress.step - self.last_log_step - self.excluded_steps_in_interval
        dt = (now - self.last_time - self.excluded_in_interval) / timed_steps if timed_steps > 0 else None
        self.last_time, self.last_log_step = now, progress.step
        self.excluded_in_interval, self.excluded_steps_in_interval = 0.0, 0
        row["tokens_per_s"] = self.tokens_per_step / dt if dt else None
        row["step_time_s"] = dt
        if self.compile_time_s:
            row["compile_s"] = self.compile_time_s
        if self.peak and dt:
            row["mfu"] = self.flops_per_step / dt / (self.peak * self.world_size)

    def post_eval(self) -> None:
        self.last_time = time.time()  # the evaluation is not training time


def memory_stats(device: torch.device) -> dict[str, float]:
    """Peak accelerator memory of this rank (rank 0 logs), or the process's peak RSS on CPU."""
    if device.type == "cuda":
        # alloc_retries counts the times the caching allocator had to free its cache and synchronise to find
        # room: each costs a stall, so a rising count explains steps that are slow for no kernel's sake
        return {"max_memory_gb": torch.cuda.max_memory_allocated(device) / 2**30,
                "max_memory_reserved_gb": torch.cuda.max_memory_reserved(device) / 2**30,
                "alloc_retries": torch.cuda.memory_stats(device).get("num_alloc_retries", 0)}
    try:
        import resource
        return {"max_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}  # KiB on Linux
    except (ImportError, OSError):
        return {}


class MemoryMonitor(Callback):
    """Peak memory of this rank in every metrics row."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def pre_log_metrics(self, progress: TrainProgress, row: dict) -> None:
        row.update(memory_stats(self.device))
