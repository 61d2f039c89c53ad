"""Shared helpers: relative-error checks against untiled references."""

from __future__ import annotations

import gc
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Iterator

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

import launch  # noqa: E402  (tests/, on the path just above)
from hollow_matmul import hollow_matmuls, hollow_matmuls_native_bf16_too  # noqa: E402

# one intra-op thread per core a pytest-xdist worker has: two workers of two threads each on two cores spin against
# each other (SmolLM2's fp32+fp64 grads test: 10 s alone, 79 s in the suite)
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(max(1, min(2, (os.cpu_count() or 1) // _WORKERS)))


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """``|a - b| / |b|`` in float64 (0 when both are zero)."""
    a, b = a.detach().double(), b.detach().double()
    denom = b.norm()
    diff = (a - b).norm()
    return float(diff if denom == 0 else diff / denom)


def assert_rel(a: torch.Tensor | None, b: torch.Tensor | None, tol: float, what: str = "") -> None:
    assert (a is None) == (b is None), f"{what}: one grad is None ({a is None}, {b is None})"
    if a is None:
        return
    assert a.shape == b.shape, f"{what}: shape {tuple(a.shape)} != {tuple(b.shape)}"
    assert a.dtype == b.dtype, f"{what}: dtype {a.dtype} != {b.dtype}"
    err = rel_err(a, b)
    assert err <= tol, f"{what}: relative error {err:.3e} > {tol:.0e}"


@pytest.fixture(scope="session", autouse=True)
def _own_extension_builds(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Every CPU DeepSpeed launch JIT-builds DeepSpeed's shared-memory comm op under a lock file in
    ``~/.cache/torch_extensions``. A build killed midway leaves that lock behind, and every later launch waits on
    it forever (this hung CI once). This run's launches build into a directory of their own, one for all its xdist
    workers (each had its own, so on the GPU machine, which has no prebuilt op, every worker's first DeepSpeed job
    built it again at once), seeded with the build ``make venv`` made (copied with its mtimes, so ninja finds it up
    to date: ~60 s less)."""

    def seed() -> str:
        own = tmp_path_factory.mktemp("torch_extensions")
        prebuilt = Path(sys.prefix) / "torch_extensions"
        if prebuilt.is_dir():
            shutil.copytree(prebuilt, own, dirs_exist_ok=True)
        return str(own)

    os.environ["TORCH_EXTENSIONS_DIR"] = launch.once_per_run(tmp_path_factory, "torch_extensions", seed)


@pytest.fixture(autouse=True)
def _hollow_matmuls(request: pytest.FixtureRequest) -> Iterator[None]:
    """Tests marked ``hollow_matmuls`` run inside :func:`hollow_matmul.hollow_matmuls` (where this CPU's
    16-bit matmuls, flash attention's included, have only ATen's reference kernel): they assert bytes, and
    tests/test_hollow_matmul.py shows that their allocations are the same without the arithmetic. Marked
    ``hollow_matmuls(native_bf16_too=True)``: on AVX512-BF16/AMX CPUs too, oneDNN off there
    (:func:`hollow_matmul.hollow_matmuls_native_bf16_too`)."""
    marker = request.node.get_closest_marker("hollow_matmuls")
    if marker is not None and marker.kwargs.get("native_bf16_too"):
        with hollow_matmuls_native_bf16_too():
            yield
        return
    with hollow_matmuls(None if marker else False):
        yield


@pytest.fixture(scope="session")
def smollm2_loaded(tmp_path_factory: pytest.TempPathFactory) -> tuple[torch.nn.Module, object]:
    """The embedded SmolLM2-135M in float32, read from its GGUF file once per run (~15 s; the other xdist worker
    unpickles the same model and tokenizer in ~1 s): use ``smollm2_copy``, which gives each test its own model."""
    pytest.importorskip("gguf", reason="the SmolLM2 fixture needs the demo extra: pip install gguf")
    from tiledmlp.train.args import DEFAULT_MODEL
    from tiledmlp.train.models import load_model_and_tokenizer

    return launch.once_per_run(tmp_path_factory, "smollm2", lambda: load_model_and_tokenizer(DEFAULT_MODEL, "float32"))


@pytest.fixture
def smollm2_copy(smollm2_loaded: tuple[torch.nn.Module, object]) -> tuple[torch.nn.Module, object]:
    """A deep copy of the session's SmolLM2 (tests patch and cast it) and its tokenizer."""
    import copy

    model, tokenizer = smollm2_loaded
    return copy.deepcopy(model), tokenizer


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture(params=["eager", "compiled"])
def kernels(request: pytest.FixtureRequest) -> Iterator[str]:
    """Run a test with the eager per-tile ops and again with the torch.compile'd ones (pointwise.py)."""
    from tiledmlp import pointwise

    import torch._dynamo.config as dynamo_config

    compiled = request.param == "compiled"
    if compiled:  # fresh kernels: a kernel past Dynamo's recompile limit would run eagerly and test nothing compiled
        pointwise._compiled.cache_clear()
    pointwise.set_fused(compiled)
    try:
        with dynamo_config.patch(fail_on_recompile_limit_hit=True):
            yield request.param
    finally:
        pointwise.set_fused("auto")


def _module_fixtures(item: pytest.Item) -> list[str]:
    """The module-scoped fixtures ``item`` uses (the multi-process jobs run once for all their module's tests)."""
    info = getattr(item, "_fixtureinfo", None)
    defs = info.name2fixturedefs.items() if info is not None else ()
    return sorted(name for name, chain in defs if chain and chain[-1].scope == "module")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # modules holding a slow test first, each kept whole (its module fixtures set up once): xdist hands the first
    # items out round-robin, so the long multi-process jobs start at once on different workers instead of one of
    # them starting last and setting the suite's end (on the 12-worker GPU run the suite was stopped at its budget
    # with two tests left)
    slow = {item.module.__name__ for item in items if item.get_closest_marker("slow") is not None}
    items.sort(key=lambda item: item.module.__name__ not in slow)
    if torch.cuda.is_available():  # then the tests of the CUDA paths (named so: test_cuda.py, [cuda] cases) before
        # all: a GPU run stopped at its time budget (benchmarks/gpu.sh) has run them whatever it left
        items.sort(key=lambda item: "cuda" not in item.nodeid.lower())
    # the tests sharing module fixtures, kept on one worker under `--dist loadgroup` (benchmarks/gpu.sh; xdist >= 2.5
    # with a pytest whose node ids xdist can still rename): each job then runs once while the other tests spread
    # over the workers. Where the groups are ignored (pytest 9.2, this machine's pins), launch.once_per_run still
    # runs each job once, the other workers waiting for it.
    for item in items:
        jobs = _module_fixtures(item)
        if jobs:
            item.add_marker(pytest.mark.xdist_group(f"{item.module.__name__}.{'+'.join(jobs)}"))


def pytest_collection_finish(session: pytest.Session) -> None:
    """Everything imported so far (torch, transformers, DeepSpeed, the test modules: ~10^6 objects) moved out of
    the collector's reach: each full collection, by the interpreter or by ``measure.profiler_peak_bytes`` before
    every measured step, then walks only what the tests made (0.3 s each before, 14% of the plan tests' time)."""
    _freeze_survivors()


def _freeze_survivors() -> None:
    gc.collect()
    gc.freeze()


_LAST_MODULE = [""]


def _refreeze_at_a_new_module(item: pytest.Item) -> None:
    """The same at the first test of each module: what earlier modules imported lazily (Dynamo and Inductor at the
    first compile, peft, DeepSpeed's engine, each model family's classes) and the caches they filled survive their
    tests, and every later full collection walked them again (explicit ``gc.collect`` calls: 160 s of the suite's
    CPU, its measured steps' 104 s of it). What a module's tests leave behind has been collected by then, so little
    that will become garbage is frozen."""
    module = item.nodeid.split("::")[0]
    if module != _LAST_MODULE[0]:
        _LAST_MODULE[0] = module
        _freeze_survivors()


# the GPU benchmark's time budget (benchmarks/gpu.sh sets it, in seconds since the epoch): a test not started by
# then is skipped with this reason, so the run ends on its own with its summary (which tests failed, the durations),
# where a SIGINT at the budget had stopped xdist with an INTERNALERROR and lost the names of 5 failures (2026-11-27)
PAST_DEADLINE = "not run: past TILEDMLP_TEST_DEADLINE (the GPU benchmark's time budget)"


def pytest_runtest_setup(item: pytest.Item) -> None:
    _refreeze_at_a_new_module(item)
    deadline = os.environ.get("TILEDMLP_TEST_DEADLINE")
    if deadline and time.time() > float(deadline):  # named in the reason: -rs then lists each test not run
        pytest.skip(f"{PAST_DEADLINE}: {item.nodeid}")
