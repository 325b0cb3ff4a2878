"""kvpool.kvstore.transport."""
