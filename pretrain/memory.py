"""Peak memory of a training step on one GPU, estimated, and the activation checkpointing that fits.

The estimate, in bytes: 16.5 a parameter (fp32 weights, gradients and the two AdamW moments; the half
byte is what the compiled step keeps beyond them, bf16 weight copies among it), the fused loss's buffers,
the activations each block keeps per token (the architecture's `act_bytes_per_d` x d without
checkpointing; 4 d, its fp32 input, for a fully checkpointed block), and 1.5 GiB. The per-block bytes are
the slopes of measured peaks over the tokens of a micro-batch (compiled, bf16 autocast, on an H100), the
constants the least that keeps the estimate at or above every measured peak of 410m and 1B from 8K to 64K
tokens. A recomputed block's activations add nothing to the peak: the backward reaches the checkpointed
blocks after it has freed the kept activations above them and the loss's buffers.
tests/test_train_long_context.py holds the measured peaks and checks the estimate against them;
docs/training.md, Long context, the method.

Under DeepSpeed ZeRO a rank holds (16.5 + extra) bytes a parameter less the share its stage splits over
the data-parallel ranks (`ZERO_BYTES_PER_PARAM`): the extra is what the engine keeps beside the plain
path's state (its buffers, at one rank), the split share what a second rank takes away. Both are fitted
like the rest, to rank 0's peaks of compiled 1B runs on one and two H200s, and checked at 7B on two.
"""
from __future__ import annotations

import os

from models import ModelConfig, exact_params, get_arch
from models.lm import checkpointed_blocks

STATE_BYTES_PER_PARAM = 16.5
OVERHEAD_GIB = 1.5
# ZeRO stage -> (bytes a parameter the engine adds at one rank, bytes a parameter split over the ranks):
# stage 1 splits the fp32 master weights and Adam's moments (by design: not measured on more than one GPU),
# stage 2 the gradients too; stage 3's split share was measured smaller than stage 2's (it holds gathered
# blocks and their gradients while they work)
ZERO_BYTES_PER_PARAM = {1: (11.0, 12.0), 2: (9.0, 16.0), 3: (6.5, 14.5)}
ALLOCATOR = "expandable_segments:True"


def configure_allocator() -> str:
    """Let PyTorch's CUDA allocator grow its segments in place unless PYTORCH_CUDA_ALLOC_CONF is set; call it
    before the first CUDA allocation. Without it the memory reserved at 64K tokens per micro-batch ran up
    to 7 GiB above the memory in use (blocks of many sizes, freed and reallocated each step), which the
    budget of `auto` would have to leave spare. Returns the setting in force."""
    return os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", ALLOCATOR)


def state_bytes_per_param(zero: int = 0, ranks: int = 1) -> float:
    """Bytes a parameter of weights, gradients, optimizer state and engine buffers on one rank: the plain
    path's (`zero` 0), or DeepSpeed ZeRO stage `zero` with its state split over `ranks` data-parallel ranks."""
    if zero not in (0, *ZERO_BYTES_PER_PARAM):
        raise ValueError(f"zero stage must be 0-3, got {zero}")
    if ranks < 1:
        raise ValueError(f"ranks must be >= 1, got {ranks}")
    if zero == 0:
        return STATE_BYTES_PER_PARAM
    extra, split = ZERO_BYTES_PER_PARAM[zero]
    return STATE_BYTES_PER_PARAM + extra - split * (1 - 1 / ranks)


def estimate_peak_gib(cfg: ModelConfig, micro_tokens: int, mode: str = "none", fraction: float = 1.0,
                      zero: int = 0, ranks: int = 1) -> float:
    """Estimated peak GiB of one training step with `micro_tokens` tokens per micro-batch, `mode`
    ('none', 'mlp' or 'full') on the share `fraction` of the blocks (models.lm.checkpointed_blocks), on the
    plain path (`zero` 0) or under DeepSpeed ZeRO stage `zero` over `ranks` data-parallel ranks."""
    d, g, l, v = cfg.d_model, cfg.d_glu, cfg.n_layers, cfg.vocab_size
    # activation bytes a block keeps per token (compiled, bf16 autocast, fp32 residual stream)
    per_block = get_arch(cfg.arch).act_bytes_per_d * d
    kept = {"none": per_block, "mlp": per_block - 6 * g, "full": 4 * d}[mode]
    n_ckpt = 0 if mode == "none" else len(checkpointed_blocks(l, fraction))
    act = micro_tokens * ((l - n_ckpt) * per_block + n_ckpt * kept)
    state = state_bytes_per_param(zero, ranks) * exact_params(cfg)["total"]
    loss = 4096 * v * 2 + v * d * 8 + micro_tokens * d * 4
    return (act + state + loss) / 2**30 + OVERHEAD_GIB


def choose_checkpointing(cfg: ModelConfig, micro_tokens: int, budget_gib: float, zero: int = 0,
                         ranks: int = 1) -> tuple[str, float]:
    """The cheapest setting whose estimate fits in `budget_gib`: none, else full checkpointing of the fewest
    blocks that fit (fraction k / n_layers), else every block. `zero`, `ranks`: as in `estimate_peak_gib`."""
    l = cfg.n_layers
    if estimate_peak_gib(cfg, micro_tokens, zero=zero, ranks=ranks) <= budget_gib:
        return "none", 1.0
    for k in range(1, l + 1):
        if estimate_peak_gib(cfg, micro_tokens, "full", k / l, zero, ranks) <= budget_gib:
            return "full", (1.0 if k == l else k / l)
    return "full", 1.0


