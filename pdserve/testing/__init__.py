"""Support for pdserve's tests and benchmarks, never imported by the product: daemons as real processes
(`launch`), compilation counting (`compile_watch`), synthetic caches, adapters and model families whose
values are known, the structured-output schemas both use."""
