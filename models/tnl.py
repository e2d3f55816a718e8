"""TNL (TransNormerLLM) token mixer: lightning attention with a fixed, data-independent decay per head.

    q = silu(X Wq), k = silu(X Wk), v = X Wv;  o_t = sum_{s<=t} lambda^(t-s) (q_t . k_s) v_s
    out = Wo [ Norm(o) * sigmoid(X Wgdown Wgup) ]
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from models.config import ModelConfig
from models.layers import LowRankGate, Norm, sglu, split_heads
from models.spec import ArchSpec, ModelExtra
from ops import lightning_attn


def alibi_slopes(n_heads: int) -> list[float]:
    """ALiBi slopes 2^(-8(i+1)/h); for h not a power of two, the standard interleave."""
    def power_of_two(n: int) -> list[float]:
        start = 2.0 ** (-8.0 / n)
        return [start ** (i + 1) for i in range(n)]
    if math.log2(n_heads).is_integer():
        return power_of_two(n_heads)
    m = 2 ** math.floor(math.log2(n_heads))
    return power_of_two(m) + power_of_two(2 * m)[0::2][: n_heads - m]


def tnl_decays(n_heads: int, layer: int, n_layers: int, schedule: str = "code") -> list[float]:
    """lambda per head. 'code' (the authors' released code): exp(-s_i * c), c = 1 - layer/(l-1) + 1e-5.
    'paper' (the TNL paper's formula): exp(-8i/h * (1 - layer/l))."""
    if schedule == "paper":
        return [math.exp(-8 * i / n_heads * (1 - layer / n_layers)) for i in range(n_heads)]
    c = 1.0 if n_layers == 1 else 1 - layer / (n_layers - 1) + 1e-5
    return [math.exp(-s * c) for s in alibi_slopes(n_heads)]


def decay_dtype(device: torch.device) -> torch.dtype:
    """float64 for the decay table (TnlDecays), fp32 where the device has no float64 (Apple's MPS)."""
    return torch.float32 if torch.device(device).type == "mps" else torch.float64


class TnlTokenMixer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        d = cfg.d_model
        self.n_heads = cfg.n_heads
        self.q_proj = nn.Linear(d, d, bias=False)
        self.k_proj = nn.Linear(d, d, bias=False)
        self.v_proj = nn.Linear(d, d, bias=False)
        self.gate = LowRankGate(d, cfg.gate_rank)
        self.norm = Norm(d, cfg.norm_type, cfg.norm_eps)
        self.out_proj = nn.Linear(d, d, bias=False)
        # a Python constant, not a buffer: a bf16 cast of the module must not round 0.99998 to 1.0
        self.decays = tnl_decays(cfg.n_heads, layer, cfg.n_layers, cfg.tnl_decay_schedule)

    def forward(self, x: Tensor, state: dict | None = None, pos: int = 0, cu_seqlens: Tensor | None = None,
                decay: Tensor | None = None) -> Tensor:
        """`decay`: this layer's lambdas as a float64 tensor [h] (the language model passes them in, so that
        every block runs the same compiled graph); built from `self.decays` when not given."""
        q = split_heads(F.silu(self.q_proj(x)), self.n_heads)
        k = split_heads(F.silu(self.k_proj(x)), self.n_heads)
        v = split_heads(self.v_proj(x), self.n_heads)
        if decay is None:
            decay = torch.tensor(self.decays, dtype=decay_dtype(x.device), device=x.device)
        h0 = None if state is None else state.get("S")
        o, S = lightning_attn(q, k, v, decay, initial_state=h0, output_final_state=True,
                              cu_seqlens=cu_seqlens, check_values=False)
        if state is not None:
            state["S"] = S
        o = self.norm(o.reshape(x.shape).to(x.dtype))
        return self.out_proj(o * self.gate(x))


class TnlDecays(ModelExtra):
    """Hands each layer its decays as a float64 tensor [h]: as an input, not as Python constants baked into
    the block's code, so that all blocks share one compiled graph (TrainModule.compile compiles per
    block). No parameters: a Python table, which a bf16 cast of the model cannot round. The table is
    copied to each device once and kept (a plain attribute, which no dtype cast touches): a copy from host
    memory at every forward would wait for all the work queued on the GPU, and the GPU would then idle
    while the host launches the next kernels. Float64, because the last layers' decays lie within 1e-7 of 1,
    where fp32's spacing (6e-8) would move their rates -log(lambda) by up to half; the ops take the logs at
    that precision (ops.reference.log_decay) and run on the rates in fp32."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.table = [tnl_decays(cfg.n_heads, i, cfg.n_layers, cfg.tnl_decay_schedule) for i in range(cfg.n_layers)]
        self._on_device: dict[torch.device, Tensor] = {}

    def layer_inputs(self, n_layers: int, device) -> list[dict[str, Tensor]]:
        device = torch.device(device)
        decays = self._on_device.get(device)
        if decays is None:
            # an ordinary tensor even when first asked for under inference mode, so training can use it too
            with torch.inference_mode(False):
                decays = self._on_device[device] = torch.tensor(self.table, dtype=decay_dtype(device), device=device)
        return [{"decay": decays[i]} for i in range(n_layers)]


def paper_params(cfg: ModelConfig) -> int:
    l, d, g, t = cfg.n_layers, cfg.d_model, cfg.d_glu, cfg.gate_rank
    return 4 * l * d * d + 2 * l * d * t + 3 * l * d * g


def layer_flops(cfg: ModelConfig, n: int) -> float:
    d, h, g, t, B = cfg.d_model, cfg.n_heads, cfg.d_glu, cfg.gate_rank, cfg.head_dim
    C = 8 * n * d * d + 4 * n * d * d / h + n * d * d / (B * h) + 4 * n * B * d + n * B * h + 4 * n * t * d + 2 * n * d
    return 3 * C + 18 * n * d * g + 3 * n * g


def describe(model: nn.Module) -> list[str]:
    """The decay table, logged at the start of training."""
    lines = [f"TNL decay schedule '{model.config.tnl_decay_schedule}' (lambda per layer x head):"]
    for i, block in enumerate(model.blocks):
        lines.append(f"  layer {i:2d}: " + " ".join(f"{x:.5f}" for x in block.token_mixer.decays))
    return lines


SPEC = ArchSpec(
    name="tnl", title="TNL", token_mixer=TnlTokenMixer, channel_mixer=sglu, default_norm="srmsnorm",
    paper_params=paper_params, layer_flops=layer_flops, extras={"decays": TnlDecays},
    aliases=("transnormer", "transnormerllm"), layer_overrides={"410m": 25}, sequence_parallel=True, norms_per_layer=3,
    act_bytes_per_d=44,
    paper_law={"L": (3.5391, -0.0768), "N_opt": (2.74e8, 0.6470), "D_opt": (4.43e10, 0.4684)},
    color="#ff7f0e", describe=describe)
