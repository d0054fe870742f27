"""`python -m app`: the entry point, and start-up refusals that need no model."""

import subprocess
import sys


def test_module_entry_point_prints_usage_without_a_command():
    result = subprocess.run([sys.executable, "-m", "app"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "usage: python -m app serve" in result.stderr


def test_an_unknown_kernel_option_stops_start_up_with_the_valid_keys():
    """A real `python -m app serve --kernel-options bogus=1`: exit 2 before any actor starts, the
    message naming the key and listing every valid one."""
    result = subprocess.run([sys.executable, "-m", "app", "serve", "--kernel-options", "bogus=1"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "--kernel-options: unknown key 'bogus'; the keys are fused-kernels, triton-gemv," in result.stderr
    assert "triton-decode-stage2-pdl" in result.stderr and "serving" not in result.stderr


def test_a_bad_kernel_option_value_lists_the_values_the_key_takes():
    result = subprocess.run([sys.executable, "-m", "app", "serve", "--kernel-options", "fused-mlp=yes"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "--kernel-options fused-mlp takes auto or on or off, got 'yes'" in result.stderr
