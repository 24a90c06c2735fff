"""Shared test set-up: 8 fake CPU devices (before JAX is imported), the default model, small engines, test
tiers and the check that nothing is skipped unexpectedly.

Tiers (exactly one marker per test, checked at collection; `scripts/test.sh fast|model|daemon` runs one):
- fast: model-free units (scheduler, block manager, codec, layout, wire, sampling, manifests): seconds.
- model: real weights in this process (engine, tokenizer, LoRA, reference parity).
- daemon: real daemon processes on loopback ports (and the CLI as a process).
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# --dtype auto on a CPU is float32 in every test process and daemon (the references are float32), whatever
# this CPU computes natively (engine.config.CPU_DTYPE_ENV; bfloat16 tests name their dtype)
os.environ["PDSERVE_CPU_DTYPE"] = "float32"

import gc  # noqa: E402
import importlib.util  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402

import pytest  # noqa: E402

from pdserve.engine.compile_cache import configure_jax  # noqa: E402

# the daemons' persistent XLA cache (under the pdserve cache folder) serves the test process too: a later
# run loads the executables an earlier one compiled (the model tier takes about a third less time)
configure_jax()

TIERS = ("fast", "model", "daemon")
SHARED_DAEMONS = {"prefill", "decode", "conditional", "full_daemons"}  # a `standalone` test uses none
MODEL_FIXTURES = {
    "model_path",
    "loaded_model",
    "make_engine",
    "colocated",
    "full_gguf_path",
    "full_model",
    "full_engine",
    "full_colocated",
}

# Skips that may happen in a full run (`--no-unexpected-skips` fails the run on any other): a regex on
# the skip's reason, and why it is expected. On a CPU box with the dev + reference extras, none is.
ALLOWED_SKIPS: dict[str, str] = {
    r"needs a TPU": "TPU-only code paths (kernels, libtpu) cannot run on a CPU-only machine",
}

HAS_REFERENCE = (
    importlib.util.find_spec("torch") is not None and importlib.util.find_spec("transformers") is not None
)
requires_reference = pytest.mark.skipif(
    not HAS_REFERENCE, reason="needs the reference extra (torch, transformers)"
)


# ---- tiers and skips ----------------------------------------------------------------------------------
def pytest_addoption(parser):
    parser.addoption(
        "--no-unexpected-skips",
        action="store_true",
        help="fail the run when a test is skipped for a reason not in tests/conftest.py ALLOWED_SKIPS",
    )


def tier_of(item) -> str:
    return next(m.name for m in item.iter_markers() if m.name in TIERS)


def pytest_collection_modifyitems(config, items):
    problems = []
    for item in items:
        tiers = {m.name for m in item.iter_markers() if m.name in TIERS}
        if len(tiers) != 1:
            problems.append(f"{item.nodeid}: tier markers {sorted(tiers)}; give it one of {TIERS}")
        elif "fast" in tiers and MODEL_FIXTURES & set(item.fixturenames):
            problems.append(
                f"{item.nodeid}: marked fast but uses {sorted(MODEL_FIXTURES & set(item.fixturenames))}"
            )
        elif item.get_closest_marker("standalone") and SHARED_DAEMONS & set(item.fixturenames):
            shared = sorted(SHARED_DAEMONS & set(item.fixturenames))
            problems.append(f"{item.nodeid}: marked standalone but uses the session's daemons {shared}")
    if problems:
        raise pytest.UsageError("test tiers:\n" + "\n".join(problems))
    items.sort(key=lambda item: TIERS.index(tier_of(item)))  # stable: fast first, then model, then daemon


_skips: list[tuple[str, str]] = []


def pytest_runtest_logreport(report):
    if report.skipped and isinstance(report.longrepr, tuple):
        _skips.append((report.nodeid, report.longrepr[2].removeprefix("Skipped: ")))


def unexpected_skips() -> list[tuple[str, str]]:
    return [(node, why) for node, why in _skips if not any(re.search(p, why) for p in ALLOWED_SKIPS)]


# What a run of fast tests alone must not import: `scripts/test.sh fast` sets up without the reference and
# plots extras (and fetches no model), so a fast test that needs them fails there.
HEAVY_FOR_FAST = ("torch", "transformers", "accelerate", "peft", "matplotlib")
_heavy: list[str] = []  # HEAVY_FOR_FAST modules a run of fast tests alone imported (pytest_sessionfinish)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    import resource

    from pdserve.testing.launch import Daemon

    gib = 1 / (1 << 20)  # KiB -> GiB
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * gib  # KiB on Linux
    daemon = Daemon.max_peak_rss_kib * gib
    terminalreporter.write_line(
        f"peak resident memory: test process {own:.2f} GiB, largest daemon {daemon:.2f} GiB"
    )
    if config.getoption("--no-unexpected-skips") and unexpected_skips():
        terminalreporter.section("unexpected skips (see ALLOWED_SKIPS in tests/conftest.py)", red=True)
        for node, why in unexpected_skips():
            terminalreporter.line(f"{node}: {why}")
    if _heavy:
        terminalreporter.section("fast tests imported an extra's modules (HEAVY_FOR_FAST)", red=True)
        terminalreporter.line(f"{_heavy}: mark the test that needs them `model`")


def pytest_sessionfinish(session, exitstatus):
    if session.config.getoption("--no-unexpected-skips") and unexpected_skips() and exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
    items = getattr(session, "items", [])
    if items and all(tier_of(item) == "fast" for item in items):
        _heavy[:] = [name for name in HEAVY_FOR_FAST if name in sys.modules]
    if _heavy and exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


# ---- the model and engines ----------------------------------------------------------------------------
@pytest.fixture(scope="session")
def full_gguf_path():
    """The default model's GGUF file, where `pdserve models fetch` puts it (fetched on first use): the
    parity tests against transformers' recorded outputs and the end-to-end answers use it whole."""
    from pdserve.engine.loading.sources import DEFAULT_MODEL, fetch

    return fetch(DEFAULT_MODEL, progress=False)


