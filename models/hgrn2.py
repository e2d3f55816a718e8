"""HGRN2 token mixer: a gated linear RNN with state expansion e and layer-wise forget-gate lower bounds.

    lambda_t = beta + (1 - beta) * sigmoid(X Wfg)   (in log space);  k_t = 1 - lambda_t
    S_t = diag(lambda_t) S_{t-1} + k_t i_t^T, i = X Wh;  o_t = S_t^T og_t, og = silu(X Wog)
    out = Wo Norm(o)
The lower bounds beta come from one l x d parameter shared by all layers (`HgrnLowerBounds`).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from models.config import ModelConfig
from models.layers import Norm, sglu, split_heads
from models.spec import ArchSpec, ModelExtra
from ops import gated_linear_attn


class HgrnLowerBounds(ModelExtra):
    """P = softmax(B over layers); C = cumsum(P); beta_layer = C[layer] - C[0] (layer 0 has no bound).
    Kept and computed in fp32 whatever the module's dtype."""

    fp32_params = ("bounds",)  # LanguageModel.fp32_parameter_names: a bf16 cast for inference keeps them fp32

    def __init__(self, n_layers: int, d: int):
        super().__init__()
        self.bounds = nn.Parameter(torch.zeros(n_layers, d))

    @torch.no_grad()
    def init_extra(self) -> None:
        self.bounds.zero_()  # uniform P: beta rises linearly from 0 at layer 0 to (l-1)/l

    def forward(self) -> Tensor:
        # fp32 at least: a bf16-cast model still takes its bounds in fp32, a float64 one keeps float64
        c = torch.softmax(self.bounds.to(torch.promote_types(self.bounds.dtype, torch.float32)), dim=0).cumsum(dim=0)
        return c - c[0:1]

    def layer_inputs(self, n_layers: int, device) -> list[dict[str, Tensor]]:
        betas = self()
        return [{"lower_bound": betas[i]} for i in range(n_layers)]


