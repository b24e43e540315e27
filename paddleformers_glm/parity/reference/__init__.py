"""The torch reference of ``glm52 align`` (the ``reference`` extra: torch + transformers): :mod:`.train`
the training run, :mod:`.indexer` its indexer training, :mod:`.topk_gaps` the top-k margins (shared
with the fixture generator tools/make_reference.py).  Importing it needs neither torch nor
transformers: they are imported inside the functions that use them.
"""
