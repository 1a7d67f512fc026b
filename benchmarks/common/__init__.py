"""Code the benchmarks share: medians and ranges over repeats (`stats`), matplotlib
figures with those ranges as error bars (`plots`). Benchmarks run as scripts, so
`benchmarks/` is on `sys.path` and `from common import stats` finds this package."""
