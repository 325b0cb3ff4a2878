"""kvpool.runtime: what every kvpool process shares: its lifecycle (readiness line, signals, /metrics) and
the one spawner that starts kvpool processes as children."""
