"""launch/bench_kernels.py's pure parts (the timing modes need a GPU)."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "launch"))
import bench_kernels  # noqa: E402


def test_variant_summary_relative_to_each_cells_default():
    """Ratios are taken per cell against that cell's own default, then summarised: hand-computed."""
    cells = {
        "2x12 T8192 la0": {"default": 0.600, "st3": 0.540, "w8": 0.900},
        "1x12 T8192 la0": {"default": 0.400, "st3": 0.380, "w8": 0.560},
        "4x16 T8192 la0": {"default": 1.000, "st3": 0.880},  # w8 did not run here
        "broken": {"st3": 1.0},  # no default: left out
    }
    s = bench_kernels.variant_summary(cells)
    assert set(s) == {"st3", "w8"}
    assert s["st3"]["cells"] == 3 and s["w8"]["cells"] == 2
    assert s["st3"]["median"] == pytest.approx(0.90)  # 0.90, 0.95, 0.88
    assert (s["st3"]["min"], s["st3"]["max"]) == (pytest.approx(0.88), pytest.approx(0.95))
    assert s["w8"]["median"] == pytest.approx((1.5 + 1.4) / 2)


def test_parse_variants_splits_launches_from_plan_settings():
    v = bench_kernels.parse_variants('{"span 120": {"plan": {"tame_span": 120}}, '
                                     '"dqk b16": {"dqk": {"block": 16}}}', "f.json")
    assert list(v) == ["default", "span 120", "dqk b16"]
    assert v["default"] == ({}, {})
    assert v["span 120"] == ({}, {"tame_span": 120})
    assert v["dqk b16"] == ({"dqk": {"block": 16}}, {})
    with pytest.raises(ValueError, match="variant 'x'.*unknown plan setting.*tame"):
        bench_kernels.parse_variants('{"x": {"plan": {"tame": 1}}}', "f.json")
    with pytest.raises(ValueError, match="variant 'y'"):
        bench_kernels.parse_variants('{"y": {"nosuchkernel": {"block": 16}}}', "f.json")


def _row(B, H, T, op, ours, fla=None, layout="scan"):
    r = {"B": B, "H": H, "T": T, "op": op, "ours_ms": ours, "layout": layout}
    if fla is not None:
        r["fla_ms"] = fla
    return r


def test_matrix_summary_per_op_and_over_all_cells():
    """fla / ours per op and over every cell with both times: hand-computed."""
    rows = [_row(1, 12, 2048, "la0", 1.0, 1.5), _row(2, 12, 2048, "la0", 2.0, 2.2),
            _row(1, 12, 2048, "gla1", 1.0, 0.9), _row(2, 12, 2048, "gla1", 1.0, 1.3),
            _row(1, 12, 2048, "gla16", 1.0, 1.2),
            _row(4, 16, 2048, "gla16", 1.0),  # no fla time: not in the summary
            {"B": 1, "H": 12, "T": 2048, "op": "gla32", "ours_error": "boom"}]
    s = bench_kernels.matrix_summary(rows)
    assert set(s) == {"la0", "gla1", "gla16", "all"}
    assert s["la0"]["cells"] == 2 and s["la0"]["median"] == pytest.approx((1.5 + 1.1) / 2)
    assert s["gla1"]["below_1"] == 1 and s["gla1"]["min"] == pytest.approx(0.9)
    assert s["all"]["cells"] == 5 and s["all"]["below_1"] == 1
    assert s["all"]["median"] == pytest.approx(1.2)  # 0.9, 1.1, 1.2, 1.3, 1.5
    assert s["all"]["max"] == pytest.approx(1.5)


def test_matrix_report_lays_cells_out_by_shape_T_and_op():
    rows = [_row(16, 12, 2048, "gla1", 3.0, 4.5), _row(1, 12, 8192, "gla1", 2.0, 1.0, "split S=12"),
            _row(1, 12, 2048, "la0", 0.5, 1.0, "split S=6"), _row(1, 12, 2048, "gla1", 0.25)]
    lines = bench_kernels.matrix_report(rows).splitlines()
    assert lines[0] == "| B x H | T | la0 | gla1 | ours' layout |"  # ops in the matrix's order
    # shapes in the matrix's order (1 x 12 before 16 x 12), T ascending; a missing cell is a dash
    assert lines[2] == "| 1 x 12 | 2048 | 0.500 / 1.000 (2.00) | 0.250 | split S=6 |"
    assert lines[3] == "| 1 x 12 | 8192 | — | **2.000 / 1.000 (0.50)** | split S=12 |"
    assert lines[4] == "| 16 x 12 | 2048 | — | 3.000 / 4.500 (1.50) | scan |"
    assert "| all | 3 | 0.50 | 1.50 | 2.00 | 1 |" in lines


def test_report_refuses_a_file_that_is_not_a_matrix(tmp_path, capsys):
    f = tmp_path / "launches.json"
    f.write_text('{"meta": {}, "cells": {}, "summary": {}}')
    with pytest.raises(SystemExit, match="not a --matrix JSON"):
        bench_kernels.report([str(f)])
    sweep = tmp_path / "sweep.json"  # a --sweep file: rows, but of layouts' times
    sweep.write_text('{"meta": {}, "rows": [{"op": "la0", "B": 1, "H": 12, "T": 2048, "ms": {"S=1": 1.0}}]}')
    with pytest.raises(SystemExit, match="sweep.json: not a --matrix JSON"):
        bench_kernels.report([str(sweep)])
    g = tmp_path / "m.json"
    g.write_text('{"meta": {"device": "X"}, "rows": [{"B": 1, "H": 12, "T": 2048, "op": "la0", '
                 '"ours_ms": 1.0, "fla_ms": 1.25, "layout": "scan"}]}')
    bench_kernels.report([str(g)])
    assert "| 1 x 12 | 2048 | 1.000 / 1.250 (1.25) | scan |" in capsys.readouterr().out
