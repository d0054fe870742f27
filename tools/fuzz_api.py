"""Fuzz the HTTP API from its OpenAPI document with schemathesis: no 5xx, no failed check.

Runs schemathesis (4.x; not a dependency of the project: ``pip install schemathesis``) against a
running server (``--base-url``) or against ours, launched here with the flags after ``--``
(``app.server_process.ServerProcess``, as bench_serving.py does; stopped, with every process
reaped, at the end)::

    python tools/fuzz_api.py [--base-url URL] [--api-key KEY] [--admin-api-key KEY]
        [--max-examples 200] [--seed N] [--checks all] [--exclude-checks NAMES] [--phases NAMES]
        [--request-timeout 60] [--report-dir DIR] [-- SERVER FLAGS]
    python tools/fuzz_api.py --max-examples 50                   # ours, twice: without keys, with keys
    python tools/fuzz_api.py --base-url http://127.0.0.1:30000   # a running server, once
    python tools/fuzz_api.py -- --model-path /tmp/models/llama-3.2-1b --context-length 512

Runs. A launched server is fuzzed twice: first with no key configured (every route open), then
with both keys configured (``--api-key`` and ``--admin-api-key``, else ``$APP_API_KEY`` and
``$APP_ADMIN_API_KEY``, else random ones), handed to the server in its environment, never on a
command line; that server's OpenAPI document declares the bearer scheme, schemathesis sends the
admin key (it opens every route) and its ``ignored_auth`` check sends each operation's requests
again without a key and with a wrong one, expecting a 401. A running server (``--base-url``) is
fuzzed once, as it is configured, with the admin key (else the API key) when one is given. A
launched server's flags default to ``--context-length 256 --max-total-tokens 4096``, so that each
answer schemathesis generates (``max_tokens`` up to 2**31 - 1, ``n`` up to 16) stays short.

How. schemathesis's own command line (``python -m schemathesis.cli run``) in a subprocess, not
its Python API: in 4.x the Python API for one operation (``schemathesis.openapi.from_url(...)``,
``schema[path][method].as_strategy()``, ``case.call_and_validate()``) draws hypothesis examples
only, while the command line's engine (whose Python entry, ``schemathesis.engine``, is not a
public API) also runs the coverage phase, which sends every declared bound and one past it
(``le`` + 1, ``maxLength`` + 1: exactly what range validation must refuse), probes unsupported
methods and runs the stateful and auth checks. The document is fetched here (with the key: it
is not an open route) and handed over as a file; the key reaches schemathesis through its
environment and a ``schemathesis.toml`` that names the variable (``[auth.openapi.<scheme>]
bearer = "${APP_FUZZ_BEARER}"``), so it is on no command line and in no file, and schemathesis
filters it from its output and reports.

Report, per run and per operation (method and path, as declared): requests sent, those sent
without a key, answers by class (2xx, 4xx, 401, 5xx), and each failed check (schemathesis's
code and title: ``ST202 Schema-valid request rejected``...). A run fails on any 5xx answer, any
failed check or error schemathesis reports, schemathesis's own non-zero exit, a launched server
that stopped serving or logged a ``Traceback``, and, with keys, when no keyless request got a
401 (the auth checks did not run). Output: schemathesis's own on stderr, then a table per run on
stdout, then (the last line) one JSON object with every run; ``DIR/summary.json`` holds the same,
beside schemathesis's reports (``json-*.json``; ``junit-*.xml``: each failure with a command that
reproduces it, the first three of each operation also in our report; ``har-*.json``: every
request and answer). Exit code: 0 when every run passed, 1 on any failure, 2 when nothing could
be run (schemathesis missing, the server did not start, the document could not be fetched).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import secrets
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any, NamedTuple
from urllib.parse import urlsplit
from xml.etree import ElementTree

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from app.http.auth import ADMIN_API_KEY_ENV, API_KEY_ENV  # noqa: E402
from app.server_process import ServerProcess  # noqa: E402

DEFAULT_SERVER_FLAGS = ("--context-length", "256", "--max-total-tokens", "4096")
BEARER_ENV = "APP_FUZZ_BEARER"  # how the key reaches schemathesis (its config names it)
METHODS = ("get", "put", "post", "delete", "options", "head", "patch", "trace")


class CannotRun(Exception):
    """Nothing could be fuzzed: schemathesis is missing, no server, no document."""


class Run(NamedTuple):
    """One schemathesis run: against which server, with which key."""

    name: str  # "open", "keys" (a launched server) or "given" (--base-url)
    base_url: str
    bearer: str | None  # the key schemathesis sends


# ---------------------------------------------------------------- schemathesis


def require_schemathesis() -> str:
    """schemathesis's version; CannotRun when it is not installed or older than 4."""
    try:
        import schemathesis  # imported here: not a dependency of the project
    except ImportError:
        raise CannotRun("schemathesis is not installed: pip install schemathesis (4.x)") from None
    version = schemathesis.__version__
    if int(version.split(".")[0]) < 4:
        raise CannotRun(f"schemathesis {version} is too old: pip install 'schemathesis>=4,<5'")
    return version


