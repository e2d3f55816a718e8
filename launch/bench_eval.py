"""Evaluation speed on one GPU with random weights (timing only): WikiText-2 perplexity of a 1B model,
a NIAH grid, and batched / single-stream decoding tokens/s per arch. Prints one JSON line per result.

    python launch/bench_eval.py --archs tnl llama --size 1b
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path[0] = str(Path(__file__).resolve().parents[1])

import torch  # noqa: E402

from evaluation import niah, perplexity  # noqa: E402
from evaluation.scoring import generate_tokens  # noqa: E402
from models import arch_names, build_model  # noqa: E402


def timed(fn):
    torch.cuda.synchronize()
    t = time.time()
    out = fn()
    torch.cuda.synchronize()
    return out, time.time() - t


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--archs", nargs="+", default=list(arch_names()), choices=list(arch_names()))
    p.add_argument("--size", default="1b")
    p.add_argument("--wikitext", nargs="+", default=["tnl", "llama"], choices=list(arch_names()),
                   help="archs to time WikiText-2 on")
    p.add_argument("--niah", nargs="+", default=["tnl"], choices=list(arch_names()),
                   help="archs to time the default NIAH grid on")
    p.add_argument("--wikitext-path")
    p.add_argument("--haystack", nargs="*", default=[])
    a = p.parse_args()
    if not torch.cuda.is_available():
        # checked before a model is built: building a 1B model on the CPU takes minutes, and its move to the
        # GPU would only then fail
        from pretrain.errors import UserError
        raise UserError("bench_eval needs a CUDA GPU (it times evaluation on one)")
    dev = torch.device("cuda")
    for arch in a.archs:
        torch.manual_seed(0)
        model = build_model(arch, a.size, max_seq_len=16384 + 64).to(dev, torch.bfloat16).eval()
        info = {"arch": arch, "size": a.size, "device": torch.cuda.get_device_name(), "weights": "random"}
        if arch in a.wikitext:
            perplexity.wikitext_perplexity(model, a.wikitext_path, max_length=8192, batch_size=4, limit=2)  # warm-up
            res, secs = timed(lambda: perplexity.wikitext_perplexity(model, a.wikitext_path, max_length=8192,
                                                                     batch_size=4))
            print(json.dumps({**info, "bench": "wikitext2_test", "seconds": round(secs, 2), "tokens": res["tokens"],
                              "documents": res["documents"], "window": 8192}), flush=True)
        for batch in (1, 32):
            prompts = [list(range(1000 + i, 1512 + i)) for i in range(batch)]
            generate_tokens(model, prompts, 8, batch_size=batch)
            _, secs = timed(lambda: generate_tokens(model, prompts, 128, batch_size=batch))
            print(json.dumps({**info, "bench": "decode", "batch": batch, "prompt": 512, "new_tokens": 128,
                              "seconds": round(secs, 3), "tokens_per_s": round(batch * 128 / secs, 1)}), flush=True)
        if arch in a.niah:
            cfg = niah.NiahConfig(mode="standard", haystack=tuple(a.haystack), batch_size=11)
            res, secs = timed(lambda: niah.run_niah(model, cfg))
            print(json.dumps({**info, "bench": "niah_grid", "lengths": list(cfg.lengths), "depths": len(cfg.depths),
                              "seconds": round(secs, 1)}), flush=True)
        del model
        torch.cuda.empty_cache()


if __name__ == "__main__":
    from pretrain.errors import run_cli
    sys.exit(run_cli(lambda argv: main()))
