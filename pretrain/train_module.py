"""The train module: what the trainer and the checkpoint manager drive, as an abstract base
(`TrainModule`), and its plain PyTorch engine (`TorchTrainModule`: one process, or DDP when there are
several and no ZeRO). Parallelism and precision are applied here, from outside the model.
`pretrain.deepspeed_module.DeepSpeedTrainModule` is the other engine."""
from __future__ import annotations

import contextlib
import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from torch import Tensor, nn

from checkpoints.layout import TORCH_MODEL, TORCH_OPTIMIZER
from pretrain import grad_accumulation
from pretrain.batches import device_batch
from pretrain.config import OptimConfig
from pretrain.distributed import all_reduce_mean, get_rank


@dataclass
class StepResult:
    loss: float          # mean loss over the step's micro-batches (all ranks)
    grad_norm: float     # before clipping
    skipped: bool        # the update was skipped (non-finite loss or gradient norm)


def mean_loss(forward: Callable[[dict], Tensor], batches: list[dict],
              stop: Callable[[], bool] | None = None) -> float | None:
    """The mean of forward(b) over `batches`, or None once stop() is true (see TrainModule.eval_loss)."""
    total = 0.0
    for i, b in enumerate(batches):
        total += float(forward(b))
        if stop is not None and i < len(batches) - 1 and stop():
            return None
    return total / max(1, len(batches))


def lr_at(step: int, cfg: OptimConfig) -> float:
    """Linear warm-up from 0 to lr over warmup_steps, then constant (the paper's schedule). A pure
    function of the step, so a resumed run has nothing to restore."""
    if cfg.warmup_steps > 0 and step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    return cfg.lr


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay on linear and embedding matrices only; norm gains, HGRN2 lower bounds, LRPE angles and
    TPE parameters are left undecayed. The decayed group comes first (`set_hyperparameters` relies on it)."""
    decay_ids = {id(m.weight) for m in model.modules() if isinstance(m, (nn.Linear, nn.Embedding))}
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if id(p) in decay_ids else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def set_hyperparameters(optimizer: torch.optim.Optimizer, cfg: OptimConfig, step: int) -> float:
    """Puts the run config's optimizer settings on the parameter groups for step `step` (0-based): the
    learning rate `lr_at(step)`, betas, eps, and the weight decay (on the first group, the decayed one of
    `param_groups`; none on the others). Called before every update, not once: loading a checkpoint's
    optimizer state (torch's `load_state_dict`, DeepSpeed's `load_checkpoint`) brings back the settings it
    was saved with, and a setting changed at a resume (`--weight-decay`, `--beta2`) must be the one that
    trains. Returns the learning rate."""
    lr = lr_at(step, cfg)
    for i, g in enumerate(optimizer.param_groups):
        g["lr"] = lr
        g["betas"] = (cfg.beta1, cfg.beta2)
        g["eps"] = cfg.eps
        g["weight_decay"] = cfg.weight_decay if i == 0 else 0.0
    return lr


def build_optimizer(model: nn.Module, cfg: OptimConfig, device: torch.device,
                    cls: type[torch.optim.AdamW] = torch.optim.AdamW) -> torch.optim.AdamW:
    """The recipe's AdamW (`cls`: AdamW or a subclass) over `param_groups`; fused on CUDA."""
    kw = dict(lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)
    if device.type == "cuda":
        kw["fused"] = True
    return cls(param_groups(model, cfg.weight_decay), **kw)


