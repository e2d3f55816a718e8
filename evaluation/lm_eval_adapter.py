"""The lm-eval-harness model `linscale`: any directory `models.load_pretrained` reads (an export, or a
snapshot RUN/snapshots/step_N as it is) as an lm-eval LM.

    lm_eval --model linscale --model_args pretrained=DIR,dtype=bfloat16 --tasks ...
    python -m evaluation.lm_eval_cli --model linscale --model_args pretrained=DIR --tasks csr_local

The class registers itself under "linscale" when this module is imported: the installed package's
linscale_lm_eval.pth hook imports it when the `lm_eval` command starts, and `python -m
evaluation.lm_eval_cli` imports it and adds our task folder to the include path. Tokenizer: cl100k
(data_pipeline.tokenizer), <|endoftext|> as the prefix token for empty contexts and rolling windows.
Scoring and decoding live in evaluation.scoring (the same code the perplexity functions use).
"""
from __future__ import annotations

from pathlib import Path

import torch
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from tqdm import tqdm

from data_pipeline.tokenizer import EOT_ID, get_tokenizer
from evaluation.context import scoring_window
from evaluation.devices import DTYPES, resolve_device, resolve_dtype  # noqa: F401  (also imported from here)
from evaluation.scoring import generate_tokens, rolling_loglikelihood, score_continuations, truncated_requests
from models import LanguageModel, ModelConfig, get_arch, load_pretrained, pretrained_meta
from pretrain.logs import get_logger

logger = get_logger(__name__)


