"""SGLang HiCache storage backend contract tests (run in .venv-vllm by `make test`)."""
