"""The torch reference of ``glm52 align`` (the ``reference`` extra: torch + transformers).

* :mod:`.train`: the reference training run, HF transformers' ``GlmMoeDsaForCausalLM`` plus the
  MTP layers from HF's building blocks, torch AdamW, one process
  (``python -m paddleformers_glm.parity.reference.train``);
* :mod:`.topk_gaps`: the margin of every top-k decision HF makes (indexer and router), shared with
  the fixture generator tools/make_reference.py.

Importing this package needs neither torch nor transformers: they are imported inside the
functions that use them.
"""
