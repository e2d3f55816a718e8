"""Token-level scoring shared by every evaluation: log-likelihood of continuations (batched, right-padded),
rolling document log-likelihood, and batched greedy / sampled decoding from the model's cache.

The tied LM head is applied only to the positions that are scored, in row chunks, so the full
[batch, time, vocab] fp32 logits (26 GB at B=32, T=2048, V=100K) are never held. Semantics follow
lm-eval-harness's HF model: a request (context, continuation) is scored on the last max_length+1 tokens
of context+continuation; is_greedy means every continuation token is the argmax.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence

import torch
from torch import Tensor

from models.lm import LanguageModel, sample_next

HEAD_ROWS = 4096  # rows of hidden state per head matmul: 4096 x 100K fp32 = 1.6 GB transient


def model_device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def head_logits(model: LanguageModel, h: Tensor) -> Tensor:
    """The tied LM head (LanguageModel.logits), float32 whatever the model's dtype."""
    return model.logits(h).float()


def target_logprobs(model: LanguageModel, h: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
    """Log-probability of each target and whether it is the argmax, for hidden rows h [N, D], targets [N]."""
    logps, greedy = [], []
    for i in range(0, h.shape[0], HEAD_ROWS):
        logits = head_logits(model, h[i:i + HEAD_ROWS])
        t = targets[i:i + HEAD_ROWS]
        logps.append(torch.log_softmax(logits, dim=-1).gather(1, t[:, None]).squeeze(1))
        greedy.append(logits.argmax(dim=-1) == t)
    if not logps:
        return h.new_zeros(0, dtype=torch.float32), torch.zeros(0, dtype=torch.bool, device=h.device)
    return torch.cat(logps), torch.cat(greedy)


def truncated_requests(requests: Sequence[tuple[Sequence[int], Sequence[int]]], max_length: int) -> list[int]:
    """Indices of the requests whose context is cut from the left to fit the window: context + continuation
    longer than max_length + 1 tokens (the last token is only a target), the continuation itself fitting."""
    return [i for i, (ctx, cont) in enumerate(requests)
            if len(ctx) + len(cont) > max_length + 1 and len(cont) <= max_length]


def check_requests_fit(requests: Sequence[tuple[Sequence[int], Sequence[int]]], max_length: int,
                       labels: Sequence[str] | None = None) -> None:
    """Refuse, before anything is scored, requests that cannot be scored whole in windows of max_length: a
    continuation with no context token before it, or one longer than the window (only the context can be cut:
    cutting the continuation would sum fewer tokens and mis-score the item without a sign; lm-eval's HF model
    refuses both too and prefixes an empty context with <|endoftext|>). The error names the request (its
    `labels` entry, e.g. 'task piqa_local, item 314', else its index) and the window that fits every one."""
    name = (lambda i: labels[i]) if labels is not None else (lambda i: f"request {i}")
    for i, (ctx, cont) in enumerate(requests):
        if not cont:
            # lm-eval's split gives the continuation the tokens of context+continuation past the context's own, so
            # a non-empty text can get none: "Number: 1" + "2" is tokenised as "Number: 12", one token fewer.
            # Scoring it 0 would make that choice a sure winner, so say why it cannot be scored instead
            raise ValueError(f"{name(i)} has no continuation token to score: its continuation is empty, or its text "
                             f"merges into the last context token when context and continuation are tokenised "
                             f"together (lm-eval's split, e.g. digits right after digits); separate them, e.g. with "
                             f"the task's target_delimiter ' '")
        if not ctx:
            raise ValueError(f"{name(i)} has no context: its first continuation token cannot be scored; "
                             f"prefix the context with <|endoftext|> as lm-eval does")
    too_long = [i for i, (_, cont) in enumerate(requests) if len(cont) > max_length]
    if not too_long:
        return
    worst = max(too_long, key=lambda i: len(requests[i][1]))
    need = len(requests[worst][1])
    # the choices of one item share its label: name the others once each
    others = list(dict.fromkeys(name(i) for i in sorted(too_long, key=lambda i: -len(requests[i][1]))))[1:]
    more = (f"; {len(others)} other(s) do not fit either ({', '.join(others[:3])}{', ...' if len(others) > 3 else ''})"
            if others else "")
    raise ValueError(f"{name(worst)}: a continuation of {need} tokens is longer than the scoring window max_length "
                     f"{max_length}, so it cannot be scored whole (only the context is cut from the left to fit)"
                     f"{more}. Pass --max-length {need} or more to launch/evaluate.py (max_length={need} in lm-eval's "
                     f"model_args; evaluation.max_length in a study config)")


@torch.no_grad()
def score_continuations(model: LanguageModel, requests: Sequence[tuple[Sequence[int], Sequence[int]]],
                        max_length: int, batch_size: int = 8,
                        progress: Callable[[int], None] | None = None,
                        labels: Sequence[str] | None = None) -> list[tuple[float, bool]]:
    """(sum log p(continuation | context), is_greedy) per (context_ids, continuation_ids) request.

    Inputs are the last max_length+1 tokens of context+continuation minus the final one (lm-eval's
    truncation: the continuation is kept whole and the context cut from the left; `truncated_requests` says
    which); rows are sorted by length so a batch wastes little padding. Right padding is safe: the models are
    causal, so padded positions never influence the scored ones. A request that cannot be scored whole is
    refused before any is scored (`check_requests_fit`; `labels` name the requests in its error)."""
    check_requests_fit(requests, max_length, labels)
    device = model_device(model)
    out: list[tuple[float, bool] | None] = [None] * len(requests)
    order = sorted(range(len(requests)), key=lambda i: -(len(requests[i][0]) + len(requests[i][1])))
    for start in range(0, len(order), batch_size):
        idx = order[start:start + batch_size]
        rows, n_cont = [], []
        for i in idx:
            ctx, cont = requests[i]
            whole = (list(ctx) + list(cont))[-(max_length + 1):]
            rows.append(whole[:-1])
            n_cont.append(len(cont))
        width = max(len(r) for r in rows)
        ids = torch.zeros(len(rows), width, dtype=torch.long)
        for j, r in enumerate(rows):
            ids[j, :len(r)] = torch.tensor(r, dtype=torch.long)
        h = model.hidden_states(ids.to(device))
        sel_h, sel_t, owner = [], [], []
        for j, (r, n) in enumerate(zip(rows, n_cont)):
            cont = requests[idx[j]][1][-n:]
            sel_h.append(h[j, len(r) - n:len(r)])
            sel_t.append(torch.tensor(cont, dtype=torch.long))
            owner += [j] * n
        logp, greedy = target_logprobs(model, torch.cat(sel_h), torch.cat(sel_t).to(device))
        owner_t = torch.tensor(owner, device=device)
        sums = torch.zeros(len(rows), device=device, dtype=torch.float64).index_add_(0, owner_t, logp.double())
        misses = torch.zeros(len(rows), device=device, dtype=torch.long).index_add_(0, owner_t, (~greedy).long())
        for j, i in enumerate(idx):
            out[i] = (float(sums[j]), bool(misses[j] == 0))
        if progress is not None:
            progress(len(idx))
    return out  # type: ignore[return-value]


def rolling_windows(tokens: Sequence[int], prefix_token: int, max_length: int) -> list[tuple[list[int], list[int]]]:
    """Disjoint (context, continuation) windows that together predict every token once, as lm-eval's
    rolling log-likelihood does with context_len=1: the first window predicts up to max_length tokens
    after `prefix_token`; each later window predicts the next max_length tokens given the one before,
    except the last, shorter one, which is conditioned on enough earlier tokens to fill max_length."""
    tokens = list(tokens)
    windows = []
    done = 0
    while done < len(tokens):
        n = min(max_length, len(tokens) - done)
        end = done + n
        ctx = [prefix_token] if done == 0 else tokens[end - max_length - 1:done]
        windows.append((ctx, tokens[done:end]))
        done = end
    return windows


def rolling_loglikelihood(model: LanguageModel, documents: Sequence[Sequence[int]], prefix_token: int,
                          max_length: int, batch_size: int = 8,
                          progress: Callable[[int], None] | None = None) -> list[float]:
    """Sum of log p over every token of each tokenised document (windows of max_length, lm-eval style)."""
    windows, owner = [], []
    for d, toks in enumerate(documents):
        for w in rolling_windows(toks, prefix_token, max_length):
            windows.append(w)
            owner.append(d)
    scores = score_continuations(model, windows, max_length, batch_size, progress)
    totals = [0.0] * len(documents)
    for d, (lp, _) in zip(owner, scores):
        totals[d] += lp
    return totals


@torch.no_grad()
def generate_tokens(model: LanguageModel, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                    batch_size: int = 8, eos_id: int | None = None,
                    stop: Callable[[list[int]], bool] | None = None, temperature: float = 0.0,
                    top_k: int | None = None, generator: torch.Generator | None = None) -> list[list[int]]:
    """New tokens for each prompt: the prompt is prefilled once into the model's cache (KV cache for LLaMA,
    the fixed-size recurrent state for the linear models), then tokens are decoded one step at a time for
    a whole batch. Prompts of equal length share a batch (the models take no padding mask). A row stops at
    `eos_id` (not returned) or when stop(new_tokens) is true."""
    device = model_device(model)
    by_len: dict[int, list[int]] = {}
    for i, p in enumerate(prompts):
        if not p:
            raise ValueError(f"prompt {i} is empty; give at least one token (e.g. <|endoftext|>)")
        by_len.setdefault(len(p), []).append(i)
    out: list[list[int]] = [[] for _ in prompts]
    for length in sorted(by_len, reverse=True):
        group = by_len[length]
        for s in range(0, len(group), batch_size):
            idx = group[s:s + batch_size]
            ids = torch.tensor([list(prompts[i]) for i in idx], dtype=torch.long, device=device)
            new = _decode_batch(model, ids, max_new_tokens, eos_id, stop, temperature, top_k, generator)
            for i, toks in zip(idx, new):
                out[i] = toks
    return out


def _decode_batch(model: LanguageModel, ids: Tensor, max_new_tokens: int, eos_id: int | None,
                  stop: Callable[[list[int]], bool] | None, temperature: float, top_k: int | None,
                  generator: torch.Generator | None) -> list[list[int]]:
    cache = model.new_cache()
    logits = head_logits(model, model.hidden_states(ids, cache)[:, -1])
    new: list[list[int]] = [[] for _ in range(ids.shape[0])]
    done = [False] * ids.shape[0]
    for i in range(max_new_tokens):
        nxt = sample_next(logits, temperature, top_k, generator)
        for j, t in enumerate(nxt.tolist()):
            if done[j]:
                continue
            if eos_id is not None and t == eos_id:
                done[j] = True
                continue
            new[j].append(t)
            if stop is not None and stop(new[j]):
                done[j] = True
        # the last token is never fed back: its forward would be wasted, and for LLaMA it would need one
        # position past prompt + max_new_tokens - 1, which the RoPE table need not have
        if all(done) or i == max_new_tokens - 1:
            break
        logits = head_logits(model, model.hidden_states(nxt[:, None], cache)[:, -1])
    return new


@torch.no_grad()
def validation_loss(model: LanguageModel, windows: Iterable[Sequence[int] | Tensor], batch_size: int = 8,
                    max_windows: int | None = None) -> dict:
    """Mean next-token cross-entropy (nats/token) over token windows of seq_len+1 tokens, as the loader
    packs them: input w[:-1], target w[1:]. Windows may differ in length; the mean weights every token
    equally. Returns loss, perplexity, token and window counts."""
    device = model_device(model)
    total, count, n_win = 0.0, 0, 0
    batch: list[Tensor] = []

    def flush() -> None:
        nonlocal total, count
        for length in sorted({len(w) for w in batch}):
            same = torch.stack([w for w in batch if len(w) == length]).to(device)
            h = model.hidden_states(same[:, :-1])
            logp, _ = target_logprobs(model, h.reshape(-1, h.shape[-1]), same[:, 1:].reshape(-1))
            total -= float(logp.double().sum())
            count += logp.numel()
        batch.clear()

    for w in windows:
        w = torch.as_tensor(w, dtype=torch.long).flatten()
        if w.numel() < 2:
            continue
        batch.append(w)
        n_win += 1
        if len(batch) == batch_size:
            flush()
        if max_windows is not None and n_win >= max_windows:
            break
    if batch:
        flush()
    if count == 0:
        raise ValueError("validation_loss: no window with at least 2 tokens")
    loss = total / count
    # math.exp, not torch: torch.tensor(loss) is float32, which holds the perplexity to 7 digits only
    try:
        ppl = math.exp(loss)
    except OverflowError:   # a diverged model: report inf, as torch's exp does
        ppl = math.inf
    return {"loss": loss, "perplexity": ppl, "tokens": count, "windows": n_win}
