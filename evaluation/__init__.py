"""Evaluation of exported snapshots: perplexity (WikiText-2, LAMBADA, validation loss), the lm-eval-harness
model `linscale` (registered here, on import, when lm-eval is installed), NIAH with the paper's metrics,
and sweeps over every snapshot of a run. See docs/evaluation.md."""
from __future__ import annotations

try:  # registers the lm-eval model "linscale"; the rest of the package works without lm-eval
    import lm_eval.models  # noqa: F401  (fills the registry first, so registering ours keeps "hf" etc.)
    from evaluation.lm_eval_adapter import LinscaleLM  # noqa: F401
except ImportError:  # pragma: no cover - e.g. the GPU image, which lacks lm-eval
    LinscaleLM = None
