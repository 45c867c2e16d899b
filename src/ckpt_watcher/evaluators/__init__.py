"""Evaluators run inside worker processes only: they import torch, lm-eval and the backends."""
