"""Adapters that put kvpool's store behind other serving engines (``kvpool.integrations.<engine>``)."""
