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
