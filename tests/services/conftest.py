"""Daemons shared by the tests of one module: a prefill-server process on a loopback port."""

from __future__ import annotations

import pytest

from services.launch import prefill_server


@pytest.fixture(scope="module")
def log_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("daemons")


@pytest.fixture(scope="module")
def prefill(gguf_path, log_dir):
    daemon = prefill_server(gguf_path, log_dir, extra=["--metrics-port", "0"])
    yield daemon
    assert daemon.terminate() == 0
