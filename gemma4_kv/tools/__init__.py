"""Tools: the command line, the demos and the engine harness the tests and benchmarks drive."""
