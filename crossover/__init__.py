"""crossover: adaptive gradient compression and crossover scheduling for Horovod.

Importing this package is cheap and silent: Horovod and the frameworks are imported only by the
submodules that need them.
"""

__version__ = "0.1.0"
__all__ = ["__version__"]