def fetch_document(base_url: str, bearer: str | None, timeout: float) -> dict[str, Any]:
    headers = {"authorization": f"Bearer {bearer}"} if bearer else {}
    try:
        response = httpx.get(f"{base_url}/openapi.json", headers=headers, timeout=timeout)
        document = response.json()
    except (httpx.HTTPError, ValueError) as exc:
        raise CannotRun(f"GET {base_url}/openapi.json failed: {exc!r}") from None
    if response.status_code != 200 or not isinstance(document, dict) or "paths" not in document:
        raise CannotRun(f"GET {base_url}/openapi.json answered {response.status_code}: {response.text[:200]!r}")
    return document


def bearer_schemes(document: dict[str, Any]) -> list[str]:
    schemes = document.get("components", {}).get("securitySchemes", {})
    return [name for name, s in schemes.items() if s.get("type") == "http" and s.get("scheme", "").lower() == "bearer"]


# schemathesis hides the values of keys holding "token" or "key" in its output and reports, which
# hid max_tokens, min_tokens and stop_token_ids from every reproduction command: only credentials.
SANITIZATION = """[output.sanitization]
keys-to-sanitize = ["authorization", "proxy-authorization", "cookie", "set-cookie", "x-api-key"]
sensitive-markers = ["authorization", "cookie", "secret", "password", "credential"]
"""


def write_config(path: Path, document: dict[str, Any], with_key: bool) -> None:
    """schemathesis.toml: what its output hides; with a key, ``$APP_FUZZ_BEARER`` sent as each
    bearer scheme the document declares (so schemathesis knows it as the declared auth, and its
    auth checks use it), or as a plain Authorization header when it declares none."""
    sections = [SANITIZATION]
    if with_key:
        schemes = bearer_schemes(document)
        sections += [f'[auth.openapi.{name}]\nbearer = "${{{BEARER_ENV}}}"\n' for name in schemes]
        if not schemes:
            sections.append(f'[headers]\nAuthorization = "Bearer ${{{BEARER_ENV}}}"\n')
    path.write_text("\n".join(sections))  # names the variable only: the key itself is in no file


def schemathesis_command(args: argparse.Namespace, run: Run, document_path: Path, config: Path,
                         report_dir: Path) -> list[str]:
    command = [
        sys.executable, "-m", "schemathesis.cli", "--no-color", "--config-file", str(config),
        "run", str(document_path), "--url", run.base_url, "--checks", args.checks,
        "--max-examples", str(args.max_examples), "--seed", str(args.seed),
        "--request-timeout", str(args.request_timeout),
        "--report", "json,junit,har", "--report-dir", str(report_dir),
        "--continue-on-failure",  # a failed check must not end an operation's run before a 5xx is found
    ]
    if args.exclude_checks:
        command += ["--exclude-checks", args.exclude_checks]
    if args.phases:
        command += ["--phases", args.phases]
    return command