@pytest.fixture(scope="session")
def gguf_path():
    """The test model as a GGUF file (pdserve.testing.models.small_gguf): the GGUF loading tests."""
    from pdserve.testing.models import small_gguf

    return small_gguf()


@pytest.fixture(scope="session")
def model_path():
    """The test model: the default model's first layers as a Hugging Face folder (pdserve.testing.models),
    real weights and tokenizer at a fraction of the compute. Tests that compare pdserve with itself
    (disaggregated with colocated, batched with alone, TP 2 with TP 1, ...) and every daemon they start
    use it."""
    from pdserve.testing.models import small_model

    return small_model()


@pytest.fixture(scope="session")
def loaded_model(model_path):
    from pdserve.engine.loading.sources import load_model

    return load_model(model_path).in_memory()  # read once, for the many engines the tests build


@pytest.fixture(scope="session")
def full_model(full_gguf_path):
    from pdserve.engine.loading.sources import load_model

    return load_model(full_gguf_path).in_memory()


@pytest.fixture(scope="session")
def full_engine(full_model, small_config):
    """An engine over the whole default model, with the tests' sizes (the parity tests)."""
    from pdserve.engine.llm_engine import LLMEngine

    return LLMEngine(full_model, small_config)


@pytest.fixture(scope="session")
def small_config():
    """Engine sizes for tests (pdserve.testing.launch.TEST_ENGINE, whose flags the daemons get)."""
    from pdserve.testing.launch import TEST_ENGINE

    return TEST_ENGINE


_engines: dict = {}  # (config, device ids) -> engine
_module_engines: list = []  # keys of the engines built with overrides: freed when their module ends


@pytest.fixture(scope="session")
def make_engine(loaded_model, small_config):
    """Builds engines over the session's model; same config and devices -> the same engine object.

    The default engine (`make_engine()`) lives for the session; any other is freed at the end of the
    module that built it: engines and their compiled steps are what fills the test process's memory."""
    import dataclasses

    from pdserve.engine.llm_engine import LLMEngine

    def make(devices=None, **overrides):
        config = dataclasses.replace(small_config, **overrides)
        key = (config, tuple(d.id for d in devices) if devices else None)
        if key not in _engines:
            _engines[key] = LLMEngine(loaded_model, config, devices)
            if key != (small_config, None):
                _module_engines.append(key)
        engine = _engines[key]
        assert not engine.has_unfinished and engine.scheduler.kv.pool.num_used == 0, (
            "a test leaked requests or blocks"
        )
        return engine

    return make


