"""Tandem's benchmark harness: `python -m bench --help` (or `make bench`).

__main__.py  flags, and what a run does         suite.py    one run: pairs x modes x configs x loads
pairs.py     a pair directory and its facts      plans.py    per-pair plans (loads, mix) and thresholds
modes.py     shared / two-device (taskset pins)  workloads/  named prompt sources: code, chat (add more here)
runner.py    one config's stack and its loads    client.py   streaming HTTP client, closed/open-loop drivers
prom.py      /metrics scrapes and their deltas   anchor.py   transformers generate(assistant_model=draft)
stats.py     configs, summaries, correctness     figures.py  the issues' figures, each against its threshold
report.py    results.json/.md, samples.json      plots.py    PNG plots per pair x mode (matplotlib, lazily)
"""