def fuzz(args: argparse.Namespace, run: Run, report_dir: Path) -> dict[str, Any]:
    """One schemathesis run; its report (``failed`` says whether anything went wrong)."""
    report_dir.mkdir(parents=True, exist_ok=True)
    document = fetch_document(run.base_url, run.bearer, args.request_timeout)
    document_path = report_dir / "openapi.json"
    document_path.write_text(json.dumps(document))
    config = report_dir / "schemathesis.toml"
    write_config(config, document, run.bearer is not None)
    env = dict(os.environ, **({BEARER_ENV: run.bearer} if run.bearer else {}))
    print(f"fuzz_api: run {run.name!r} against {run.base_url}, {args.max_examples} examples per operation, "
          f"seed {args.seed}, {'with' if run.bearer else 'without'} a key", file=sys.stderr, flush=True)
    # schemathesis's output goes to our stderr; hypothesis's files land in the report directory.
    finished = subprocess.run(schemathesis_command(args, run, document_path, config, report_dir),
                              stdout=sys.stderr, env=env, cwd=report_dir)
    return summarize(run, document, report_dir, finished.returncode, args)


# ---------------------------------------------------------------- the report


def _newest(report_dir: Path, pattern: str) -> dict[str, Any] | None:
    found = sorted(report_dir.glob(pattern))
    return json.loads(found[-1].read_text()) if found else None


_CASE_START = re.compile(r"^\d+\. Test Case ID: ", re.MULTILINE)
_STATUS = re.compile(r"^\[(\d{3})\] [^\n]*:\n\n\s*(.+)$", re.MULTILINE)


def failure_examples(report_dir: Path, limit: int = 3) -> dict[str, list[str]]:
    """Per operation, its first failing cases from the JUnit report: the checks that failed, the
    answer, and the command that reproduces it."""
    found = sorted(report_dir.glob("junit-*.xml"))
    if not found:
        return {}
    examples: dict[str, list[str]] = {}
    for testcase in ElementTree.parse(found[-1]).iter("testcase"):
        for failure in testcase:
            for case in _CASE_START.split(failure.text or "")[1:limit + 1]:
                codes = [line[2:] for line in case.splitlines() if line.startswith("- ")]
                status = _STATUS.search(case)
                answer = f"[{status.group(1)}] {status.group(2)[:200]}" if status else ""
                curl = next((line.strip() for line in case.splitlines() if line.strip().startswith("curl ")), "")
                examples.setdefault(testcase.get("name", "?"), []).append(
                    f"{'; '.join(codes)}: {answer} <- {curl[:600]}".strip())
    return examples


def declared_operations(document: dict[str, Any]) -> list[str]:
    return [f"{method.upper()} {path}" for path, item in document["paths"].items() for method in item
            if method in METHODS]


def _path_of(url: str, base_url: str) -> str:
    path = urlsplit(url).path
    base = urlsplit(base_url).path.rstrip("/")
    return path[len(base):] if base and path.startswith(base) else path


def count_requests(har: dict[str, Any] | None, base_url: str) -> dict[str, Counter[str]]:
    """Per ``METHOD PATH`` sent: requests, those without a key, answers by class."""
    counts: dict[str, Counter[str]] = {}
    for entry in (har or {}).get("log", {}).get("entries", []):
        request, status = entry["request"], entry["response"]["status"]
        tally = counts.setdefault(f"{request['method']} {_path_of(request['url'], base_url)}", Counter())
        tally["requests"] += 1
        if not any(h["name"].lower() == "authorization" for h in request["headers"]):
            tally["keyless"] += 1
        if status == 401:
            tally["401"] += 1
        elif status:
            tally[f"{status // 100}xx"] += 1
    return counts


