"""Glue between crossover and horovod.torch / horovod.tensorflow."""
