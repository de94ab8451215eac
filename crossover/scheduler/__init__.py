"""Node-local crossover scheduler: daemon, client and wire protocol."""
