"""The language model around the token mixers: tied embedding, pre-norm blocks, final norm, LM head.

    x = x + TokenMixer(Norm(x));  x = x + ChannelMixer(Norm(x))

Written for one device; precision (autocast / bf16 cast) and parallelism are applied from outside.
Incremental decoding goes through `InferenceCache`: LLaMA keeps keys and values, the linear models a
fixed-size state per layer, so their memory per generated token is constant.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.utils.checkpoint
from torch import Tensor, nn

from models.config import ModelConfig
from models.layers import Norm
from models.registry import get_arch
from ops import linear_cross_entropy

RESIDUAL_PROJECTIONS = ("out_proj", "down_proj")  # scaled by 1/sqrt(2l) at init
IGNORE_INDEX = -100  # targets that count in no loss


@dataclass
class InferenceCache:
    """Per-layer decoding state, the model extras' states (by extra name), the number of tokens
    already consumed, and the number of sequences (rows) it holds (None until the first forward)."""
    layers: list[dict] = field(default_factory=list)
    extras: dict[str, dict] = field(default_factory=dict)
    pos: int = 0
    batch: int | None = None

    def nbytes(self) -> int:
        tensors = [t for d in self.layers + list(self.extras.values()) for t in d.values() if torch.is_tensor(t)]
        return sum(t.numel() * t.element_size() for t in tensors)


AC_MODES = ("none", "mlp", "full")  # what an activation-checkpointed block recomputes in its backward


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        spec = get_arch(cfg.arch)
        self.mixer_norm = Norm(cfg.d_model, cfg.norm_type, cfg.norm_eps)
        self.token_mixer = spec.token_mixer(cfg, layer)
        self.channel_norm = Norm(cfg.d_model, cfg.norm_type, cfg.norm_eps)
        self.channel_mixer = spec.channel_mixer(cfg)
        # activation checkpointing (set by LanguageModel.set_activation_checkpointing): 'full' keeps only
        # the block's input and recomputes the block; 'mlp' recomputes the channel mixer and its norm (the
        # GLU's two [tokens, g] intermediates and their product, the largest activations of a block)
        self.recompute = "none"

    def set_recompute(self, mode: str) -> None:
        """What this block recomputes in its backward (AC_MODES). Every module of the block with an
        attribute `recomputed` (a token mixer, a fused projection of pretrain/grad_accumulation.py) learns
        whether it runs inside the recomputed part, and while training there runs its hand-written
        autograd.Functions as plain ops: a compiled checkpointed block keeps what such a Function saves
        instead of recomputing it (cos2's LRPE 8 d, HGRN2's forget gate 4 d bytes a token; the fused
        projections about 26 d, most of what the block would keep unchecked; H100), plain ops it
        recomputes."""
        self.recompute = mode
        inside = self.recomputed_modules()
        for m in self.modules():
            if hasattr(m, "recomputed"):
                m.recomputed = m in inside

    def recomputed_modules(self) -> set[nn.Module]:
        """The modules whose forward activation checkpointing runs again in the backward ('full': the whole
        block; 'mlp': the channel mixer and its norm; 'none': none)."""
        roots = {"none": [], "mlp": [self.channel_norm, self.channel_mixer], "full": [self]}[self.recompute]
        return {m for root in roots for m in root.modules()}

    def forward(self, x: Tensor, **mixer_kwargs) -> Tensor:
        if self.recompute == "full" and self._checkpointing(mixer_kwargs):
            return torch.utils.checkpoint.checkpoint(self._forward, x, use_reentrant=False, **mixer_kwargs)
        return self._forward(x, **mixer_kwargs)

    def _forward(self, x: Tensor, **mixer_kwargs) -> Tensor:
        x = x + self.token_mixer(self.mixer_norm(x), **mixer_kwargs)
        if self.recompute == "mlp" and self._checkpointing(mixer_kwargs):
            return x + torch.utils.checkpoint.checkpoint(self._channel, x, use_reentrant=False)
        return x + self._channel(x)

    def _channel(self, x: Tensor) -> Tensor:
        return self.channel_mixer(self.channel_norm(x))

    def _checkpointing(self, mixer_kwargs: dict) -> bool:
        # training only, and never while decoding (the inference cache is written during the forward)
        return self.training and torch.is_grad_enabled() and mixer_kwargs.get("state") is None


# the integer dtypes the model indexes with: nn.Embedding takes int64 and int32 ids only (int16, uint8, ...
# fail inside it), torch has few ops for uint16/32/64 (min, comparisons), and the ops take int32/int64 offsets
INDEX_DTYPES = (torch.int64, torch.int32)
_CONVERT = "int64 or int32 (convert with .long())"


def _is_index(t: Tensor) -> bool:
    return t.dtype in INDEX_DTYPES


def check_token_ids(input_ids: Tensor, vocab_size: int) -> None:
    """Raise ValueError unless every id lies in [0, vocab_size). Reads values: free for a CPU tensor, a host
    sync for one on a GPU."""
    if input_ids.numel():
        lo, hi = int(input_ids.min()), int(input_ids.max())
        if lo < 0 or hi >= vocab_size:
            raise ValueError(f"token ids must lie in [0, {vocab_size}), got min {lo}, max {hi}")


def check_input_shapes(input_ids: Tensor, targets: Tensor | None = None, cu_seqlens: Tensor | None = None) -> None:
    """The checks that read no values (free under torch.compile and on any device): ids [batch, time >= 1]
    of an integer dtype the model indexes with (`INDEX_DTYPES`), targets of their shape and such a dtype,
    cu_seqlens 1-D offsets of such a dtype."""
    if not isinstance(input_ids, Tensor) or input_ids.dim() != 2:
        shape = tuple(input_ids.shape) if isinstance(input_ids, Tensor) else type(input_ids).__name__
        raise ValueError(f"input_ids must be [batch, time], got shape {shape}")
    if not _is_index(input_ids):
        raise ValueError(f"input_ids must be integer token ids, got dtype {input_ids.dtype}; give them as "
                         f"{_CONVERT}")
    if input_ids.shape[0] == 0 or input_ids.shape[1] == 0:
        raise ValueError(f"input_ids holds no tokens (shape {tuple(input_ids.shape)}); pass at least one "
                         f"sequence of at least one token")
    if targets is not None:
        if not isinstance(targets, Tensor) or tuple(targets.shape) != tuple(input_ids.shape):
            shape = tuple(targets.shape) if isinstance(targets, Tensor) else type(targets).__name__
            raise ValueError(f"targets must have the shape of input_ids {tuple(input_ids.shape)}, got {shape}")
        if not _is_index(targets):
            raise ValueError(f"targets must be integer token ids (or -100 to ignore a position), got dtype "
                             f"{targets.dtype}; give them as {_CONVERT}")
    if cu_seqlens is not None:
        if not isinstance(cu_seqlens, Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 \
                or not _is_index(cu_seqlens):
            what = (f"shape {tuple(cu_seqlens.shape)}, dtype {cu_seqlens.dtype}" if isinstance(cu_seqlens, Tensor)
                    else type(cu_seqlens).__name__)
            raise ValueError(f"cu_seqlens must be a 1-D integer tensor of document start offsets in the "
                             f"flattened batch, [0, ..., batch x time], of dtype {_CONVERT}, got {what}")


def check_input_values(input_ids: Tensor, vocab_size: int, targets: Tensor | None = None,
                       cu_seqlens: Tensor | None = None, segments: int = 1) -> None:
    """`check_input_shapes`, then the values: ids in [0, vocab_size), targets in [0, vocab_size) or -100,
    cu_seqlens from 0 to batch x time, strictly increasing. `segments` > 1: the ids are one of that many
    equal segments of each sequence (a sequence-parallel rank's share), and cu_seqlens describes the whole
    sequences, batch x time x segments tokens. Reads values: free for CPU tensors, a host sync for tensors
    on a GPU."""
    check_input_shapes(input_ids, targets, cu_seqlens)
    check_token_ids(input_ids, vocab_size)
    if targets is not None:
        bad = (targets != IGNORE_INDEX) & ((targets < 0) | (targets >= vocab_size))
        if bool(bad.any()):
            first = int(targets[bad].flatten()[0])
            raise ValueError(f"targets must lie in [0, {vocab_size}) or be {IGNORE_INDEX} (ignored), got "
                             f"{int(bad.sum())} outside, e.g. {first}")
    if cu_seqlens is not None:
        c = cu_seqlens.tolist()
        n = input_ids.numel() * segments
        if c[0] != 0 or c[-1] != n:
            whole = "batch x time" if segments == 1 else f"batch x time x {segments} sequence-parallel segments"
            raise ValueError(f"cu_seqlens must start at 0 and end at {whole} = {n} (offsets into the "
                             f"flattened batch), got {c[0]} ... {c[-1]}")
        if any(b <= a for a, b in zip(c[:-1], c[1:])):
            raise ValueError(f"cu_seqlens must be strictly increasing (no empty document), got {c}")


def check_cache(cache: InferenceCache, input_ids: Tensor, cu_seqlens: Tensor | None) -> None:
    """A cache continues the rows it was filled with, one position counter for all: packed documents
    (cu_seqlens) would leave states per document under positions counted over the packed row, and a batch
    of another size would meet states of the wrong rows. Records the batch on first use."""
    if cu_seqlens is not None:
        raise ValueError("decoding with a cache takes one sequence per batch row, not packed documents "
                         "(cu_seqlens): give each document its own row (and its own cache for another length)")
    if cache.batch is None:
        cache.batch = input_ids.shape[0]
    elif input_ids.shape[0] != cache.batch:
        raise ValueError(f"this cache holds the state of {cache.batch} sequence(s), got a batch of "
                         f"{input_ids.shape[0]}; feed the same rows, or start a new cache (model.new_cache())")


def checkpointed_blocks(n_layers: int, fraction: float) -> list[int]:
    """The blocks a share `fraction` of `n_layers` checkpoints, spread evenly over the depth (0.5: every
    second block; k / n_layers: exactly k blocks). The memory estimate counts the same blocks."""
    # the tolerance keeps k / n_layers * n_layers at k where the float product lands just below it
    cut = [math.floor(i * fraction + 1e-9) for i in range(n_layers + 1)]
    return [i for i in range(n_layers) if cut[i + 1] > cut[i]]


class LanguageModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        # the architecture's model-level parts (cos2's TPE, HGRN2's lower bounds, TNL's decays), each an
        # attribute under its own name, so that its parameters keep their state-dict names
        self.extra_names = tuple(get_arch(cfg.arch).extras)
        for name, build in get_arch(cfg.arch).extras.items():
            setattr(self, name, build(cfg))
        self.blocks = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layers))
        self.final_norm = Norm(cfg.d_model, cfg.norm_type, cfg.norm_eps)
        self.init_weights()

    # -- precision ----------------------------------------------------------------------------------
    def fp32_parameter_names(self) -> list[str]:
        """The parameters that keep fp32 (float64 in a float64 model) when the model is cast to a lower
        precision for inference (`cast_for_inference`, `load_pretrained(dtype=...)`) or exported in bf16:
        those a module names in its class attribute `fp32_params` (cos2's LRPE angles and TPE decays, HGRN2's
        lower bounds). They are multiplied by positions or set how fast a state forgets, so a bf16 rounding
        (up to 2^-8 of the value) grows with the distance between tokens, unlike a weight's; training keeps them
        fp32 as it keeps every parameter."""
        names = []
        for prefix, module in self.named_modules():
            names += [f"{prefix}.{n}" if prefix else n for n in getattr(module, "fp32_params", ())]
        return names

    def cast_for_inference(self, dtype: torch.dtype) -> "LanguageModel":
        """`self.to(dtype)`, except the `fp32_parameter_names` (at least fp32) and LLaMA's RoPE tables (fp32
        constants, kept by the attention module's own cast)."""
        keep = {n: self.get_parameter(n).detach() for n in self.fp32_parameter_names()}
        self.to(dtype)
        for name, value in keep.items():
            self.get_parameter(name).data = value.to(torch.promote_types(dtype, torch.float32))
        return self

    # -- activation checkpointing -------------------------------------------------------------------
    def set_activation_checkpointing(self, mode: str, fraction: float = 1.0) -> list[int]:
        """Recompute activations in the backward instead of keeping them. `mode` (AC_MODES): 'none',
        'mlp' (each chosen block recomputes its channel mixer) or 'full' (each chosen block keeps only its
        input and recomputes itself); `fraction` of the blocks is chosen, spread evenly over the depth
        (0.5: every second block). Returns the indices of the checkpointed blocks."""
        if mode not in AC_MODES:
            raise ValueError(f"activation checkpointing {mode!r}; choose from {', '.join(AC_MODES)}")
        if not 0.0 <= fraction <= 1.0:
            raise ValueError(f"activation-checkpointing fraction must lie in [0, 1], got {fraction}")
        chosen = [] if mode == "none" else checkpointed_blocks(len(self.blocks), fraction)
        for i, block in enumerate(self.blocks):
            block.set_recompute(mode if i in chosen else "none")
        return chosen

    @property
    def gradient_checkpointing(self) -> bool:
        return any(b.recompute != "none" for b in self.blocks)

    @gradient_checkpointing.setter
    def gradient_checkpointing(self, on: bool) -> None:  # the usual switch: every block, fully
        self.set_activation_checkpointing("full" if on else "none")

    # -- init ---------------------------------------------------------------------------------------
    @torch.no_grad()
    def init_weights(self) -> None:
        """normal(0, std) for linear and embedding weights; residual output projections std/sqrt(2l);
        norm gains 1; each special parameter (TPE, LRPE angles, HGRN2 bounds) its own init."""
        cfg = self.config
        for name, m in self.named_modules():
            if isinstance(m, nn.Linear):
                std = cfg.init_std / math.sqrt(2 * cfg.n_layers) if name.split(".")[-1] in RESIDUAL_PROJECTIONS else cfg.init_std
                nn.init.normal_(m.weight, 0.0, std)
            elif isinstance(m, nn.Embedding):
                nn.init.normal_(m.weight, 0.0, cfg.init_std)
            elif isinstance(m, Norm) and m.weight is not None:
                m.weight.fill_(1.0)
            if m is not self and hasattr(m, "init_extra"):
                m.init_extra()

    # -- forward ------------------------------------------------------------------------------------
    def hidden_states(self, input_ids: Tensor, cache: InferenceCache | None = None,
                      cu_seqlens: Tensor | None = None, check_ids: bool = True) -> Tensor:
        cfg = self.config
        check_input_shapes(input_ids)
        # the range check reads values: eager only, so that a compiled forward stays one graph
        if check_ids and not torch.compiler.is_compiling():
            check_token_ids(input_ids, cfg.vocab_size)
        pos = 0 if cache is None else cache.pos
        if cache is not None:
            check_cache(cache, input_ids, cu_seqlens)
            if not cache.layers:
                cache.layers = [{} for _ in self.blocks]
        x = self.embed(input_ids)
        layer_inputs: list[dict] = [{} for _ in self.blocks]
        for name in self.extra_names:
            extra = getattr(self, name)
            state = None if cache is None else cache.extras.setdefault(name, {})
            delta = extra.input_delta(x, state, cu_seqlens)
            if delta is not None:
                x = x + delta
            for i, kwargs in enumerate(extra.layer_inputs(len(self.blocks), x.device) or []):
                layer_inputs[i].update(kwargs)
        for i, block in enumerate(self.blocks):
            state = None if cache is None else cache.layers[i]
            x = block(x, state=state, pos=pos, cu_seqlens=cu_seqlens, **layer_inputs[i])
        if cache is not None:
            cache.pos += input_ids.shape[1]
        return self.final_norm(x)

    def forward(self, input_ids: Tensor, targets: Tensor | None = None, cache: InferenceCache | None = None,
                cu_seqlens: Tensor | None = None, check_ids: bool = True) -> Tensor:
        """logits [B, T, V] (float32, or float64 for a float64 model), or with `targets` [B, T] the mean cross-entropy, computed fused with
        the tied head so the full logits are never held (targets of -100 are ignored). With `cu_seqlens`
        (int offsets of document starts in the flattened [B*T] batch, ending at B*T) the linear models
        reset their state at each document start. `check_ids=False` skips the check that every id lies in
        the vocabulary, for a caller that has checked them already: on a GPU the check reads two values
        back, which stalls the GPU until the host has launched the next work (the train modules check on
        the host, before the copy; `check_input_values`); it also skips the range checks of `targets` and
        `cu_seqlens`, whose shapes are checked always."""
        check_input_shapes(input_ids, targets, cu_seqlens)
        if check_ids and not torch.compiler.is_compiling():
            check_input_values(input_ids, self.config.vocab_size, targets, cu_seqlens)
            check_ids = False  # done
        B, T = input_ids.shape
        if cu_seqlens is not None:
            # the ops take packed documents as one batch-1 row: cu_seqlens indexes the flattened batch
            input_ids, cu_seqlens = input_ids.reshape(1, -1), cu_seqlens.to(input_ids.device)
        h = self.hidden_states(input_ids, cache, cu_seqlens, check_ids)
        if cu_seqlens is not None:
            h = h.reshape(B, T, -1)
        if targets is not None:
            # an embedding whose gradient is accumulated in a buffer (pretrain/grad_accumulation.py) takes the
            # tied head's part there too
            return linear_cross_entropy(h.reshape(-1, h.shape[-1]), self.embed.weight, targets.reshape(-1),
                                        ignore_index=IGNORE_INDEX,
                                        weight_grad_into=getattr(self.embed, "main_grad", None))
        return self.logits(h)

    def logits(self, h: Tensor) -> Tensor:
        """The tied LM head on hidden states h [..., d_model]: float32 logits (float64 for a float64 model)."""
        logits = h @ self.embed.weight.to(h.dtype).t()
        return logits if logits.dtype == torch.float64 else logits.float()

    # -- decoding -----------------------------------------------------------------------------------
    def new_cache(self) -> InferenceCache:
        return InferenceCache()

    @torch.no_grad()
    def generate(self, input_ids: Tensor, max_new_tokens: int, temperature: float = 0.0, top_k: int | None = None,
                 eos_id: int | None = None, generator: torch.Generator | None = None) -> Tensor:
        """Prefill the prompt once, then decode one token at a time from the cache (greedy when
        temperature is 0). Returns prompt + generated ids; stops early when every row has hit `eos_id`."""
        if input_ids.dim() != 2 or input_ids.shape[1] == 0:
            raise ValueError(f"generate: the prompt must be token ids [batch, length >= 1], got shape "
                             f"{tuple(input_ids.shape)}; start an empty prompt with a token such as <|endoftext|>")
        if max_new_tokens < 0:
            raise ValueError(f"generate: max_new_tokens must be >= 0, got {max_new_tokens}")
        if top_k is not None and not 1 <= top_k <= self.config.vocab_size:
            raise ValueError(f"generate: top_k must be in [1, vocab_size={self.config.vocab_size}], got {top_k}")
        # every generated token but the last is fed back: positions up to prompt + max_new_tokens - 1
        need = input_ids.shape[1] + max(max_new_tokens - 1, 0)
        if get_arch(self.config.arch).context_limited and need > self.config.max_seq_len:
            raise ValueError(f"generate: a prompt of {input_ids.shape[1]} tokens and {max_new_tokens} new ones "
                             f"need {need} positions, past this model's max_seq_len={self.config.max_seq_len} "
                             f"(its RoPE table); generate fewer tokens or load it with "
                             f"load_pretrained(path, max_seq_len={need})")
        cache = self.new_cache()
        # the head on the last position only: the prompt's logits, [batch, length, vocab] in fp32, would take
        # 400 kB a token (3 GB for an 8K-token prompt) to keep one row of them
        logits = self.logits(self.hidden_states(input_ids, cache)[:, -1])
        out = [input_ids]
        done = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        for i in range(max_new_tokens):
            nxt = sample_next(logits, temperature, top_k, generator)
            if eos_id is not None:
                nxt = torch.where(done, torch.full_like(nxt, eos_id), nxt)
                done |= nxt == eos_id
            out.append(nxt[:, None])
            if i == max_new_tokens - 1 or (eos_id is not None and bool(done.all())):
                break  # the last token is never fed back
            logits = self.logits(self.hidden_states(nxt[:, None], cache)[:, -1])
        return torch.cat(out, dim=1)


def sample_next(logits: Tensor, temperature: float, top_k: int | None, generator: torch.Generator | None) -> Tensor:
    if temperature <= 0:
        return logits.argmax(dim=-1)
    logits = logits / temperature
    if top_k is not None:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator).squeeze(1)
