"""Packaging: `kernels/` is installed as `gemma4_kv.kernels` (a top-level `kernels`
module would clash with the PyPI package of that name)."""

from setuptools import find_packages, setup

setup(
    packages=find_packages(include=["gemma4_kv", "gemma4_kv.*"]) + ["gemma4_kv.kernels"],
    package_dir={"gemma4_kv.kernels": "kernels"},
    package_data={"gemma4_kv": ["py.typed"], "gemma4_kv.model_shapes": ["*.json"]},
)
