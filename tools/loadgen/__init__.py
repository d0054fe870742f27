"""The parts of tools/bench_serving.py: one streamed request and its figures (``stream``), the
client processes that send a level's requests (``procs``), and the offline engine's run on the
same workload (``offline``)."""
