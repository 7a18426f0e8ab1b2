# The two fresh-machine commands (README): `make demo` and `make test`. Both set up .venv first.
.PHONY: setup demo test

setup:
	@scripts/setup.sh

demo: setup
	.venv/bin/mm3-compile demo $(ARGS)

test: setup
	.venv/bin/python -m pytest -q -n 2 $(ARGS)
