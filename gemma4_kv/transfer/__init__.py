"""Data movement: kernels and streams that copy blocks, and loads and saves as jobs."""