def summarize(run: Run, document: dict[str, Any], report_dir: Path, exit_code: int,
              args: argparse.Namespace) -> dict[str, Any]:
    """The run's report: its operations' rows, and why it failed (``problems``)."""
    report = _newest(report_dir, "json-*.json")
    counts = count_requests(_newest(report_dir, "har-*.json"), run.base_url)
    failed_checks: dict[str, list[str]] = {}
    for failure in (report or {}).get("failures", []):
        for operation in failure.get("operations", []):
            failed_checks.setdefault(operation, []).append(f"{failure['code']} {failure['title']}")
    examples = failure_examples(report_dir)
    declared = declared_operations(document)
    operations = [operation_row(label, counts.get(label, Counter()), failed_checks.get(label, []),
                                examples.get(label, [])) for label in declared]
    # Requests with methods the document does not declare (schemathesis's unsupported_method probes).
    undeclared = sum((c for label, c in counts.items() if label not in declared), Counter())
    problems = report_problems(report, exit_code)
    problems += [f"{o['operation']}: {o['5xx']} answers 5xx" for o in operations if o["5xx"]]
    problems += [f"{o['operation']}: {check}" for o in operations for check in o["failures"]]
    problems += [f"{o['operation']}: e.g. {example}" for o in operations for example in o["examples"]]
    problems += [f"{label}: {check}" for label, checks in failed_checks.items() if label not in declared
                 for check in checks]
    if undeclared["5xx"]:
        problems.append(f"undeclared methods: {undeclared['5xx']} answers 5xx")
    if exit_code != 0 and not problems:
        problems.append(f"schemathesis exited with {exit_code}")
    if run.bearer and "ignored_auth" not in (args.exclude_checks or "") and not any(o["401"] for o in operations):
        problems.append("no request without the key was refused with a 401: the auth checks did not run")
    return {"run": run.name, "base_url": run.base_url, "with_key": run.bearer is not None,
            "schemathesis_exit_code": exit_code, "operations": operations,
            "undeclared_methods": {"requests": undeclared["requests"], "5xx": undeclared["5xx"]},
            "problems": problems, "failed": bool(problems), "report_dir": str(report_dir)}


def operation_row(label: str, tally: Counter[str], failures: list[str], examples: list[str]) -> dict[str, Any]:
    return {"operation": label, "requests": tally["requests"], "keyless": tally["keyless"], "2xx": tally["2xx"],
            "4xx": tally["4xx"], "401": tally["401"], "5xx": tally["5xx"], "failures": failures,
            "examples": examples}


def report_problems(report: dict[str, Any] | None, exit_code: int) -> list[str]:
    """What schemathesis's JSON report says went wrong besides failed checks."""
    if report is None:
        return [f"schemathesis wrote no report (exit code {exit_code})"]
    problems = [f"schemathesis error: {e['title']} ({e['count']}x)" for e in report.get("errors", [])]
    if not report.get("complete", True):
        problems.append(f"schemathesis stopped early: {report.get('stop_reason')}")
    return problems


def server_problems(server: ServerProcess, url: str) -> list[str]:
    """A launched server after a run: it must still serve, with no traceback in its log."""
    problems = []
    try:
        health = httpx.get(f"{url}/health", timeout=10).status_code
    except httpx.HTTPError as exc:
        health = repr(exc)
    if server.popen.poll() is not None or health != 200:
        problems.append(f"the server stopped serving (exit code {server.popen.poll()}, /health {health})")
    log = list(server.lines)
    tracebacks = sum("Traceback" in line for line in log)
    if tracebacks:
        errors = [line for line in log if " ERROR " in line][:5]
        problems.append(f"the server logged {tracebacks} traceback(s): " + " | ".join(errors))
    return problems


COLUMNS = ("requests", "keyless", "2xx", "4xx", "401", "5xx")


def table(result: dict[str, Any]) -> str:
    """The run's operations, one row each, then its problems."""
    rows = [["operation", *COLUMNS, "failed checks"]]
    rows += [[o["operation"], *(str(o[c]) for c in COLUMNS), ", ".join(o["failures"]) or "-"]
             for o in result["operations"]]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    lines = ["  ".join([row[0].ljust(widths[0]), *(c.rjust(w) for c, w in zip(row[1:-1], widths[1:])), row[-1]])
             for row in rows]
    verdict = "FAILED" if result["failed"] else "passed"
    head = f"run {result['run']!r} ({'with' if result['with_key'] else 'without'} a key): {verdict}"
    return "\n".join([head, *lines, *(f"  problem: {p}" for p in result["problems"])])


