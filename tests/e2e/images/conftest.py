"""Fixtures of the image tests: the images, built (or brought up to date) once per session."""
from __future__ import annotations

import shutil

import pytest

from tokenfleet_dev import images


@pytest.fixture(scope="session")
def built_images(tmp_path_factory) -> dict[str, str]:
    """``hack/build-images.sh`` for both images (layers cached: seconds when nothing changed), so the tests
    always run the images of this checkout. Returns name -> local reference."""
    for tool in ("podman", "runc", "mmdebstrap"):
        if shutil.which(tool) is None:
            pytest.fail(f"{tool} is missing: bash hack/setup.sh installs what the image tests need")
    log = tmp_path_factory.mktemp("images") / "build-images.log"
    try:
        images.build(log=log)
    except images.ImageError as e:
        pytest.fail(f"{e}\n{log.read_text(errors='replace')[-6000:]}")
    return {name: f"localhost/{images.ref(name)}" for name in images.NAMES}
