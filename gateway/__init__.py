"""kvpool.gateway."""
