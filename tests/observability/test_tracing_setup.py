"""--enable-trace's checks at start, and that without it no process loads OpenTelemetry.

Each case runs in a fresh interpreter (this one has OpenTelemetry loaded by other tests): one
where the packages cannot be imported (a meta-path finder refuses them, as on a machine without
the ``trace`` extra), and one that imports everything the server's processes import.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from app.observability.settings import ObservabilitySettings

ROOT = Path(__file__).resolve().parents[2]

# Makes every ``opentelemetry`` import fail, as when the extra is not installed.
WITHOUT_OPENTELEMETRY = """
import sys
class NoOpenTelemetry:
    def find_spec(self, name, path=None, target=None):
        if name == "opentelemetry" or name.startswith("opentelemetry."):
            raise ModuleNotFoundError(f"No module named {name!r}")
        return None
sys.meta_path.insert(0, NoOpenTelemetry())
"""


def python(code: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)


def test_enable_trace_without_the_packages_exits_2_naming_the_flag_and_the_extra():
    done = python(WITHOUT_OPENTELEMETRY + "from app.serve import main\nsys.exit(main(['--enable-trace']))")
    assert done.returncode == 2, done.stderr
    assert "error: --enable-trace needs the OpenTelemetry packages" in done.stderr
    assert "pip install 'app[trace]'" in done.stderr
    assert "No module named 'opentelemetry" in done.stderr


def test_without_enable_trace_the_same_machine_starts_checking_nothing():
    done = python(WITHOUT_OPENTELEMETRY + "from app.server_args import parse_server_args\n"
                  "args = parse_server_args([])\nprint(args.observability.enable_trace)")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"


def test_no_process_imports_opentelemetry_without_enable_trace():
    done = python(
        "import sys\n"
        "import app.serve, app.actors.tokenizer, app.actors.scheduler, app.actors.detokenizer\n"
        "from app.observability.settings import ObservabilitySettings\n"
        "from app.observability.tracing import actor_tracing, process_tracing\n"
        "settings = ObservabilitySettings()\n"
        "settings.validate()\n"
        "with process_tracing(settings, 'ingress') as tracing:\n"
        "    assert tracing is None\n"
        "with actor_tracing({'observability': settings.to_config()}, 'tokenizer') as tracing:\n"
        "    assert tracing is None\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'opentelemetry'))"
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


@pytest.mark.parametrize("endpoint", ["localhost:4318", "grpc://collector:4317", "http://", "/v1/traces"])
def test_an_endpoint_that_is_not_an_http_url_is_refused_naming_the_flag(endpoint):
    with pytest.raises(ValueError, match="--otlp-traces-endpoint must be an http:// or https:// URL"):
        ObservabilitySettings(enable_trace=True, otlp_traces_endpoint=endpoint).validate()


def test_the_endpoint_is_checked_only_with_enable_trace():
    ObservabilitySettings(otlp_traces_endpoint="not a url").validate()
    ObservabilitySettings(enable_trace=True, otlp_traces_endpoint="https://tempo.example:4318/v1/traces").validate()
