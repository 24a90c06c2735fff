"""Benchmarking: the load generator and scenarios behind `pdserve bench`, and what the scripts in bench/
share (timing, best-of, the JSON report, the same-run ratio).

- `workload`: what is sent (length distributions, datasets, prompts);
- `clients`: sending it to a decode-server and recording each request as the client saw it;
- `stats`: the figures (percentiles, throughput, goodput) as a pure function of those records;
- `plots`: latency CDFs and throughput over time (matplotlib, optional);
- `serve`: `pdserve bench serve`, the load generator against a running server;
- `offline`: `pdserve bench throughput|latency`, the engine in this process;
- `commands`: the `pdserve bench` command line;
- `common`: timing, best-of, the JSON report and same-run ratios of the scripts in bench/;
- `engine_timing`: decode steps and speculative runs timed on an engine in this process;
- `prompts`: the prompt texts and random token prompts the scripts share.
"""
