"""What makes an architecture: one `ArchSpec` per model file, registered in `models.registry`.

The language model around the token mixers (`models.lm`) is the same for every architecture; a spec
supplies what differs: the token mixer and channel mixer, the default norm, model-level parts outside the
blocks (`ModelExtra`), the paper's parameter and FLOPs formulas, and the paper's fitted scaling law.

The token mixer contract. `token_mixer(cfg, layer)` builds the mixer of block `layer`; its forward is

    forward(x [B, T, d], state: dict | None = None, pos: int = 0, cu_seqlens: Tensor | None = None,
            **layer_inputs) -> [B, T, d]

`state` is the block's decoding cache (None when training; the mixer reads and writes its own keys),
`pos` the position of x's first token, `cu_seqlens` the document starts of a packed batch-1 row (a mixer
that cannot reset its state there raises), and `layer_inputs` the keyword tensors the model's extras hand
this layer (`ModelExtra.layer_inputs`). Mixers declare every keyword they take: a misspelled one is a
TypeError, not silently ignored.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from torch import Tensor, nn

if TYPE_CHECKING:
    from models.config import ModelConfig


class ModelExtra(nn.Module):
    """A model-level part of an architecture outside the blocks. It may add to the embedded input
    (`input_delta`: cos2's TPE) and may hand every block's token mixer extra keyword inputs
    (`layer_inputs`: HGRN2's lower bounds, TNL's decays). Both default to doing nothing."""

    def input_delta(self, x: Tensor, state: dict | None, cu_seqlens: Tensor | None) -> Tensor | None:
        """What to add to the embedded input x [B, T, d] (None: nothing). `state` is this extra's decoding
        cache (None when training)."""
        return None

    def layer_inputs(self, n_layers: int, device) -> list[dict[str, Tensor]] | None:
        """One dict of keyword inputs per block's token mixer (None: none)."""
        return None


def _no_params(cfg: ModelConfig) -> int:
    return 0


def _no_flops(cfg: ModelConfig, batch: int, seq_len: int) -> int:
    return 0


def _no_lines(model: nn.Module) -> list[str]:
    return []


def _no_buffers(model: nn.Module, device) -> None:
    return None


def _no_check(cfg: ModelConfig) -> None:
    return None


@dataclass(frozen=True)
class ArchSpec:
    """Everything architecture-specific. Notation of the formulas as the paper: l layers, d width, h heads,
    e = d/h, g GLU width, t gate rank, n sequence length, b batch (sequences); FLOPs are training FLOPs
    (forward + backward, multiply-add = 2, backward = 2x forward).

    name: the registry key (ModelConfig.arch, `--arch`, run names); aliases: other accepted names.
    title: the name tables and plots print.
    token_mixer: (cfg, layer) -> module, with the forward contract of this module's docstring.
    channel_mixer: cfg -> module (SwiGLU, SGLU, ...).
    default_norm: 'rmsnorm' (learned gain) or 'srmsnorm' when the config names none.
    extras: attribute name -> (cfg -> ModelExtra), built once per model (the name is its state-dict prefix).
    paper_params: the paper's non-embedding parameter formula.
    extra_params: parameters the model builds beyond `paper_params` and the norm gains.
    layer_flops: (cfg, n) -> one layer's training FLOPs for one sequence of n tokens.
    model_flops: (cfg, b, n) -> training FLOPs outside the layers besides the LM head (0 for most).
    paper_law: the paper's fitted laws {'L' | 'N_opt' | 'D_opt': (coef, exponent)}, C in PFLOP-days
        (its Table 3); None for an architecture the paper did not study.
    layer_overrides: registry size -> layer count where this architecture departs from the size table.
    context_limited: positions come from a table of max_seq_len entries (RoPE), so a run's sequence
        length must fit it (the run config sizes the table).
    sequence_parallel: its layers pass only a fixed-size state along the sequence, so the sequence-parallel
        plan (pretrain/sequence_parallel.py, `--sp`) can split a sequence over ranks.
    sp_positions: its token mixers take `pos` as the absolute positions of their tokens (a tensor; cos2's
        LRPE), so the sequence-parallel plan hands each rank's mixers the global positions of its segment.
    sp_carries: extra name -> (extra, x, cu_seqlens, sp) -> what the state carried in from the ranks before
        adds to that extra's output (cos2's TPE recurrence); the sequence-parallel plan adds it.
    norms_per_layer: the `Norm`s a block holds, each with a gain of d parameters under 'rmsnorm' (the
        accounting counts them): the block's two pre-norms, plus one inside a token mixer that normalises
        its output (TNL, HGRN2, cos2: 3).
    act_bytes_per_d: activation bytes a block keeps per token, in units of d, for the memory estimate
        (`pretrain.memory`; measured for the four paper architectures, a high guess otherwise).
    color: the plots' hue (None: grey).
    describe: model -> lines the trainer logs at start (e.g. TNL's decay table).
    rebuild_buffers: (model, device) -> recompute the buffers a checkpoint does not hold (LLaMA's RoPE
        tables), after `load_pretrained` built the model on the meta device.
    check_config: cfg -> None; raises ValueError (what is wrong) for a config this architecture cannot run
        beyond `ModelConfig.check_shape` (LLaMA: RoPE needs an even head width). ModelConfig calls it, so a
        bad `--model` override is refused when the run config is parsed, not at the first forward.
    """
    name: str
    title: str
    token_mixer: Callable[[ModelConfig, int], nn.Module]
    channel_mixer: Callable[[ModelConfig], nn.Module]
    default_norm: str
    paper_params: Callable[[ModelConfig], int]
    layer_flops: Callable[[ModelConfig, int], float]
    extra_params: Callable[[ModelConfig], int] = _no_params
    model_flops: Callable[[ModelConfig, int, int], float] = _no_flops
    extras: dict[str, Callable[[ModelConfig], ModelExtra]] = field(default_factory=dict)
    aliases: tuple[str, ...] = ()
    paper_law: dict[str, tuple[float, float]] | None = None
    layer_overrides: dict[str, int] = field(default_factory=dict)
    context_limited: bool = False
    sequence_parallel: bool = False
    sp_positions: bool = False
    sp_carries: dict[str, Callable[..., Any]] = field(default_factory=dict)
    norms_per_layer: int = 2
    act_bytes_per_d: int = 64
    color: str | None = None
    describe: Callable[[nn.Module], list[str]] = _no_lines
    rebuild_buffers: Callable[[nn.Module, Any], None] = _no_buffers
    check_config: Callable[[ModelConfig], None] = _no_check
