"""The train module on a DeepSpeed engine (ZeRO stage 1/2/3): a `pretrain.train_module.TrainModule`
like the plain `TorchTrainModule` (`train_step`, `eval_loss`, and the checkpoint contract), so the
trainer does not know which one it drives.

Skipping a non-finite step under DeepSpeed. `engine.step()` at the accumulation boundary runs the whole
update (clip, optimizer, zero grads) in one call, so the plain path's "look at the norm, then decide"
cannot be done from outside. Two guards, together covering every stage:
  1. The loss. Before the boundary `engine.step()` the step's loss is averaged over ranks (all ranks see
     the same value). If it is not finite, our AdamW (`GuardedAdamW`, the optimizer DeepSpeed wraps) is
     told to skip: ZeRO then copies the unchanged fp32 partitions back into the model, so weights and
     Adam moments stay as they were. DeepSpeed's gradient accumulation counters still advance normally.
  2. The gradient norm. DeepSpeed >= 0.19 checks the global norm itself in ZeRO-1/2/3 and skips the
     update when it is inf/NaN (`engine.was_step_applied()` is then False). We read that back, so a
     finite loss with a non-finite gradient is reported as skipped as well. For ZeRO-1/2 with DeepSpeed's
     own bf16 weights this check is `bf16.check_grad_overflow` (default true): keep it on.
The grad norm we report is `engine.get_global_grad_norm()`: the norm before clipping, as in the plain path.
It is the norm of this step's gradients over every parameter (not stale, not clipped): with
LINSCALE_VERIFY_GRAD_NORM=1 every step recomputes it from the full gradients (`safe_get_full_grad`, a
collective) before the update and raises if the two differ (tests/test_train_distributed.py sets it).
That ZeRO-3's logged norm can differ from a single process's by ~10-20% late in a run is the
trajectories drifting apart, not a misread norm (docs/training.md, "Grad norms across engines").
"""
from __future__ import annotations

import importlib
import json
import math
import os
from pathlib import Path
from typing import Callable

import torch
from torch import Tensor, nn

from checkpoints.layout import DEEPSPEED_DIR, DEEPSPEED_META, UNIVERSAL_DIR
from pretrain.batches import device_batch
from pretrain.config import RunConfig
from pretrain.deepspeed_config import build_deepspeed_config
from pretrain.distributed import DistEnv, all_reduce_mean, free_port
from pretrain.logs import get_logger
from pretrain.train_module import (StepResult, TrainModule, build_optimizer, compile_blocks, mean_loss,
                                   set_hyperparameters)

logger = get_logger(__name__)

VERIFY_GRAD_NORM = "LINSCALE_VERIFY_GRAD_NORM"


