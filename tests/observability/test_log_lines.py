"""The line writer: whole lines from many threads of one process (longer than PIPE_BUF), library
warnings, stdlib records and text printed to sys.stderr as JSON lines, and an actor's non-JSON
stderr wrapped into JSON by the process that forwards it.

A process configures logging once for good, so the multi-threaded case runs in a child process
whose stderr is a pipe, as an actor's is.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from app.observability.logs import LineWriter

ROOT = Path(__file__).resolve().parents[2]
THREADS, LINES, PAYLOAD = 8, 40, 20_000

_CHILD = textwrap.dedent(f"""
    import logging, threading, warnings
    from app.observability.logs import configure_logging, get_logger

    configure_logging("writer_test", "info", json=True)
    log = get_logger()
    barrier = threading.Barrier({THREADS})

    library = logging.getLogger("some.library")

    def work(n):
        barrier.wait()
        for i in range({LINES}):
            if n % 2:  # half the threads through the standard library, as libraries log
                library.info("long record %d %d %s", n, i, chr(65 + n) * {PAYLOAD})
            else:
                log.info("long line", thread=n, i=i, payload=chr(65 + n) * {PAYLOAD})

    threads = [threading.Thread(target=work, args=(n,)) for n in range({THREADS})]
    for t in threads:
        t.start()
    library.warning("a stdlib record with %s", "arguments")
    warnings.warn("a library's warning", DeprecationWarning, stacklevel=1)
    for t in threads:
        t.join()
    import sys
    log.info("odd text", text="a lone surrogate \\udcff", big=2**70)  # what msgspec refuses: still a line
    print("a plain print to stderr", file=sys.stderr)
    failing = threading.Thread(target=lambda: 1 / 0)
    failing.start()
    failing.join()
""")


def test_threads_write_whole_json_lines_longer_than_pipe_buf_and_warnings_become_lines():
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONWARNINGS="always")
    done = subprocess.run([sys.executable, "-c", _CHILD], cwd=ROOT, env=env, capture_output=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stderr.decode().splitlines()
    records = [json.loads(line) for line in lines]  # every line is whole JSON
    seen = set()
    for record in records:
        if record["event"] == "long line":
            thread, i, payload = record["thread"], record["i"], record["payload"]
        elif record["event"].startswith("long record "):
            _, _, thread, i, payload = record["event"].split(" ")
            thread, i = int(thread), int(i)
            assert record["logger"] == "some.library"
        else:
            continue
        assert payload == chr(65 + thread) * PAYLOAD  # nothing of another thread inside
        assert record["actor"] == "app::writer_test" and record["level"] == "info"
        seen.add((thread, i))
    assert len(seen) == THREADS * LINES
    stdlib = [r for r in records if r.get("logger") == "some.library" and r["level"] == "warning"]
    assert [r["event"] for r in stdlib] == ["a stdlib record with arguments"] and stdlib[0]["level"] == "warning"
    warned = [r for r in records if r.get("logger") == "py.warnings"]
    assert len(warned) == 1 and "DeprecationWarning: a library's warning" in warned[0]["event"]
    assert warned[0]["actor"] == "app::writer_test"
    odd = [r for r in records if r["event"] == "odd text"]
    assert len(odd) == 1 and odd[0]["text"] == "a lone surrogate \udcff" and odd[0]["big"] == 2**70
    printed = [r["event"] for r in records if r.get("logger") == "stderr"]  # sys.stderr, line by line
    assert printed[0] == "a plain print to stderr"
    assert printed[1].startswith("Exception in thread") and printed[-1] == "ZeroDivisionError: division by zero"


def _read_lines(fd: int) -> list[str]:
    return os.read(fd, 1 << 20).decode().splitlines()


def test_forwarded_lines_are_wrapped_into_json_in_json_mode_only():
    read, write = os.pipe()
    try:
        writer = LineWriter(write)
        writer.json = True
        own = json.dumps({"event": "already json", "actor": "app::tokenizer", "pid": 7})
        writer.forward(own, source="app::tokenizer", pid=7)
        writer.forward("Fatal Python error: Segmentation fault", source="app::scheduler_TP0", pid=42)
        writer.forward('{"half": "a json line cut', source="app::detokenizer", pid=9)
        first, second, third = _read_lines(read)
        assert first == own
        wrapped = json.loads(second)
        assert wrapped["event"] == "Fatal Python error: Segmentation fault"
        assert wrapped["actor"] == "app::scheduler_TP0" and wrapped["pid"] == 42 and wrapped["logger"] == "stderr"
        assert wrapped["timestamp"].endswith("Z") and wrapped["level"] == "warning"
        assert json.loads(third)["event"] == '{"half": "a json line cut'
        writer.json = False
        writer.forward("plain text stays plain", source="app::tokenizer", pid=7)
        assert _read_lines(read) == ["plain text stays plain"]
    finally:
        os.close(read)
        os.close(write)


def test_a_line_to_a_closed_reader_is_dropped_without_raising():
    read, write = os.pipe()
    os.close(read)
    try:
        LineWriter(write).write_line("nobody reads this")  # EPIPE (SIGPIPE is ignored by Python)
    finally:
        os.close(write)


def test_every_example_line_of_the_logging_page_is_json_with_the_keys_every_line_has():
    page = (ROOT / "docs" / "logging.md").read_text()
    blocks = page.split("```json\n")[1:]
    examples = [json.loads(block.split("\n```", 1)[0]) for block in blocks]
    events = {example["event"] for example in examples}
    assert {"http", "request arrived", "request tokenized", "request admitted", "request first token",
            "request retracted", "request finished", "request detokenized", "Prefill batch", "Decode batch"} <= events
    for example in examples:
        assert {"event", "level", "timestamp", "actor", "pid"} <= example.keys(), example
        if example["event"].startswith("request "):
            assert example["rid"], example
        for key in example:  # each key of an example is named in the page's tables
            assert f"`{key}`" in page, key
