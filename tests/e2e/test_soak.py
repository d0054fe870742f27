"""A short soak through tools/soak.py: a mixed, hostile workload leaves no violation."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_a_short_soak_finds_no_violation(cache_dir):
    result = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "soak.py"), "--seconds", "8", "--concurrency", "16"],
        capture_output=True, text=True, timeout=300, env=dict(os.environ, APP_CACHE_DIR=str(cache_dir)),
    )
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert result.returncode == 0 and summary["violations"] == [], summary
    assert summary["counts"]["requests"] > 50
    assert summary["counts"]["status_400"] > 0 and summary["counts"]["status_200"] > 0
