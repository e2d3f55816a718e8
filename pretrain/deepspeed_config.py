"""The DeepSpeed config, generated from the run config so that one set of flags drives both the plain
PyTorch path and DeepSpeed; a user JSON (`--deepspeed-config`) is merged over it for everything the run
config does not own (bucket sizes, offload, overlap, ...).

What the run config owns, and so what a user JSON may only repeat (or leave "auto"):
  train_batch_size, train_micro_batch_size_per_gpu, gradient_accumulation_steps, gradient_clipping,
  zero_optimization.stage.
They come from --global-batch-tokens/--seq-len, --micro-batch, the world size, --grad-clip and --zero; a
JSON that disagrees is refused naming the flag to use instead, so the data loader, the FLOPs count and
DeepSpeed can never disagree about the batch.

Precision: `--precision bf16` becomes DeepSpeed's `torch_autocast` (bf16 compute on fp32 parameters, as
the plain path does: RoPE tables, HGRN2 lower bounds and LRPE angles stay fp32; Linear
gradients are reduced in bf16). A user JSON that enables `"bf16": {"enabled": true}` switches to
DeepSpeed's bf16 weights with fp32 master copies in the optimizer (less memory under ZeRO-1/2).

Print the config a run would use without starting one:
    python -m pretrain.deepspeed_config --world-size 64 --arch tnl --size 7b --zero 3 --micro-batch 1 \
        --global-batch-tokens 4194304
(the paper's 480-sequence batch does not split evenly over 64 ranks; the command says so and names batches that do)
"""
from __future__ import annotations

import copy
import json
import sys
from pathlib import Path
from typing import Any

from pretrain.config import RunConfig, gradient_accumulation

# keys the run config owns -> the flag that sets them (named in errors)
OWNED_KEYS = {
    "train_batch_size": "--global-batch-tokens (with --seq-len)",
    "train_micro_batch_size_per_gpu": "--micro-batch",
    "gradient_accumulation_steps": "--micro-batch / --global-batch-tokens (accumulation is derived)",
    "gradient_clipping": "--grad-clip",
}


