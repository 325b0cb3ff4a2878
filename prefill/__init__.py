"""kvpool.prefill."""