# ---------------------------------------------------------------- main


def launched_runs(args: argparse.Namespace, report_dir: Path) -> list[dict[str, Any]]:
    """Our server twice: without keys, then with both keys in its environment."""
    api_key = args.api_key or secrets.token_urlsafe(24)
    admin_key = args.admin_api_key or secrets.token_urlsafe(24)
    flags = args.server_args or list(DEFAULT_SERVER_FLAGS)
    results = []
    for name, env, bearer in (("open", {API_KEY_ENV: "", ADMIN_API_KEY_ENV: ""}, None),
                              ("keys", {API_KEY_ENV: api_key, ADMIN_API_KEY_ENV: admin_key}, admin_key)):
        with ServerProcess(*flags, env=env) as server:
            try:
                url = server.wait_serving()
            except RuntimeError as exc:
                raise CannotRun(str(exc)) from None
            result = fuzz(args, Run(name, url, bearer), report_dir / name)
            if extra := server_problems(server, url):
                result["problems"] += extra
                result["failed"] = True
        results.append(result)
    return results


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--base-url", help="a running server (default: launch ours with the flags after --)")
    # The keys' defaults are read after parsing: --help shows defaults, and a key must never show.
    add("--api-key", help=f"the API key (default: ${API_KEY_ENV}, better than a flag, which ps shows; "
        "launched: a random one)")
    add("--admin-api-key", help=f"the admin key (default: ${ADMIN_API_KEY_ENV}; launched: a random one)")
    add("--max-examples", type=int, default=200, help="test cases per operation and phase (default: %(default)s)")
    add("--seed", type=int, default=None, help="schemathesis's seed (default: a random one, reported)")
    add("--checks", default="all", help="schemathesis's checks, comma-separated (default: %(default)s)")
    add("--exclude-checks", default=None, help="checks to skip, comma-separated")
    add("--phases", default=None,
        help="schemathesis's phases, comma-separated (default: examples,coverage,fuzzing,stateful)")
    add("--request-timeout", type=float, default=60.0, help="seconds per request (default: %(default)s)")
    add("--report-dir", type=Path, default=None,
        help="where the reports go (default: a new directory in the temporary directory)")
    add("server_args", nargs="*",
        help=f"after --: flags for `python -m app serve` (default: {' '.join(DEFAULT_SERVER_FLAGS)})")
    args = parser.parse_args(argv)
    if args.max_examples < 1:
        parser.error("--max-examples must be at least 1")
    if args.base_url and args.server_args:
        parser.error("server flags after -- only apply when launching ours (no --base-url)")
    args.api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    args.admin_api_key = args.admin_api_key or os.environ.get(ADMIN_API_KEY_ENV) or None
    if args.seed is None:
        args.seed = random.randrange(2**31)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    report_dir = args.report_dir or Path(tempfile.mkdtemp(prefix="fuzz-api-"))
    try:
        version = require_schemathesis()
        if args.base_url:
            given = Run("given", args.base_url.rstrip("/"), args.admin_api_key or args.api_key)
            results = [fuzz(args, given, report_dir / given.name)]
        else:
            results = launched_runs(args, report_dir)
    except CannotRun as exc:
        print(f"fuzz_api: cannot run: {exc}", file=sys.stderr)
        return 2
    summary = {"schemathesis_version": version, "seed": args.seed, "max_examples": args.max_examples,
               "failed": any(r["failed"] for r in results), "runs": results}
    (report_dir / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    for result in results:
        print(table(result) + "\n")
    print(f"reports in {report_dir}; seed {args.seed}")
    print(json.dumps(summary))
    return 1 if summary["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
