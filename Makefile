# Two commands do all set-up: `make lab` and `make test`. Both go through `make install`.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: install docs lab lab-reference test test-fast bench clean

install: $(STAMP)

# Re-install only when the dependency files change.
$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[test]'
	touch $(STAMP)

# The course as a website in build/site (open build/site/index.html): the notebooks with their
# stored outputs, the guides, the API from the docstrings. --strict: a broken link fails it.
docs: install
	NO_MKDOCS_2_WARNING=1 $(BIN)/python -m mkdocs build --strict

# Jupyter refuses to run as root unless told to; containers often run as root.
ROOT_FLAG := $(if $(filter 0,$(shell id -u)),--allow-root)

# Students: workspace/ holds the student versions (solutions stubbed), made on the first
# run; later runs add notebooks that are new and never overwrite one there (your work).
# Exit 1 says an entry was in the way (reported, the rest copied): the lab opens anyway.
lab: install
	$(BIN)/ddplab notebooks workspace || test $$? -eq 1
	$(BIN)/jupyter lab --notebook-dir=workspace --ServerApp.ip=127.0.0.1 $(ROOT_FLAG)

# Instructors: the reference notebooks themselves, solutions and outputs in.
lab-reference: install
	$(BIN)/jupyter lab --notebook-dir=notebooks --ServerApp.ip=127.0.0.1 $(ROOT_FLAG)

# The unit and integration tests, then nbval over every notebook, in one pytest run.
# The browser test needs Debian's Chromium: installed here when missing (apt-get, as
# root, as on CI), and required, so a machine without it fails rather than skips.
# Where the time goes: the 30 slowest tests close the run, build/test-results.xml has
# every test's time, and `python tools/test_times.py` sums it by module. Last, the exercise
# matrix: which exercises have their four kinds of test (--allow-incomplete until all do).
test: install
	bash tools/ensure_chromium.sh
	bash tools/ensure_hosts.sh $(BIN)/python
	bash tools/ensure_sandbox.sh
	bash tools/ensure_hub.sh
	DDPLAB_REQUIRE_BROWSER=1 $(BIN)/python -m pytest tests notebooks --nbval --nbval-cell-timeout=300 \
		--nbval-sanitize-with ddplab/grade/nbval_sanitize.cfg \
		--durations=30 --junitxml=build/test-results.xml
	$(BIN)/python tools/test_times.py build/test-results.xml
	$(BIN)/python tools/exercise_matrix.py --allow-incomplete

# The inner loop while changing code (under a minute on 2 cores: 51 s for 431 tests): every test but the slow, course, browser,
# netns, gpu, realhosts and hub tiers, and no notebooks. `make test` (what CI runs) still runs them all.
test-fast: install
	$(BIN)/python -m pytest tests -q -m "not slow and not course and not browser and not netns and not gpu and not realhosts and not hub"

bench: install
	$(BIN)/python benchmarks/bench_start.py

clean:
	rm -rf $(VENV) .pytest_cache