@register_model("linscale")
class LinscaleLM(TemplateLM):
    """model_args: pretrained=DIR (an export or a snapshot; or model=LanguageModel from Python), device (auto|cpu|cuda:N),
    dtype (auto|float32|bfloat16), batch_size, max_length (default: the training context recorded with the
    export, else the config's max_seq_len), max_gen_toks,
    and any model config override (e.g. max_seq_len=16384 for LLaMA past its RoPE table)."""

    def __init__(self, pretrained: str | None = None, model: LanguageModel | None = None, device: str | None = "auto",
                 dtype: str | torch.dtype | None = "auto", batch_size: int | str = 8, max_length: int | None = None,
                 max_gen_toks: int = 256, max_batch_size: int | None = None, **overrides):
        super().__init__()
        device = resolve_device(device)
        # checked before the weights load, so that a typo is one line naming the argument (not a KeyError, or a
        # batch of 0 failing only when the first requests are scored)
        self.batch_size_per_gpu = parse_batch_size(batch_size)
        if max_length is not None and not (str(max_length).isdigit() and int(max_length) > 0):
            raise ValueError(f"linscale: max_length={max_length!r}; give a positive number of tokens, or leave it out "
                             f"for the export's training context")
        max_gen_toks = int(max_gen_toks)
        if max_gen_toks < 1:
            raise ValueError(f"linscale: max_gen_toks={max_gen_toks}; give a positive number of tokens")
        if model is None:
            if pretrained is None:
                raise ValueError("linscale: pass pretrained=DIR (an export written by launch/export.py, or a snapshot "
                                 "RUN/snapshots/step_N)")
            if isinstance(dtype, str) and dtype != "auto" and dtype not in DTYPES:
                raise ValueError(f"linscale: dtype={dtype!r}; use auto, {', '.join(DTYPES)}")
            overrides = {k: int(v) if str(v).isdigit() else v for k, v in overrides.items()}
            saved = (pretrained_meta(pretrained).get("model") or {}).get("max_seq_len")
            # the training context (from the export or its run), not max_seq_len: see evaluation.context
            window = scoring_window(pretrained, overrides.get("max_seq_len") or saved or ModelConfig.max_seq_len,
                                    max_length, warn=logger.warning)
            if "max_seq_len" not in overrides and isinstance(saved, int) and window > saved:
                # LLaMA's RoPE table must cover the scoring window (as the sweep loads it); a table is computed,
                # not learnt, so a longer one changes nothing within the saved length
                overrides["max_seq_len"] = window
            model = load_pretrained(pretrained, device=device, dtype=resolve_dtype(dtype, device), **overrides)
        else:
            if overrides:
                raise ValueError(f"linscale: config overrides {sorted(overrides)} need pretrained=, not model=")
            window = scoring_window(pretrained, model.config.max_seq_len, max_length,
                                    warn=None if pretrained is None else logger.warning)
        if get_arch(model.config.arch).context_limited and window > model.config.max_seq_len:
            raise ValueError(f"linscale: max_length={window} is past this {model.config.arch} model's max_seq_len="
                             f"{model.config.max_seq_len} (its RoPE table); pass a max_length of at most that, or a "
                             f"model loaded with max_seq_len >= {window} (model_args max_seq_len={window})")
        self.model = model.eval()
        self.pretrained = str(pretrained) if pretrained is not None else None
        self._max_length = window
        self.max_gen_toks = int(max_gen_toks)
        self.tokenizer_obj = get_tokenizer()
        # {task: {doc_id, ...}}: the items whose context was cut to fit the window (count_truncated)
        self.truncated: dict = {}

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict, additional_config: dict | None = None) -> "LinscaleLM":
        """model_args win over the CLI's --device/--batch_size (lm-eval would pass both and fail)."""
        extra = {k: v for k, v in (additional_config or {}).items() if v is not None}
        return cls(**{**extra, **arg_dict})

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None) -> "LinscaleLM":
        from lm_eval.utils import simple_parse_args_string
        return cls.create_from_arg_obj(simple_parse_args_string(arg_string), additional_config)

    # -- what TemplateLM needs ------------------------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        return EOT_ID

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def device(self):
        return next(self.model.parameters()).device

    @property
    def tokenizer_name(self) -> str:
        return self.tokenizer_obj.name

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        return self.tokenizer_obj.encode_ordinary(string)

    def tok_decode(self, tokens: list[int]) -> str:
        return self.tokenizer_obj.decode(tokens)

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        """TemplateLM's (tokenize, then _loglikelihood_tokens), keeping which task and item each request is
        of, so that a request that cannot be scored is named by them and context truncation is counted per
        task (`truncated`)."""
        self._items = [(getattr(r, "task_name", None), getattr(r, "doc_id", None)) for r in requests]
        try:
            return super().loglikelihood(requests, disable_tqdm=disable_tqdm)
        finally:
            self._items = None

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        pairs = [(ctx, cont) for _, ctx, cont in requests]
        items = getattr(self, "_items", None)
        if items is None or len(items) != len(pairs):
            items = [(None, None)] * len(pairs)
        labels = [request_label(task, doc, i) for i, (task, doc) in enumerate(items)]
        with tqdm(total=len(pairs), disable=disable_tqdm, desc="linscale loglikelihood") as bar:
            # refuses, before any is scored, a request that cannot be scored whole (named by its label)
            results = score_continuations(self.model, pairs, self.max_length, self.batch_size_per_gpu, bar.update,
                                          labels=labels)
        self.count_truncated(pairs, items)
        for (key, _, _), res in zip(requests, results):
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, res)
        return results

    def count_truncated(self, pairs, items) -> None:
        """Items (documents) of each task with a request whose context was cut from the left to fit the window,
        added to `self.truncated` {task: {doc_id, ...}} and logged (one line per task). Requests that name no
        task count under None, by their index."""
        if getattr(self, "truncated", None) is None:
            self.truncated = {}
        cut: dict = {}
        for i in truncated_requests(pairs, self.max_length):
            task, doc = items[i]
            cut.setdefault(task, set()).add(doc if doc is not None else i)
        for task, docs in cut.items():
            self.truncated.setdefault(task, set()).update(docs)
            total = len({d if d is not None else i for i, (t, d) in enumerate(items) if t == task})
            logger.warning(f"{task or 'loglikelihood'}: the context of {len(docs)} of {total} "
                           f"{'items' if task is not None else 'requests'} is cut from the left to fit the scoring "
                           f"window of {self.max_length} tokens (each continuation is scored whole); a larger "
                           f"max_length (--max-length) keeps them whole")

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        docs = [self.tok_encode(req.args[0]) for req in requests]
        with tqdm(disable=disable_tqdm, desc="linscale rolling windows") as bar:
            results = rolling_loglikelihood(self.model, docs, self.prefix_token_id, self.max_length,
                                            self.batch_size_per_gpu, bar.update)
        for req, res in zip(requests, results):
            self.cache_hook.add_partial("loglikelihood_rolling", (req.args[0],), res)
        return results

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy (or sampled, with do_sample/temperature) decoding from the model's cache, batched over
        requests that share generation settings and prompt length; stops at any `until` string or EOT."""
        groups: dict[str, list[int]] = {}
        for i, req in enumerate(requests):
            groups.setdefault(repr(sorted(req.args[1].items())), []).append(i)
        out: list[str | None] = [None] * len(requests)
        bar = tqdm(total=len(requests), disable=disable_tqdm, desc="linscale generate_until")
        for idx in groups.values():
            kw = dict(requests[idx[0]].args[1])
            until = kw.pop("until", None) or []
            until = [until] if isinstance(until, str) else list(until)
            # an empty string would stop every reply after its first token and cannot split the text; lm-eval's
            # own post-processing skips it too
            until = [u for u in until if u]
            max_new = max_new_tokens(kw, self.max_gen_toks)
            temperature = float(kw.pop("temperature", 0.0)) if kw.pop("do_sample", False) else 0.0
            top_k = kw.pop("top_k", None)
            budget = max(1, self.max_length - max_new)   # prompt tokens kept (from the right)
            prompts = [self.tok_encode(requests[i].args[0])[-budget:] or [EOT_ID] for i in idx]

            def stop(new: list[int]) -> bool:
                return any(u in self.tok_decode(new) for u in until)

            gens = generate_tokens(self.model, prompts, max_new, self.batch_size_per_gpu, EOT_ID,
                                   stop if until else None, temperature, top_k)
            for i, toks in zip(idx, gens):
                text = self.tok_decode(toks)
                for u in until:
                    text = text.split(u)[0]
                out[i] = text
                self.cache_hook.add_partial("generate_until", requests[i].args, text)
            bar.update(len(idx))
        bar.close()
        return out  # type: ignore[return-value]

    def get_model_info(self) -> dict:
        cfg = self.model.config
        return {"linscale_arch": cfg.arch, "linscale_size": cfg.size, "pretrained": self.pretrained,
                "model_num_parameters": sum(p.numel() for p in self.model.parameters())}


# lm-eval's names for the generation budget, in its order of priority (lm_eval.models.utils.normalize_gen_kwargs):
# a task's generation_kwargs or the CLI's --gen_kwargs may use any of them
MAX_TOKEN_KEYS = ("max_gen_toks", "max_new_tokens", "max_tokens", "max_completion_tokens")


def request_label(task: str | None, doc_id, index: int) -> str:
    """How an error names a log-likelihood request: its task and item (lm-eval's doc_id, the item's index in the
    task's split), else its index."""
    if task is None:
        return f"request {index}"
    return f"task {task}, item {doc_id}" if doc_id is not None else f"task {task}, request {index}"


def max_new_tokens(gen_kwargs: dict, default: int) -> int:
    """The number of tokens to generate: the first of MAX_TOKEN_KEYS given (all are removed from gen_kwargs),
    else `default` (the model's max_gen_toks)."""
    given = [v for v in (gen_kwargs.pop(k, None) for k in MAX_TOKEN_KEYS) if v is not None]
    return int(given[0]) if given else int(default)


AUTO_BATCH_SIZE = 8


def parse_batch_size(value: int | str) -> int:
    """A positive integer. lm-eval's "auto" / "auto:N" (a search for the largest batch that fits, an HF-model
    feature) means AUTO_BATCH_SIZE: a fixed size is predictable on every arch."""
    text = str(value).strip()
    if text == "auto" or text.startswith("auto:"):
        return AUTO_BATCH_SIZE
    if text.isdigit() and int(text) > 0:
        return int(text)
    raise ValueError(f"linscale: batch_size={value!r}; give a positive integer (or auto = {AUTO_BATCH_SIZE})")


def tasks_dir() -> Path:
    """Our local lm-eval task configs (pass to --include_path / TaskManager(include_path=...))."""
    return Path(__file__).resolve().parent / "tasks"
