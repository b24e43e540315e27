"""Hybrid-parallel primitives (TP / SP / EP / ETP groups, layers and collectives) that run on CPU
gloo and GPU NCCL; see docs/parallel.md. Import the modules themselves (``parallel.topology``,
``parallel.layers``, ``parallel.comm``, ...): this package file imports nothing, so importing one
primitive does not load the training machinery.
"""
