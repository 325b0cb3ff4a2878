"""Plain-Python references the compiled code is checked against (as fla keeps ``naive.py`` beside its
kernels)."""
