"""Tandem's benchmark harness: `python -m bench --help` (or `make bench`).

workload.py  prompts cut from the held-out corpus files, the loads (closed loop, Poisson)
client.py    streaming HTTP client (SSE chunk arrival times), closed- and open-loop drivers
prom.py      /metrics scrapes and their deltas
anchor.py    transformers `generate(assistant_model=draft)` on the same pair
stats.py     per config x load summaries, the correctness check, the summary ratios
report.py    markdown tables and JSON; plots.py: PNG plots (matplotlib, imported lazily)
"""
