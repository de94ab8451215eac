"""Packaging for crossover. Horovod itself is installed by scripts/setup.sh (it needs patches to build)."""

from setuptools import find_packages, setup

setup(
    name="crossover",
    version="0.1.0",
    description="Adaptive gradient compression (GraVAC, DQ-SGD) and crossover scheduling for Horovod",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.9",
    packages=find_packages(include=["crossover", "crossover.*", "horovod_ext", "horovod_ext.*", "benchmarks",
                                    "benchmarks.*"]),
    package_data={"crossover.compression": ["*.c"]},  # the C kernels are compiled on first use
    install_requires=["numpy", "psutil", "torch"],
    extras_require={
        "tensorflow": ["tensorflow", "tf-keras"],
        "benchmarks": ["matplotlib", "tqdm", "scikit-learn", "pillow"],
        "test": ["pytest", "pytest-timeout", "scikit-learn"],
    },
    entry_points={"console_scripts": [
        "crossover-netem=benchmarks.netem.cli:main",
        "crossover-run=crossover.scheduler.run:main",
        "crossover-bench=benchmarks.cli:main",
    ]},
)