class GuardedAdamW(torch.optim.AdamW):
    """torch AdamW whose next `step()` can be vetoed (`skip_next = True`): the hook DeepSpeed leaves us to
    keep a non-finite step from touching the weights. ZeRO-1/2 call `step()` once per parameter group,
    so the veto stays set until the module clears it after `engine.step()`."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.skip_next = False

    @torch.no_grad()
    def step(self, closure=None):
        if self.skip_next:
            return None
        return super().step(closure)


def _import_deepspeed():
    try:
        import deepspeed
    except ImportError as err:
        raise ImportError("--zero > 0 needs DeepSpeed: pip install -c constraints.txt deepspeed "
                          "(or run with --zero 0 for plain PyTorch / DDP)") from err
    # The CPU accelerator JIT-builds a shared-memory all-reduce op on first use (~30 s); gloo does the work
    # anyway, so skip the build. On CUDA this attribute is not used.
    try:
        importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    except Exception:
        pass
    return deepspeed


def steps_to_param_device(optimizer: torch.optim.Optimizer) -> None:
    """Moves each parameter's AdamW `step` onto that parameter's device. DeepSpeed's universal-checkpoint
    loader restores it from step.pt as a CPU tensor, and fused AdamW (our CUDA default) refuses a step that
    is not on its parameter's device. The state is walked by its keys, not through `param_groups`: ZeRO-3
    puts its fp32 partition into the group only for the length of its own `step()` and leaves the group's
    parameter list empty in between."""
    if not any(g.get("fused") for g in optimizer.param_groups):
        return
    for p, state in optimizer.state.items():
        step = state.get("step") if torch.is_tensor(p) else None
        if step is not None and not (torch.is_tensor(step) and step.device == p.device):
            state["step"] = torch.as_tensor(float(step), dtype=torch.float32, device=p.device)


def low_precision_weights_warning(ds_config: dict, model: nn.Module) -> str | None:
    """What a DeepSpeed config with bf16/fp16 weights rounds that the model keeps fp32 otherwise, or None.
    DeepSpeed's bf16/fp16 engine casts every parameter: cos2's LRPE angles and TPE decays and HGRN2's lower
    bounds (`fp32_parameter_names`) set positions' angles and decay rates, whose rounding error grows with
    the distance between tokens."""
    low = [k for k in ("bf16", "fp16") if (ds_config.get(k) or {}).get("enabled")]
    kept = model.fp32_parameter_names() if low and hasattr(model, "fp32_parameter_names") else []
    if not kept:
        return None
    return (f"the DeepSpeed config enables {low[0]} weights, which rounds {', '.join(kept[:4])}"
            f"{' ...' if len(kept) > 4 else ''} ({len(kept)} parameters the model otherwise keeps fp32: angles "
            f"of positions, decay rates) to {low[0]} in the forward; drop '{low[0]}' from the JSON to train "
            f"with --precision bf16 (autocast on fp32 weights)")


class DeepSpeedTrainModule(TrainModule):
    def __init__(self, model: nn.Module, cfg: RunConfig, env: DistEnv, precision: str, accum: int):
        deepspeed = _import_deepspeed()
        self.cfg, self.env, self.precision = cfg, env, precision
        self.device = env.device
        self.ds_config = build_deepspeed_config(cfg, env.world_size, precision)
        if self.ds_config["gradient_accumulation_steps"] != accum:
            raise RuntimeError(f"DeepSpeed accumulation {self.ds_config['gradient_accumulation_steps']} != "
                               f"trainer accumulation {accum}")  # both come from gradient_accumulation()
        if not torch.distributed.is_initialized():
            # one process without a launcher: DeepSpeed still wants a process group (of one), on a port
            # of its own so that two such runs on one node do not collide
            for k, v in (("RANK", env.rank), ("LOCAL_RANK", env.local_rank), ("WORLD_SIZE", env.world_size),
                         ("MASTER_ADDR", "127.0.0.1")):
                os.environ.setdefault(k, str(v))
            if not os.environ.get("MASTER_PORT"):
                os.environ["MASTER_PORT"] = str(free_port())
            deepspeed.init_distributed(dist_backend=_backend(cfg, env), auto_mpi_discovery=False)
        model = model.to(env.device)
        if self.ds_config["zero_optimization"]["stage"] >= 3 and getattr(model, "blocks", None) is not None:
            # ZeRO-3 gathers a leaf module's parameters all at once, in hooks on the module itself, and sets
            # no hooks inside it: a block's own code can then be compiled (`compile`), with the gathering
            # around it. A block's parameters (about 200M at 7B) are gathered together instead of one
            # projection at a time (docs/training.md, DeepSpeed).
            deepspeed.utils.set_z3_leaf_modules(model, [type(model.blocks[0])])
        rounded = low_precision_weights_warning(self.ds_config, model)
        if rounded:
            logger.warning(rounded)
        self.optimizer = build_optimizer(model, cfg.optim, env.device, cls=GuardedAdamW)
        self.engine, _, _, _ = deepspeed.initialize(model=model, optimizer=self.optimizer, config=self.ds_config)
        self.model = self.engine.module
        self.wrapped = self.engine
        self.accum = accum

    def compile(self, backend: str = "inductor") -> None:
        """Regional compilation of the model inside the engine, as on the plain path (`compile_blocks`).
        ZeRO-1/2 act on gradients only (hooks on the parameters' gradient accumulation), so a compiled block
        is what they see of an eager one. ZeRO-3 gathers and releases each block's parameters in hooks on
        the block (a leaf module, see `__init__`): each block's `forward` is compiled and those hooks run
        eagerly around it. Compiling the whole module through `engine.compile()` instead traces the full
        depth: on an H200 at 1B under ZeRO-2 its first step took 142-162 s for TNL in every launch and
        84 s for LLaMA; under ZeRO-3 it loses the tied embedding's gathered weight."""
        zero3 = self.ds_config["zero_optimization"]["stage"] >= 3
        if zero3 and torch.nn.functional.linear is not torch._C._nn.linear:
            # a user JSON turned DeepSpeed's memory-efficient linear back on (see deepspeed_config)
            logger.warning("zero_optimization.memory_efficient_linear is on: each compiled block reads its "
                           "weights' ds_id and recompiles, and the blocks past Dynamo's recompile limit run "
                           "eagerly; set it to false in --deepspeed-config")
        if compile_blocks(self.model, backend, hooks_outside=zero3):
            return
        if zero3:
            raise RuntimeError("torch.compile under ZeRO-3 compiles a model's blocks, and this model has none "
                               "(no `blocks`): train it eagerly (--no-compile)")
        self.engine.compile(backend=backend)  # not a LanguageModel: the engine compiles it whole

    # -- one optimizer step ---------------------------------------------------------------------------
    def _forward(self, batch: dict) -> Tensor:
        # autocast (when the config asks for it) is applied by the engine around the module's forward
        return self.engine(**device_batch(batch, self.device, self.model.config.vocab_size,
                                        self.sequence_segments))

    def train_step(self, micro_batches: list[dict], step: int, inject_nonfinite: bool = False) -> StepResult:
        if len(micro_batches) != self.accum:
            raise ValueError(f"got {len(micro_batches)} micro-batches for a step; DeepSpeed expects {self.accum}")
        set_hyperparameters(self.optimizer, self.cfg.optim, step)
        self.engine.train()
        total = torch.zeros((), device=self.device)
        verify = os.environ.get(VERIFY_GRAD_NORM, "0") not in ("", "0")
        expected = None
        for i, mb in enumerate(micro_batches):
            loss = self._forward(mb)
            if inject_nonfinite:
                loss = loss * float("nan")
            self.engine.backward(loss)          # DeepSpeed scales by 1/accumulation itself
            total += loss.detach().float() / self.accum
            if i == len(micro_batches) - 1:
                loss_v = float(all_reduce_mean(total))   # the same value on every rank
                self.optimizer.skip_next = not math.isfinite(loss_v)
                if verify:
                    expected = self._full_grad_norm()
            self.engine.step()                  # a no-op except at the accumulation boundary
        vetoed = self.optimizer.skip_next
        self.optimizer.skip_next = False
        gn = self.engine.get_global_grad_norm()
        gn = float(gn) if gn is not None else float("nan")
        if expected is not None and math.isfinite(expected) and not math.isclose(gn, expected, rel_tol=1e-5):
            raise RuntimeError(f"step {step + 1}: engine.get_global_grad_norm() = {gn} but the gradients the "
                               f"update used have norm {expected}")
        skipped = vetoed or not self.engine.was_step_applied() or not math.isfinite(gn)
        return StepResult(loss_v, gn, skipped)

    @torch.no_grad()
    def _full_grad_norm(self) -> float:
        """The global L2 norm of the accumulated gradients, gathered whole per parameter (every rank must
        call it, at the boundary, before `engine.step()`): the check behind LINSCALE_VERIFY_GRAD_NORM."""
        from deepspeed.utils import safe_get_full_grad
        sq = 0.0
        for p in self.model.parameters():
            g = safe_get_full_grad(p) if p.requires_grad else None
            if g is not None:
                sq += float(g.double().pow(2).sum())
        return math.sqrt(sq)

    @torch.no_grad()
    def eval_loss(self, batches: list[dict], stop: Callable[[], bool] | None = None) -> float | None:
        # every rank must run it under ZeRO-3 (parameters are gathered collectively)
        self.engine.eval()
        try:
            return mean_loss(self._forward, batches, stop)
        finally:
            self.engine.train()

    # -- checkpoint contract (see checkpoints/) -------------------------------------------------------
    def save_state(self, directory: Path) -> None:
        """Model + optimizer, ZeRO-partitioned: every rank writes its shard into <directory>/deepspeed/.
        All ranks must call it. The trainer's own state (step, loader, RNG) is the checkpointer's."""
        directory = Path(directory)
        self.engine.save_checkpoint(str(directory), tag=DEEPSPEED_DIR, client_state={}, save_latest=False)
        if self.env.is_main:
            meta = {"world_size": self.env.world_size, "zero_stage": self.cfg.dist.zero,
                    "deepspeed_config": self.ds_config}
            (directory / DEEPSPEED_META).write_text(json.dumps(meta, indent=2))

    def stage_state(self, buffers, directory: Path):
        """Background saving: `save_state` with DeepSpeed's file writes deferred (checkpoints/ds_engine.py).
        Every rank's shard is copied to host buffers now; the returned write() writes and hashes the files
        (in the checkpoint manager's writer thread) and returns their records."""
        from checkpoints.ds_engine import staged_save_checkpoint
        return staged_save_checkpoint(self.engine, buffers, lambda: self.save_state(directory))

    def engine_config(self) -> dict:
        return self.ds_config

    def load_state(self, directory: Path) -> None:
        """Load what `save_state` wrote. On the same world size the ZeRO shards load directly. On another
        world size DeepSpeed needs a universal checkpoint: if <directory>/universal exists (made with
        `python -m deepspeed.checkpoint.ds_to_universal --input_folder <dir>/deepspeed --output_folder
        <dir>/universal`, see docs/training.md) it is loaded, otherwise the error says how to make it."""
        directory = Path(directory)
        meta_path = directory / DEEPSPEED_META
        saved_world = json.loads(meta_path.read_text())["world_size"] if meta_path.exists() else None
        tag, load_dir = DEEPSPEED_DIR, directory
        if saved_world is not None and saved_world != self.env.world_size:
            universal = directory / UNIVERSAL_DIR
            if not universal.is_dir():
                raise RuntimeError(
                    f"checkpoint {directory} was written by {saved_world} ranks, this run has "
                    f"{self.env.world_size}. Convert it once: python -m deepspeed.checkpoint.ds_to_universal "
                    f"--input_folder {directory / DEEPSPEED_DIR} --output_folder {universal} (then resume again), "
                    f"or resume on {saved_world} ranks")
            self.engine._config.load_universal_checkpoint = True
            load_dir, tag = directory, UNIVERSAL_DIR
        path, _ = self.engine.load_checkpoint(str(load_dir), tag=tag, load_optimizer_states=True,
                                              load_lr_scheduler_states=False, load_module_strict=True)
        if path is None:
            raise FileNotFoundError(f"no DeepSpeed checkpoint under {load_dir / tag}")
        steps_to_param_device(self.optimizer)

    def full_state_dict(self) -> dict[str, Tensor]:
        """Consolidated fp32 weights (the optimizer's master copy when DeepSpeed holds bf16 weights) on
        rank 0; other ranks get {}. Collective under ZeRO-3: every rank must call it."""
        from deepspeed.utils import safe_get_full_fp32_param
        out: dict[str, Tensor] = {}
        params = dict(self.model.named_parameters(remove_duplicate=False))
        for name, tensor in self.model.state_dict(keep_vars=True).items():
            p = params.get(name)
            full = safe_get_full_fp32_param(p) if p is not None else None
            if full is None:  # a buffer (or a parameter DeepSpeed does not track): the module's copy is whole
                full = tensor.detach()
            if self.env.is_main:
                out[name] = full.detach().float().cpu().clone()
        return out

    # compatibility with the plain module's in-memory state (tests, small runs)
    def state_dict(self) -> dict:
        return {"model": self.full_state_dict()}


def _backend(cfg: RunConfig, env: DistEnv) -> str:
    if cfg.dist.backend != "auto":
        return cfg.dist.backend
    return "nccl" if env.device.type == "cuda" else "gloo"
