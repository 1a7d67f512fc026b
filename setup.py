"""Packaging: the package and its data (the kernels live in `gemma4_kv/kernels/`)."""

from setuptools import find_packages, setup

setup(
    packages=find_packages(include=["gemma4_kv", "gemma4_kv.*"]),
    package_data={"gemma4_kv": ["py.typed"], "gemma4_kv.model_shapes": ["*.json"]},
)
