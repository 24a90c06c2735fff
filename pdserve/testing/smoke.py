"""A smoke test for an environment other than the pinned one (scripts/compat.sh: the newest Python and
JAX the index serves): import pdserve, load the default model, and check its greedy tokens and last
logits on the reference prompts (tests/fixtures/reference_smollm2.npz, transformers' figures, which the
pinned environment's model tier matches) against the fixture.

    python -m pdserve.testing.smoke          # exit status 0: equal; prints the versions it ran on
"""

from __future__ import annotations

import json
import platform
import sys
from pathlib import Path

import numpy as np

FIXTURES = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "reference_smollm2.npz"
GREEDY_TOKENS = 8
MAX_LOGIT_DIFF = 1e-3  # tests/engine/test_reference.py's


def main() -> int:
    import jax
    import jaxlib

    from pdserve.engine.config import EngineConfig
    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.engine.sampling_params import SamplingParams

    versions = {
        "python": platform.python_version(),
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "numpy": np.__version__,
    }
    data = np.load(FIXTURES)
    count = len([k for k in data.files if k.startswith("prompt_")])
    prompts = [data[f"prompt_{i}"].tolist() for i in range(count)]
    config = EngineConfig(num_blocks=192, max_model_len=1024, max_num_seqs=8, max_num_batched_tokens=256)
    engine = LLMEngine.from_model(None, config, warmup=False, progress=False)
    params = SamplingParams(temperature=0.0, max_tokens=GREEDY_TOKENS, ignore_eos=True)
    results = engine.generate(prompts, params)
    failures = []
    for i, result in enumerate(results):
        expected = data[f"greedy_{i}"].tolist()[:GREEDY_TOKENS]
        if result.token_ids != expected:
            failures.append(f"prompt {i}: greedy {result.token_ids} != {expected}")
    diff = float(np.max(np.abs(engine.prompt_logits(prompts[0]) - data["logits_0"])))
    if diff > MAX_LOGIT_DIFF:
        failures.append(f"prompt 0: last logits differ by {diff:.2e} > {MAX_LOGIT_DIFF}")
    print(json.dumps({**versions, "prompts": count, "max_logit_diff": diff, "ok": not failures}))
    for failure in failures:
        print(failure, file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
