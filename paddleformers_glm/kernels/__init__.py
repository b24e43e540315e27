"""Compiled kernels with Paddle-op fallbacks (see cpu.py)."""
