"""Helpers for the multi-process tests (scripts run under paddle.distributed.launch)."""
