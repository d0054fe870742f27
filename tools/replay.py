"""Re-send a crash dump's requests to a server, with their original relative timing.

    python tools/replay.py DUMP --url URL [--speed X] [--api-key KEY] [--json]

To reproduce a crash: the requests a dump recorded (those finished in the five minutes before
the crash and those in flight at it, one per request id) go to the server at URL in the order
and at the offsets they originally arrived, ``--speed`` times faster (2: twice as fast). Each
is sent as it was given where the dump has it (the text, the token ids, or the chat messages,
with its sampling parameters, priority and stream flag): token ids and text to ``/generate``,
chat messages to ``/v1/chat/completions``. A request the dump recorded without its input
(``--log-requests-level`` below 2) or without an arrival time (the server's warm-up) is
skipped, and counted. The report says what came back for each request: the status, the
finish reason or the error, the time; the last line is a JSON summary. Exit 0 when every
request got an answer (an error status included), 1 when some got none (the server went
away: the crash reproduced?), 2 for a file that is not a crash dump.

The key, when the server needs one: ``--api-key`` or $APP_API_KEY.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import trio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from app.observability.crash_dump import read_crash_dump  # noqa: E402

# SamplingParams fields that /generate's sampling_params takes under the same name.
_SAME_NAME = ("min_new_tokens", "temperature", "top_p", "top_k", "min_p", "frequency_penalty", "presence_penalty",
              "repetition_penalty", "stop", "stop_token_ids", "ignore_eos", "skip_special_tokens", "waiting_timeout",
              "timeout")
# ... and those the chat route takes (OpenAI's names first).
_CHAT_NAMES = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
               "frequency_penalty": "frequency_penalty", "presence_penalty": "presence_penalty",
               "repetition_penalty": "repetition_penalty", "stop": "stop", "stop_token_ids": "stop_token_ids",
               "ignore_eos": "ignore_eos", "skip_special_tokens": "skip_special_tokens", "seed": "seed",
               "min_new_tokens": "min_tokens", "waiting_timeout": "waiting_timeout", "timeout": "timeout"}


def requests_of(dump: dict[str, Any]) -> tuple[list[dict[str, Any]], Counter]:
    """The dump's requests that can be re-sent, by arrival; and how many were skipped, by why."""
    by_rid: dict[str, dict[str, Any]] = {}
    for record in dump.get("recent_requests") or []:
        if isinstance(record, dict) and "rid" in record:
            by_rid[record["rid"]] = record
    for record in dump.get("pending_requests") or []:  # the ingress's record has the client's own input
        if isinstance(record, dict) and "rid" in record:
            scheduler_view = by_rid.get(record["rid"]) or {}
            by_rid[record["rid"]] = {**scheduler_view, **record}
    chosen, skipped = [], Counter()
    for record in by_rid.values():
        if not record.get("arrival_time"):
            skipped["no arrival time (warm-up)"] += 1
        elif not any(key in record for key in ("text", "input_ids", "messages")):
            skipped["no input recorded (--log-requests-level < 2)"] += 1
        elif record.get("input_cut"):
            skipped["input cut (--log-requests-level 2 keeps 2048)"] += 1
        else:
            chosen.append(record)
    return sorted(chosen, key=lambda r: r["arrival_time"]), skipped


def generate_body(record: dict[str, Any]) -> dict[str, Any]:
    """The /generate body that asks for what ``record`` asked for."""
    sampling = record.get("sampling") or {}
    params = {name: sampling[name] for name in _SAME_NAME if name in sampling}
    if sampling.get("max_new_tokens_given", True) and "max_new_tokens" in sampling:
        params["max_new_tokens"] = sampling["max_new_tokens"]
    elif sampling.get("max_new_tokens_given", True):
        params["max_new_tokens"] = 128  # SamplingParams' default, omitted from the dump as a default
    if "seed" in sampling:
        params["sampling_seed"] = sampling["seed"]
    if sampling.get("logit_bias"):
        params["logit_bias"] = {str(token): bias for token, bias in sampling["logit_bias"]}
    body: dict[str, Any] = {"sampling_params": params, "stream": bool(record.get("stream"))}
    if "text" in record:
        body["text"] = record["text"]
    else:
        body["input_ids"] = record["input_ids"]
    if sampling.get("logprobs"):
        body["return_logprob"] = True
        body["top_logprobs_num"] = sampling.get("top_logprobs", 0)
    if record.get("priority"):
        body["priority"] = record["priority"]
    return body