@pytest.fixture(scope="module", autouse=True)
def _free_module_engines():
    yield
    if _module_engines:
        for key in _module_engines:
            _engines.pop(key, None)
        _module_engines.clear()
        gc.collect()
    if "jax" in sys.modules:
        # Every executable a process has loaded keeps its code mapped: the model tier loads thousands, and
        # past vm.max_map_count (65,530 by default) XLA:CPU's loader crashed the process (a segfault in
        # deserialize_executable). A module's executables go with it; the next module's load from the
        # persistent compilation cache.
        sys.modules["jax"].clear_caches()


@pytest.fixture(scope="session")
def colocated(make_engine):
    """`colocated(prompt, **kw)`: the tokens the default colocated engine generates under Client keywords
    `kw`, mapped as a decode-server maps them (tests.helpers.Reference: cached, `.prepare` batches)."""
    from tests.helpers import Reference

    return Reference(make_engine)


@pytest.fixture(scope="session")
def openai():
    """The official OpenAI client (dev extra), for the HTTP API tests."""
    return pytest.importorskip("openai")


# ---- daemons ---------------------------------------------------------------------------------------------
# One prefill-server and one decode-server for the whole session (tests only send them requests and leave
# every block free), and `daemons`, which starts a test's own daemons and stops every one of them when the
# test ends, whatever happened.
@pytest.fixture(scope="session")
def log_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("daemons")


@pytest.fixture(scope="session")
def otlp_collector():
    """The OTLP trace collector the shared daemons export their spans to (tests.helpers.OTLPCollector)."""
    from tests.helpers import OTLPCollector

    collector = OTLPCollector()
    yield collector
    collector.stop()


@pytest.fixture(scope="session")
def prefill(model_path, log_dir, otlp_collector):
    """A prefill-server with /metrics, a step log (log_dir/prefill-steps.jsonl) and traces (otlp_collector),
    shared by every daemon test."""
    from pdserve.testing.launch import HOST_TIER_ARGS, prefill_server

    extra = ["--metrics-port", "0", *HOST_TIER_ARGS, "--step-log", str(log_dir / "prefill-steps.jsonl")]
    extra += ["--otlp-traces-endpoint", otlp_collector.endpoint]
    daemon = prefill_server(model_path, log_dir, extra=extra)
    yield daemon
    assert daemon.terminate() == 0


@pytest.fixture(scope="session")
def decode(model_path, prefill, log_dir, otlp_collector):
    """A decode-server on `prefill` with /metrics, the OpenAI HTTP API (Qwen3's reasoning parser: an output
    thinks only when it starts with <think>), JSON logs, a step log (log_dir/decode-steps.jsonl) and traces
    (otlp_collector), shared by every daemon test that only sends it requests."""
    from pdserve.testing.launch import HOST_TIER_ARGS, decode_server

    extra = ["--max-num-seqs", "32", "--metrics-port", "0", "--http-port", "0", "--log-format", "json"]
    extra += HOST_TIER_ARGS
    extra += ["--reasoning-parser", "qwen3", "--step-log", str(log_dir / "decode-steps.jsonl")]
    extra += ["--otlp-traces-endpoint", otlp_collector.endpoint]
    daemon = decode_server(model_path, prefill.address, log_dir, extra=extra)
    yield daemon
    assert daemon.terminate() == 0


@pytest.fixture(scope="session")
def full_daemons(full_gguf_path, log_dir):
    """(prefill, decode): a prefill-server and a decode-server with the OpenAI HTTP API on the whole
    default model, for the few daemon tests whose outputs must end as the real model ends them (its
    answer's EOS, constrained JSON, tool calls)."""
    from pdserve.testing.launch import decode_server, prefill_server

    prefill = prefill_server(full_gguf_path, log_dir, name="full-prefill")
    try:
        decode = decode_server(
            full_gguf_path, prefill.address, log_dir, name="full-decode", extra=["--http-port", "0"]
        )
    except BaseException:
        prefill.terminate()
        raise
    yield prefill, decode
    assert decode.terminate() == 0 and prefill.terminate() == 0


@pytest.fixture(scope="session")
def full_colocated(full_engine):
    """`colocated` on the whole default model (full_daemons' reference)."""
    from tests.helpers import Reference

    return Reference(lambda: full_engine)


@pytest.fixture
def daemons(model_path, log_dir):
    """Starts a test's own daemons (tests.helpers.Daemons); stops them all when the test ends."""
    from tests.helpers import Daemons

    group = Daemons(model_path, log_dir)
    yield group
    codes = group.stop_all()
    assert all(code == 0 for code in codes.values()), codes
