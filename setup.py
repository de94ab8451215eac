"""Packaging for crossover. Horovod itself is installed by scripts/setup.sh (it needs patches to build).

The repository's ``benchmarks/`` folder is installed as ``crossover_bench``: a generic top-level name such as
``benchmarks`` would collide with other projects' packages in site-packages. Inside a checkout both names work
(``python -m benchmarks.cli``); the console scripts use the installed one.
"""

from setuptools import find_packages, setup

BENCH = "crossover_bench"  # the installed name of benchmarks/

setup(
    name="crossover",
    version="0.1.0",
    description="Adaptive gradient compression (GraVAC, DQ-SGD) and crossover scheduling for Horovod",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    author="the crossover developers",
    license="MIT",  # an SPDX expression (setuptools deprecates License classifiers)
    license_files=["LICENSE"],
    classifiers=[
        "Development Status :: 3 - Alpha",
        "Intended Audience :: Developers",
        "Intended Audience :: Science/Research",
        "Operating System :: POSIX :: Linux",
        "Programming Language :: Python :: 3",
        "Programming Language :: Python :: 3 :: Only",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
        "Topic :: System :: Distributed Computing",
    ],
    python_requires=">=3.9",
    packages=[*find_packages(include=["crossover", "crossover.*", "horovod_ext", "horovod_ext.*"]),
              BENCH, *(f"{BENCH}.{p}" for p in find_packages("benchmarks"))],
    package_dir={BENCH: "benchmarks"},
    package_data={"crossover.compression": ["*.c"]},  # the C kernels are compiled on first use
    # torch is an extra: the TensorFlow path (crossover.tensorflow, crossover-run) imports none. A horovod.torch user
    # has torch already (Horovod's torch ops are built against it); `pip install .[torch]` pulls it in otherwise.
    install_requires=["numpy", "psutil"],
    extras_require={
        "torch": ["torch"],
        "tensorflow": ["tensorflow", "tf-keras"],
        "tensorboard": ["tensorboard"],  # tensorboard="DIR" writes event files with it
        "benchmarks": ["torch", "matplotlib", "tqdm", "scikit-learn", "pillow", "mlxtend"],
        "test": ["torch", "pytest", "pytest-timeout", "scikit-learn"],
    },
    entry_points={"console_scripts": [
        f"crossover-netem={BENCH}.netem.cli:main",
        "crossover-run=crossover.scheduler.run:main",
        f"crossover-bench={BENCH}.cli:main",
    ]},
)
