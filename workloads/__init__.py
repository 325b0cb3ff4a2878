"""kvpool.workloads."""
