"""tests.harness."""
