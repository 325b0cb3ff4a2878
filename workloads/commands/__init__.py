"""kvpool.workloads.commands: one module per workloads command (replay, price, report, trace)."""
