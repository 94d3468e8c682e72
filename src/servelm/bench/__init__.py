"""servelm bench: a load generator for any OpenAI-compatible server (servelm, vLLM, SGLang, llama.cpp).

    workload.py   requests, traffic classes, SLOs           profiles.py  voice / code / analytics / chat / mixed
    tokens.py     prompt text with exact token counts        trace.py     Mooncake-format trace replay
    arrivals.py   Poisson / gamma times (or closed loop)     runner.py    sends them, bounded, Ctrl-C safe
    client.py     one streamed request, measured             server_info.py  /v1/models, /metrics counters
    stats.py      percentiles, attainment, goodput           report.py / plots.py  run.json, summary.md, PNGs
    execute.py    one run end to end                         sweep.py     runs at several loads; the best one
    compare.py    two runs side by side                      cli.py       `servelm bench run | sweep | compare | report`

It talks to the server over HTTP only; servelm's extras (priority, the TTFT breakdown) are used
when the server is servelm and never required.
"""
