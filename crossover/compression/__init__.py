"""Gradient compressors and their kernels (framework code lives here)."""