def chat_body(record: dict[str, Any], model: str) -> dict[str, Any]:
    """The /v1/chat/completions body that asks for what ``record`` asked for."""
    sampling = record.get("sampling") or {}
    body: dict[str, Any] = {"model": model, "messages": record["messages"], "stream": bool(record.get("stream"))}
    body.update({ours: sampling[name] for name, ours in _CHAT_NAMES.items() if name in sampling})
    if sampling.get("max_new_tokens_given", True):
        body["max_completion_tokens"] = sampling.get("max_new_tokens", 128)
    if sampling.get("logit_bias"):
        body["logit_bias"] = {str(token): bias for token, bias in sampling["logit_bias"]}
    if record.get("priority"):
        body["priority"] = record["priority"]
    return body


async def send_one(client: httpx.AsyncClient, record: dict[str, Any], model: str) -> dict[str, Any]:
    """Send one request; what came back (the status, the finish or error, seconds, stream events)."""
    chat = "messages" in record
    path, body = ("/v1/chat/completions", chat_body(record, model)) if chat else ("/generate", generate_body(record))
    started = time.perf_counter()
    result: dict[str, Any] = {"rid": record["rid"], "route": path}
    try:
        if body["stream"]:
            events: list[str] = []
            async with client.stream("POST", path, json=body) as response:
                result["status"] = response.status_code
                async for line in response.aiter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
            result["events"] = len(events)
            errors = [e for e in events if e.startswith('{"error"') or '"error":' in e[:20]]
            result["error"] = json.loads(errors[-1])["error"].get("message") if errors else None
            result["complete"] = bool(events) and events[-1] == "[DONE]"
        else:
            response = await client.post(path, json=body)
            result["status"] = response.status_code
            answer = response.json()
            if response.status_code >= 400:
                result["error"] = answer.get("message") or answer.get("error", {}).get("message")
            elif chat:
                result["finish"] = answer["choices"][0]["finish_reason"]
                result["output_tokens"] = answer["usage"]["completion_tokens"]
            else:
                answer = answer[0] if isinstance(answer, list) else answer
                result["finish"] = answer["meta_info"]["finish_reason"]["type"]
                result["output_tokens"] = answer["meta_info"]["completion_tokens"]
    except httpx.HTTPError as exc:
        result["status"] = None
        result["error"] = f"no answer: {exc!r}"
    result["seconds"] = round(time.perf_counter() - started, 3)
    return result


async def replay(url: str, records: list[dict[str, Any]], speed: float, api_key: str | None,
                 timeout: float) -> list[dict[str, Any]]:
    """Send ``records`` at their relative arrival times (divided by ``speed``); the results, in order."""
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    results: list[dict[str, Any] | None] = [None] * len(records)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=timeout, limits=limits) as client:
        model = "default"
        if any("messages" in record for record in records):
            model = (await client.get("/v1/models")).json()["data"][0]["id"]
        start = trio.current_time()
        first = records[0]["arrival_time"] if records else 0.0

        async def at_its_time(index: int, record: dict[str, Any]) -> None:
            await trio.sleep_until(start + (record["arrival_time"] - first) / speed)
            results[index] = await send_one(client, record, model)

        async with trio.open_nursery() as nursery:
            for index, record in enumerate(records):
                nursery.start_soon(at_its_time, index, record)
    return [result for result in results if result is not None]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dump", type=Path, metavar="DUMP", help="a crash dump (crash_dump_*.json)")
    parser.add_argument("--url", required=True, help="the server to send to, e.g. http://127.0.0.1:30000")
    parser.add_argument("--speed", type=float, default=1.0, help="replay this many times faster than the original")
    parser.add_argument("--api-key", default=os.environ.get("APP_API_KEY"), help="the server's key ($APP_API_KEY)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds each request may take")
    parser.add_argument("--json", action="store_true", help="one JSON line per request instead of a table")
    options = parser.parse_args(argv)
    if not options.speed > 0:
        parser.error(f"--speed must be positive, got {options.speed}")
    try:
        dump = read_crash_dump(options.dump)
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    records, skipped = requests_of(dump)
    results = trio.run(replay, options.url.rstrip("/"), records, options.speed, options.api_key, options.timeout)
    for result in results:
        if options.json:
            print(json.dumps(result))
        else:
            outcome = result.get("finish") or result.get("error") or ""
            print(f"{str(result['status']):>4} {result['seconds']:8.3f}s {result['route']:<22} {result['rid']}  {outcome}")
    statuses = Counter(str(result["status"]) for result in results)
    unanswered = statuses.get("None", 0)
    print(json.dumps({"sent": len(results), "statuses": dict(statuses), "unanswered": unanswered,
                      "skipped": dict(skipped)}))
    return 1 if unanswered else 0


if __name__ == "__main__":
    sys.exit(main())
