import subprocess
import sys


def test_module_entry_point_prints_usage_without_a_command():
    result = subprocess.run([sys.executable, "-m", "app"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "usage: python -m app serve" in result.stderr
