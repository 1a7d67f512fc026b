"""The lookup channel: typed messages from the scheduler half to the worker ranks, and the
worker's answers."""
