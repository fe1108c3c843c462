"""Strata: a compiler and runtime for Mixture-of-Experts language models."""

__version__ = "0.1.0"
