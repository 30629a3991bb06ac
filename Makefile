# Two commands do all set-up: `make lab` and `make test`. Each installs the profile it needs.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin

# The install profiles (docs/install.md, "Install profiles"): what pip installs from
# pyproject.toml, every version pinned by constraints.txt.
#   student     make lab, make workspace, make bench: the course, no instructor or test tools
#   instructor  make lab-reference: + grading (nbval), nbgrader, JupyterHub
#   docs        make docs: + mkdocs and its plugins
#   test        make test, make test-fast, `make install`: everything (what CI installs)
PROFILE.student    := .
PROFILE.instructor := .[instructor]
PROFILE.docs       := .[docs]
PROFILE.test       := .[instructor,docs,test]
# The profiles each one holds, whose stamps its install touches too.
HOLDS.student    := student
HOLDS.instructor := student instructor
HOLDS.docs       := student docs
HOLDS.test       := student instructor docs test

# `make install` installs the test profile, `make install PROFILE=student` another (only a
# PROFILE given on the command line: one in the shell's environment is not ours).
ifneq ($(origin PROFILE),command line)
PROFILE := test
endif
STAMP = $(VENV)/.installed-$(1)

# The folder `make lab` serves, and the Jupyter settings in it (`ddplab notebooks` writes them):
# JupyterLab looks there before the user's own ~/.jupyter, for this server only.
WORKSPACE := workspace
STUDENT_JUPYTER := JUPYTER_CONFIG_PATH="$(CURDIR)/$(WORKSPACE)/.jupyter$(if $(JUPYTER_CONFIG_PATH),:$(JUPYTER_CONFIG_PATH))"

.PHONY: install docs lab lab-reference workspace test test-fast bench clean

install: $(call STAMP,$(PROFILE))

# One stamp per profile: a .venv made by `make lab` gets the extras at `make test`.
# Re-install only when the dependency files change.
$(VENV)/.installed-%: pyproject.toml constraints.txt
	$(if $(PROFILE.$*),,$(error no install profile '$*': one of student, instructor, docs, test))
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '$(PROFILE.$*)'
	touch $(foreach held,$(HOLDS.$*),$(call STAMP,$(held)))

# The course as a website in build/site (open build/site/index.html): the notebooks with their
# stored outputs, the guides, the API from the docstrings. --strict: a broken link fails it.
docs: $(call STAMP,docs)
	NO_MKDOCS_2_WARNING=1 $(BIN)/python -m mkdocs build --strict

# Jupyter refuses to run as root unless told to; containers often run as root.
ROOT_FLAG := $(if $(filter 0,$(shell id -u)),--allow-root)

# The student's workspace, without starting JupyterLab (scripts, tests, an instructor preparing
# a machine): the student profile, then workspace/, which holds the student versions
# (solutions stubbed), made on the first run; later runs add notebooks that are new and never
# overwrite one there (your work).
# Exit 1 says an entry was in the way (reported, the rest copied): the lab opens anyway.
workspace: $(call STAMP,student)
	$(BIN)/ddplab notebooks $(WORKSPACE) || test $$? -eq 1

# Students: JupyterLab on the workspace, with its settings (no nbgrader, no news pop-up).
lab: workspace
	$(STUDENT_JUPYTER) $(BIN)/jupyter lab --notebook-dir=$(WORKSPACE) --ServerApp.ip=127.0.0.1 $(ROOT_FLAG)

# Instructors: the reference notebooks themselves, solutions and outputs in, with nbgrader.
lab-reference: $(call STAMP,instructor)
	$(BIN)/jupyter lab --notebook-dir=notebooks --ServerApp.ip=127.0.0.1 $(ROOT_FLAG)

# The unit and integration tests, then nbval over every notebook, in one pytest run.
# The browser test needs Debian's Chromium: installed here when missing (apt-get, as
# root, as on CI), and required, so a machine without it fails rather than skips.
# Where the time goes: the 30 slowest tests close the run, build/test-results.xml has
# every test's time, and `python tools/test_times.py` sums it by module. Last, the exercise
# matrix: which exercises have their four kinds of test (--allow-incomplete until all do).
test: $(call STAMP,test)
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
test-fast: $(call STAMP,test)
	$(BIN)/python -m pytest tests -q -m "not slow and not course and not browser and not netns and not gpu and not realhosts and not hub"

bench: $(call STAMP,student)
	$(BIN)/python benchmarks/bench_start.py

clean:
	rm -rf $(VENV) .pytest_cache