class TrainModule(ABC):
    """One optimizer step over a list of micro-batches, evaluation, and the model + optimizer state, on
    one engine. The checkpoint contract (checkpoints/manager.py, docs/checkpoints.md):

      save_state(dir)        model + optimizer; every rank calls it
      load_state(dir)        the inverse; every rank
      full_state_dict()      consolidated weights on rank 0 (a collective under ZeRO-3: every rank calls it)
      stage_state(buffers, dir)  copy model + optimizer to host memory now and return write(), which writes
                             the files into dir (in a background thread) and returns their records by path;
                             None (the default): the manager calls save_state instead, synchronously
      stage_layout()         what stage_state will copy, so host buffers can be prepared early; None: unknown
    """

    model: nn.Module          # the bare model (no DDP or engine wrapper)
    device: torch.device
    sequence_segments: int = 1  # --sp: each rank's batch is one of this many segments of every sequence

    @abstractmethod
    def train_step(self, micro_batches: list[dict], step: int, inject_nonfinite: bool = False) -> StepResult:
        """One optimizer step at learning rate lr_at(step); a non-finite loss or gradient norm skips the
        update (reported in the result). `inject_nonfinite`: make this step's loss NaN (fault injection)."""

    @abstractmethod
    def eval_loss(self, batches: list[dict], stop: Callable[[], bool] | None = None) -> float | None:
        """Mean loss over `batches` without gradients (every rank calls it). `stop`: a collective asked
        after each batch but the last; once it is true the pass ends and gives None (a stop request
        must not wait for a long validation pass: Slurm kills the job at the end of its grace time)."""

    @abstractmethod
    def compile(self) -> None:
        """torch.compile the model in place."""

    @abstractmethod
    def save_state(self, directory: Path) -> None: ...

    @abstractmethod
    def load_state(self, directory: Path) -> None: ...

    @abstractmethod
    def full_state_dict(self) -> dict[str, Tensor]: ...

    def stage_state(self, buffers, directory: Path) -> Callable[[], dict] | None:
        return None

    def stage_layout(self) -> dict | None:
        return None

    def engine_config(self) -> dict | None:
        """The engine's own configuration, written to the run directory (DeepSpeed's); None: nothing."""
        return None


def compile_blocks(model: nn.Module, backend: str = "inductor", hooks_outside: bool = False) -> bool:
    """torch.compile each block of `model` in place (regional compilation, as torchtitan does). The blocks
    are alike and take their per-layer constants as inputs, so they share one compiled graph: compile time
    is that of one block, not of the whole depth. The embedding, the final norm and the fused loss (one
    custom op each) and the optimizer step stay eager. Returns False (and compiles nothing) when the
    model has no `blocks`; Dynamo's switch for data-dependent outputs is set either way, for the caller's
    whole-model compile.

    Args:
        model: the language model (a `models` model: `model.blocks` is its list of blocks).
        backend: torch.compile's backend ("inductor"; "aot_eager" in CPU tests).
        hooks_outside: compile each block's `forward` only, so that hooks on the block module (DeepSpeed
            ZeRO-3 gathers a block's parameters in them) run eagerly around the compiled code; otherwise
            the whole call is compiled (`nn.Module.compile`).
    Returns:
        whether the blocks were compiled.
    """
    allow_data_dependent_outputs()
    blocks = getattr(model, "blocks", None)
    if blocks is None:
        return False
    for block in blocks:
        if hooks_outside:
            block.forward = torch.compile(block.forward, backend=backend)
        else:
            block.compile(backend=backend)
    return True


def allow_data_dependent_outputs() -> None:
    """Let torch.compile keep ops whose outputs have a data-dependent length inside the graph. The Triton
    linear-attention ops hand their backward the per-segment states of the layout they chose at run
    time (a custom-op output of unknown length); without this switch Dynamo breaks the graph at each such
    call unless it compiles with fullgraph=True: every linear-model block would become several graphs,
    and the work around each op would no longer be fused."""
    torch._dynamo.config.capture_dynamic_output_shape_ops = True


