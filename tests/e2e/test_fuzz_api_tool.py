"""tools/fuzz_api.py as a real subprocess: schemathesis against two launched servers, one without
keys and one with both; skipped where schemathesis (not a dependency of the project) is missing.

One run of the tool serves both tests: the first checks the tool (its report, its exit code, the
auth checks it must exercise, no key in any output), the second the server (schemathesis finds
nothing).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from server import tool_args_with_shared_gpu_pool

pytest.importorskip("schemathesis")

ROOT = Path(__file__).resolve().parents[2]
KEYS = {"APP_API_KEY": "fuzz-tool-test-api-key-5b1e", "APP_ADMIN_API_KEY": "fuzz-tool-test-admin-key-93c0"}
# The fuzzing phase alone, 3 cases an operation: the tool's test, not a thorough fuzzing (whose
# coverage phase alone sends hundreds of requests an operation).
FLAGS = ("--max-examples", "3", "--phases", "fuzzing", "--seed", "1")
SERVER_FLAGS = ("--context-length", "128", "--max-total-tokens", "4096")


@pytest.fixture(scope="module")
def tool_run(cache_dir, tmp_path_factory) -> tuple[subprocess.CompletedProcess, dict, Path]:
    """The tool's finished process, its report (the last stdout line) and its report directory;
    the keys come from the environment, as an operator's would."""
    report_dir = tmp_path_factory.mktemp("fuzz-api")
    args = tool_args_with_shared_gpu_pool((*FLAGS, "--report-dir", str(report_dir), "--", *SERVER_FLAGS))
    env = dict(os.environ, APP_CACHE_DIR=str(cache_dir), **KEYS)
    result = subprocess.run([sys.executable, str(ROOT / "tools" / "fuzz_api.py"), *args],
                            capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode in (0, 1), result.stderr[-3000:]  # 2: it could not run at all
    return result, json.loads(result.stdout.strip().splitlines()[-1]), report_dir


def test_the_tool_fuzzes_every_operation_without_and_with_keys_and_reports_it(tool_run):
    result, summary, report_dir = tool_run
    assert result.returncode == (1 if summary["failed"] else 0)
    assert summary["failed"] == any(run["failed"] for run in summary["runs"])
    assert json.loads((report_dir / "summary.json").read_text()) == summary
    assert [run["run"] for run in summary["runs"]] == ["open", "keys"]
    for run in summary["runs"]:
        operations = {o["operation"]: o for o in run["operations"]}
        assert {"POST /v1/completions", "POST /v1/chat/completions", "POST /generate", "POST /abort_request",
                "GET /health", "GET /openapi.json"} <= set(operations), run["run"]
        assert all(o["requests"] > 0 for o in run["operations"]), run["operations"]
        assert run["failed"] == bool(run["problems"])
        assert f"run {run['run']!r}" in result.stdout  # its table
    open_run, keys_run = summary["runs"]
    assert not open_run["with_key"] and keys_run["with_key"]
    # Without keys no request carries one and none is refused for it; with keys the auth checks
    # sent requests without the key or with a wrong one, and /health, open, was never refused.
    assert all(o["keyless"] == o["requests"] and o["401"] == 0 for o in open_run["operations"])
    keyed = {o["operation"]: o for o in keys_run["operations"]}
    assert sum(o["401"] for o in keyed.values()) > 0 and keyed["GET /health"]["401"] == 0
    # The keys are in no output and no report.
    reports = [path.read_text(errors="replace") for path in report_dir.rglob("*") if path.is_file()]
    texts = [result.stdout, result.stderr, *reports]
    assert not [key for key in KEYS.values() for text in texts if key in text]


# "Schema-valid request rejected": refusals the document cannot declare, since they depend on the
# model (a token id past its vocabulary, a chat role its template refuses) or on JSON Schema's
# "integer" taking 1.0, which the server refuses as a float (docs/security.md, "Fuzzing").
MODEL_DEPENDENT = "ST202"


def test_the_server_passes_schemathesis(tool_run):
    _, summary, _ = tool_run
    problems = [f"{run['run']}: {problem}" for run in summary["runs"] for problem in run["problems"]
                if MODEL_DEPENDENT not in problem]
    assert not problems, "\n".join(problems)
    for run in summary["runs"]:
        assert sum(o["5xx"] for o in run["operations"]) == 0 and run["undeclared_methods"]["5xx"] == 0
