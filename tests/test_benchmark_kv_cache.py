"""experiments/benchmark_kv_cache.py: the KV cache under grouped-query attention, MHA vs GQA vs MQA in one run."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from tests import forkserver

SCRIPT = Path(__file__).resolve().parents[1] / "experiments" / "benchmark_kv_cache.py"


@pytest.mark.slow  # runs experiments/benchmark_kv_cache.py in a subprocess
def test_the_kv_cache_benchmark_quick_mode_measures_the_cache_each_arm_keeps():
    """The cache read tensor by tensor holds exactly the formula's bytes, n_heads / n_kv_heads fewer than MHA's."""
    result = forkserver.run([sys.executable, str(SCRIPT), "--quick", "--profile"], capture_output=True, text=True,
                            timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    assert re.search(r"^versions: python [\d.]+, torch \S+", out, re.MULTILINE), out
    assert re.search(r"^machine: .+ CPUs, 1 torch thread", out, re.MULTILINE), out
    rows = re.findall(r"^\| (MHA|GQA|MQA) \| (\d+) \| [\d,]+ \| ([\d,]+) \| ([\d,]+) \| ([\d.]+)× \| (\d+) \(", out, re.MULTILINE)
    assert [(arm, int(kv)) for arm, kv, *_ in rows] == [("MHA", 4), ("GQA", 2), ("MQA", 1)], out
    for _, kv, measured, formula, memory, tokens_per_s in rows:
        assert measured == formula, out  # 2 x 2 layers x kv heads x 16 x 4 bytes
        assert int(formula.replace(",", "")) == 2 * 2 * int(kv) * 16 * 4
        assert float(memory) == pytest.approx(int(kv) / 4, abs=1e-3) and int(tokens_per_s) > 0
    assert "timed generations gave generate's tokens" in out
    profile = re.findall(r"^\| (MHA|GQA|MQA) \| (\d) \| (buffer|torch.cat) \| [\d.]+ \| [\d.]+ \| [\d.]+ \| [\d.]+ \|$", out, re.MULTILINE)
    assert profile == [("MHA", "4", "buffer"), ("GQA", "2", "buffer"), ("MQA", "1", "buffer"), ("MHA", "4", "torch.cat")], out
    # the baseline cache ran in the same rounds and gave the same tokens; its ratio is printed
    assert re.search(r"^\| torch.cat \(baseline\) \| \d+ \(", out, re.MULTILINE), out
    assert re.search(r"^buffer / torch.cat: [\d.]+× wall, [\d.]+× CPU", out, re.MULTILINE), out
