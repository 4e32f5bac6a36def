"""Ready-made model pairs that are not the toy demo (see docs/models.md).

``python -m model_zoo --out models/smollm2`` builds the SmolLM2 pair; ``build.build()`` is the API;
``hf_draft.load_causal_lm()`` loads a reduced-vocabulary draft into transformers.
"""