class _ForgetGate(torch.autograd.Function):
    """log(lambda) and k = 1 - lambda of lambda = beta' + (1 - beta) sigmoid(f), beta' = max(beta, tiny).

    The same function as log(lambda) = logaddexp(log beta', log1p(-beta) + logsigmoid(f)), k = -expm1(log
    lambda), but from one exp per element instead of seven transcendentals, and with a hand-written
    backward that recomputes the same few values (the gate is a large elementwise kernel of every HGRN2
    block, compute-bound in the log-space form). beta' keeps log(lambda) finite at layer 0 (beta = 0
    exactly) when sigmoid(f) underflows, as clamping log(beta) did. Accuracy: k comes from sigmoid(-f)
    directly (exact for lambda near 1), and log(lambda) from log1p(-k) where k < 1/2, else from log(lambda)."""

    @staticmethod
    def _parts(f: Tensor, beta: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        pos = f >= 0
        e = torch.exp(torch.where(pos, -f, f))   # exp(-|f|), with the right one-sided derivative at f = 0
        inv = 1 / (1 + e)
        s = torch.where(pos, inv, e * inv)        # sigmoid(f)
        sbar = torch.where(pos, e * inv, inv)     # sigmoid(-f) = 1 - s, without cancellation
        k = (1 - beta) * sbar
        lam = beta.clamp_min(TINY) + (1 - beta) * s
        return s, sbar, k, lam

    @staticmethod
    def forward(ctx, f: Tensor, beta: Tensor) -> tuple[Tensor, Tensor]:
        ctx.save_for_backward(f, beta)
        return _forget_gate_ops(f, beta)

    @staticmethod
    def backward(ctx, g_log: Tensor | None, g_k: Tensor | None) -> tuple[Tensor, Tensor]:
        f, beta = ctx.saved_tensors
        s, _, k, lam = _ForgetGate._parts(f, beta)
        g_log = torch.zeros_like(f) if g_log is None else g_log
        g_k = torch.zeros_like(f) if g_k is None else g_k
        # d log(lambda)/df = k s / lambda, dk/df = -k s; d log(lambda)/d beta = (m - s) / lambda and
        # dk/d beta = s - m, with m = [beta >= tiny] (the floor passes no gradient below tiny)
        m = (beta >= TINY).to(f.dtype)
        g_f = k * ((s / lam) * g_log - s * g_k)
        g_beta = (m - s) * (g_log / lam - g_k)
        return g_f, g_beta.reshape(-1, beta.shape[-1]).sum(0)


TINY = torch.finfo(torch.float32).tiny  # the smallest normal float32: the floor of beta in log(lambda)


def _forget_gate_ops(f: Tensor, beta: Tensor) -> tuple[Tensor, Tensor]:
    """_ForgetGate's forward as plain ops (autograd derives their backward). Each branch of the select
    sees only the values it is chosen for, so the other branch passes a zero gradient, not 0 * inf."""
    _, _, k, lam = _ForgetGate._parts(f, beta)
    small = k < 0.5
    return torch.where(small, torch.log1p(-torch.where(small, k, 0.0)), torch.log(torch.where(small, 1.0, lam))), k


def forget_gate(f: Tensor, beta: Tensor, recomputed: bool = False) -> tuple[Tensor, Tensor]:
    """HGRN2's forget gate. Args: f [..., d] the gate's pre-activation (fp32), beta [d] the layer's lower
    bound in [0, 1); recomputed: inside a fully checkpointed block (plain ops, whose inputs the checkpoint
    can drop; see `Hgrn2TokenMixer.recomputed`). Returns (log lambda, k = 1 - lambda), both shaped like f,
    with lambda = beta + (1 - beta) sigmoid(f) (beta floored at the smallest normal float32 inside the log)."""
    return _forget_gate_ops(f, beta) if recomputed else _ForgetGate.apply(f, beta)


class Hgrn2TokenMixer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        d = cfg.d_model
        self.n_heads = cfg.n_heads
        self.og_proj = nn.Linear(d, d, bias=False)   # output gate, the "query"
        self.fg_proj = nn.Linear(d, d, bias=False)   # forget gate
        self.i_proj = nn.Linear(d, d, bias=False)    # input, the "value"
        self.norm = Norm(d, cfg.norm_type, cfg.norm_eps)
        self.out_proj = nn.Linear(d, d, bias=False)
        # True in a fully checkpointed block: the forget gate runs as plain ops there (models.lm.Block.set_recompute)
        self.recomputed = False

    def forward(self, x: Tensor, lower_bound: Tensor, state: dict | None = None, pos: int = 0,
                cu_seqlens: Tensor | None = None) -> Tensor:
        og = F.silu(self.og_proj(x))
        gate_dtype = torch.promote_types(x.dtype, torch.float32)  # fp32, or float64 for a float64 model
        f = self.fg_proj(x).to(gate_dtype)
        i = self.i_proj(x)
        log_lam, k = forget_gate(f, lower_bound.to(gate_dtype), self.recomputed and self.training)
        og, k, i, log_lam = (split_heads(t, self.n_heads) for t in (og, k.to(i.dtype), i, log_lam))
        h0 = None if state is None else state.get("S")
        o, S = gated_linear_attn(og, k, i, log_lam, initial_state=h0, output_final_state=True,
                                 cu_seqlens=cu_seqlens, check_values=False)
        if state is not None:
            state["S"] = S
        return self.out_proj(self.norm(o.reshape(x.shape).to(x.dtype)))


def paper_params(cfg: ModelConfig) -> int:
    l, d, g = cfg.n_layers, cfg.d_model, cfg.d_glu
    return 4 * l * d * d + 3 * l * d * g + l * d


def layer_flops(cfg: ModelConfig, n: int) -> float:
    d, h, g, B = cfg.d_model, cfg.n_heads, cfg.d_glu, cfg.head_dim
    C = 8 * n * d * d + 4 * n * d * d / h + n * d * d / (B * h) + 4 * n * B * d + n * B * h + 5 * n * d
    return 3 * C + 18 * n * d * g + 3 * n * g


def model_flops(cfg: ModelConfig, batch: int, seq_len: int) -> int:
    return 12 * cfg.d_model * cfg.n_layers  # the lower bounds


def lower_bounds(cfg: ModelConfig) -> HgrnLowerBounds:
    return HgrnLowerBounds(cfg.n_layers, cfg.d_model)


SPEC = ArchSpec(
    name="hgrn2", title="HGRN2", token_mixer=Hgrn2TokenMixer, channel_mixer=sglu, default_norm="srmsnorm",
    paper_params=paper_params, layer_flops=layer_flops, model_flops=model_flops,
    extras={"lower_bounds": lower_bounds}, sequence_parallel=True, norms_per_layer=3, act_bytes_per_d=48,
    paper_law={"L": (3.4788, -0.0753), "N_opt": (2.66e8, 0.6427), "D_opt": (4.80e10, 0.4500)},
    color="#2ca02c")
