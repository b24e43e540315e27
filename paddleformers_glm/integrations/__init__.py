"""Bridges to other libraries, each opt-in through one documented call (nothing registers itself on
import): ``integrations.paddleformers.register()`` for PaddleFormers' Auto classes and Trainer."""
