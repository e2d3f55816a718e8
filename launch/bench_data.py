"""Data pipeline benchmarks (default config: the shared 2:1 corpus).

    python launch/bench_data.py [--config ...] [--workers 2]   # prepare vs tiktoken alone, loader read rate
    python launch/bench_data.py --quality                      # filters: clean text removed, junk caught
    python launch/bench_data.py --langid                       # language-ID packages compared
    python launch/bench_data.py --merge-scale 20000000         # staged merge on synthetic keys
    python launch/bench_data.py --loader-index 100000000       # loader on a synthetic index
"""
import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from data_pipeline.bench import (bench_langid, bench_loader, bench_loader_index, bench_merge,  # noqa: E402
                                 bench_prepare, bench_quality, bench_tokenizer)
from pretrain.argtypes import non_negative_int, positive_int  # noqa: E402

DEFAULT = Path(__file__).resolve().parent / "configs" / "data" / "shared_2to1.yaml"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=str(DEFAULT))
    p.add_argument("--workers", type=non_negative_int, default=0)
    p.add_argument("--seq-len", type=positive_int, default=2048)
    p.add_argument("--quality", action="store_true", help="filter measurements on real and planted text")
    p.add_argument("--langid", action="store_true", help="compare the installed language-ID packages")
    p.add_argument("--merge-scale", type=non_negative_int, default=0, help="documents of a synthetic staged-merge run")
    p.add_argument("--loader-index", type=non_negative_int, default=0, help="documents of a synthetic loader index")
    p.add_argument("--keep", action="store_true", help="keep the synthetic data (for --reuse)")
    p.add_argument("--reuse", action="store_true", help="--merge-scale on the parts kept by an earlier run")
    p.add_argument("--scratch", default=tempfile.gettempdir(), help="folder for the synthetic data")
    a = p.parse_args(argv)
    if a.quality:
        res = bench_quality(a.config)
    elif a.langid:
        res = bench_langid(a.config)
    elif a.merge_scale:
        res = bench_merge(a.merge_scale, Path(a.scratch) / "linscale-bench-merge", keep=a.keep or a.reuse,
                          reuse=a.reuse)
    elif a.loader_index:
        res = bench_loader_index(a.loader_index, Path(a.scratch) / "linscale-bench-index")
    else:
        tok = bench_tokenizer(a.config)
        prep = bench_prepare(a.config, near=True, workers=a.workers)
        res = {"tiktoken_alone": tok, "prepare_all_filters_exact_and_near_dedup": prep,
               "prepare_per_cpu_s_over_tiktoken_per_cpu_s": prep["tokens_per_cpu_s"] / tok["tokens_per_cpu_s"],
               "loader": bench_loader(a.config, a.seq_len)}
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    from pretrain.errors import run_cli
    sys.exit(run_cli(main))
