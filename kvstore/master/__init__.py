"""kvpool.kvstore.master."""
