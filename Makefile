# The two fresh-machine commands (README): `make demo` and `make test`. Both set up .venv first.
# `make lint` is what CI (.ci/run) runs before the tests, and what the pre-commit hooks run.
.PHONY: setup demo test lint

setup:
	@scripts/setup.sh

demo: setup
	.venv/bin/mm3-compile demo $(ARGS)

test: setup
	.venv/bin/python -m pytest -q -n 2 --dist worksteal $(ARGS)

lint: setup
	.venv/bin/ruff check .
	.venv/bin/ruff format --check .
