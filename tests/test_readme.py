"""The README's usage example runs as written, its Quickstart is the two Make targets, the GPU script runs
every test file, and the ``tiledmlp`` command answers ``--version``, no command and typos."""

from __future__ import annotations

import pathlib
import re

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def test_readme_usage_example_runs():
    text = README.read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert blocks, "README has no python example"
    namespace: dict = {}
    exec(compile(blocks[0], "README.md", "exec"), namespace)  # noqa: S102 - the example is ours
    assert namespace["report"].patched and namespace["loss"].isfinite()
    assert all(p.grad is not None for p in namespace["model"].parameters() if p.requires_grad)


def test_quickstart_is_two_commands():
    quickstart = text_between(README.read_text(), "## Quickstart", "##")
    commands = re.findall(r"^make \w+", quickstart, re.M)
    assert commands == ["make demo", "make test"]


def test_gpu_script_runs_the_whole_suite():
    """benchmarks/gpu.sh runs the ``tests`` folder itself, not a list of files that a new test file would miss
    (unless GPU_SH_TESTS asks for a selection, which the summary then names as one)."""
    script = (README.parent / "benchmarks" / "gpu.sh").read_text()
    assert re.search(r"-m pytest \$\{GPU_SH_TESTS:-tests\} ", script)
    assert re.findall(r"tests/\w+", script) == [], "gpu.sh names single test paths: run the folder"


def text_between(text: str, start: str, end: str) -> str:
    head = text.index(start) + len(start)
    tail = text.find(end, head)
    return text[head : tail if tail != -1 else len(text)]


def test_top_level_command_version_usage_and_typos(capsys):
    """``tiledmlp --version`` names the versions a bug report needs; no command or a typo is exit 2 on stderr."""
    import torch
    import transformers

    import tiledmlp
    from tiledmlp.cli import main

    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == (f"tiledmlp {tiledmlp.__version__} (torch {torch.__version__}, "
                                               f"transformers {transformers.__version__})")
    assert main([]) == 2 and "usage: tiledmlp" in capsys.readouterr().err
    assert main(["trian"]) == 2 and "unknown command 'trian'" in capsys.readouterr().err
    assert main(["--help"]) == 0 and "bench" in capsys.readouterr().out
