"""The detokenizer actor: token ids in, text out; applies stop strings.

The work itself is app.text.detokenization (which the offline Engine runs too); this actor
moves its inputs and outputs: StepOutputs in, TextBatches to the ingress (cut to fit the
channel), stop-string hits to the scheduler, control replies passed on.
"""

from __future__ import annotations

import sys
from typing import Any

from app.actors.child import ReadyCallback, run_actor
from app.actors.endpoints import Endpoints
from app.actors.faults import FaultPlan, around
from app.actors.heartbeat import Heartbeat, beating
from app.ipc.trace import RequestTrace
from app.ipc.batching import batches_under, text_output_size
from app.ipc.messages import ControlReply, MetricsSnapshot, StepOutput, TextBatch
from app.observability.actor_metrics import DetokenizerMetrics, PublishingInbox, enabled
from app.observability.logs import get_logger
from app.observability.tracing import actor_tracing
from app.observability.request_log import DetokenizerRequestLog
from app.observability.settings import ObservabilitySettings
from app.text.detokenization import Detokenization
from app.text.tokenizer import Tokenizer


async def detokenizer_main(config: dict[str, Any], ready: ReadyCallback) -> None:
    log = get_logger()
    trace = RequestTrace.from_env("detokenizer")
    request_log = DetokenizerRequestLog.for_settings(ObservabilitySettings.from_config(config.get("observability")))
    detokenize = Detokenization(Tokenizer.from_dir(config["model_path"]))
    with Endpoints("detokenizer", config["channels"]) as channels, actor_tracing(config, "detokenizer") as tracing:
        if tracing is not None:  # --enable-trace: a span per traced request
            from app.observability.text_spans import TracedDetokenization

            detokenize = TracedDetokenization(detokenize, tracing)
        inbox = channels.receivers["to_detokenizer"]
        to_ingress = channels.senders["detokenizer_to_ingress"]
        to_scheduler = channels.senders["detokenizer_to_scheduler"]
        ready({})
        process = detokenize.process
        if enabled(config):  # --enable-metrics: steps timed, snapshots sent while the inbox is read
            metrics = DetokenizerMetrics()
            process, inbox = metrics.timed(process), PublishingInbox(inbox, metrics, to_ingress.send)
        process = around(FaultPlan.from_env("detokenizer"), "output", process)  # $APP_FAULT: tests only
        async for message in beating(inbox, Heartbeat.from_config(config)):  # the watchdog sees each message
            if isinstance(message, StepOutput):
                trace.mark("detokenizer.recv", "", len(message.outputs))
                texts, hits = process(message.outputs)
                if request_log is not None:
                    request_log.outputs(texts)
                for part in batches_under(texts, text_output_size, to_ingress.max_message_bytes // 2):
                    await to_ingress.send(TextBatch(tuple(part)))
                trace.mark("detokenizer.sent", "", len(texts))
                for hit in hits:
                    await to_scheduler.send(hit)
            elif isinstance(message, (ControlReply, MetricsSnapshot)):  # the scheduler's snapshots pass on
                await to_ingress.send(message)
        log.info("scheduler closed its channel: stopping")


def main() -> None:
    run_actor(sys.argv[-1].removeprefix("app::"), detokenizer_main)


if __name__ == "__main__":
    main()
