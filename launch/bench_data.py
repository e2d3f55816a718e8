"""Data pipeline benchmark on a data config (default: the shared 2:1 corpus).

    python launch/bench_data.py [--config launch/configs/data/shared_2to1.yaml] [--workers 2]
"""
import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from data_pipeline.bench import bench_loader, bench_prepare  # noqa: E402

DEFAULT = Path(__file__).resolve().parent / "configs" / "data" / "shared_2to1.yaml"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=str(DEFAULT))
    p.add_argument("--workers", type=int, default=0)
    p.add_argument("--seq-len", type=int, default=2048)
    a = p.parse_args(argv)
    res = {"prepare_exact_dedup": bench_prepare(a.config, near=False, workers=a.workers),
           "prepare_exact_and_near_dedup": bench_prepare(a.config, near=True, workers=a.workers),
           "loader": bench_loader(a.config, a.seq_len)}
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
