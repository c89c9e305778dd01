"""tools/check_learnable.py, run for real: the tiny model learns `learnable` (GRPO)."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_reward_rises_by_at_least_0_2_in_40_updates():
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "check_learnable.py"),
                           "--updates", "40"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    curve = [float(m) for m in re.findall(r"mean reward ([0-9.]+)", proc.stdout)]
    assert len(curve) == 40 and all(0.0 <= r <= 1.0 for r in curve)
    rise = float(re.search(r"rise ([-+0-9.]+)", proc.stdout).group(1))
    assert rise >= 0.2
    assert sum(curve[-5:]) / 5 - sum(curve[:5]) / 5 == pytest.approx(rise, abs=1e-3)
