"""Code the benchmarks share, so that no benchmark script imports another:

- `stats`: medians and ranges over repeats;
- `plots`: matplotlib figures with those ranges as error bars;
- `timing`: CUDA-event medians, and host seconds per profiled phase (`Timers`);
- `workload`: the serving workload (options, model shape and layout, sizes, token
  streams, each system's engine arguments, vLLM's counters), used by `bench_serving`,
  `bench_replicas`, `bench_sweep` and the tests' `tier_sim`;
- `peers`: the KV transfer config of every system measured beside ours
  (OffloadingConnector, LMCache's MP connector).

Benchmarks run as scripts, so `benchmarks/` is on `sys.path` and `from common import
stats` finds this package."""
