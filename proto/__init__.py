"""kvpool.proto."""