class TorchTrainModule(TrainModule):
    def __init__(self, model: nn.Module, optim_cfg: OptimConfig, device: torch.device, precision: str,
                 ddp: bool = False, fuse_grad_accumulation: bool | None = None):
        """`fuse_grad_accumulation`: the blocks' projections add their weight gradients into fp32 buffers
        in their own matmul (pretrain/grad_accumulation.py); one process only (DDP reduces in autograd's
        hooks, which those weights no longer reach). None: fused without DDP."""
        self.device = device
        self.optim_cfg = optim_cfg
        self.model = model.to(device)
        self.precision = precision
        self.wrapped = self.model
        if fuse_grad_accumulation is None:
            fuse_grad_accumulation = not ddp
        if fuse_grad_accumulation and ddp:
            raise ValueError("fused gradient accumulation is for one process; DDP reduces the gradients in "
                             "autograd's hooks")
        if fuse_grad_accumulation:
            self.fused_grads = grad_accumulation.fuse(self.model)
        else:
            grad_accumulation.unfuse(self.model)
            self.fused_grads = []
        if ddp:
            # gradients as views into DDP's reduction buckets: no copy of every gradient into a bucket and
            # back, and no second fp32 copy of the gradients (4 GiB at 1B)
            self.wrapped = nn.parallel.DistributedDataParallel(
                self.model, device_ids=[device.index] if device.type == "cuda" else None,
                gradient_as_bucket_view=True)
        self.optimizer = build_optimizer(self.model, optim_cfg, device)

    def compile(self, backend: str = "inductor") -> None:
        """Regional compilation (`compile_blocks`); DDP wraps the model unchanged. A model without blocks
        is compiled whole."""
        if not compile_blocks(self.model, backend):
            self.wrapped = torch.compile(self.wrapped, backend=backend)

    def autocast(self):
        if self.precision == "bf16":
            return torch.autocast(device_type=self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def forward_loss(self, batch: dict) -> Tensor:
        kwargs = device_batch(batch, self.device, self.model.config.vocab_size, self.sequence_segments)
        with self.autocast():
            return self.wrapped(**kwargs)

    def train_step(self, micro_batches: list[dict], step: int, inject_nonfinite: bool = False) -> StepResult:
        set_hyperparameters(self.optimizer, self.optim_cfg, step)
        self.model.train()
        total = torch.zeros((), device=self.device)
        n = len(micro_batches)
        # the fused projections' bf16 weights, made once for all the micro-batches (none without the fusion)
        cast = torch.bfloat16 if self.precision == "bf16" and self.fused_grads else None
        grad_accumulation.expose(self.fused_grads)  # a gradient autograd hands a fused weight goes into its buffer
        with grad_accumulation.cast_weights_once(self.model, cast):
            for i, mb in enumerate(micro_batches):
                sync = i == n - 1 or not isinstance(self.wrapped, nn.parallel.DistributedDataParallel)
                ctx = contextlib.nullcontext() if sync else self.wrapped.no_sync()
                with ctx:
                    loss = self.forward_loss(mb)
                    if inject_nonfinite:
                        loss = loss * float("nan")
                    (loss / n).backward()
                total += loss.detach() / n
        total = all_reduce_mean(total)
        grad_accumulation.expose(self.fused_grads)
        # grad_clip 0 turns clipping off (as DeepSpeed's gradient_clipping 0); the norm is still reported
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.optim_cfg.grad_clip or math.inf)
        loss_v, gn = float(total), float(grad_norm)
        skipped = not (math.isfinite(loss_v) and math.isfinite(gn))
        if not skipped:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        grad_accumulation.reset(self.fused_grads)
        return StepResult(loss_v, gn, skipped)

    @torch.no_grad()
    def eval_loss(self, batches: list[dict], stop: Callable[[], bool] | None = None) -> float | None:
        self.model.eval()
        try:
            return mean_loss(self.forward_loss, batches, stop)
        finally:
            self.model.train()

    def state_dict(self) -> dict:
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])

    # -- the checkpoint contract (TrainModule) ----------------------------------------------------------
    # Under DDP every rank holds the same full state: rank 0 writes it, every rank reads it, so a resume
    # on any number of ranks is a plain load.
    def save_state(self, dir: Path) -> None:
        if get_rank() == 0:
            torch.save(self.model.state_dict(), Path(dir) / TORCH_MODEL)
            torch.save(self.optimizer.state_dict(), Path(dir) / TORCH_OPTIMIZER)

    def stage_layout(self) -> dict | None:
        """The state stage_state will copy (live references; only shapes and dtypes are read), so the host
        buffers can be prepared in advance; None on ranks that stage nothing."""
        return self.state_dict() if get_rank() == 0 else None

    def stage_state(self, buffers, dir: Path) -> Callable[[], dict]:
        """Copy model + optimizer to host buffers now (`checkpoints.staging.StagingBuffers`); the returned
        function writes that copy into `dir` (it may run in a background thread while training goes on),
        hashing the bytes as they are written, and returns the files' records."""
        if get_rank() != 0:
            return lambda: {}
        from checkpoints.hashio import save_torch
        staged = buffers.stage(self.state_dict())

        def write() -> dict:
            return {Path(dir) / name: save_torch(staged[key], Path(dir) / name)
                    for key, name in (("model", TORCH_MODEL), ("optimizer", TORCH_OPTIMIZER))}
        return write

    def load_state(self, dir: Path) -> None:
        self.model.load_state_dict(torch.load(Path(dir) / TORCH_MODEL, map_location=self.device, weights_only=True))
        self.optimizer.load_state_dict(torch.load(Path(dir) / TORCH_OPTIMIZER, map_location=self.device,
                                                  weights_only=True))

    def full_state_dict(self) -> dict[str, Tensor]:
        """The live weights (the checkpoint manager copies them before training goes on)."""
        return {k: v.detach() for k, v in self.model.state_dict().items()}