def generate_deepspeed_config(cfg: RunConfig, world_size: int, precision: str) -> dict[str, Any]:
    """The DeepSpeed config for `cfg` on `world_size` ranks (before a user JSON is merged).

    precision is the resolved run precision ("bf16" or "fp32"). Raises ValueError, naming a valid
    micro-batch, when the global batch cannot be reached exactly and --allow-inexact-batch is not set.
    """
    t = cfg.train
    # with --sp N, N ranks share each sequence: world_size / N data-parallel ranks draw distinct samples
    accum = gradient_accumulation(cfg.global_batch, world_size // cfg.dist.sp, t.micro_batch, t.allow_inexact_batch)
    zero: dict[str, Any] = {"stage": cfg.dist.zero}
    if cfg.dist.zero >= 1:
        # overlap the gradient reduction with the backward pass; contiguous buffers avoid fragmentation
        zero.update({"overlap_comm": True, "contiguous_gradients": True,
                     "reduce_bucket_size": 5e8, "allgather_bucket_size": 5e8})
    if cfg.dist.zero == 3:
        # keep parameters below ~1M elements resident (norms, gates): gathering them costs more than it saves
        zero.update({"stage3_param_persistence_threshold": 1e6, "stage3_prefetch_bucket_size": 5e8,
                     "stage3_max_live_parameters": 1e9, "stage3_gather_16bit_weights_on_model_save": False,
                     # DeepSpeed's "memory efficient" linear replaces torch.nn.functional.linear process-wide
                     # with an autograd Function whose backward reads each weight's ds_id: compiled blocks
                     # then guard on that per-block integer and recompile for every block until Dynamo's
                     # limit (8), leaving the rest eager. The blocks are leaf modules whose parameters are
                     # gathered around their forward and backward (DeepSpeedTrainModule), so the plain
                     # linear sees full weights whenever it runs.
                     "memory_efficient_linear": False})
        zero.pop("allgather_bucket_size")
    ds: dict[str, Any] = {
        # DeepSpeed counts every rank as data parallel (the sequence-parallel plan scales the loss so that its
        # gradient average over all ranks is the right one), so its batch counts each segment as a sample
        "train_batch_size": world_size * t.micro_batch * accum,
        "train_micro_batch_size_per_gpu": t.micro_batch,
        "gradient_accumulation_steps": accum,
        "gradient_clipping": cfg.optim.grad_clip,
        "zero_optimization": zero,
        # the optimizer is ours (torch AdamW, built in pretrain.train_module): no JIT-compiled fused Adam,
        # the same update as the plain path, and the lr schedule stays a pure function of the step
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,          # the trainer logs; keep DeepSpeed's own step log quiet
        "wall_clock_breakdown": False,
    }
    if precision == "bf16":
        ds["torch_autocast"] = {"enabled": True, "dtype": "bfloat16"}
    return ds


def _deep_merge(base: dict, over: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _deep_merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def load_user_config(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"--deepspeed-config {p}: no such file")
    try:
        user = json.loads(p.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"--deepspeed-config {p} is not valid JSON ({err})") from err
    if not isinstance(user, dict):
        raise ValueError(f"--deepspeed-config {p} must hold a JSON object, got {type(user).__name__}")
    return user


def merge_user_config(generated: dict[str, Any], user: dict[str, Any], source: str = "--deepspeed-config",
                      sp: int = 1) -> dict:
    """Merge a user DeepSpeed JSON over the generated config. Keys the run config owns may be "auto" or
    repeat the generated value; anything else is refused naming the flag to use. Under --sp N the generated
    train_batch_size counts each of a sequence's N segments (DeepSpeed sees every rank as data parallel), so
    the global batch in sequences, which a user would write, is accepted too."""
    user = copy.deepcopy(user)
    for key, flag in OWNED_KEYS.items():
        if key in user:
            sequences = key == "train_batch_size" and sp > 1 and user[key] * sp == generated[key]
            if user[key] == "auto" or user[key] == generated[key] or sequences:
                user.pop(key)
            elif key == "train_batch_size" and sp > 1:
                raise ValueError(f"{source} sets {key}={user[key]!r} but the run's global batch is "
                                 f"{generated[key] // sp} sequences ({generated[key]} for DeepSpeed, which counts "
                                 f"each of a sequence's --sp {sp} segments); set it with {flag} instead "
                                 f"(or write \"auto\")")
            else:
                raise ValueError(f"{source} sets {key}={user[key]!r} but the run config gives {generated[key]!r}; "
                                 f"set it with {flag} instead (or write \"auto\")")
    stage = user.get("zero_optimization", {}).get("stage")
    if stage not in (None, "auto", generated["zero_optimization"]["stage"]):
        raise ValueError(f"{source} sets zero_optimization.stage={stage!r} but --zero gives "
                         f"{generated['zero_optimization']['stage']}; use --zero {stage} instead")
    if stage == "auto":
        user["zero_optimization"].pop("stage")
    for key in ("optimizer", "scheduler"):
        if key in user:
            raise ValueError(f"{source} sets {key!r}: the optimizer (AdamW) and lr schedule come from the run "
                             f"config (--lr, --warmup-steps, --weight-decay, --beta1/--beta2); remove {key!r}")
    merged = _deep_merge(generated, user)
    # DeepSpeed's own bf16/fp16 weights replace torch autocast, unless the user asked for both explicitly
    if ((merged.get("bf16", {}).get("enabled") or merged.get("fp16", {}).get("enabled"))
            and "torch_autocast" not in user):
        merged.pop("torch_autocast", None)
    return merged


def build_deepspeed_config(cfg: RunConfig, world_size: int, precision: str) -> dict[str, Any]:
    """Generated config, with the user JSON of --deepspeed-config merged over it when given."""
    ds = generate_deepspeed_config(cfg, world_size, precision)
    if cfg.dist.deepspeed_config:
        ds = merge_user_config(ds, load_user_config(cfg.dist.deepspeed_config), cfg.dist.deepspeed_config,
                               sp=cfg.dist.sp)
    return ds


def main(argv: list[str] | None = None) -> int:
    """Print the DeepSpeed config a run would use on --world-size ranks (accepts every pretrain flag)."""
    from pretrain.config import parse_config
    argv = list(sys.argv[1:] if argv is None else argv)
    world, precision = 1, "bf16"
    for name in ("--world-size", "--ds-precision"):
        if name in argv:
            i = argv.index(name)
            value = argv[i + 1]
            del argv[i:i + 2]
            if name == "--world-size":
                world = int(value)
            else:
                precision = value
    try:
        cfg = parse_config(argv)
        if cfg.train.precision != "auto":
            precision = cfg.train.precision
        ds = build_deepspeed_config(cfg, world, precision)
    except (ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(json.dumps(ds, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
