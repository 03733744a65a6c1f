"""The images built and run the way the chart starts them (issue #16).

helm/ci/build-images.sh builds the bridge and Spark images with podman from a debootstrap
base (cached in the project cache: a rebuild of unchanged layers takes seconds);
helm/ci/check-images.sh runs their entrypoints as the chart does (``--help``, the CLI's
subcommands, the watcher's /healthz, the Spark driver's main file, the cloud file systems
in the JVM) and checks what each image must not hold; helm/ci/check-s3.sh writes a Delta
table to s3a:// on a local S3 server from the Spark image. Skips, saying so, where podman is
not installed (a fresh machine: the build script installs it, ~5 minutes with the base).
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def built() -> str:
    if shutil.which("podman") is None:
        pytest.skip(
            "podman is not installed: run helm/ci/build-images.sh to install it and "
            "build the images"
        )
    proc = subprocess.run(
        ["bash", str(REPO / "helm" / "ci" / "build-images.sh")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=1800,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout + proc.stderr


def test_images_run_as_the_chart_starts_them(built: str) -> None:
    proc = subprocess.run(
        ["bash", str(REPO / "helm" / "ci" / "check-images.sh")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    lines = proc.stdout.splitlines()
    assert proc.returncode == 0 and not [x for x in lines if x.startswith("FAIL")], (
        proc.stdout[-4000:] + proc.stderr[-2000:]
    )
    assert sum(x.startswith("PASS") for x in lines) >= 20, proc.stdout
    print("\n".join(x for x in lines if not x.startswith("PASS")))


def test_spark_image_writes_delta_to_s3(built: str) -> None:
    """s3a:// works from the image (hadoop-aws matched to pyspark's Hadoop): a Delta table
    written to a local S3-compatible server (moto) and read back."""
    proc = subprocess.run(
        ["bash", str(REPO / "helm" / "ci" / "check-s3.sh")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "rows 110 max 109 versions [1, 0]" in proc.stdout, proc.stdout
