# The commands of the quick start. Each creates .venv and installs commjax into it the
# first time (with the extras it needs, at the versions pinned in .ci/lowest-versions.txt:
# the floors of pyproject.toml), then runs.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
CONSTRAINTS ?= .ci/lowest-versions.txt
STAMP := $(VENV)/.commjax-installed
DOCS_STAMP := $(VENV)/.commjax-docs-installed

.PHONY: demo test docs bench clean

$(STAMP): pyproject.toml $(CONSTRAINTS)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c $(CONSTRAINTS) -e '.[test,examples]'
	touch $(STAMP)

# The docs toolchain is its own extra, so `make test` stays as light as it was.
$(DOCS_STAMP): $(STAMP)
	$(PY) -m pip install --quiet -c $(CONSTRAINTS) -e '.[docs]'
	touch $(DOCS_STAMP)

demo: $(STAMP)
	$(PY) examples/demo.py

# Two workers (one per core of the CI machine), one test file each at a time, so a
# file's module fixtures are built once; the slowest files start first (tests/conftest.py).
# Every test but those marked exact_codegen compiles with XLA's faster CPU emitters, then
# those run with the default ones (tests/xla_flags.py). Fails if either run fails; exit
# status 5 (no test collected) if either collected nothing. The second run collects only
# the files that mark a test. --capture=sys: what XLA's C++
# code writes to stderr reaches the log (a worker that aborted left no message when
# pytest captured file descriptor 2 into a file that died with it).
PYTEST := $(PY) -m pytest -q -n 2 --dist loadfile --capture=sys
test: $(STAMP)
	@COMMJAX_TEST_CODEGEN=fast $(PYTEST); a=$$?; \
	COMMJAX_TEST_CODEGEN=default $(PYTEST) -m exact_codegen $$(grep -l exact_codegen tests/test_*.py); b=$$?; \
	for rc in $$a $$b; do if [ $$rc -ne 0 ] && [ $$rc -ne 5 ]; then exit $$rc; fi; done; \
	if [ $$a -eq 5 ] || [ $$b -eq 5 ]; then exit 5; fi

# The site (API reference from the docstrings) in site/; --strict fails on any warning
# (a broken reference, a missing object).
docs: $(DOCS_STAMP)
	$(PY) -m mkdocs build --strict --site-dir site

bench: $(STAMP)
	$(PY) benchmarks/wire.py
	$(PY) benchmarks/convergence.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis site
