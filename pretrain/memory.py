"""Peak memory of a training step on one GPU, estimated, and the activation checkpointing that fits.

The estimate: fp32 weights, gradients and AdamW state (16 bytes a parameter), the fused loss's buffers,
and the activations each block keeps per token (the architecture's `act_bytes_per_d` x d bytes without checkpointing,
measured compiled on an H100 at 1B, seq 8192; 4 d bytes -- its fp32 input -- for a fully checkpointed
block, plus one block's activations while it is recomputed). It errs on the high side (a half-checkpointed
TNL 1B at 32K: 68.8 GiB estimated, 55.1 GiB measured); docs/training.md, Long context, has the numbers.
"""
from __future__ import annotations

from models import ModelConfig, exact_params, get_arch

FRACTIONS = [k / 8 for k in range(1, 9)]  # the shares of checkpointed blocks `auto` considers


def estimate_peak_gib(cfg: ModelConfig, micro_tokens: int, mode: str = "none", fraction: float = 1.0) -> float:
    """Estimated peak GiB of one training step with `micro_tokens` tokens per micro-batch."""
    d, g, l, v = cfg.d_model, cfg.d_glu, cfg.n_layers, cfg.vocab_size
    # activation bytes a block keeps per token, in units of d (compiled, bf16 autocast, fp32 residual stream)
    per_block = get_arch(cfg.arch).act_bytes_per_d * d
    kept = {"none": per_block, "mlp": per_block - 6 * g, "full": 4 * d}[mode]
    n_ckpt = 0 if mode == "none" else round(l * fraction)
    act = micro_tokens * ((l - n_ckpt) * per_block + n_ckpt * kept + (per_block if n_ckpt else 0))
    state = 16 * exact_params(cfg)["total"]
    loss = 4096 * v * 2 + v * d * 8 + micro_tokens * d * 4
    return (act + state + loss) / 2**30 + 1.5


def choose_checkpointing(cfg: ModelConfig, micro_tokens: int, budget_gib: float) -> tuple[str, float]:
    """The cheapest setting whose estimate fits in `budget_gib`: none, else full checkpointing of the
    smallest share of blocks (eighths) that fits, else every block."""
    if estimate_peak_gib(cfg, micro_tokens) <= budget_gib:
        return "none", 1.0
    for f in FRACTIONS:
        if estimate_peak_gib(cfg, micro_tokens, "full", f) <= budget_gib:
            return "full", f
    return "full", 1.0


def larger_micro_batch(cfg: ModelConfig, seq_tokens: int, micro_batch: int, accumulation: int,
                       budget_gib: float) -> int | None:
    """The largest micro-batch above `micro_batch` whose estimate without activation checkpointing fits in
    `budget_gib` and that keeps the global batch exact (micro_batch x k with k dividing `accumulation`);
    None when there is none. `seq_tokens`: the tokens of one sequence on a rank. Fewer, larger
    micro-batches are faster where they fit (a linear model's scans over one 8K sequence leave most SMs
    idle, and the per-micro-batch work is paid less often; docs/training.md, Micro-batch)."""
    best = None
    for k in range(2, accumulation + 1):
        if accumulation % k:
            continue
        if estimate_peak_gib(cfg, micro_batch * k * seq_tokens) > budget_gib:
            break  # the estimate grows with the tokens: no larger k fits either
        best = micro_batch * k
    return best


def _setting(mode: str, fraction: float) -> str:
    if mode == "none":
        return "off"
    return mode + ("" if fraction >= 1 else f" on {fraction:.0%} of the blocks")


def fit_warning(cfg: ModelConfig, micro_tokens: int, mode: str, fraction: float, device_gib: float) -> str | None:
    """A warning when the estimated peak of this setting exceeds the device's memory (None: it fits), with
    the settings that would fit. The estimate errs high (up to about a quarter), so this is a warning, not
    a refusal; a step that really runs out of memory stops the run with its own message."""
    est = estimate_peak_gib(cfg, micro_tokens, mode, fraction)
    if est <= device_gib:
        return None
    head = (f"{cfg.arch} {cfg.size} at {micro_tokens:,} tokens per micro-batch with activation checkpointing "
            f"{_setting(mode, fraction)}: estimated peak {est:.0f} GiB, more than the {device_gib:.0f} GiB of "
            f"this GPU; the first step will probably run out of memory. ")
    full = estimate_peak_gib(cfg, micro_tokens, "full", 1.0)
    if full > 0.9 * device_gib:
        sp = ", or split each sequence over GPUs with --sp N" if get_arch(cfg.arch).sequence_parallel else ""
        return head + (f"Even with every block checkpointed the estimate is {full:.0f} GiB: use fewer tokens per "
                       f"micro-batch (a smaller --micro-batch or a shorter --seq-len){sp}")
    m, f = choose_checkpointing(cfg, micro_tokens, 0.9 * device_gib)
    return head + (f"Use --activation-checkpointing auto (here: {_setting(m, f)}, estimated "
                   f"{estimate_peak_gib(cfg, micro_tokens, m, f):.0f} GiB) or a smaller --micro-batch")
