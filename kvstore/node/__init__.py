"""kvpool.kvstore.node."""