def larger_micro_batch(cfg: ModelConfig, seq_tokens: int, micro_batch: int, accumulation: int,
                       budget_gib: float, zero: int = 0, ranks: int = 1) -> int | None:
    """The largest micro-batch above `micro_batch` whose estimate without activation checkpointing fits in
    `budget_gib` and that keeps the global batch exact (micro_batch x k with k dividing `accumulation`);
    None when there is none. `seq_tokens`: the tokens of one sequence on a rank. Fewer, larger
    micro-batches are faster where they fit (a linear model's scans over one 8K sequence leave most SMs
    idle, and the per-micro-batch work is paid less often; docs/training.md, Micro-batch)."""
    best = None
    for k in range(2, accumulation + 1):
        if accumulation % k:
            continue
        if estimate_peak_gib(cfg, micro_batch * k * seq_tokens, zero=zero, ranks=ranks) > budget_gib:
            break  # the estimate grows with the tokens: no larger k fits either
        best = micro_batch * k
    return best


def describe_setting(mode: str, fraction: float, n_layers: int) -> str:
    """'off', 'full', or 'full on 10 of 32 blocks': activation checkpointing as a log line says it."""
    if mode == "none":
        return "off"
    return mode + ("" if fraction >= 1 else f" on {len(checkpointed_blocks(n_layers, fraction))} of {n_layers} blocks")


def _zero3_ranks_that_fit(cfg: ModelConfig, micro_tokens: int, budget_gib: float, most: int = 1024) -> int | None:
    """The fewest data-parallel ranks (a power of two, at most `most`) over which ZeRO-3 with every block
    checkpointed is estimated to fit `budget_gib`; None when no count does (the activations alone, or the
    state a rank keeps however many ranks share it, exceed it)."""
    r = 1
    while r <= most:
        if estimate_peak_gib(cfg, micro_tokens, "full", 1.0, 3, r) <= budget_gib:
            return r
        r *= 2
    return None


def fit_warning(cfg: ModelConfig, micro_tokens: int, mode: str, fraction: float, device_gib: float,
                zero: int = 0, ranks: int = 1) -> str | None:
    """A warning when the estimated peak of this setting exceeds the device's memory (None: it fits), with
    the settings that would fit. The estimate is fitted to measured peaks and may err either way on a model
    or GPU it was not measured on, so this is a warning, not a refusal; a step that really runs out of
    memory stops the run with its own message."""
    est = estimate_peak_gib(cfg, micro_tokens, mode, fraction, zero, ranks)
    if est <= device_gib:
        return None
    head = (f"{cfg.arch} {cfg.size} at {micro_tokens:,} tokens per micro-batch with activation checkpointing "
            f"{describe_setting(mode, fraction, cfg.n_layers)}: estimated peak {est:.0f} GiB, more than the {device_gib:.0f} GiB of "
            f"this GPU; the first step will probably run out of memory. ")
    budget = 0.9 * device_gib
    full = estimate_peak_gib(cfg, micro_tokens, "full", 1.0, zero, ranks)
    if full > budget:
        zero3 = _zero3_ranks_that_fit(cfg, micro_tokens, budget)
        shard = ("shard the weights, gradients and optimizer state with --zero 3 over more GPUs" +
                 (f" (estimated {estimate_peak_gib(cfg, micro_tokens, 'full', 1.0, 3, zero3):.0f} GiB a rank on "
                  f"{zero3} data-parallel ranks, every block checkpointed)" if zero3 else ""))
        fixed = estimate_peak_gib(cfg, 0, "full", 1.0, zero, ranks)
        if fixed > budget:
            # what no token count changes (the state, the loss's buffers, the overhead) is over the budget
            # already: fewer tokens cannot fit, only sharding the state or a smaller model can
            return head + (f"Even with every block checkpointed the estimate is {full:.0f} GiB, of which "
                           f"{fixed:.0f} GiB (weights, gradients, optimizer state, the loss's buffers) does not "
                           f"shrink with the tokens, so fewer tokens per micro-batch cannot fit: {shard}, or "
                           f"train a smaller model")
        sp = ", or split each sequence over GPUs with --sp N" if get_arch(cfg.arch).sequence_parallel else ""
        return head + (f"Even with every block checkpointed the estimate is {full:.0f} GiB: use fewer tokens per "
                       f"micro-batch (a smaller --micro-batch or a shorter --seq-len){sp}"
                       + (f", or {shard}" if zero3 and (zero < 3 or zero3 > ranks) else ""))
    m, f = choose_checkpointing(cfg, micro_tokens, 0.9 * device_gib, zero, ranks)
    return head + (f"Use --activation-checkpointing auto (here: {describe_setting(m, f, cfg.n_layers)}, estimated "
                   f"{estimate_peak_gib(cfg, micro_tokens, m, f, zero, ranks):.0f} GiB) or a smaller --micro-batch")
